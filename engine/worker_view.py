"""WorkerView: what a worker actor reports about its engine and asks of its cache.

The worker (``actors/worker.py``) and its router link (``actors/router_link.py``) read loads,
gauges, snapshots and counters here and place / drop / refresh prefix pins here; they never
reach into the scheduler or the cache themselves. ``EngineCore`` builds one (``worker_view``)
from its parts and owns the ``EngineCounters`` the view reads live.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from engine.disagg import CompletedRead, HeldBlocks, TransferStats
from engine.kv_cache.coordinator import HybridCoordinator
from engine.kv_cache.coordinator_types import PinTier
from engine.kv_cache.spec import KVCacheGroup
from engine.model.kv_layout import KVLayout
from engine.pd_handoff import Expected, PDHandoff
from engine.runner import ModelRunner
from engine.scheduler import Scheduler


@dataclass
class EngineCounters:
    """Counters the engine changes every step (``EngineCore.step``) and a ``WorkerView`` reads."""

    #: prompt tokens of the step being computed synchronously (``WorkerView.load`` counts them as
    #: still to compute: the scheduler advanced their requests when it scheduled them)
    step_prompt_tokens: int = 0
    #: steps whose forward raised
    failed_steps: int = 0
    #: requests ended with ``finish_reason="error"``
    failed_requests: int = 0
    #: steps scheduled and launched while the step before ran (``scheduler.async_scheduling``)
    overlapped_steps: int = 0
    #: the part of ``overlapped_steps`` holding a prompt chunk (prefill and mixed steps)
    overlapped_prompt_steps: int = 0


class WorkerView:
    """Owns nothing but references: one engine's scheduler, KV-cache coordinator, model runner,
    KV layout, P/D hand-off (None without a ``kv_role``) and counters, all of which the engine
    owns and builds before the view.

    Invariants: nothing here changes a request; only pins and hit leases change (``pin_prefix`` /
    ``unpin_prefix`` / ``lease_prefix`` / ``release_lease``); every value is read
    live from those parts at the call (the view caches nothing), and it is called on the
    engine's thread only, like the engine.
    """

    def __init__(
        self,
        scheduler: Scheduler,
        coordinator: HybridCoordinator,
        runner: ModelRunner,
        layout: KVLayout,
        pool_blocks: tuple[int, ...],
        handoff: PDHandoff | None,
        counters: EngineCounters,
        promote_gib_s: float,
    ):
        self.scheduler = scheduler
        self.coordinator = coordinator
        self.runner = runner
        self.layout = layout
        #: blocks per pool (null included), as the engine's ``EngineInfo.pool_blocks``
        self.pool_blocks = pool_blocks
        self.handoff = handoff
        self.counters = counters
        #: host-tier copy bandwidth assumed until measured (``kv_cache.offload.promote_gib_s``)
        self.promote_gib_s = promote_gib_s

    def load(self) -> tuple[float, int, float, float]:
        """(tokens still to compute, with the prompt chunks of the step being computed; requests
        holding KV; fraction of the tightest pool in use; seconds to promote one host-tier hit
        token: ``promote_s_per_token``, 0 without a host tier), the fields of
        ``engine.routing.WorkerLoad``."""
        scheduler = self.scheduler
        queued = sum(r.num_tokens - r.num_computed_tokens for r in scheduler.waiting)
        queued += sum(max(0, r.num_tokens - r.num_computed_tokens - 1) for r in scheduler.running)
        queued += self.counters.step_prompt_tokens
        running = len(scheduler.running) + len(scheduler.waiting_for_kv)
        return float(queued), running, min(1.0, max(0.0, self.coordinator.usage)), self.promote_s_per_token()

    def promote_s_per_token(self) -> float:
        """Seconds the host tier takes to copy one hit token's KV back to the device: the bytes a
        hit token moves (per pool, a block's bytes over the block size of its groups) over the
        measured copy bandwidth (``kv_cache.offload.promote_gib_s`` until measured); 0 without
        a host tier."""
        memory = self.runner.host_kv
        if memory is None or self.coordinator.host is None:
            return 0.0
        coordinator = self.coordinator
        per_token = 0.0
        for p in range(coordinator.num_pools):
            sizes = [g.spec.block_size for g in coordinator.groups if g.pool == p]
            per_token += memory.block_bytes(p) / min(sizes)
        return per_token / memory.bandwidth(self.promote_gib_s * 2**30)

    def cache_gauges(self) -> dict[str, float]:
        """Free and pinned-free blocks (tightest pool), prefix-cache hit rate, running and waiting."""
        scheduler, coordinator = self.scheduler, self.coordinator
        pool = coordinator.pools[coordinator.capacity.tightest_pool]
        queried = scheduler.queried_tokens
        return {
            "free_blocks": pool.num_free_blocks,
            "pinned_free_blocks": pool.num_retained_blocks,
            "hit_rate": scheduler.hit_tokens / queried if queried else 0.0,
            "running": len(scheduler.running),
            "waiting": len(scheduler.waiting) + len(scheduler.waiting_for_kv),
        }

    @property
    def kv_groups(self) -> list[KVCacheGroup]:
        """The KV-cache groups of this engine (the router predicts hits with the same ones)."""
        return list(self.coordinator.groups)

    def cached_prefix_tokens(self, block_hashes: list[bytes], num_tokens: int) -> int:
        """Tokens of the prefix ``block_hashes`` (up to ``num_tokens``) this cache could serve now."""
        return self.coordinator.find_longest_cache_hit(block_hashes, num_tokens).num_tokens

    def pin_prefix(self, block_hashes: list[bytes], num_tokens: int, tier: PinTier = "device") -> int:
        """Pin the cached prefix in ``tier`` ("device": kept on the device, moved to the host tier
        pinned under pressure; "host": held in the host tier only, ``kv_cache.offload``); returns
        the tokens pinned (``HybridCoordinator.pin_prefix``). A host-tier pin's copies run before
        the next forward, with the other queued host-tier copies."""
        return self.coordinator.pin_prefix(block_hashes, num_tokens, tier)

    def unpin_prefix(self, block_hashes: list[bytes], num_tokens: int, tier: PinTier = "device") -> bool:
        """Undo one ``pin_prefix`` with the same arguments; False if no such pin is held."""
        return self.coordinator.unpin_prefix(block_hashes, num_tokens, tier)

    def lease_prefix(self, request_id: str, block_hashes: list[bytes], num_tokens: int) -> int:
        """Hold the cached blocks of the hit the router predicted for ``request_id`` (up to
        ``num_tokens`` tokens of ``block_hashes``) until the request is admitted, aborted or the
        lease expires (``Scheduler.lease_hit``); returns the tokens held (less than predicted: the
        blocks were evicted after the router last heard of them)."""
        return self.scheduler.lease_hit(request_id, block_hashes, num_tokens)

    def release_lease(self, request_id: str) -> bool:
        """End ``request_id``'s hit lease before its admission; False if it held none."""
        return self.scheduler.leases.release(request_id) > 0

    @property
    def event_seq(self) -> int:
        """Sequence number of the last KV event emitted."""
        return self.coordinator.event_seq

    def cache_snapshot(self) -> tuple[int, tuple[dict[bytes, int], ...], tuple[dict[bytes, int], ...]]:
        """(event seq, per group every cached hash and its pin level, the same of the host tier):
        a router resync (the fields of ``engine.routing.WorkerSnapshot``)."""
        return self.coordinator.snapshot()

    # -- P/D: the hand-off's state -----------------------------------------------------------------
    @property
    def transfer_stats(self) -> TransferStats:
        """The P/D transfer counters."""
        return self.handoff.stats if self.handoff is not None else TransferStats()

    @property
    def held(self) -> HeldBlocks:
        """The requests whose blocks are held for a reader (``PDHandoff.held``)."""
        return self._handoff().held

    @property
    def expected(self) -> Mapping[str, Expected]:
        """The announced remote prefills waiting for their handles (``PDHandoff.expected``)."""
        return self._handoff().expected

    def _handoff(self) -> PDHandoff:
        if self.handoff is None:
            raise ValueError("kv_role: this engine was built without one, so it has no P/D hand-off")
        return self.handoff

    def is_reserved(self, request_id: str) -> bool:
        """Whether an announced request holds its blocks while it waits for its handle."""
        return self.handoff is not None and self.handoff.is_reserved(request_id)

    def take_completed_reads(self) -> list[CompletedRead]:
        """The KV reads that ended well since the last call, each once."""
        return self.handoff.take_completed_reads() if self.handoff is not None else []

    def stats(self) -> dict[str, Any]:
        """Queue lengths, block counts, hit counters and transfer counters (plain data).

        ``num_blocks`` / ``free_blocks`` / ``pinned_blocks`` describe pool 0 (the attention pool
        of a hybrid layout, the only pool otherwise); ``capacity.pools`` has every pool."""
        scheduler, pool, handoff = self.scheduler, self.coordinator.pool, self.handoff
        return {
            "running": len(scheduler.running),
            "waiting": len(scheduler.waiting),
            "waiting_for_kv": len(scheduler.waiting_for_kv),
            "held_for_transfer": len(scheduler.held),
            "expecting_handles": len(handoff.expected) if handoff is not None else 0,
            "queued_tokens": sum(r.num_tokens - r.num_computed_tokens for r in scheduler.waiting),
            "num_blocks": self.pool_blocks[0] - 1,
            "free_blocks": pool.num_free_blocks,
            "capacity": self.capacity(),
            "pinned_blocks": pool.num_retained_blocks,  # explicit pins + retained window/state anchors
            "explicitly_pinned_blocks": pool.explicit.size,
            "hit_tokens": scheduler.hit_tokens,
            "queried_tokens": scheduler.queried_tokens,
            "num_preemptions": scheduler.num_preemptions,
            "hit_leases": scheduler.leases.counters(),  # predicted hits held from arrival to admission
            "failed_steps": self.counters.failed_steps,
            "eager_steps": self.runner.eager_steps,  # steps no static step took (ModelRunner.eager_steps)
            "failed_requests": self.counters.failed_requests,
            "transfer": asdict(handoff.stats if handoff is not None else TransferStats()),
            "host_tier": self.host_tier_stats(),
        }

    def host_tier_stats(self) -> dict[str, Any] | None:
        """The host tier (``kv_cache.offload``; None when off): per pool its usable and cached
        blocks, the blocks offloaded / refreshed (already there) / dropped (no free host block) /
        promoted, the bytes copied each way and the host-side seconds the copies took (in all and
        each way), and the hit tokens each tier served (``hit_tokens``: device + host ==
        ``stats()["hit_tokens"]``; a request's host part is its ``num_host_cached_tokens``)."""
        host, memory = self.coordinator.host, self.runner.host_kv
        if host is None or memory is None:
            return None
        scheduler = self.scheduler
        return {
            "hit_tokens": {
                "device": scheduler.hit_tokens - scheduler.host_hit_tokens,
                "host": scheduler.host_hit_tokens,
            },
            "pools": [
                {"num_blocks": pool.num_blocks - 1, "cached_blocks": host.num_cached_blocks(p)}
                for p, pool in enumerate(host.pools)
            ],
            **asdict(host.counters),
            "bytes_offloaded": memory.bytes_to_host,
            "bytes_promoted": memory.bytes_to_device,
            "copy_seconds": memory.seconds,
            "offload_seconds": memory.seconds_to_host,
            "promote_seconds": memory.seconds_to_device,
            "memcpy_bytes": memory.memcpy_bytes,
            "memcpy_seconds": memory.memcpy_seconds,
            "host_bytes": memory.nbytes,
        }

    def capacity(self) -> dict[str, Any]:
        """What this worker's KV memory holds: ``tokens`` of attention KV, ``recurrent_states``
        (requests' full recurrent states), and per pool its kind, page size and blocks."""
        coordinator, layout = self.coordinator, self.layout
        pools = [
            {
                "kind": pool.kind,
                "page_bytes": pool.page_bytes,
                "slots": pool.num_slots,
                "num_blocks": coordinator.capacity.num_blocks_in(p),
                "free_blocks": coordinator.capacity.num_free_blocks_in(p),
            }
            for p, pool in enumerate(layout.pools)
        ]
        return {
            **layout.capacity(self.pool_blocks),
            "bytes": layout.pool_bytes(self.pool_blocks),
            "pools": pools,
        }
