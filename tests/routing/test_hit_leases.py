"""A routed request's predicted hit stays true until its admission (``engine.kv_cache.hit_leases``).

The router predicts a worker's hit from the worker's KV events (a real ``RoutingPolicy`` index fed
by a real ``HybridCoordinator``); the request reaches the worker's ``Scheduler`` behind requests
whose allocations evict free cached blocks; its admission must still find every predicted token.
"""

from __future__ import annotations

import time

import pytest

from configs.schema import SchedulerConfig
from engine.kv_cache import FullAttentionSpec, HybridCoordinator, KVCacheGroup, MambaSpec, SlidingWindowSpec
from engine.kv_cache.spec import KVCacheSpec
from engine.request import Request
from engine.routing import RoutingPolicy
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler

SPECS: dict[str, list[KVCacheSpec]] = {
    "full": [FullAttentionSpec(4)],
    "hybrid": [FullAttentionSpec(4), SlidingWindowSpec(4, 8), MambaSpec(4)],
}
PREFIX = list(range(1, 33))  # 32 tokens: 8 blocks per attention group


def run(scheduler: Scheduler, until_idle: bool = True, steps: int = 1) -> None:
    """Step the scheduler as an engine would, every sampled token 0."""
    done = 0
    while (scheduler.has_work if until_idle else done < steps) and done < 1000:
        out = scheduler.schedule()
        scheduler.update(out, {c.request.request_id: 0 for c in out.chunks if c.sample})
        scheduler.coordinator.check_invariants()
        done += 1


def request(scheduler: Scheduler, rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=1), scheduler.coordinator.hash_block_size)


@pytest.mark.parametrize("kind", sorted(SPECS))
def test_a_leased_hit_survives_the_evictions_of_the_requests_ahead(kind: str) -> None:
    groups = [KVCacheGroup(spec) for spec in SPECS[kind]]
    coord = HybridCoordinator(groups, num_blocks=24 * len(groups), enable_events=True)
    config = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, prefill_chunk_size=64)
    scheduler = Scheduler(config, coord, max_model_len=4096)
    policy = RoutingPolicy(groups)
    policy.add_worker("w")

    scheduler.add_request(request(scheduler, "warm", [*PREFIX, 40]))
    run(scheduler)  # the prefix is cached, its blocks free (evictable)
    policy.apply_events("w", coord.take_events(), 0.0)

    prompt = [*PREFIX, 41, 42]
    routed = request(scheduler, "routed", prompt)
    predicted = policy.index.predict(routed.block_hashes, len(prompt) - 1).get("w", 0)
    assert predicted == len(PREFIX)

    # Requests ahead of it (new prefixes) take every free block; then the routed one arrives
    # (what the worker does with the router's prediction) and waits behind them.
    for i in range(3):
        scheduler.add_request(request(scheduler, f"ahead{i}", [100 + 60 * i + t for t in range(56)]))
    assert scheduler.lease_hit("routed", routed.block_hashes, predicted) == predicted
    scheduler.add_request(routed)
    run(scheduler)

    assert routed.num_cached_tokens == predicted  # no false hit
    assert len(scheduler.leases) == 0  # the admission ended the lease
    assert coord.num_free_blocks == sum(pool.num_blocks - 1 for pool in coord.pools)


def test_leases_give_way_before_a_running_request_is_preempted_or_the_queue_stalls() -> None:
    groups = [KVCacheGroup(FullAttentionSpec(4))]
    coord = HybridCoordinator(groups, num_blocks=20)
    config = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, prefill_chunk_size=64)
    scheduler = Scheduler(config, coord, max_model_len=4096)
    scheduler.add_request(request(scheduler, "warm", [*PREFIX, 40]))
    run(scheduler)
    hashes = request(scheduler, "x", [*PREFIX, 1]).block_hashes
    assert scheduler.lease_hit("late", hashes, len(PREFIX)) == len(PREFIX)
    # a request that needs every block but the leased ones' and more: it is admitted once the
    # lease of a request that never came gives way
    big = request(scheduler, "big", [200 + t for t in range(70)])
    scheduler.add_request(big)
    run(scheduler)
    assert big.num_cached_tokens == 0 and scheduler.leases.broken == 1 and len(scheduler.leases) == 0
    assert scheduler.num_preemptions == 0


def test_a_lease_expires_and_abort_ends_it() -> None:
    groups = [KVCacheGroup(FullAttentionSpec(4))]
    coord = HybridCoordinator(groups, num_blocks=20)
    scheduler = Scheduler(SchedulerConfig(), coord, max_model_len=4096)
    scheduler.add_request(request(scheduler, "warm", [*PREFIX, 40]))
    run(scheduler)
    hashes = request(scheduler, "x", [*PREFIX, 1]).block_hashes
    free = coord.num_free_blocks
    assert scheduler.lease_hit("a", hashes, len(PREFIX)) == len(PREFIX)
    assert coord.num_free_blocks == free - len(PREFIX) // 4
    now = time.monotonic()
    assert scheduler.leases.expire(now) == []
    assert scheduler.leases.expire(now + scheduler.leases.lease_s) == ["a"]
    assert coord.num_free_blocks == free
    scheduler.lease_hit("b", hashes, len(PREFIX))
    scheduler.abort("b")
    assert coord.num_free_blocks == free and len(scheduler.leases) == 0
    coord.check_invariants()


@pytest.mark.parametrize("kind", sorted(SPECS))
def test_a_leased_hit_in_the_host_tier_survives_the_host_tiers_evictions(kind: str) -> None:
    groups = [KVCacheGroup(spec) for spec in SPECS[kind]]
    coord = HybridCoordinator(groups, num_blocks=32 * len(groups), host_blocks=32 * len(groups), enable_events=True)
    config = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, prefill_chunk_size=64)
    scheduler = Scheduler(config, coord, max_model_len=4096)

    def flood(seed: int) -> None:
        for i in range(4):
            scheduler.add_request(request(scheduler, f"flood{seed}-{i}", [1000 * seed + 60 * i + t for t in range(40)]))
        run(scheduler)
        coord.take_tier_copies()  # the runner would run them

    scheduler.add_request(request(scheduler, "warm", [*PREFIX, 40]))
    run(scheduler)
    flood(1)  # the prefix moves to the host tier
    routed = request(scheduler, "routed", [*PREFIX, 41, 42])
    hit = coord.get_computed_blocks(routed)
    assert hit.num_tokens == len(PREFIX) and coord.host_hit_tokens(hit) > 0  # (partly) on the host
    assert scheduler.lease_hit("routed", routed.block_hashes, hit.num_tokens) == hit.num_tokens
    flood(2)  # the host tier takes the next flood's blocks and drops its least recently used ones
    flood(3)
    scheduler.add_request(routed)
    run(scheduler)
    assert routed.num_cached_tokens == len(PREFIX) and len(scheduler.leases) == 0
