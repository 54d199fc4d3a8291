"""RankGroups: how the cluster starts a worker, on one rank or split over several.

At ``workers.tensor_parallel_size`` 1 a worker is one actor, as ever. At N > 1 it is a Ray
placement group of N bundles packed on one node (one per rank: the worker's CPUs, and one GPU
each on CUDA), the worker actor in bundle 0 (rank 0, the ``EngineCore`` the cluster talks to)
and a ``RankFollower`` in each other bundle; the ranks meet at a ``tcp://`` address on that node
(``rendezvous``, picked there); in a P/D cluster every rank has the worker's ``kv_role`` (its own
transfer agent, engine/rank_group.py). The cluster sees one worker: it health-checks and calls the
worker actor only; a rank that dies breaks rank 0's next step (or keep-alive), which takes the
worker down, and ``release`` then kills the rest of the group.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

from cluster.handles import WorkerHandle
from configs.schema import ClusterConfig, WorkerResources

if TYPE_CHECKING:
    from ray.actor import ActorClass

log = logging.getLogger(__name__)

#: seconds a worker's placement group may take to be placed before its start fails
PLACEMENT_TIMEOUT_S = 120.0


def rendezvous() -> str:
    """A free ``tcp://`` address on this node (run in the group's bundle 0, on its node)."""
    import ray

    host = ray.util.get_node_ip_address()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        port = probe.getsockname()[1]
    return f"tcp://{host}:{port}"


class RankGroups:
    """Owns the placement groups and follower actors of the cluster's split workers, by worker id.

    Invariants: a worker id has a placement group and N - 1 followers exactly while its worker
    actor (rank 0) was started by ``launch`` and not yet ``release``d; at N = 1 nothing is kept."""

    def __init__(self, config: ClusterConfig):
        self.config = config
        self.size = config.workers.tensor_parallel_size
        self.groups: dict[str, Any] = {}  # worker id -> ray.util.placement_group.PlacementGroup
        self.followers: dict[str, list[Any]] = {}  # worker id -> its RankFollower actors

    def launch(self, actor_class: Any, worker_id: str, role: str, options: dict[str, Any], *args: Any) -> WorkerHandle:
        """Start worker ``worker_id`` (``actor_class.options(**options).remote(config, worker_id,
        *args)``), with its other ranks when the worker is split. Blocks while a split worker's
        placement group is placed (at most ``PLACEMENT_TIMEOUT_S``)."""
        config = self.config
        if self.size == 1:
            handle: WorkerHandle = actor_class.options(**options).remote(config, worker_id, *args)
            return handle
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from actors.rank_follower import RankFollower

        resources: WorkerResources = getattr(config.workers, role)
        bundle: dict[str, float] = {"CPU": max(resources.num_cpus, 0.01)}
        if config.model.device == "cuda":
            bundle["GPU"] = 1.0
        first = {**bundle, **options.get("resources", {})}
        group = placement_group([first] + [dict(bundle) for _ in range(self.size - 1)], strategy="STRICT_PACK")
        try:
            ray.get(group.ready(), timeout=PLACEMENT_TIMEOUT_S)

            def in_bundle(index: int) -> PlacementGroupSchedulingStrategy:
                return PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=index)

            find = ray.remote(num_cpus=0)(rendezvous)
            address: str = ray.get(find.options(scheduling_strategy=in_bundle(0)).remote(), timeout=60)
            follower_class = cast("ActorClass[RankFollower]", RankFollower)  # what @ray.remote made of it
            # the supervisor's rule (cluster/supervisor.py): prefill workers make the cluster P/D
            kv_role = role if config.workers.num_prefill > 0 else None
            followers = [
                follower_class.options(num_cpus=resources.num_cpus, scheduling_strategy=in_bundle(rank)).remote(
                    config, worker_id, rank, address, kv_role
                )
                for rank in range(1, self.size)
            ]
            leader_options = {**options, "scheduling_strategy": in_bundle(0)}
            leader_options.pop("resources", None)  # bundle 0 holds them
            handle = actor_class.options(**leader_options).remote(config, worker_id, *args, address)
        except BaseException:
            remove_placement_group(group)
            raise
        self.groups[worker_id] = group
        self.followers[worker_id] = followers
        log.info("worker %s: %d ranks at %s", worker_id, self.size, address)
        return handle

    def release(self, worker_id: str, kill: Callable[[Any], None]) -> None:
        """Kill a split worker's followers (``kill``: how an actor is killed) and free its placement
        group; nothing at one rank. The worker actor itself is the caller's."""
        followers = self.followers.pop(worker_id, [])
        for follower in followers:
            try:
                kill(follower)
            except Exception as exc:  # noqa: BLE001 - already gone
                log.debug("kill %s follower: %s", worker_id, exc)
        group = self.groups.pop(worker_id, None)
        if group is not None:
            from ray.util.placement_group import remove_placement_group

            try:
                remove_placement_group(group)
            except Exception as exc:  # noqa: BLE001 - the cluster is going away
                log.debug("remove %s placement group: %s", worker_id, exc)

    def release_all(self, kill: Callable[[Any], None]) -> None:
        for worker_id in list(self.groups):
            self.release(worker_id, kill)
