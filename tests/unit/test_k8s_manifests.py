"""The KubeRay manifests in k8s/ validate offline and agree with the repo and the config schema.

* KubeRay custom resources (RayCluster, RayJob, RayService) are checked against the
  ``openAPIV3Schema`` of their CRD in ../shared/k8s-crds/ with jsonschema, strictly: an object
  with declared properties rejects unknown fields (what ``kubectl apply --validate=strict``
  does), so a misspelled field fails. CEL rules (``x-kubernetes-validations``) are not run.
* Core kinds (ConfigMap, PersistentVolumeClaim, ...) and every pod template embedded in a
  custom resource are checked with ``kubernetes-validate`` (strict) for Kubernetes K8S_VERSION.
* Cross-checks: every ``python -m <module>`` names a module file of this repo; every preset a
  manifest names (a mounted ConfigMap key or a repo preset) loads with ``configs.load_config``;
  each worker group advertises exactly the custom resource of its role (the roles of
  ``configs.schema.WorkersConfig``) with enough pods, CPUs and GPUs for the preset's workers.
* The RayService: its serveConfigV2 is a valid Ray Serve config (with no unknown keys) whose
  import path is a module of this repo that accepts its ``args``; the preset it names is the
  mounted ConfigMap; its deployments are the app's (``KvfleetController``, ``KvfleetIngress``),
  on the head, within the head's CPUs; port 8000 agrees across http_options, the head's `serve`
  container port, the Service and the preset; its cluster is raycluster.yaml's but for the
  documented serving changes.
Every test that walks the manifests of a kind first asserts there is one: none passes on an
empty k8s/. Negative tests mutate a manifest and show each validator catches the error.
"""

from __future__ import annotations

import copy
import functools
import importlib
import json
import os
import shlex
import typing
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any

import jsonschema
import kubernetes_validate
import pydantic
import pytest
import yaml

from configs import ClusterConfig, ConfigError, WorkersConfig, config_from_dict, load_config
from configs.schema import WorkerResources

REPO = Path(__file__).resolve().parents[2]
K8S_DIR = REPO / "k8s"
# KubeRay's published CRDs (ray.io/v1 RayCluster, RayJob, RayService) live beside the repo in the
# project's shared data, not in it; KVFLEET_KUBERAY_CRDS points elsewhere. Without them the
# CRD-schema tests skip (with this reason in the summary); every other check still runs.
CRD_DIR = Path(os.environ.get("KVFLEET_KUBERAY_CRDS", REPO.parent / "shared" / "k8s-crds"))
needs_crds = pytest.mark.skipif(
    not any(CRD_DIR.glob("ray.io_*.yaml")), reason=f"KubeRay CRDs not found in {CRD_DIR} (set KVFLEET_KUBERAY_CRDS)"
)
K8S_VERSION = "1.37.0"  # newest schema set kubernetes-validate 1.37 ships (v1.37.0-local-strict)
RAY_KINDS = {"RayCluster", "RayJob", "RayService"}
# The worker roles of the config schema: the WorkersConfig fields holding a WorkerResources.
ROLES = tuple(name for name, hint in typing.get_type_hints(WorkersConfig).items() if hint is WorkerResources)

_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # the CRD files are ~1 MB each


# ---------------------------------------------------------------------------------------------
# Loading manifests and CRD schemas


@functools.cache
def _manifests() -> tuple[tuple[str, dict[str, Any]], ...]:
    docs = []
    for path in sorted(K8S_DIR.rglob("*.y*ml")):
        for i, doc in enumerate(yaml.load_all(path.read_text(), Loader=_Loader)):
            if doc is not None:
                docs.append((f"{path.relative_to(REPO)}#{i}", doc))
    return tuple(docs)


def manifests(kind: str | None = None) -> list[tuple[str, dict[str, Any]]]:
    return [(where, doc) for where, doc in _manifests() if kind is None or doc.get("kind") == kind]


def _ids(items: list[tuple[str, dict[str, Any]]]) -> list[str]:
    return [where for where, _ in items]


