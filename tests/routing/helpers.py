"""Helpers for routing tests: workers with real coordinators whose events feed a policy."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from configs.schema import AutoPinConfig, RouterConfig, RouterWeights
from engine.kv_cache import (
    CacheRequest,
    HybridCoordinator,
    KVCacheGroup,
    RetentionOptions,
)
from engine.kv_cache.spec import (
    ChunkedLocalSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from engine.routing import (
    PinOn,
    PlacementPolicy,
    RequestSnapshot,
    RoutingPolicy,
    Unpin,
    snapshot_coordinator,
)
from engine.routing.types import Action

# Group mixes the hit rules must agree on (block sizes give hash granularity 4, alignment 4 or 8).
CONFIGS: dict[str, list[KVCacheSpec]] = {
    "full+2swa": [FullAttentionSpec(4), SlidingWindowSpec(4, window=9), SlidingWindowSpec(4, window=17)],
    "full+mamba": [FullAttentionSpec(4), MambaSpec(4)],
    "full+swa8+mamba8": [FullAttentionSpec(4), SlidingWindowSpec(8, window=13), MambaSpec(8)],
    "swa+mamba": [SlidingWindowSpec(4, window=9), MambaSpec(4)],
    "full4+full8+chunked": [FullAttentionSpec(4), FullAttentionSpec(8), ChunkedLocalSpec(4, chunk_size=16)],
}


def groups_of(specs: Sequence[KVCacheSpec]) -> list[KVCacheGroup]:
    return [KVCacheGroup(spec) for spec in specs]


class Worker:
    """A worker's coordinator driven the way the engine drives it: admission with the local hit,
    prefill in chunks ending on aligned boundaries (Mamba checkpoints), window drops, free."""

    def __init__(
        self,
        name: str,
        specs: Sequence[KVCacheSpec],
        num_blocks: int,
        retention: bool = True,
        host_blocks: int | None = None,
    ):
        """``host_blocks``: blocks of each pool's host tier (None: no host tier)."""
        self.name = name
        options = RetentionOptions(enabled=retention, min_drop_blocks=1)
        self.coord = HybridCoordinator(
            groups_of(specs), num_blocks, retention=options, enable_events=True, host_blocks=host_blocks
        )
        self.running: dict[str, CacheRequest] = {}
        self._ids = 0
        self.last_id = ""
        self.last_hit = (0, 0)  # (tokens, host tokens) of the last admission's hit

    def request(self, tokens: Sequence[int], remote: bool = False) -> CacheRequest:
        self._ids += 1
        return CacheRequest(f"{self.name}-{self._ids}", tokens, self.coord.hash_block_size, remote_prefill=remote)

    def actual_hit(self, tokens: Sequence[int], remote: bool = False) -> int:
        return self.coord.get_computed_blocks(self.request(tokens, remote)).num_tokens

    def actual_tiers(self, tokens: Sequence[int], remote: bool = False) -> tuple[int, int]:
        """(hit tokens, the host tier's part) the coordinator would serve ``tokens`` now."""
        hit = self.coord.get_computed_blocks(self.request(tokens, remote))
        return hit.num_tokens, self.coord.host_hit_tokens(hit)

    def run(self, tokens: Sequence[int]) -> int | None:
        """Admit and prefill ``tokens``; returns the hit it got, or None if it did not fit."""
        coord = self.coord
        req = self.request(tokens)
        hit = coord.get_computed_blocks(req)
        n = req.num_tokens
        start = hit.num_tokens
        boundary = n - n % coord.alignment
        first = boundary - start if boundary > start else n - start
        if coord.allocate_slots(req, first, hit) is None:
            return None
        coord.take_tier_copies()  # the runner would run them before the forward
        self.last_hit = (hit.num_tokens, coord.host_hit_tokens(hit))
        req.num_computed_tokens = start + first
        coord.remove_skipped_blocks(req.request_id, req.num_computed_tokens)
        self.running[req.request_id] = req
        self.last_id = req.request_id
        if req.num_computed_tokens < n:
            coord.new_step()
            if coord.allocate_slots(req, n - req.num_computed_tokens) is not None:
                req.num_computed_tokens = n
                coord.remove_skipped_blocks(req.request_id, n)
        coord.new_step()
        return start

    def finish(self, request_id: str | None = None, rng: random.Random | None = None) -> None:
        if not self.running:
            return
        if request_id is None:
            request_id = (rng or random).choice(sorted(self.running))
        self.running.pop(request_id)
        self.coord.free(request_id)
        self.coord.new_step()

    def finish_all(self) -> None:
        for rid in list(self.running):
            self.finish(rid)


def execute(
    policy: PlacementPolicy, workers: dict[str, Worker], actions: list[Action], now: float = 0.0
) -> list[Action]:
    """Run actions against the workers (PinOn computes the prefix first when needed) and feed the
    resulting events and results back; returns every action executed (for assertions)."""
    done: list[Action] = []
    queue = list(actions)
    while queue:
        action = queue.pop(0)
        done.append(action)
        worker = workers.get(action.worker)  # type: ignore[arg-type]
        if worker is None:
            continue
        if isinstance(action, RequestSnapshot):
            queue.extend(policy.apply_snapshot(action.worker, snapshot_coordinator(worker.coord), now))
        elif isinstance(action, Unpin):
            worker.coord.unpin_prefix(action.block_hashes, action.num_tokens, action.tier)
            queue.extend(sync(policy, workers, now))
        elif isinstance(action, PinOn):
            coord = worker.coord
            warm = None
            if coord.find_longest_cache_hit(action.block_hashes, action.num_tokens).num_tokens < action.num_tokens:
                assert action.token_ids is not None
                # warm-up prefill; one extra token so the hit search (N - 1) reaches the whole prefix
                if worker.run([*list(action.token_ids), 0]) is not None:
                    warm = worker.last_id
            pinned = coord.pin_prefix(action.block_hashes, action.num_tokens, action.tier)
            if warm is not None:
                worker.finish(warm)
            queue.extend(sync(policy, workers, now))
            assert isinstance(policy, RoutingPolicy)
            queue.extend(policy.pin_result(action.worker, action.pin_id, pinned, now, coord.event_seq))
    return done


def sync(policy: PlacementPolicy, workers: dict[str, Worker], now: float = 0.0) -> list[Action]:
    """Deliver every worker's pending events to the policy."""
    actions: list[Action] = []
    for name, worker in workers.items():
        if name in policy.roles:
            actions.extend(policy.apply_events(name, worker.coord.take_events(), now))
    return actions


def tokens(rng: random.Random, n: int, vocab: int = 50) -> list[int]:
    return [rng.randrange(vocab) for _ in range(n)]


_WEIGHTS = {
    "w_uncached": "uncached_tokens",
    "w_queued": "queued_tokens",
    "w_running": "running_requests",
    "w_used": "used_block_fraction",
    "w_churn": "cache_churn",
}


def router_config(**knobs: Any) -> RouterConfig:
    """A ``RouterConfig`` from flat test knobs: ``w_<term>`` for weights, ``auto_pin_<field>`` for
    the automatic pins (``auto_pin=True`` turns them on), anything else as a ``RouterConfig`` field."""
    weights = {_WEIGHTS[k]: knobs.pop(k) for k in list(knobs) if k in _WEIGHTS}
    auto = {k.removeprefix("auto_pin_"): knobs.pop(k) for k in list(knobs) if k.startswith("auto_pin_")}
    if knobs.pop("auto_pin", False):
        auto["enabled"] = True
    return RouterConfig(weights=RouterWeights(**weights), auto_pin=AutoPinConfig(**auto), **knobs)
