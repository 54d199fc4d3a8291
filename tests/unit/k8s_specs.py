"""What the manifests of k8s/ describe: the Ray cluster specs, their pod templates and worker groups,
the RayJob entrypoints and the presets the pods mount from a ConfigMap; the checks on them.
"""

from __future__ import annotations

import copy
import json
import shlex
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any

from configs import ClusterConfig, load_config
from configs.schema import WorkerResources
from tests.unit.k8s_schemas import REPO, ROLES, manifests

# ---------------------------------------------------------------------------------------------
# What the manifests describe


def cluster_specs() -> list[tuple[str, dict[str, Any]]]:
    """Every RayCluster spec in k8s/: RayCluster.spec, RayJob.spec.rayClusterSpec, RayService's."""
    specs = []
    for where, doc in manifests():
        spec = doc.get("spec") or {}
        if doc.get("kind") == "RayCluster":
            specs.append((where, spec))
        elif doc.get("kind") == "RayJob" and "rayClusterSpec" in spec:
            specs.append((where, spec["rayClusterSpec"]))
        elif doc.get("kind") == "RayService":
            specs.append((where, spec["rayClusterConfig"]))
    return specs


def job_cluster(doc: dict[str, Any]) -> dict[str, Any]:
    """The cluster spec a RayJob runs on: its own, or the RayCluster its clusterSelector names."""
    spec = doc["spec"]
    if "rayClusterSpec" in spec:
        return spec["rayClusterSpec"]
    name = spec.get("clusterSelector", {}).get("ray.io/cluster")
    for _, cluster in manifests("RayCluster"):
        if cluster["metadata"]["name"] == name:
            return cluster["spec"]
    raise AssertionError(f"RayJob {doc['metadata']['name']}: no RayCluster named {name!r} in k8s/")


