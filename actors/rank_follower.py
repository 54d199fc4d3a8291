"""RankFollower: one tensor-parallel rank (above 0) of a worker, as a Ray actor.

A worker at ``workers.tensor_parallel_size`` N is its worker actor (rank 0: the ``EngineCore``
the cluster talks to) and N - 1 of these, all in one placement group on one node
(cluster/rank_groups.py). Each joins the worker's torch.distributed group, builds its shard of the
engine and runs ``engine.rank_group.follow_leader`` in a thread: it steps only when rank 0 sends
a step. A rank of a prefill or decode worker (``kv_role``) has its own transfer agent over its
shard of the KV: a decode rank reads its shard of each request rank 0 pulls from the prefill
worker's same rank (``engine.transfer.ranked``). The cluster never calls it for requests; it only
starts it, asks whether it is ready and kills it with its worker.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

import ray

from configs.schema import ClusterConfig

if TYPE_CHECKING:
    from engine.core import KVRole

log = logging.getLogger(__name__)


@ray.remote(max_restarts=0)
class RankFollower:
    """Owns one rank's engine (weights, KV pages and states of its shard) and the thread following
    rank 0. Invariant: the engine's runner is touched by that thread only; once it ends (rank 0
    stopped it, or the group broke) the rank does nothing more and ``status`` says why."""

    def __init__(self, config: ClusterConfig, worker_id: str, rank: int, address: str, kv_role: KVRole | None = None):
        """``kv_role``: the worker's P/D role (None: it runs aggregated)."""
        from configs.logs import setup_logging
        from engine.core import EngineCore
        from engine.rank_group import join_rank_group
        from engine.transfer.ranked import FollowerReads

        setup_logging(config.logging)
        self.worker_id = worker_id
        self.rank = rank
        workers = config.workers
        resources = workers.prefill if worker_id.startswith("prefill") else workers.decode
        join_rank_group(
            address, rank, workers.tensor_parallel_size, config.model.device, workers.engine_stall_timeout_s
        )
        self.engine = EngineCore(
            config,
            threads=resources.num_threads,
            name=f"{worker_id}-rank{rank}",
            kv_role=kv_role,
            tensor_parallel_rank=rank,
        )
        transfer = self.engine.transfer
        #: this rank's P/D reads (None without a kv_role)
        self.reads = FollowerReads(transfer, rank) if transfer is not None else None
        self.steps = 0
        self.error: str | None = None
        self.done = False
        self._thread = threading.Thread(target=self._follow, name=f"rank-{worker_id}-{rank}", daemon=True)
        self._thread.start()

    def _follow(self) -> None:
        from engine.rank_group import follow_leader

        try:
            follow_leader(self.engine.runner, self._count_step, self.reads)
        except BaseException as exc:
            self.error = f"{type(exc).__name__}: {exc}"
            log.exception("%s rank %d: following rank 0 failed", self.worker_id, self.rank)
        finally:
            self.done = True

    def _count_step(self) -> None:
        self.steps += 1

    def status(self) -> dict[str, str | int | bool | None]:
        """This rank: its worker, its number, the steps it ran, the P/D reads it finished and the
        blocks they moved, whether it stopped and why."""
        reads = self.reads
        return {
            "worker": self.worker_id,
            "rank": self.rank,
            "steps": self.steps,
            "reads": reads.reads_done if reads is not None else 0,
            "read_blocks": reads.blocks if reads is not None else 0,
            "done": self.done,
            "error": self.error,
        }
