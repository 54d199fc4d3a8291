"""The RayService of k8s/ (k8s_serving.py holds its checks).

Its serveConfigV2 is a valid Ray Serve config (with no unknown keys) whose import path is a module
of this repo that accepts its ``args``; the preset it names is the mounted ConfigMap; its
deployments are the app's (``KvfleetController``, ``KvfleetIngress``), on the head, within the
head's CPUs; port 8000 agrees across http_options, the head's `serve` container port, the Service
and the preset; the API key comes from an optional Secret; its cluster is raycluster.yaml's but
for the documented serving changes. Negative tests show the Serve-config, port, deployment and
cluster-drift checks catch errors.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from configs import config_from_dict
from tests.unit.k8s_schemas import REPO, core_errors, crd_errors, manifests, needs_crds
from tests.unit.k8s_serving import (
    API_KEY_SECRET,
    DEPLOYMENTS,
    HEAD_RESOURCE,
    SERVE_PORT,
    _rayservice_preset,
    deployment_problems,
    rayservice,
    serve_config,
    serve_config_problems,
    serving_cluster,
    serving_port_problems,
    the_application,
)
from tests.unit.k8s_specs import _group, ray_container

# ---------------------------------------------------------------------------------------------
# The RayService as it is


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
# The checks catch errors


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