def pod_templates(spec: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    yield "head", spec["headGroupSpec"]["template"]
    for group in spec.get("workerGroupSpecs", []):
        yield group["groupName"], group["template"]


def ray_container(template: dict[str, Any]) -> dict[str, Any]:
    return template["spec"]["containers"][0]  # KubeRay runs `ray start` in the first container


def env_of(container: dict[str, Any]) -> dict[str, str]:
    return {item["name"]: item.get("value", "") for item in container.get("env", [])}


def parse_cpu(quantity: str | float) -> float:
    text = str(quantity)
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


def role_resources(ray_start_params: dict[str, str]) -> dict[str, float]:
    """The custom resources of ``rayStartParams.resources``.

    KubeRay pastes the value into the shell command ``ray start --resources=<value>``, so the
    value is shell-quoted JSON (``'"{\\"prefill\\": 1}"'`` in YAML); parse it as the shell would.
    """
    raw = ray_start_params.get("resources")
    if raw is None:
        return {}
    words = shlex.split(raw)
    assert len(words) == 1, f"rayStartParams.resources is not one shell word: {raw!r}"
    parsed = json.loads(words[0])
    assert isinstance(parsed, dict), f"rayStartParams.resources is not a JSON object: {raw!r}"
    return {str(k): float(v) for k, v in parsed.items()}


def entrypoint_argv(entrypoint: str) -> list[str]:
    return shlex.split(entrypoint)


def module_problems(entrypoint: str) -> list[str]:
    """Each ``python -m <module>`` of an entrypoint whose module file is not in this repo."""
    argv = entrypoint_argv(entrypoint)
    problems = []
    for i, arg in enumerate(argv[:-1]):
        if arg == "-m" and PurePosixPath(argv[i - 1] if i else "").name.startswith("python"):
            module = argv[i + 1]
            base = REPO.joinpath(*module.split("."))
            if not (base.with_suffix(".py").is_file() or (base / "__main__.py").is_file()):
                problems.append(
                    f"`python -m {module}`: no {base.relative_to(REPO)}.py or "
                    f"{base.relative_to(REPO)}/__main__.py in the repo"
                )
    return problems


def flag_value(argv: list[str], flag: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def configmap_preset(spec: dict[str, Any], path: str) -> tuple[str, str]:
    """(ConfigMap name, text) of the file ``path`` as the head pod of ``spec`` sees it."""
    template = spec["headGroupSpec"]["template"]
    volumes = {v["name"]: v for v in template["spec"].get("volumes", [])}
    for mount in ray_container(template).get("volumeMounts", []):
        mount_path = PurePosixPath(mount["mountPath"])
        if mount_path not in PurePosixPath(path).parents:
            continue
        source = volumes[mount["name"]].get("configMap")
        assert source, f"{path}: mounted from volume {mount['name']!r}, which is not a ConfigMap"
        relative = str(PurePosixPath(path).relative_to(mount_path))
        key = next((i["key"] for i in source.get("items", []) if i["path"] == relative), relative)
        for _, cm in manifests("ConfigMap"):
            if cm["metadata"]["name"] == source["name"]:
                assert key in cm.get("data", {}), f"ConfigMap {source['name']} has no key {key!r}"
                return source["name"], cm["data"][key]
        raise AssertionError(f"{path}: ConfigMap {source['name']!r} is not defined in k8s/")
    raise AssertionError(f"{path}: no volume of the head pod is mounted above it")


def preset_from_text(text: str, tmp_path: Path) -> ClusterConfig:
    path = tmp_path / "preset.yaml"
    path.write_text(text)
    return load_config(path)


def worker_group_problems(spec: dict[str, Any], config: ClusterConfig) -> list[str]:
    """Why the worker groups of a cluster spec cannot host the config's workers ([] if they can)."""
    problems = []
    workers = config.workers
    if not workers.role_resources:
        problems.append("preset: workers.role_resources must be true so actors land on their group")
    head = role_resources(spec["headGroupSpec"].get("rayStartParams", {}))
    if set(head) & set(ROLES):
        problems.append(f"head advertises role resources {sorted(set(head) & set(ROLES))}")
    groups = {g["groupName"]: g for g in spec.get("workerGroupSpecs", [])}
    if set(groups) != set(ROLES):
        problems.append(f"worker groups {sorted(groups)} != roles {sorted(ROLES)}")
    for role in ROLES:
        group = groups.get(role)
        if group is None:
            continue
        advertised = role_resources(group.get("rayStartParams", {}))
        others = set(advertised) & set(ROLES) - {role}
        if others:
            problems.append(f"group {role}: also advertises {sorted(others)}")
        per_pod = advertised.get(role, 0.0)  # one unit per worker actor
        if per_pod < 1:
            problems.append(f"group {role}: rayStartParams.resources must give {role!r} >= 1 (got {advertised})")
            continue
        wanted = getattr(workers, f"num_{role}")
        replicas = group.get("replicas", 0)
        if not group["minReplicas"] <= replicas <= group["maxReplicas"]:
            problems.append(f"group {role}: replicas {replicas} outside [minReplicas, maxReplicas]")
        if replicas * int(per_pod) < wanted:
            problems.append(f"group {role}: {replicas} pods x {int(per_pod)} slots < workers.num_{role}={wanted}")
        needs: WorkerResources = getattr(workers, role)
        limits = ray_container(group["template"]).get("resources", {}).get("limits", {})
        gpus = float(limits.get("nvidia.com/gpu", 0))
        if gpus < needs.num_gpus * per_pod:
            problems.append(f"group {role}: nvidia.com/gpu limit {gpus} < {per_pod} x num_gpus {needs.num_gpus}")
        cpus = parse_cpu(limits.get("cpu", 0))
        if cpus < needs.num_cpus * per_pod:
            problems.append(f"group {role}: cpu limit {cpus} < {per_pod} x num_cpus {needs.num_cpus}")
    return problems


def _kinds() -> set[str]:
    return {doc.get("kind", "") for _, doc in manifests()}


# ---------------------------------------------------------------------------------------------
# Copies to mutate (the negative tests)


def _raycluster() -> dict[str, Any]:
    ((_, doc),) = manifests("RayCluster")
    return copy.deepcopy(doc)


def _group(doc: dict[str, Any], role: str) -> dict[str, Any]:
    return next(g for g in doc["spec"]["workerGroupSpecs"] if g["groupName"] == role)