@functools.cache
def crd_schema(kind: str, api_version: str) -> dict[str, Any]:
    """The jsonschema (strict) for ``kind`` at ``api_version`` (``ray.io/v1``) from its CRD file."""
    group, _, version = api_version.partition("/")
    for path in sorted(CRD_DIR.glob(f"{group}_*.yaml")):
        crd = yaml.load(path.read_text(), Loader=_Loader)
        if crd["spec"]["names"]["kind"] != kind or crd["spec"]["group"] != group:
            continue
        for entry in crd["spec"]["versions"]:
            if entry["name"] == version and entry.get("served", False):
                return openapi_to_jsonschema(entry["schema"]["openAPIV3Schema"], strict=True)
        raise LookupError(f"{path.name}: no served version {version!r} of {kind}")
    raise LookupError(f"no CRD for kind {kind!r} in group {group!r} under {CRD_DIR}")


def openapi_to_jsonschema(node: Any, *, strict: bool) -> Any:
    """A Kubernetes structural OpenAPI v3 schema as a plain (draft 4) jsonschema.

    ``x-kubernetes-int-or-string`` becomes integer|string (when the CRD did not spell that out
    with ``anyOf``), ``nullable`` admits null, ``x-kubernetes-preserve-unknown-fields`` keeps an
    object open, and with ``strict`` every other object with declared ``properties`` forbids
    unknown fields. The other ``x-kubernetes-*`` keys (list/map types, CEL validations) are
    dropped: they constrain merges and updates, not a single manifest's shape.
    """
    if isinstance(node, list):
        return [openapi_to_jsonschema(item, strict=strict) for item in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key.startswith("x-kubernetes-") or key == "nullable":
            continue
        if key in ("properties", "patternProperties", "definitions"):
            out[key] = {name: openapi_to_jsonschema(sub, strict=strict) for name, sub in value.items()}
        elif key in ("default", "example", "enum", "required", "description"):
            out[key] = value
        else:
            out[key] = openapi_to_jsonschema(value, strict=strict)
    if node.get("x-kubernetes-int-or-string") and "type" not in out and "anyOf" not in out:
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if (
        strict
        and "properties" in out
        and "additionalProperties" not in out
        and not node.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    if node.get("nullable"):
        out = {"anyOf": [out, {"type": "null"}]}
    return out


_FORMATS = jsonschema.FormatChecker()


@_FORMATS.checks("int32")
def _is_int32(value: object) -> bool:
    return not isinstance(value, int) or -(2**31) <= value < 2**31


@_FORMATS.checks("int64")
def _is_int64(value: object) -> bool:
    return not isinstance(value, int) or -(2**63) <= value < 2**63


def crd_errors(doc: dict[str, Any]) -> list[str]:
    """Every schema violation of one KubeRay custom resource, as ``path: message`` lines."""
    schema = crd_schema(doc["kind"], doc["apiVersion"])
    validator = jsonschema.Draft4Validator(schema, format_checker=_FORMATS)
    return [
        f"{'.'.join(str(p) for p in err.absolute_path) or '<root>'}: {err.message}"
        for err in sorted(validator.iter_errors(doc), key=lambda e: list(map(str, e.absolute_path)))
    ]


def core_errors(doc: dict[str, Any]) -> list[str]:
    """The kubernetes-validate (strict) verdict on one core-kind object: [] or one message."""
    try:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as err:
        return [f"{'.'.join(str(p) for p in err.path)}: {err.message}"]
    return []


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
# The RayService: its Serve config and what it must agree with

SERVE_PORT = 8000
SERVE_PORT_NAME = "serve"  # the head container port KubeRay's serve Service targets
DEPLOYMENTS = {"KvfleetController", "KvfleetIngress"}  # the deployments of serving/app.py
HEAD_RESOURCE = "node:__internal_head__"  # the resource Ray gives the head node alone
API_KEY_SECRET = {"name": "kvfleet-api-key", "key": "api-key", "optional": True}


def rayservice() -> dict[str, Any]:
    """A copy of the one RayService in k8s/."""
    services = manifests("RayService")
    assert len(services) == 1, f"expected exactly one RayService in k8s/, found {_ids(services)}"
    return copy.deepcopy(services[0][1])


def serve_config(doc: dict[str, Any]) -> dict[str, Any]:
    """The RayService's serveConfigV2 (a YAML string in the manifest), parsed."""
    text = doc["spec"]["serveConfigV2"]
    assert isinstance(text, str), "serveConfigV2 must be a YAML string"
    parsed = yaml.safe_load(text)
    assert isinstance(parsed, dict), "serveConfigV2 must hold a YAML mapping"
    return parsed


def the_application(doc: dict[str, Any]) -> dict[str, Any]:
    apps = serve_config(doc).get("applications", [])
    assert len(apps) == 1, f"expected one Serve application, found {len(apps)}"
    return apps[0]


def serve_config_problems(config: dict[str, Any]) -> list[str]:
    """Why Ray Serve would not take ``config`` as written ([] if it would).

    Ray's own schema (``ray.serve.schema.ServeDeploySchema``) checks types and values; it ignores
    unknown keys (for forward compatibility), so each key is also checked against its model here.
    """
    schema = pytest.importorskip("ray.serve.schema")
    problems = []

    def unknown_keys(where: str, mapping: Any, model: Any) -> None:
        if isinstance(mapping, dict):
            unknown = sorted(set(mapping) - set(model.model_fields))
            problems.extend(f"{where}.{key}: unknown to Ray Serve" for key in unknown)

    unknown_keys("<root>", config, schema.ServeDeploySchema)
    unknown_keys("http_options", config.get("http_options"), schema.HTTPOptionsSchema)
    for i, app in enumerate(config.get("applications") or []):
        unknown_keys(f"applications.{i}", app, schema.ServeApplicationSchema)
        deployments = app.get("deployments") if isinstance(app, dict) else None
        for j, deployment in enumerate(deployments or []):
            where = f"applications.{i}.deployments.{j}"
            unknown_keys(where, deployment, schema.DeploymentSchema)
            if isinstance(deployment, dict):
                actor_options = deployment.get("ray_actor_options")
                unknown_keys(f"{where}.ray_actor_options", actor_options, schema.RayActorOptionsSchema)
    try:
        schema.ServeDeploySchema.model_validate(config)
    except pydantic.ValidationError as err:
        problems += [f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in err.errors()]
    return problems


def serving_port_problems(doc: dict[str, Any], config: ClusterConfig) -> list[str]:
    """Where the port chain breaks: Serve's proxy (http_options), the head's `serve` container
    port, the serve Service's port and target, and the preset's serve.port must all agree."""
    problems = []
    http = serve_config(doc).get("http_options", {})
    port = http.get("port")
    if http.get("host") != "0.0.0.0":
        problems.append(f"http_options.host {http.get('host')!r}: the proxy must listen on the pod IP (0.0.0.0)")
    head = ray_container(doc["spec"]["rayClusterConfig"]["headGroupSpec"]["template"])
    named = {p.get("name"): p for p in head.get("ports", [])}
    if SERVE_PORT_NAME not in named:
        problems.append(f"head container: no port named {SERVE_PORT_NAME!r} (KubeRay's serve Service needs it)")
    elif named[SERVE_PORT_NAME]["containerPort"] != port:
        container_port = named[SERVE_PORT_NAME]["containerPort"]
        problems.append(f"head container port {SERVE_PORT_NAME!r} {container_port} != http_options.port {port}")
    service_ports = [p for p in doc["spec"].get("serveService", {}).get("spec", {}).get("ports", [])
                     if p.get("name") == SERVE_PORT_NAME]  # fmt: skip
    if len(service_ports) != 1:
        problems.append(f"serveService: expected one port named {SERVE_PORT_NAME!r}, found {len(service_ports)}")
    else:
        service_port = service_ports[0]
        if service_port.get("port") != port:
            problems.append(f"serveService port {service_port.get('port')} != http_options.port {port}")
        if service_port.get("targetPort", service_port.get("port")) not in (SERVE_PORT_NAME, port):
            problems.append(f"serveService targetPort {service_port['targetPort']!r} is not the proxy's port")
    if config.serve.port != port:
        problems.append(f"preset serve.port {config.serve.port} != http_options.port {port}")
    return problems


def deployment_problems(doc: dict[str, Any], config: ClusterConfig) -> list[str]:
    """Why the app's deployments are not the expected ones, on the head, within its CPUs."""
    app = the_application(doc)
    deployments = {d.get("name"): d for d in app.get("deployments", [])}
    if set(deployments) != DEPLOYMENTS:
        return [f"deployments {sorted(map(str, deployments))} != {sorted(DEPLOYMENTS)} (serving/app.py's names)"]
    problems = []
    head_cpus_needed = 0.0
    for name, deployment in sorted(deployments.items()):
        options = deployment.get("ray_actor_options", {})
        if options.get("resources", {}).get(HEAD_RESOURCE, 0) <= 0:
            problems.append(f"{name}: ray_actor_options.resources must ask for {HEAD_RESOURCE} (run on the head)")
        head_cpus_needed += deployment.get("num_replicas", 1) * options.get("num_cpus", 1)  # Serve's default: 1 CPU
    controller, ingress = deployments["KvfleetController"], deployments["KvfleetIngress"]
    if controller.get("num_replicas") != 1 or controller.get("ray_actor_options", {}).get("num_cpus") != 0:
        problems.append("KvfleetController: one replica, num_cpus 0 (it owns the cluster's actors)")
    if ingress.get("num_replicas") != config.serve.ingress_replicas:
        problems.append(f"KvfleetIngress num_replicas != preset serve.ingress_replicas {config.serve.ingress_replicas}")
    if ingress.get("ray_actor_options", {}).get("num_cpus") != config.serve.ingress_num_cpus:
        problems.append(f"KvfleetIngress num_cpus != preset serve.ingress_num_cpus {config.serve.ingress_num_cpus}")
    head = doc["spec"]["rayClusterConfig"]["headGroupSpec"]
    head_cpus = float(head.get("rayStartParams", {}).get("num-cpus", 0))
    if head_cpus_needed > head_cpus:
        problems.append(f"the head's deployments need {head_cpus_needed} CPUs, rayStartParams num-cpus is {head_cpus}")
    limit = parse_cpu(ray_container(head["template"]).get("resources", {}).get("limits", {}).get("cpu", 0))
    if head_cpus > limit:
        problems.append(f"head num-cpus {head_cpus} > its container's cpu limit {limit}")
    return problems


def serving_cluster(cluster_spec: dict[str, Any]) -> dict[str, Any]:
    """raycluster.yaml's spec with the RayService's documented changes (see rayservice.yaml).

    On the head only: the container port `serve` 8000 (Serve's HTTP proxy, which the serve
    Service targets), KVFLEET_API_KEY from the optional Secret kvfleet-api-key, and no
    kvfleet-data volume (serving reads no files; the ReadWriteOnce claim would tie this head to
    raycluster.yaml's and block the second cluster KubeRay builds on a rayClusterConfig change).
    """
    spec = copy.deepcopy(cluster_spec)
    template = spec["headGroupSpec"]["template"]
    head = ray_container(template)
    head["ports"].append({"name": SERVE_PORT_NAME, "containerPort": SERVE_PORT})
    head["env"].append({"name": "KVFLEET_API_KEY", "valueFrom": {"secretKeyRef": dict(API_KEY_SECRET)}})
    head["volumeMounts"] = [m for m in head["volumeMounts"] if m["name"] != "kvfleet-data"]
    template["spec"]["volumes"] = [v for v in template["spec"]["volumes"] if v["name"] != "kvfleet-data"]
    return spec


def _rayservice_preset(doc: dict[str, Any], tmp_path: Path) -> tuple[str, ClusterConfig]:
    """(path as the pods see it, loaded config) of the preset the app's ``args.config`` names."""
    path = the_application(doc)["args"]["config"]
    _, text = configmap_preset(doc["spec"]["rayClusterConfig"], path)
    return path, preset_from_text(text, tmp_path)


# ---------------------------------------------------------------------------------------------
# The manifests as they are


def test_k8s_dir_has_the_expected_kinds() -> None:
    assert {"RayCluster", "RayJob", "RayService", "ConfigMap", "PersistentVolumeClaim"} <= _kinds()
    for where, doc in manifests():
        assert doc.get("apiVersion") and doc.get("kind"), f"{where}: apiVersion and kind are required"
        assert doc.get("metadata", {}).get("name"), f"{where}: metadata.name is required"
    assert cluster_specs(), "no Ray cluster spec in k8s/"


def test_parametrized_manifest_sets_are_not_empty() -> None:
    """A parametrized test over zero manifests is skipped, not failed: name what each must see."""
    custom = [d.get("kind") for _, d in manifests() if d.get("kind") in RAY_KINDS]
    assert set(custom) == RAY_KINDS, f"each KubeRay kind needs a manifest to validate: {custom}"
    core = [d.get("kind") for _, d in manifests() if d.get("kind") not in RAY_KINDS]
    assert {"ConfigMap", "PersistentVolumeClaim"} <= set(core)
    # raycluster.yaml, rayjob.yaml's own cluster and rayservice.yaml's
    assert sorted(where.split("#")[0] for where, _ in cluster_specs()) == [
        "k8s/raycluster.yaml",
        "k8s/rayjob.yaml",
        "k8s/rayservice.yaml",
    ]


@needs_crds
@pytest.mark.parametrize(
    "where,doc",
    [pytest.param(w, d, id=w) for w, d in manifests() if d.get("kind") in RAY_KINDS],
)
def test_custom_resource_validates_against_its_crd(where: str, doc: dict[str, Any]) -> None:
    assert crd_errors(doc) == [], where


@pytest.mark.parametrize(
    "where,doc",
    [pytest.param(w, d, id=w) for w, d in manifests() if d.get("kind") not in RAY_KINDS],
)
def test_core_kind_validates_with_kubernetes_validate(where: str, doc: dict[str, Any]) -> None:
    assert core_errors(doc) == [], where


@pytest.mark.parametrize("where,spec", [pytest.param(w, s, id=w) for w, s in cluster_specs()])
def test_embedded_pod_templates_validate_as_core_pod_templates(where: str, spec: dict[str, Any]) -> None:
    for group, template in pod_templates(spec):
        doc = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": group}, "template": template}
        assert core_errors(doc) == [], f"{where} group {group}"


def test_entrypoint_modules_exist_in_the_repo() -> None:
    jobs = manifests("RayJob")
    assert jobs
    for where, doc in jobs:
        entrypoint = doc["spec"]["entrypoint"]
        assert "-m" in entrypoint_argv(entrypoint), f"{where}: expected `python -m <module>`"
        problems = module_problems(entrypoint)  # cluster/job.py: the `ray job submit` entrypoint
        assert not problems, f"{where}: " + "; ".join(problems)


def test_entrypoint_preset_is_a_mounted_configmap_that_loads(tmp_path: Path) -> None:
    jobs = manifests("RayJob")
    assert jobs
    for where, doc in jobs:
        argv = entrypoint_argv(doc["spec"]["entrypoint"])
        config_arg = flag_value(argv, "--config")
        assert config_arg, f"{where}: the entrypoint names no --config"
        if not config_arg.startswith("/"):  # a repo preset name or repo-relative path
            load_config(config_arg if "/" not in config_arg else REPO / config_arg)
            continue
        _, text = configmap_preset(job_cluster(doc), config_arg)
        preset_from_text(text, tmp_path)
        assert flag_value(argv, "--input") and flag_value(argv, "--output"), where


def test_every_configmap_preset_loads(tmp_path: Path) -> None:
    found = 0
    for where, cm in manifests("ConfigMap"):
        for key, text in cm.get("data", {}).items():
            if key.endswith((".yaml", ".yml")):
                preset_from_text(text, tmp_path)
                found += 1
        base = cm["metadata"].get("annotations", {}).get("kvfleet.dev/base-preset")
        if base:
            load_config(base)  # the preset it documents itself as derived from still exists
    assert found, "no ConfigMap holds a preset"


def test_worker_groups_advertise_their_role_and_fit_the_preset(tmp_path: Path) -> None:
    assert ROLES == ("prefill", "decode")
    assert cluster_specs()
    for where, spec in cluster_specs():
        _, text = configmap_preset(spec, "/etc/kvfleet/preset.yaml")
        config = preset_from_text(text, tmp_path)
        assert worker_group_problems(spec, config) == [], where


def test_ray_pods_have_shm_usage_stats_off_and_ucx_env(tmp_path: Path) -> None:
    assert cluster_specs()
    for where, spec in cluster_specs():
        _, text = configmap_preset(spec, "/etc/kvfleet/preset.yaml")
        config = preset_from_text(text, tmp_path)
        for group, template in pod_templates(spec):
            container = ray_container(template)
            env = env_of(container)
            assert env.get("RAY_USAGE_STATS_ENABLED") == "0", f"{where} {group}"
            volumes = {v["name"]: v for v in template["spec"].get("volumes", [])}
            shm = [m for m in container.get("volumeMounts", []) if m["mountPath"] == "/dev/shm"]
            assert shm, f"{where} {group}: no volume at /dev/shm"
            assert volumes[shm[0]["name"]].get("emptyDir", {}).get("medium") == "Memory", f"{where} {group}"
            if group in ROLES:
                assert env.get("UCX_NET_DEVICES") == config.transfer.ucx_net_devices, f"{where} {group}"
                assert env.get("UCX_TLS"), f"{where} {group}: UCX_TLS unset"
                requests = container["resources"]["requests"]
                assert {"cpu", "memory"} <= set(requests), f"{where} {group}"
                assert {"cpu", "memory", "nvidia.com/gpu"} <= set(container["resources"]["limits"]), where


def test_all_ray_containers_share_one_image() -> None:
    images = {ray_container(t)["image"] for _, spec in cluster_specs() for _, t in pod_templates(spec)}
    assert len(images) == 1, f"replace the image placeholder in one place only: {images}"


def test_rayjob_cluster_is_the_raycluster_spec() -> None:
    ((_, cluster),) = manifests("RayCluster")
    jobs = manifests("RayJob")
    assert any("rayClusterSpec" in job["spec"] for _, job in jobs), "no RayJob with its own cluster"
    assert any("clusterSelector" in job["spec"] for _, job in jobs), "no RayJob on the RayCluster"
    for where, job in jobs:
        if "rayClusterSpec" in job["spec"]:
            assert job["spec"]["rayClusterSpec"] == cluster["spec"], f"{where}: drifted from raycluster.yaml"
        else:
            assert job_cluster(job) is not None




@needs_crds
def test_the_one_rayservice_validates_against_its_crd() -> None:
    doc = rayservice()
    assert doc["apiVersion"] == "ray.io/v1" and doc["metadata"]["name"] == "kvfleet"
    assert crd_errors(doc) == []


def test_rayservice_serve_service_validates_as_a_core_service() -> None:
    service = rayservice()["spec"]["serveService"]
    assert core_errors({"apiVersion": "v1", "kind": "Service", **service}) == []
    assert service["metadata"]["name"] == "kvfleet-serve-svc"  # what k8s/README.md port-forwards


def test_rayservice_serve_config_is_valid_for_ray_serve() -> None:
    doc = rayservice()
    config = serve_config(doc)
    assert serve_config_problems(config) == []
    assert config.get("proxy_location") == "HeadOnly"  # the proxy with the deployments, on the head
    app = the_application(doc)
    assert app["name"] == "kvfleet" and app["route_prefix"] == "/"


def test_rayservice_import_path_is_a_module_of_the_repo() -> None:
    module, _, attribute = the_application(rayservice())["import_path"].partition(":")
    assert (module, attribute) == ("serving.app", "build_app")
    source = REPO.joinpath(*module.split(".")).with_suffix(".py")
    assert source.is_file(), f"{source.relative_to(REPO)} is not in the repo"
    text = source.read_text()
    assert f"def {attribute}(" in text
    for name in DEPLOYMENTS:  # Serve rejects a config that names a deployment the app lacks
        assert f'"{name}"' in text, f"{source.relative_to(REPO)} names no deployment {name!r}"


def test_rayservice_preset_is_the_mounted_configmap_and_the_app_builds_from_it(tmp_path: Path) -> None:
    doc = rayservice()
    path, config = _rayservice_preset(doc, tmp_path)
    assert path == "/etc/kvfleet/preset.yaml"
    assert config.ray.address == "auto" and config.workers.role_resources
    # build_app with the manifest's args (the preset at a local path): it rejects unknown args
    # and loads the preset, as the replica will; nothing starts until Serve deploys it.
    serve = pytest.importorskip("ray.serve")
    app = the_application(doc)
    module, _, attribute = app["import_path"].partition(":")
    builder = getattr(importlib.import_module(module), attribute)
    assert isinstance(builder({**app["args"], "config": str(tmp_path / "preset.yaml")}), serve.Application)


def test_rayservice_deployments_run_on_the_head_and_fit_it(tmp_path: Path) -> None:
    doc = rayservice()
    _, config = _rayservice_preset(doc, tmp_path)
    assert deployment_problems(doc, config) == []
    constants = pytest.importorskip("ray._common.constants")
    assert constants.HEAD_NODE_RESOURCE_NAME == HEAD_RESOURCE


def test_rayservice_port_8000_agrees_everywhere(tmp_path: Path) -> None:
    doc = rayservice()
    _, config = _rayservice_preset(doc, tmp_path)
    assert serve_config(doc)["http_options"]["port"] == SERVE_PORT
    assert serving_port_problems(doc, config) == []


def test_rayservice_api_key_comes_from_an_optional_secret(tmp_path: Path) -> None:
    doc = rayservice()
    _, config = _rayservice_preset(doc, tmp_path)
    head = ray_container(doc["spec"]["rayClusterConfig"]["headGroupSpec"]["template"])
    env = {item["name"]: item for item in head["env"]}
    assert env[config.serve.api_key_env]["valueFrom"]["secretKeyRef"] == API_KEY_SECRET
    assert config.serve.api_key is None, "keep the key out of the ConfigMap"


def test_rayservice_cluster_is_the_raycluster_spec_with_the_serving_changes() -> None:
    ((_, cluster),) = manifests("RayCluster")
    assert rayservice()["spec"]["rayClusterConfig"] == serving_cluster(cluster["spec"])


# ---------------------------------------------------------------------------------------------
# The validators catch errors


def _raycluster() -> dict[str, Any]:
    ((_, doc),) = manifests("RayCluster")
    return copy.deepcopy(doc)


def _group(doc: dict[str, Any], role: str) -> dict[str, Any]:
    return next(g for g in doc["spec"]["workerGroupSpecs"] if g["groupName"] == role)


@needs_crds
def test_crd_validation_rejects_a_wrong_type() -> None:
    doc = _raycluster()
    _group(doc, "prefill")["replicas"] = "two"
    assert any("replicas" in e and "integer" in e for e in crd_errors(doc))


@needs_crds
def test_crd_validation_rejects_a_misspelled_field() -> None:
    doc = _raycluster()
    _group(doc, "decode")["replica"] = 1
    errors = crd_errors(doc)
    assert errors and any("replica" in e for e in errors)


@needs_crds
def test_crd_validation_rejects_missing_required_and_out_of_range() -> None:
    doc = _raycluster()
    del _group(doc, "decode")["groupName"]
    _group(doc, "prefill")["maxReplicas"] = 2**31
    errors = crd_errors(doc)
    assert any("groupName" in e for e in errors)
    assert any("maxReplicas" in e and "int32" in e for e in errors)


@needs_crds
def test_crd_validation_handles_int_or_string() -> None:
    doc = _raycluster()
    group = _group(doc, "prefill")
    env = group["template"]["spec"]["containers"][0]["env"]
    env.append({"name": "X", "valueFrom": {"resourceFieldRef": {"resource": "limits.cpu", "divisor": 1}}})
    assert crd_errors(doc) == []  # int-or-string accepts an integer ...
    env[-1]["valueFrom"]["resourceFieldRef"]["divisor"] = "1m"
    assert crd_errors(doc) == []  # ... and a quantity string
    env[-1]["valueFrom"]["resourceFieldRef"]["divisor"] = [1]
    assert crd_errors(doc)


@needs_crds
def test_crd_validation_rejects_a_bad_rayjob() -> None:
    ((_, job),) = [m for m in manifests("RayJob") if "rayClusterSpec" in m[1]["spec"]]
    job = copy.deepcopy(job)
    job["spec"]["shutdownAfterJobFinishes"] = "yes"
    job["spec"]["entrypiont"] = job["spec"].pop("entrypoint")
    errors = crd_errors(job)
    assert any("shutdownAfterJobFinishes" in e for e in errors)
    assert any("entrypiont" in e for e in errors)


@needs_crds
def test_crd_validation_rejects_a_bad_rayservice() -> None:
    doc = rayservice()
    doc["spec"]["serveConfigV2"] = serve_config(doc)  # a mapping where the CRD wants a string
    doc["spec"]["serveService"]["spec"]["ports"][0]["port"] = "8000"
    doc["spec"]["serveConfig"] = doc["spec"].pop("serveService")
    errors = crd_errors(doc)
    assert any(e.startswith("spec.serveConfigV2") and "string" in e for e in errors), errors
    assert any("serveConfig" in e and "Additional properties" in e for e in errors), errors
    doc["spec"]["serveService"] = doc["spec"].pop("serveConfig")
    doc["spec"]["serveConfigV2"] = rayservice()["spec"]["serveConfigV2"]
    assert any("ports.0.port" in e and "integer" in e for e in crd_errors(doc))


def test_serve_config_check_catches_bad_serve_configs() -> None:
    config = serve_config(rayservice())
    deployment = config["applications"][0]["deployments"][1]
    deployment["num_replica"] = deployment.pop("num_replicas")
    deployment["ray_actor_options"]["num_cpu"] = 1
    config["proxy_location"] = "Nowhere"
    config["http_options"]["port"] = "eighty"
    problems = serve_config_problems(config)
    for fragment in ("num_replica:", "num_cpu:", "proxy_location", "http_options.port"):
        assert any(fragment in p for p in problems), (fragment, problems)


def test_serving_checks_catch_port_and_deployment_mismatches(tmp_path: Path) -> None:
    doc = rayservice()
    _, config = _rayservice_preset(doc, tmp_path)
    head = ray_container(doc["spec"]["rayClusterConfig"]["headGroupSpec"]["template"])
    next(p for p in head["ports"] if p["name"] == "serve")["containerPort"] = 8080
    assert any("8080" in p for p in serving_port_problems(doc, config))
    moved = config_from_dict({**config.model_dump(), "serve": {**config.serve.model_dump(), "port": 9000}})
    assert any("serve.port 9000" in p for p in serving_port_problems(rayservice(), moved))

    text = doc["spec"]["serveConfigV2"]
    doc["spec"]["serveConfigV2"] = text.replace("num_cpus: 1\n", "num_cpus: 3\n")
    assert any("need 3.0 CPUs" in p for p in deployment_problems(doc, config))
    doc["spec"]["serveConfigV2"] = text.replace('resources: {"node:__internal_head__": 0.001}', "resources: {}", 1)
    assert any("KvfleetController" in p and HEAD_RESOURCE in p for p in deployment_problems(doc, config))
    doc["spec"]["serveConfigV2"] = text.replace("KvfleetIngress", "Ingress")
    assert any("serving/app.py" in p for p in deployment_problems(doc, config))


def test_serving_cluster_drift_is_caught() -> None:
    ((_, cluster),) = manifests("RayCluster")
    doc = rayservice()
    _group({"spec": doc["spec"]["rayClusterConfig"]}, "decode")["replicas"] = 2
    assert doc["spec"]["rayClusterConfig"] != serving_cluster(cluster["spec"])


def test_core_validation_rejects_bad_core_objects() -> None:
    ((_, cm),) = manifests("ConfigMap")
    cm = copy.deepcopy(cm)
    cm["data"]["count"] = 3
    assert core_errors(cm)
    template = copy.deepcopy(_raycluster()["spec"]["headGroupSpec"]["template"])
    template["spec"]["containers"][0]["imagee"] = "typo"
    pod_template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "x"}, "template": template}
    assert core_errors(pod_template)


