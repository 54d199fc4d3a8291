"""Property-based fuzzing of the hybrid KV-cache coordinator
(``HybridCoordinator.check_invariants()``; docs/architecture.md, The hybrid KV cache).

``CoordinatorMachine`` is a hypothesis state machine over the simulated scheduler of ``sim/``:
each rule is one scheduler-level operation (arrival, first admission with hit / external tokens /
asynchronous load, prefill chunk or decode with preemption, load completion or failure, abort,
window maintenance, explicit pin / unpin, prefix-cache reset, step end) or a whole vLLM-style
scheduler step. After every operation the simulator runs ``check_invariants()`` and its own checks
(hit == brute-force oracle, failed allocations change nothing, KV events replay to the maps, the
block data model, eviction order); ``teardown`` frees everything and asserts that the pool is
whole again and no explicit pin is left.

Run with ``--hypothesis-show-statistics`` to see how many examples reached hits, external tokens,
remote (partial) hits, preemption, pins, demotion and retention.

The deterministic tests below check that the simulator's oracles catch known classes of bugs, and
reproduce the engine bugs the fuzzing found.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, rule

from engine.kv_cache import (
    CacheRequest,
    FullAttentionSpec,
    HybridCoordinator,
    KVCacheGroup,
    RetentionOptions,
    SlidingWindowSpec,
)
from engine.kv_cache.attention_managers import SlidingWindowManager
from engine.kv_cache.block_queue import TIER_EXPLICIT, TIER_RETAINED
from engine.kv_cache.mamba_manager import MambaManager
from kvfleet_testing.kv_cache_sim import (
    MIXES,
    RandomDriver,
    Sim,
    SimConfig,
    SimViolation,
    min_blocks_for,
)

# Outcomes worth knowing an example reached (reported as hypothesis events, once per example).
COVERAGE_TAGS = (
    "hit",
    "external",
    "async_load",
    "partial_hit",
    "relookup",
    "preempt",
    "alloc_fail",
    "evicted",
    "pin",
    "unpin",
    "demoted_blocks",
    "pinned_retained",
    "load_failed",
    "load_truncated",
    "mamba_same_step_defer",
    "reset",
    "decode",
    "finished",
)


@st.composite
def sim_configs(draw: st.DrawFn) -> SimConfig:
    mix = draw(st.sampled_from(sorted(MIXES)))
    low = max(12, min_blocks_for(mix))
    num_blocks = draw(st.integers(low, low + 24))
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
        num_blocks=num_blocks,
        enable_caching=draw(st.sampled_from([True] * 9 + [False])),
        retention=retention,
        enable_events=draw(st.sampled_from([True] * 9 + [False])),
        vocab=draw(st.sampled_from([2, 3, 4])),
        seed=draw(st.integers(0, 1 << 16)),
    )


CHUNKS = st.one_of(st.just(1 << 20), st.integers(1, 8), st.integers(1, 40))
INDEX = st.integers(0, 63)


class CoordinatorMachine(RuleBasedStateMachine):
    sim: Sim

    @initialize(
        cfg=sim_configs(),
        initial=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 127), st.booleans()), max_size=4),
        warmup=st.integers(0, 4),
        seed=st.integers(0, (1 << 32) - 1),
    )
    def setup(self, cfg: SimConfig, initial: list[tuple[int, int, bool]], warmup: int, seed: int) -> None:
        self.sim = Sim(cfg)
        event(f"mix {cfg.mix}")
        for base, cut, remote in initial:  # a few requests on the shared base prompts to start with
            self.sim.arrive(base, cut, [], max_tokens=4, remote=remote)
        driver = RandomDriver(self.sim, random.Random(seed))
        for _ in range(warmup):  # and some scheduler steps, so that later arrivals find a cache
            driver.scheduler_step()

    # -- arrivals and admission ---------------------------------------------------------------------------
    @rule(
        source=INDEX,
        cut=st.integers(0, 127),
        suffix=st.lists(st.integers(0, 3), max_size=9),
        max_tokens=st.integers(1, 12),
        remote=st.sampled_from([False, False, False, True]),
        salt=st.sampled_from([None, None, None, "s"]),
    )
    def arrive(self, source: int, cut: int, suffix: list[int], max_tokens: int, remote: bool, salt: str | None) -> None:
        self.sim.arrive(source, cut, suffix, max_tokens, remote, salt)

    @rule(
        index=INDEX,
        ext=st.one_of(st.just(0), st.integers(1, 40)),
        chunk=CHUNKS,
        async_load=st.booleans(),
        aligned=st.booleans(),
        reserved=st.sampled_from([0, 0, 0, 1, 3]),
        relookup=st.booleans(),
    )
    def admit(
        self, index: int, ext: int, chunk: int, async_load: bool, aligned: bool, reserved: int, relookup: bool
    ) -> None:
        self.sim.admit(index, ext, chunk, async_load, aligned, reserved, relookup)

    # -- running requests ------------------------------------------------------------------------------------
    @rule(
        index=INDEX,
        chunk=CHUNKS,
        aligned=st.booleans(),
        reserved=st.sampled_from([0, 0, 0, 1, 3]),
        policy=st.integers(0, 5),
    )
    def advance(self, index: int, chunk: int, aligned: bool, reserved: int, policy: int) -> None:
        self.sim.advance(index, chunk, aligned, reserved, policy)

    @rule(sample=st.integers(0, 1 << 16))
    def end_step(self, sample: int) -> None:
        self.sim.end_step(sample)

    @rule(index=INDEX, outcome=st.sampled_from([0, 0, 1, 2]), cut=st.integers(0, 127))
    def complete_load(self, index: int, outcome: int, cut: int) -> None:
        self.sim.complete_load(index, outcome, cut)

    @rule(index=INDEX, back=st.sampled_from([0, 0, 1, 3]))
    def remove_skipped(self, index: int, back: int) -> None:
        self.sim.remove_skipped(index, back)

    @rule(index=INDEX, twice=st.booleans())
    def abort(self, index: int, twice: bool) -> None:
        self.sim.abort(index, twice)

    # -- pins and maintenance ---------------------------------------------------------------------------------
    @rule(source=INDEX, length=st.integers(0, 127))
    def pin(self, source: int, length: int) -> None:
        self.sim.pin(source, length)

    @rule(index=INDEX)
    def unpin(self, index: int) -> None:
        self.sim.unpin(index)

    @rule()
    def reset(self) -> None:
        self.sim.reset()

    # -- whole scheduler steps (running first, then admissions until one fails, then outputs) ---------------
    @rule(seed=st.integers(0, (1 << 32) - 1), steps=st.integers(1, 3))
    def scheduler_steps(self, seed: int, steps: int) -> None:
        driver = RandomDriver(self.sim, random.Random(seed))
        for _ in range(steps):
            driver.scheduler_step()

    def teardown(self) -> None:
        sim = getattr(self, "sim", None)
        if sim is None:
            return
        sim.drain()
        for tag in COVERAGE_TAGS:
            if sim.counts.get(tag):
                event(f"reached {tag}")


CoordinatorMachine.TestCase.settings = settings(
    max_examples=400,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestCoordinatorStateful = CoordinatorMachine.TestCase


# -- deterministic random-driver runs: every mix, fixed seeds (cheap, reproducible) ------------------------------
@pytest.mark.parametrize("mix", sorted(MIXES))
def test_random_driver_every_mix(mix: str) -> None:
    rng = random.Random(mix)
    for retention in (RetentionOptions(), RetentionOptions(enabled=True, budget_blocks=2)):
        cfg = SimConfig(
            mix=mix, num_blocks=max(12, min_blocks_for(mix)) + 8, retention=retention, seed=rng.randrange(1000)
        )
        sim = Sim(cfg)
        driver = RandomDriver(sim, random.Random(rng.randrange(1 << 30)))
        for _ in range(300):
            driver.step()
        sim.drain()
        assert sim.counts["arrive"] and sim.counts["decode"]


# -- the simulator's oracles have teeth ------------------------------------------------------------------------------
def _cache_every_live_state(self, request_id, hashes, num_tokens, state_tokens=None):  # type: ignore[no-untyped-def]
    """``MambaManager.cache_blocks`` before it checked the state's token count: every live state
    block up to ``num_tokens``, whatever state it holds (the fixed one registers only the tail
    block, and only when the request's exact count is that block's boundary)."""
    full = num_tokens // self.block_size
    done = self.num_cached[request_id]
    if done >= full:
        return
    table = self.tables[request_id]
    self.pool.cache_blocks(self.group, table, hashes, done, full)
    self.num_cached[request_id] = full
    for i in self.live.get(request_id, ()):
        if done <= i < full and table[i].block_hash == hashes[i]:
            self.cached_this_step.add(hashes[i])


def _unaligned_split(req, start, chunk, aligned):  # type: ignore[no-untyped-def]
    return max(1, min(chunk, req.num_tokens - start))


def test_data_model_catches_a_mamba_state_cached_under_the_wrong_boundary(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unaligned Mamba prefill chunks (the engine's scheduler made them when a step's token budget
    left 1 token) with a manager that registers every live state block: a state lands in the
    cache under a boundary it does not hold, and the data model must notice."""
    monkeypatch.setattr(MambaManager, "cache_blocks", _cache_every_live_state)
    sim = Sim(SimConfig(mix="full+mamba", num_blocks=32))
    sim.ops.split = _unaligned_split  # type: ignore[method-assign]
    sim.arrive(source=0, cut=13, suffix=[], max_tokens=4)
    sim.admit(0, chunk=6)  # the state after 6 tokens lands in table index 1 (tokens 4..8)
    sim.end_step()
    with pytest.raises(SimViolation, match=r"holds|state"):
        sim.advance(0, chunk=6)  # ends at 12: index 1 gets cached as the state after 8 tokens


