"""From the config to Ray: how to start or attach to Ray, and each actor's options.

Resources: every worker asks for its ``num_cpus`` / ``num_gpus``; the custom resources
``prefill`` / ``decode`` (one unit per worker) are requested when ``workers.role_resources`` is
on (then the cluster must offer them) or when the cluster offers them anyway (KubeRay worker
groups, or an embedded cluster, which declares them). A request the cluster can never satisfy
is an error here, not an actor pending forever.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from configs.schema import ClusterConfig, WorkerResources

log = logging.getLogger(__name__)

ROLES = ("prefill", "decode")
# The router is light but asks for a sliver of a CPU: an actor that asks for no resources at all is
# sent to a random node of a multi-node cluster (Ray's GCS forwards it anywhere), where losing
# that node takes the router with it; one that asks for some starts on its owner's (the driver's)
# node when that node has room. It starts after the workers, so it never keeps one pending; the
# capacity check and the embedded cluster's size count it.
ROUTER_NUM_CPUS = 0.01


class PlacementError(RuntimeError):
    """The Ray cluster cannot host the configured workers (names the field and the numbers)."""


def loopback_environment() -> None:
    """Keep Ray and UCX on loopback and offline (no-ops where the user set them already)."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def needed_cpus(config: ClusterConfig) -> float:
    """Logical CPUs the configured workers ask for in all (the router not included)."""
    workers = config.workers
    one_rank = workers.num_prefill * workers.prefill.num_cpus + workers.num_decode * workers.decode.num_cpus
    return one_rank * workers.tensor_parallel_size  # each rank of a split worker asks for as much


def embedded_init_kwargs(config: ClusterConfig) -> dict[str, Any]:
    """``ray.init`` arguments of an embedded local cluster sized for ``config``'s workers."""
    ray_cfg = config.ray
    num_cpus = ray_cfg.num_cpus if ray_cfg.num_cpus is not None else max(float(os.cpu_count() or 1), 1.0)
    num_cpus = max(num_cpus, needed_cpus(config) + ROUTER_NUM_CPUS * config.router.replicas)
    workers = config.workers
    num_gpus = workers.num_prefill * workers.prefill.num_gpus + workers.num_decode * workers.decode.num_gpus
    kwargs: dict[str, Any] = {
        "address": "local",  # a new cluster, even where /tmp/ray names another (perhaps stale) one
        "num_cpus": int(-(-num_cpus // 1)),
        "resources": {"prefill": float(max(1, workers.num_prefill)), "decode": float(workers.num_decode)},
        "include_dashboard": ray_cfg.include_dashboard,
        "object_store_memory": ray_cfg.object_store_mib * 2**20,
        "namespace": ray_cfg.namespace,
        "_node_ip_address": "127.0.0.1",
    }
    if num_gpus:
        kwargs["num_gpus"] = int(-(-num_gpus // 1))
    return kwargs


def worker_options(config: ClusterConfig, role: str, cluster_resources: dict[str, float]) -> dict[str, Any]:
    """Ray actor options of a ``role`` worker on a cluster offering ``cluster_resources``."""
    resources: WorkerResources = getattr(config.workers, role)
    custom = dict(resources.custom_resources)
    if config.workers.role_resources or role in cluster_resources:
        custom.setdefault(role, 1.0)
    for name, amount in custom.items():
        if cluster_resources.get(name, 0.0) < amount:
            raise PlacementError(
                f"workers.{role}: custom resource {name!r} ({amount} per worker) is not offered by the Ray "
                f"cluster (it offers {cluster_resources.get(name, 0.0)}); set workers.role_resources=false "
                f"or start the nodes with --resources"
            )
    options: dict[str, Any] = {
        "num_cpus": resources.num_cpus,
        "max_restarts": 0,
        "max_concurrency": 1000,
    }
    if resources.num_gpus:
        options["num_gpus"] = resources.num_gpus
    if custom:
        options["resources"] = custom
    return options


def check_capacity(config: ClusterConfig, cluster_resources: dict[str, float]) -> None:
    """Raise PlacementError if the workers' total CPUs / GPUs (and the router's CPU beside them)
    exceed what the cluster has."""
    workers = config.workers
    for kind, field in (("CPU", "num_cpus"), ("GPU", "num_gpus")):
        need = workers.num_prefill * getattr(workers.prefill, field) + workers.num_decode * getattr(
            workers.decode, field
        )
        need *= workers.tensor_parallel_size  # every rank of a split worker asks for the same
        have = cluster_resources.get(kind, 0.0)
        if need > have + 1e-9:
            raise PlacementError(
                f"workers: {workers.num_prefill} prefill + {workers.num_decode} decode workers need {need:g} "
                f"{kind} in all but the Ray cluster has {have:g} (lower workers.*.{field} or add capacity; "
                f"for an embedded cluster raise ray.num_cpus)"
            )
    need, have = needed_cpus(config), cluster_resources.get("CPU", 0.0)
    routers = ROUTER_NUM_CPUS * config.router.replicas
    if need + routers > have + 1e-9:
        raise PlacementError(
            f"workers: the workers need {need:g} CPU and the router replicas {routers:g} beside them but the "
            f"Ray cluster has {have:g} (lower workers.*.num_cpus or add capacity; for an embedded cluster "
            f"raise ray.num_cpus)"
        )


def largest_node_devices(nodes: list[dict[str, Any]], device: str) -> int:
    """The most devices of kind ``device`` (GPUs for cuda, CPUs otherwise) on one alive node of
    ``ray.nodes()``: a worker's ranks share one node."""
    key = "GPU" if device == "cuda" else "CPU"
    counts = [0]
    for node in nodes:
        resources = node.get("Resources")
        if node.get("Alive", True) and isinstance(resources, dict):
            counts.append(int(float(resources.get(key, 0.0))))
    return max(counts)


def check_tensor_parallel(
    config: ClusterConfig, model_directory: Path, nodes: list[dict[str, Any]] | None = None
) -> None:
    """Refuse a ``workers.tensor_parallel_size`` > 1 the cluster cannot start, before any worker
    starts: a size the model cannot split by (naming the field, the model and the number,
    ``engine.model.layers.parallel``); and a size above the devices of the largest of ``nodes``
    (``ray.nodes()``; None: not checked; a worker's ranks share one node). Prefill and decode
    workers share the one size, as a P/D transfer between split workers needs (each decode rank
    reads its shard from the prefill worker's same rank, engine/rank_group.py)."""
    size = config.workers.tensor_parallel_size
    if size == 1:
        return
    from engine.model.arch.hf_config import arch_from_hf_config
    from engine.model.checkpoints.loader import read_hf_config
    from engine.model.layers.parallel import check_tensor_parallel as check_model

    check_model(arch_from_hf_config(read_hf_config(model_directory)), size)
    if nodes is not None:
        devices = largest_node_devices(nodes, config.model.device)
        if size > devices:
            unit = "GPUs" if config.model.device == "cuda" else "CPUs"
            raise PlacementError(
                f"workers.tensor_parallel_size: a worker's ranks share one node, but the largest node has "
                f"{devices} {unit} (got {size})"
            )
