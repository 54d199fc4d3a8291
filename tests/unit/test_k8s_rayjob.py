"""The RayJobs of k8s/ and the presets the manifests name.

* Every ``python -m <module>`` of a RayJob entrypoint names a module file of this repo; the
  entrypoint's ``--config`` is a repo preset or a mounted ConfigMap key that loads.
* Every preset a ConfigMap holds loads with ``configs.load_config`` (and the base preset it names
  exists); a RayJob's own cluster is raycluster.yaml's spec.
Negative tests show the module and preset checks catch a missing module and a bad preset.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from configs import ConfigError, load_config
from tests.unit.k8s_schemas import REPO, manifests
from tests.unit.k8s_specs import (
    _raycluster,
    configmap_preset,
    entrypoint_argv,
    flag_value,
    job_cluster,
    module_problems,
    preset_from_text,
)

# ---------------------------------------------------------------------------------------------
# The manifests as they are


def test_entrypoint_modules_exist_in_the_repo() -> None:
    jobs = manifests("RayJob")
    assert jobs
    for where, doc in jobs:
        entrypoint = doc["spec"]["entrypoint"]
        assert "-m" in entrypoint_argv(entrypoint), f"{where}: expected `python -m <module>`"
        problems = module_problems(entrypoint)  # kvfleet/job.py: the `ray job submit` entrypoint
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
    for _where, cm in manifests("ConfigMap"):
        for key, text in cm.get("data", {}).items():
            if key.endswith((".yaml", ".yml")):
                preset_from_text(text, tmp_path)
                found += 1
        base = cm["metadata"].get("annotations", {}).get("kvfleet.dev/base-preset")
        if base:
            load_config(base)  # the preset it documents itself as derived from still exists
    assert found, "no ConfigMap holds a preset"


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


# ---------------------------------------------------------------------------------------------
# The checks catch errors


def test_module_check_catches_a_missing_module() -> None:
    assert module_problems("python -m cluster.no_such_module --config x") != []
    assert module_problems("python -m configs.load") == []


def test_preset_check_catches_a_bad_preset(tmp_path: Path) -> None:
    _, text = configmap_preset(_raycluster()["spec"], "/etc/kvfleet/preset.yaml")
    data = yaml.safe_load(text)
    data["workers"]["num_decode"] = 0
    with pytest.raises(ConfigError, match=r"workers.num_decode"):
        preset_from_text(yaml.safe_dump(data), tmp_path)
    with pytest.raises(AssertionError, match="no volume"):
        configmap_preset(_raycluster()["spec"], "/opt/elsewhere/preset.yaml")