def test_unaligned_mamba_chunks_never_cache_a_state_under_the_wrong_boundary() -> None:
    """The coordinator alone keeps the cache right when chunks end off Mamba boundaries: the
    same scenario, then random runs of every Mamba mix with unaligned chunks."""
    sim = Sim(SimConfig(mix="full+mamba", num_blocks=32))
    sim.ops.split = _unaligned_split  # type: ignore[method-assign]
    sim.arrive(source=0, cut=13, suffix=[], max_tokens=4)
    sim.admit(0, chunk=6)
    sim.end_step()
    sim.advance(0, chunk=6)
    sim.end_step()
    sim.drain()
    rng = random.Random(15)
    for mix in sorted(m for m in MIXES if "mamba" in m):
        sim = Sim(SimConfig(mix=mix, num_blocks=max(12, min_blocks_for(mix)) + 8, seed=rng.randrange(1000)))
        sim.ops.split = _unaligned_split  # type: ignore[method-assign]
        driver = RandomDriver(sim, random.Random(rng.randrange(1 << 30)))
        for _ in range(400):
            driver.step()
        sim.drain()
        assert sim.counts["arrive"] and sim.counts["decode"]


def test_data_model_catches_a_window_dropped_too_early(monkeypatch: pytest.MonkeyPatch) -> None:
    """If sliding-window maintenance freed one block too many, the next step reads a null block."""
    real = SlidingWindowManager.skipped_blocks

    def one_too_many(self: SlidingWindowManager, num_tokens: int) -> int:
        return real(self, num_tokens) + (1 if num_tokens else 0)

    monkeypatch.setattr(SlidingWindowManager, "skipped_blocks", one_too_many)
    sim = Sim(SimConfig(mix="full+swa", num_blocks=40))
    sim.arrive(source=0, cut=20, suffix=[], max_tokens=8)
    sim.admit(0, chunk=1 << 20)
    sim.end_step()
    with pytest.raises(SimViolation, match=r"null|another prefix"):
        for _ in range(8):
            sim.advance(0)
            sim.end_step()


