"""The RayService of k8s/: its Serve config (serveConfigV2) and the checks of what it must agree with."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pydantic
import pytest
import yaml

from configs import ClusterConfig
from tests.unit.k8s_schemas import _ids, manifests
from tests.unit.k8s_specs import configmap_preset, parse_cpu, preset_from_text, ray_container

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
    service_ports = [
        p
        for p in doc["spec"].get("serveService", {}).get("spec", {}).get("ports", [])
        if p.get("name") == SERVE_PORT_NAME
    ]
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
