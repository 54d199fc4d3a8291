"""Several block pools in one coordinator (docs/architecture.md, The hybrid KV cache): one pool per
page size, each with its own block ids 0..n-1 and its own null block; admission counts blocks per
pool; events, pins, retention, reset and ``check_invariants()`` per pool.

``MultiPoolMachine`` is the hypothesis state machine of ``test_stateful.py`` over configurations
with two or three pools of different sizes (full attention, sliding window and Mamba each in a
pool of its own), with ``check_invariants()`` and the simulator's brute-force hit oracle after
every operation.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, assume, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize

from engine.kv_cache import (
    AllBlocksCleared,
    BlockStored,
    CacheRequest,
    FullAttentionSpec,
    HybridCoordinator,
    KVCacheGroup,
    KVCacheInvariantError,
    MambaSpec,
    RetentionOptions,
    SlidingWindowSpec,
)
from engine.kv_cache.block_queue import TIER_EXPLICIT
from kvfleet_testing.kv_cache_sim import MIX_POOLS, RandomDriver, Sim, SimConfig, min_pool_blocks_for, random_pool_sizes
from tests.kv_cache.test_stateful import CoordinatorMachine

THREE = "3pool:full|swa|mamba"


def three_pools(sizes: tuple[int, int, int] = (40, 24, 8), **kwargs) -> HybridCoordinator:  # type: ignore[no-untyped-def]
    groups = [
        KVCacheGroup(FullAttentionSpec(4), pool=0),
        KVCacheGroup(SlidingWindowSpec(4, 8), pool=1),
        KVCacheGroup(MambaSpec(4), pool=2),
    ]
    return HybridCoordinator(groups, sizes, **kwargs)


def prefill(coord: HybridCoordinator, rid: str, tokens: list[int]) -> list[int] | None:
    req = CacheRequest(rid, tokens, coord.hash_block_size)
    ids = coord.allocate_slots(req, len(tokens), hit=coord.get_computed_blocks(req))
    if ids is not None:
        req.num_computed_tokens = len(tokens)
    coord.check_invariants()
    return ids  # type: ignore[return-value]


# -- construction ------------------------------------------------------------------------------------------------
def test_every_pool_index_must_be_used() -> None:
    groups = [KVCacheGroup(FullAttentionSpec(4), pool=0), KVCacheGroup(MambaSpec(4), pool=2)]
    with pytest.raises(ValueError, match=r"KVCacheGroup\.pool.*\[1\]"):
        HybridCoordinator(groups, [8, 8, 8])
    with pytest.raises(ValueError, match=r"KVCacheGroup\.pool"):
        HybridCoordinator([KVCacheGroup(FullAttentionSpec(4), pool=-1)], 8)


def test_num_blocks_per_pool() -> None:
    with pytest.raises(ValueError, match="num_blocks: 2 values for 3 pools"):
        three_pools((8, 8))  # type: ignore[arg-type]
    coord = three_pools((40, 24, 8))
    assert [p.num_blocks for p in coord.pools] == [40, 24, 8]
    assert [coord.capacity.num_blocks_in(p) for p in range(3)] == [39, 23, 7]
    same = three_pools(16)  # type: ignore[arg-type]  # an int: that many blocks in every pool
    assert [p.num_blocks for p in same.pools] == [16, 16, 16]


def test_block_ids_are_per_pool_and_never_cross() -> None:
    coord = three_pools((40, 24, 8))
    ids = prefill(coord, "a", list(range(17)))
    assert ids is not None
    full, swa, mamba = ids
    assert full == [1, 2, 3, 4, 5]  # each pool hands out its own ids from 1 (0 is its null block)
    assert swa == [1, 2, 3, 4, 5]
    assert mamba == [1]
    tables = [m.tables["a"] for m in coord.managers]
    for g, table in enumerate(tables):
        assert all(b.pool == g for b in table)
    assert [coord.capacity.num_free_blocks_in(p) for p in range(3)] == [34, 18, 6]


def test_admission_refused_when_any_pool_is_short() -> None:
    coord = three_pools((40, 24, 3))  # the Mamba pool holds 2 usable states
    assert prefill(coord, "a", [1] * 9) is not None
    assert prefill(coord, "b", [2] * 9) is not None
    before = [coord.capacity.num_free_blocks_in(p) for p in range(3)]
    assert before[2] == 0 and before[0] > 10
    assert prefill(coord, "c", [3] * 9) is None  # attention pools have room, the Mamba pool none
    assert [coord.capacity.num_free_blocks_in(p) for p in range(3)] == before
    assert "c" not in coord.requests
    coord.free("a")
    assert prefill(coord, "c", [3] * 9) is not None


def test_reserved_blocks_per_pool() -> None:
    coord = three_pools((40, 24, 8))
    req = CacheRequest("a", [1] * 9, coord.hash_block_size)
    assert coord.allocate_slots(req, 9, reserved_blocks=(0, 0, 7)) is None  # Mamba needs 1 of 7
    assert coord.allocate_slots(req, 9, reserved_blocks=(37, 0, 0)) is None  # full needs 3 of 39
    assert coord.allocate_slots(req, 9, reserved_blocks=(36, 20, 6)) is not None
    coord.check_invariants()


def test_tightest_pool_and_pool_stats() -> None:
    coord = three_pools((40, 24, 5))
    assert prefill(coord, "a", [1] * 9) is not None  # full 3/39, swa 3/23, mamba 1/4 used
    assert coord.capacity.tightest_pool == 2
    assert coord.num_free_blocks == 3 and coord.usage == pytest.approx(0.25)
    stats = coord.capacity.pool_stats()
    assert [(s.pool, s.groups, s.num_blocks, s.free_blocks) for s in stats] == [
        (0, (0,), 39, 36),
        (1, (1,), 23, 20),
        (2, (2,), 4, 3),
    ]
    assert coord.capacity.pool_usage(0) == pytest.approx(3 / 39)


def test_hits_events_pins_and_reset_across_pools() -> None:
    coord = three_pools((40, 24, 8), enable_events=True)
    prompt = [1, 2, 3, 0] * 4
    assert prefill(coord, "a", prompt) is not None  # the Mamba state after 16 tokens is cacheable
    events = coord.take_events()
    stored = {(e.group, e.pool) for e in events if isinstance(e, BlockStored)}
    assert stored == {(0, 0), (1, 1), (2, 2)}  # each group's blocks live in its own pool
    assert [e.seq for e in events] == list(range(1, len(events) + 1))  # one sequence over all pools
    coord.free("a")
    req = CacheRequest("b", [*prompt, 5, 5], coord.hash_block_size)
    hit = coord.get_computed_blocks(req)
    assert hit.num_tokens == 16
    assert [len(b) for b in hit.blocks] == [4, 4, 4]
    assert all(b.pool == g for g, blocks in enumerate(hit.blocks) for b in blocks if not b.is_null)
    hashes = CacheRequest("x", prompt, coord.hash_block_size).block_hashes
    assert coord.pin_prefix(hashes, 16) == 16
    pinned = [[b.block_id for b in pool.blocks if b.tier == TIER_EXPLICIT] for pool in coord.pools]
    assert [len(p) for p in pinned] == [4, 2, 1]  # full: the prefix, SWA: the window, Mamba: the state
    coord.check_invariants()
    assert coord.unpin_prefix(hashes, 16)
    assert not any(b.tier for pool in coord.pools for b in pool.blocks)
    coord.take_events()
    assert prefill(coord, "c", [3] * 5) is not None
    assert not coord.reset_prefix_cache()  # pool 0..2 all busy
    coord.free("c")
    assert coord.reset_prefix_cache()
    assert [type(e) for e in coord.take_events()][-1:] == [AllBlocksCleared]
    assert not any(m.cached for m in coord.managers)
    coord.check_invariants()


def test_retention_budget_applies_per_pool() -> None:
    coord = three_pools((40, 24, 8), retention=RetentionOptions(enabled=True, budget_blocks=(0, 1, 1)))
    assert [p.retain_budget for p in coord.pools] == [0, 1, 1]
    coord = three_pools((40, 24, 8), retention=RetentionOptions(enabled=True, budget_blocks=2))
    assert [p.retain_budget for p in coord.pools] == [2, 2, 2]
    prompt = [1, 2, 3, 0] * 6
    assert prefill(coord, "a", [*prompt, 1]) is not None
    coord.free("a")
    req = CacheRequest("b", [*prompt, 2, 2, 2, 2, 2], coord.hash_block_size)
    hit = coord.get_computed_blocks(req)
    assert coord.allocate_slots(req, req.num_tokens - hit.num_tokens, hit) is not None
    coord.free("b")  # its shared prefix (24 tokens) is retained, within each pool's budget
    coord.check_invariants()
    assert all(pool.retained.size <= 2 for pool in coord.pools)
    assert any(pool.retained.size for pool in coord.pools)


def test_check_invariants_catches_a_block_of_another_pool() -> None:
    coord = three_pools((40, 24, 8))
    assert prefill(coord, "a", [1] * 9) is not None
    table = coord.managers[1].tables["a"]
    stolen = coord.pools[0].free_queue.popleft()  # a pool-0 block slipped into a pool-1 table
    stolen.ref_cnt = 1
    table.append(stolen)
    with pytest.raises(KVCacheInvariantError, match="not a block of pool 1"):
        coord.check_invariants()


# -- random runs -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mix", sorted(MIX_POOLS))
def test_random_driver_multi_pool(mix: str) -> None:
    rng = random.Random(mix)
    for retention in (RetentionOptions(), RetentionOptions(enabled=True, budget_blocks=2)):
        sizes = random_pool_sizes(rng, mix)
        sim = Sim(SimConfig(mix=mix, num_blocks=sizes, retention=retention, seed=rng.randrange(1000)))
        driver = RandomDriver(sim, random.Random(rng.randrange(1 << 30)))
        for _ in range(300):
            driver.step()
        sim.drain()
        assert sim.counts["arrive"] and sim.counts["decode"]


@st.composite
def pool_configs(draw: st.DrawFn) -> SimConfig:
    """Two or three pools of different sizes (the three-pool mix most of the time)."""
    mix = draw(st.sampled_from([THREE, THREE, *sorted(MIX_POOLS)]))
    sizes = tuple(low + draw(st.integers(0, 24)) for low in min_pool_blocks_for(mix))
    assume(len(set(sizes)) == len(sizes))
    retention = draw(
        st.one_of(
            st.just(RetentionOptions()),
            st.builds(
                RetentionOptions,
                enabled=st.just(True),
                budget_blocks=st.sampled_from([None, 1, 2, 4]),
                pin_sliding_window=st.sampled_from([True, True, False]),
                min_drop_blocks=st.sampled_from([1, 2]),
            ),
        )
    )
    return SimConfig(
        mix=mix,
        num_blocks=sizes,
        enable_caching=draw(st.sampled_from([True] * 9 + [False])),
        retention=retention,
        enable_events=draw(st.sampled_from([True] * 9 + [False])),
        vocab=draw(st.sampled_from([2, 3, 4])),
        seed=draw(st.integers(0, 1 << 16)),
    )


class MultiPoolMachine(CoordinatorMachine):
    """``CoordinatorMachine``'s rules over several pools of different sizes at once."""

    @initialize(
        cfg=pool_configs(),
        initial=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 127), st.booleans()), max_size=4),
        warmup=st.integers(0, 4),
        seed=st.integers(0, (1 << 32) - 1),
    )
    def setup(self, cfg: SimConfig, initial: list[tuple[int, int, bool]], warmup: int, seed: int) -> None:
        self.sim = Sim(cfg)
        event(f"mix {cfg.mix}")
        for base, cut, remote in initial:
            self.sim.arrive(base, cut, [], max_tokens=4, remote=remote)
        driver = RandomDriver(self.sim, random.Random(seed))
        for _ in range(warmup):
            driver.scheduler_step()


MultiPoolMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestMultiPoolStateful = MultiPoolMachine.TestCase


def test_random_runs_catch_admission_that_counts_blocks_over_all_pools(monkeypatch: pytest.MonkeyPatch) -> None:
    """The per-pool admission check has teeth: one that compares the total need with the total
    free blocks admits requests a small pool cannot hold (the allocation then fails midway)."""

    def pooled_fits(self, predicted, reserved_blocks):  # type: ignore[no-untyped-def]
        free = [pool.num_free_blocks for pool in self.pools]
        return free if sum(predicted) <= sum(free) - reserved_blocks * len(free) else None

    monkeypatch.setattr(HybridCoordinator, "_fits", pooled_fits)
    rng = random.Random(13)
    with pytest.raises((ValueError, KVCacheInvariantError, AssertionError)):
        for _ in range(20):
            sim = Sim(SimConfig(mix=THREE, num_blocks=(60, 40, 4), seed=rng.randrange(1000)))
            driver = RandomDriver(sim, random.Random(rng.randrange(1 << 30)))
            for _ in range(500):
                driver.step()


def test_check_invariants_catches_broken_table_and_queue_shapes() -> None:
    """The invariants the faster paths rely on: nulls only as a prefix outside Mamba groups (free
    walks the live suffix), the null block never counted, prev/next None iff unlinked."""
    coord = three_pools((40, 24, 8))
    assert prefill(coord, "a", [1] * 9) is not None
    table = coord.managers[0].tables["a"]
    table.append(coord.pools[0].null_block)
    with pytest.raises(KVCacheInvariantError, match="null slot after a live block"):
        coord.check_invariants()
    table.pop()
    coord.check_invariants()
    coord.pools[1].null_block.ref_cnt = 1
    with pytest.raises(KVCacheInvariantError, match="null block"):
        coord.check_invariants()
    coord.pools[1].null_block.ref_cnt = 0
    held = coord.managers[0].tables["a"][0]
    held.prev = coord.pools[0].free_queue.head  # a stale link on a block in use
    with pytest.raises(KVCacheInvariantError, match="links disagree"):
        coord.check_invariants()