def test_hit_oracle_catches_a_misaligned_hit(monkeypatch: pytest.MonkeyPatch) -> None:
    """A sliding-window search that ignored the LCM alignment would return unaligned hits."""
    real = SlidingWindowManager.find_longest_cache_hit
    monkeypatch.setattr(
        SlidingWindowManager,
        "find_longest_cache_hit",
        lambda self, hashes, max_length, alignment: real(self, hashes, max_length, self.block_size),
    )
    rng = random.Random(7)
    with pytest.raises(SimViolation, match="hit"):
        for seed in range(40):
            sim = Sim(SimConfig(mix="full8+swa4", num_blocks=40, seed=seed))
            driver = RandomDriver(sim, random.Random(rng.randrange(1 << 30)))
            for _ in range(400):
                driver.step()


# -- engine bugs found while fuzzing: minimal reproductions (fail until fixed, then stay as regression tests) ---------
def _full_swa(retention: RetentionOptions, num_blocks: int = 64) -> HybridCoordinator:
    groups = [KVCacheGroup(FullAttentionSpec(4)), KVCacheGroup(SlidingWindowSpec(4, 8))]
    return HybridCoordinator(groups, num_blocks, retention=retention)


def _prefill_then_decode(coord: HybridCoordinator, prompt: list[int], decode: int) -> CacheRequest:
    req = CacheRequest("a", prompt, coord.hash_block_size)
    assert coord.allocate_slots(req, len(prompt), hit=coord.get_computed_blocks(req)) is not None
    req.num_computed_tokens = len(prompt)
    for t in range(decode):
        req.append_token_ids([t % 4])
        coord.new_step()
        assert coord.allocate_slots(req, 1) is not None
        req.num_computed_tokens += 1
        coord.check_invariants()
    return req