def test_module_check_catches_a_missing_module() -> None:
    assert module_problems("python -m cluster.no_such_module --config x") != []
    assert module_problems("python -m configs.load") == []


def test_preset_check_catches_a_bad_preset(tmp_path: Path) -> None:
    _, text = configmap_preset(_raycluster()["spec"], "/etc/kvfleet/preset.yaml")
    data = yaml.safe_load(text)
    data["workers"]["num_decode"] = 0
    with pytest.raises(ConfigError, match="workers.num_decode"):
        preset_from_text(yaml.safe_dump(data), tmp_path)
    with pytest.raises(AssertionError, match="no volume"):
        configmap_preset(_raycluster()["spec"], "/opt/elsewhere/preset.yaml")


def test_worker_group_check_catches_role_mismatches(tmp_path: Path) -> None:
    spec = _raycluster()["spec"]
    _, text = configmap_preset(spec, "/etc/kvfleet/preset.yaml")
    config = preset_from_text(text, tmp_path)

    swapped = copy.deepcopy(spec)
    _group({"spec": swapped}, "prefill")["rayStartParams"]["resources"] = '"{\\"decode\\": 1}"'
    assert any("prefill" in p for p in worker_group_problems(swapped, config))

    too_few = config_from_dict({**config.model_dump(), "workers": {**config.workers.model_dump(), "num_decode": 3}})
    assert any("num_decode=3" in p for p in worker_group_problems(spec, too_few))

    no_gpu = copy.deepcopy(spec)
    del _group({"spec": no_gpu}, "decode")["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]
    assert any("nvidia.com/gpu" in p for p in worker_group_problems(no_gpu, config))

    renamed = copy.deepcopy(spec)
    _group({"spec": renamed}, "decode")["groupName"] = "decoders"
    assert worker_group_problems(renamed, config)


def test_role_resources_parses_kuberay_quoting() -> None:
    assert role_resources({"resources": '"{\\"prefill\\": 1}"'}) == {"prefill": 1.0}
    assert role_resources({"resources": "'{\"decode\": 2}'"}) == {"decode": 2.0}
    assert role_resources({}) == {}
