"""The Ray pods of k8s/: worker groups, resources and environment.

* Each worker group advertises exactly the custom resource of its role (the roles of
  ``configs.schema.WorkersConfig``) with enough pods, CPUs and GPUs for the preset's workers.
* Every Ray pod turns usage stats off and has a memory-backed /dev/shm; worker pods set UCX's
  network devices as the preset does, and resource requests and limits; all run one image.
Negative tests show the worker-group check catches role mismatches, and how KubeRay's quoting of
``rayStartParams.resources`` is read.
"""

from __future__ import annotations

import copy
from pathlib import Path

from configs import config_from_dict
from tests.unit.k8s_schemas import ROLES
from tests.unit.k8s_specs import (
    _group,
    _raycluster,
    cluster_specs,
    configmap_preset,
    env_of,
    pod_templates,
    preset_from_text,
    ray_container,
    role_resources,
    worker_group_problems,
)

# ---------------------------------------------------------------------------------------------
# The manifests as they are


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


# ---------------------------------------------------------------------------------------------
# The checks catch errors


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
