"""Config -> Ray options: custom role resources only where the cluster offers them (or the config
demands them), GPUs when configured, and clear errors instead of actors pending forever."""

from __future__ import annotations

import pytest

from cluster.placement import PlacementError, check_capacity, embedded_init_kwargs, worker_options
from configs import load_config


def test_role_resources_follow_the_cluster():
    config = load_config("tiny")
    bare = {"CPU": 4.0}
    assert "resources" not in worker_options(config, "prefill", bare)
    offered = {"CPU": 4.0, "prefill": 2.0, "decode": 2.0}
    assert worker_options(config, "prefill", offered)["resources"] == {"prefill": 1.0}
    assert worker_options(config, "decode", offered)["resources"] == {"decode": 1.0}
    options = worker_options(config, "decode", offered)
    assert options["num_cpus"] == 0.5 and "num_gpus" not in options


def test_required_role_resources_and_gpus():
    config = load_config("tiny", ["workers.role_resources=true", "workers.decode.num_gpus=1"])
    with pytest.raises(PlacementError, match=r"workers.prefill: custom resource 'prefill'"):
        worker_options(config, "prefill", {"CPU": 4.0})
    assert worker_options(config, "decode", {"CPU": 4.0, "decode": 1.0})["num_gpus"] == 1
    assert embedded_init_kwargs(config)["num_gpus"] == 1


def test_capacity_errors_name_the_numbers():
    config = load_config("tiny", ["workers.num_decode=4", "workers.decode.num_cpus=2"])
    with pytest.raises(PlacementError, match=r"need 8.5 CPU in all but the Ray cluster has 4"):
        check_capacity(config, {"CPU": 4.0})
    check_capacity(config, {"CPU": 9.0})
    # an embedded cluster declares enough logical CPUs and both role resources
    kwargs = embedded_init_kwargs(config)
    assert kwargs["num_cpus"] >= 9 and kwargs["resources"] == {"prefill": 1.0, "decode": 4.0}
    assert kwargs["address"] == "local" and kwargs["_node_ip_address"] == "127.0.0.1"