def test_retention_keeps_the_prompt_window_that_decode_drops_block_by_block() -> None:
    """Bug: with retention on, the sliding window at the prompt's end (a chunk-end boundary) leaves
    the window one block per decode step; ``release_dropped`` only pins a boundary's window when a
    single drop contains all of it, so it is never pinned, and the dropped cached blocks go to the
    *head* of the free queue (``evict_first``). The next allocation evicts them and a request with
    the same prompt misses, while with retention off (cached blocks to the tail) it hits."""
    prompt = [1, 2, 3, 0] * 4  # 16 tokens: the window at 16 is SWA table indices 2 and 3
    hits = {}
    for enabled in (False, True):
        coord = _full_swa(RetentionOptions(enabled=enabled, min_drop_blocks=1))
        req = _prefill_then_decode(coord, prompt, decode=16)
        window = [coord.managers[1].tables["a"][i] for i in (2, 3)]
        if enabled:
            assert all(b.is_null for b in window)  # dropped from the table
        filler = CacheRequest("b", [3] * 17, coord.hash_block_size)
        assert coord.allocate_slots(filler, 17, hit=coord.get_computed_blocks(filler)) is not None
        coord.check_invariants()
        later = CacheRequest("c", [*prompt, 0, 0, 0, 0, 1], coord.hash_block_size)
        hits[enabled] = coord.get_computed_blocks(later).num_tokens
        del req
    assert hits[False] == 16
    assert hits[True] == 16, f"retention on loses the prompt-end hit: {hits}"


def test_retention_pins_the_prompt_window_when_it_leaves_during_decode() -> None:
    """Same bug, stated on the retention tier: the window ending at the prompt's chunk boundary is
    retained (pinned) once the request has decoded past it."""
    coord = _full_swa(RetentionOptions(enabled=True, min_drop_blocks=1))
    prompt = [1, 2, 3, 0] * 4
    req = _prefill_then_decode(coord, prompt, decode=16)
    view = coord.managers[1].view(req.block_hashes)
    window = [coord.pool.cached[1].get(view[i]) for i in (2, 3)]  # None: evicted
    assert all(b is not None and b.tier == TIER_RETAINED for b in window), f"window at 16 after decode: {window}"


def test_unpin_prefix_with_the_pin_prefix_arguments_releases_every_pin() -> None:
    """Bug: ``unpin_prefix(hashes, n)`` recomputes the blocks from ``n``, but ``pin_prefix(hashes, n)``
    pinned those of the (shorter) cached hit it found. For sliding-window groups these differ: the
    window at the pinned length stays explicitly pinned for good (and a window at ``n`` pinned by
    another caller would lose a reference it still holds)."""
    coord = _full_swa(RetentionOptions())
    prompt = [1, 2, 3, 0] * 5  # 20 tokens
    a = CacheRequest("a", prompt[:13], coord.hash_block_size)  # caches 12 tokens
    assert coord.allocate_slots(a, 13, hit=coord.get_computed_blocks(a)) is not None
    coord.free("a")
    hashes = CacheRequest("x", prompt, coord.hash_block_size).block_hashes
    assert coord.pin_prefix(hashes, 20) == 12
    coord.unpin_prefix(hashes, 20)  # "undo one pin_prefix of the same prefix"
    coord.check_invariants()
    still = [b for b in coord.pool.blocks if b.tier == TIER_EXPLICIT]
    assert not still, f"blocks still explicitly pinned after the matching unpin: {still}"


def test_unpinning_a_pin_that_pinned_nothing_leaves_other_pins_of_the_prefix_alone() -> None:
    """Regression: a ``pin_prefix`` that found nothing cached (returned 0) still counts as a pin of
    that prefix, so its matching ``unpin_prefix`` must not release another caller's pin."""
    coord = HybridCoordinator([KVCacheGroup(FullAttentionSpec(4))], 32)
    prompt = [1, 2, 3, 0] * 3
    hashes = CacheRequest("x", prompt, coord.hash_block_size).block_hashes
    assert coord.pin_prefix(hashes, 12) == 0  # caller A: nothing cached yet
    r = CacheRequest("r", [*prompt, 1], coord.hash_block_size)
    assert coord.allocate_slots(r, 13, hit=coord.get_computed_blocks(r)) is not None
    coord.free("r")
    assert coord.pin_prefix(hashes, 12) == 12  # caller B pins the now cached prefix
    coord.unpin_prefix(hashes, 12)  # caller A undoes its own pin
    coord.check_invariants()
    pinned = [b for b in coord.pool.blocks if b.tier == TIER_EXPLICIT]
    assert len(pinned) == 3, f"caller B's pin was released by caller A's unpin: {pinned}"
