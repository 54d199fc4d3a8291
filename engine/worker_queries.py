"""What a worker actor reports about an ``EngineCore`` and asks of its cache: load and gauges,
cache lookups, pins and their refresh, the router's resync snapshot, stats and capacity.

A mixin of ``EngineCore``; everything here runs on the engine's thread and only reads or asks
the scheduler and the coordinator (a worker never reaches into them itself).
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from engine.kv_cache.spec import KVCacheGroup


class WorkerQueriesMixin:
    """The engine's reports and cache requests for its worker (state: none of its own; it reads
    EngineCore's ``scheduler``, ``coordinator``, ``layout``, ``info`` and counters).

    Invariant: nothing here changes a request; only pins and the eviction order of free cached
    blocks change (``pin_prefix`` / ``unpin_prefix`` / ``refresh_prefix``).
    """

    scheduler: Any
    coordinator: Any
    layout: Any
    info: Any
    expected: dict[str, Any]
    transfer_stats: Any
    failed_steps: int
    failed_requests: int

    # -- what a worker actor reports and asks (it never reaches into the scheduler or the cache) ---
    def load(self) -> tuple[float, int, float]:
        """(tokens still to compute, requests holding KV, fraction of the tightest pool in use)."""
        scheduler = self.scheduler
        queued = sum(r.num_tokens - r.num_computed_tokens for r in scheduler.waiting)
        queued += sum(max(0, r.num_tokens - r.num_computed_tokens - 1) for r in scheduler.running)
        running = len(scheduler.running) + len(scheduler.waiting_for_kv)
        return float(queued), running, min(1.0, max(0.0, self.coordinator.usage))

    def cache_gauges(self) -> dict[str, float]:
        """Free and pinned-free blocks (tightest pool), prefix-cache hit rate, running and waiting."""
        scheduler, coordinator = self.scheduler, self.coordinator
        pool = coordinator.pools[coordinator.tightest_pool]
        queried = scheduler.queried_tokens
        return {
            "free_blocks": pool.num_free_blocks,
            "pinned_free_blocks": pool.num_pinned_free_blocks,
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

    def pin_prefix(self, block_hashes: list[bytes], num_tokens: int) -> int:
        """Pin the cached prefix; returns the tokens pinned."""
        return self.coordinator.pin_prefix(block_hashes, num_tokens)

    def unpin_prefix(self, block_hashes: list[bytes], num_tokens: int) -> bool:
        return self.coordinator.unpin_prefix(block_hashes, num_tokens)

    def refresh_prefix(self, block_hashes: list[bytes], num_tokens: int) -> int:
        """Mark the cached blocks a hit of ``num_tokens`` tokens needs as just used (each pool's
        free queue evicts them last, a prefix's tail before its head), so the hit the router
        predicted for a request routed here survives the allocations of the requests ahead of
        it; returns the tokens that hit covers now (0: nothing to refresh)."""
        hit = self.coordinator.find_longest_cache_hit(block_hashes, num_tokens)
        if hit.num_tokens <= 0:
            return 0
        for g, manager in enumerate(self.coordinator.managers):
            blocks = [block for block in hit.blocks[g] if not block.is_null]
            if blocks:
                manager.pool.touch(blocks)
                manager.pool.free_blocks(blocks[::-1])
        return hit.num_tokens

    @property
    def event_seq(self) -> int:
        """Sequence number of the last KV event emitted."""
        return self.coordinator.event_seq

    def cache_snapshot(self) -> tuple[int, tuple[dict[bytes, int], ...]]:
        """(event seq, per group every cached hash and its pin level): a router resync."""
        return self.coordinator.snapshot()

    def stats(self) -> dict[str, Any]:
        """Queue lengths, block counts, hit counters and transfer counters (plain data).

        ``num_blocks`` / ``free_blocks`` / ``pinned_blocks`` describe pool 0 (the attention pool
        of a hybrid layout, the only pool otherwise); ``capacity.pools`` has every pool."""
        scheduler, pool = self.scheduler, self.coordinator.pool
        return {
            "running": len(scheduler.running),
            "waiting": len(scheduler.waiting),
            "waiting_for_kv": len(scheduler.waiting_for_kv),
            "held_for_transfer": len(scheduler.held),
            "expecting_handles": len(self.expected),
            "queued_tokens": sum(r.num_tokens - r.num_computed_tokens for r in scheduler.waiting),
            "num_blocks": self.info.num_blocks - 1,
            "free_blocks": pool.num_free_blocks,
            "capacity": self.capacity(),
            "pinned_blocks": pool.num_pinned_free_blocks,  # explicit pins + retained window/state anchors
            "explicitly_pinned_blocks": pool.explicit.size,
            "hit_tokens": scheduler.hit_tokens,
            "queried_tokens": scheduler.queried_tokens,
            "num_preemptions": scheduler.num_preemptions,
            "failed_steps": self.failed_steps,
            "failed_requests": self.failed_requests,
            "transfer": asdict(self.transfer_stats),
        }

    def capacity(self) -> dict[str, Any]:
        """What this worker's KV memory holds: ``tokens`` of attention KV, ``recurrent_states``
        (requests' full recurrent states), and per pool its kind, page size and blocks."""
        coordinator, layout = self.coordinator, self.layout
        pools = [
            {"kind": pool.kind, "page_bytes": pool.page_bytes, "slots": pool.num_slots,
             "num_blocks": coordinator.num_blocks_in(p), "free_blocks": coordinator.num_free_blocks_in(p)}
            for p, pool in enumerate(layout.pools)
        ]  # fmt: skip
        return {**layout.capacity(self.info.pool_blocks), "bytes": layout.pool_bytes(self.info.pool_blocks),
                "pools": pools}  # fmt: skip
