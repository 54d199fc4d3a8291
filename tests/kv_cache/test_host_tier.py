"""The host tier of the coordinator (``engine.kv_cache.host_tier``): offload of evicted cached
blocks, hits over both tiers, promote at admission (docs/architecture.md, The hybrid KV cache).

Oracles, none of them the code under test:
- a brute-force two-tier hit: the largest aligned length at which every group's needed blocks
  (``HitOracle.needed_blocks``, the seeds' rules written out independently) are cached in the
  device map or the host map of their group; the hit's blocks must come from the device where it
  has them and from the host otherwise;
- a data model of block *contents*: every device and host block holds what was last written to
  it (a computed block: its chain hash; a block being filled, a recurrent state between
  boundaries: a marker), the coordinator's ``TierCopy`` batches are replayed on it in order, and
  every block a claimed hit reads must hold exactly the hash the hit was found under;
- ``check_invariants()`` (both tiers) after every operation;
- the KV events replayed per tier (device: stored - removed; host: offloaded - dropped; a clear
  empties both) must give exactly the coordinator's device and host maps after every operation,
  and the host part of every admission's hit (``host_hit_tokens``) must be the positions the
  oracle's needed blocks cover where the device lacks them.
A hypothesis state machine drives admissions (with chunks), prefill chunks, decode, preemption,
frees, window maintenance, pins of both tiers (held across operations, then released) and resets
over every group mix of the simulator.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from engine.kv_cache import CacheRequest, FullAttentionSpec, HybridCoordinator, KVCacheGroup, MambaSpec
from engine.kv_cache.block_pool import TIER_EXPLICIT, TIER_NONE, Block
from engine.kv_cache.coordinator_types import PIN_TIERS, PinTier
from engine.kv_cache.events import (
    AllBlocksCleared,
    BlockDropped,
    BlockOffloaded,
    BlockRemoved,
    BlockStored,
    KVEvent,
)
from engine.kv_cache.host_tier import HOST_POOL_BASE, HostTier, TierCopy
from engine.kv_cache.mamba_manager import MambaManager
from engine.kv_cache.spec import SlidingWindowSpec
from kvfleet_testing.kv_cache_sim import MIXES
from kvfleet_testing.kv_cache_sim.configs import mix_pools
from kvfleet_testing.kv_cache_sim.oracle import HitOracle

Content = object  # a chain hash, or a marker tuple for partial contents


class ContentModel:
    """What each device and host block holds, updated by computes and by the queued copies."""

    def __init__(self) -> None:
        self.device: dict[tuple[int, int], Content] = {}
        self.host: dict[tuple[int, int], Content] = {}

    def run(self, copies: list[TierCopy]) -> None:
        for copy in copies:
            pairs = list(zip(copy.device_ids, copy.host_ids, strict=True))
            if copy.to_host:
                moved = {h: self.device.get((copy.pool, d)) for d, h in pairs}
                for h, content in moved.items():
                    self.host[(copy.pool, h)] = content
            else:
                moved = {d: self.host.get((copy.pool, h)) for d, h in pairs}
                for d, content in moved.items():
                    self.device[(copy.pool, d)] = content


def two_tier_oracle(coord: HybridCoordinator, hashes: list[bytes], max_length: int) -> int:
    host = coord.host
    assert host is not None
    if max_length <= 0:
        return 0
    align = coord.alignment
    for length in range(max_length - max_length % align, 0, -align):
        ok = True
        for g, manager in enumerate(coord.managers):
            p = coord.group_pool[g]
            device, hosted = coord.pools[p].cached[g], host.pools[p].cached[g]
            view = manager.view(hashes)
            if not all(view[i] in device or view[i] in hosted for i in HitOracle.needed_blocks(manager, length)):
                ok = False
                break
        if ok:
            return length
    return 0


def host_tokens_oracle(coord: HybridCoordinator, hashes: list[bytes], length: int) -> int:
    """Positions of a hit of ``length`` whose needed block (some group) is not on the device."""
    unit = coord.hash_block_size
    covered = [False] * (length // unit)
    for g, manager in enumerate(coord.managers):
        device = coord.pools[coord.group_pool[g]].cached[g]
        view = manager.view(hashes)
        per = manager.block_size // unit
        for i in HitOracle.needed_blocks(manager, length):
            if view[i] not in device:
                covered[i * per : (i + 1) * per] = [True] * per
    return sum(covered) * unit


class TierReplay:
    """The device and host maps a router rebuilds from the events alone, per group."""

    def __init__(self, num_groups: int) -> None:
        self.device: list[set[bytes]] = [set() for _ in range(num_groups)]
        self.host: list[set[bytes]] = [set() for _ in range(num_groups)]
        self.seq = 0

    def apply(self, events: list[KVEvent]) -> None:
        for event in events:
            assert event.seq == self.seq + 1, (event, self.seq)
            self.seq = event.seq
            if isinstance(event, AllBlocksCleared):
                for table in (*self.device, *self.host):
                    table.clear()
            elif isinstance(event, BlockStored):
                self.device[event.group].update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                assert set(event.block_hashes) <= self.device[event.group]
                self.device[event.group].difference_update(event.block_hashes)
            elif isinstance(event, BlockOffloaded):
                assert not set(event.block_hashes) & self.host[event.group]
                self.host[event.group].update(event.block_hashes)
            elif isinstance(event, BlockDropped):
                assert set(event.block_hashes) <= self.host[event.group]
                self.host[event.group].difference_update(event.block_hashes)

    def check(self, coord: HybridCoordinator) -> None:
        host = coord.host
        assert host is not None
        for g, manager in enumerate(coord.managers):
            assert self.device[g] == set(manager.cached), g
            assert self.host[g] == set(host.pools[coord.group_pool[g]].cached[g]), g


def check_two_tier_hit(coord: HybridCoordinator, hashes: list[bytes], max_length: int) -> int:
    hit = coord.find_longest_cache_hit(hashes, max_length)
    expected = two_tier_oracle(coord, hashes, max_length)
    assert hit.num_tokens == expected, (hit.num_tokens, expected)
    host = coord.host
    assert host is not None
    for g, manager in enumerate(coord.managers):
        p = coord.group_pool[g]
        view = manager.view(hashes)
        needed = HitOracle.needed_blocks(manager, expected)
        blocks = hit.blocks[g]
        assert len(blocks) == expected // manager.block_size
        for i, block in enumerate(blocks):
            if i not in needed:
                assert block.is_null
                continue
            on_device = coord.pools[p].cached[g].get(view[i])
            want = on_device if on_device is not None else host.pools[p].cached[g][view[i]]
            assert block is want, (g, i, block, want)
    device_only = coord.find_longest_cache_hit(hashes, max_length, include_host=False)
    assert device_only.num_tokens <= hit.num_tokens
    assert not any(HostTier.is_host(b) for blocks in device_only.blocks for b in blocks)
    return expected


# -- worked examples ----------
def _prefill(coord: HybridCoordinator, model: ContentModel, rid: str, tokens: list[int]) -> CacheRequest:
    request = CacheRequest(rid, tokens, coord.hash_block_size)
    hit = coord.get_computed_blocks(request)
    assert coord.allocate_slots(request, request.num_tokens - hit.num_tokens, hit) is not None
    model.run(coord.take_tier_copies())
    _write(coord, model, request, hit.num_tokens, request.num_tokens)
    request.num_computed_tokens = request.num_tokens
    coord.remove_skipped_blocks(rid, request.num_tokens)
    coord.new_step()
    coord.check_invariants()
    return request


def _write(coord: HybridCoordinator, model: ContentModel, request: CacheRequest, start: int, end: int) -> None:
    """The forward of tokens [start, end): attention blocks they fill, the recurrent state at end."""
    rid = request.request_id
    for g, manager in enumerate(coord.managers):
        p = coord.group_pool[g]
        table = manager.tables[rid]
        view = manager.view(request.block_hashes)
        bs = manager.block_size
        if isinstance(manager, MambaManager):
            block = table[-(-end // bs) - 1]
            model.device[(p, block.block_id)] = view[end // bs - 1] if end % bs == 0 else ("mid", rid, end)
            continue
        for i in range(start // bs, -(-end // bs)):
            block = table[i]
            if block.is_null:
                continue
            full = end >= (i + 1) * bs and i < len(view)
            model.device[(p, block.block_id)] = view[i] if full else ("partial", rid, i)


def _check_reads(coord: HybridCoordinator, model: ContentModel, request: CacheRequest, hit_tokens: int) -> None:
    """Every block a hit of ``hit_tokens`` needs holds the hash it was found under."""
    for g, manager in enumerate(coord.managers):
        p = coord.group_pool[g]
        view = manager.view(request.block_hashes)
        table = manager.tables[request.request_id]
        for i in HitOracle.needed_blocks(manager, hit_tokens):
            held = model.device.get((p, table[i].block_id))
            assert held == view[i], f"group {g} index {i}: block {table[i]!r} holds {held!r}, not {view[i]!r}"


def test_an_evicted_full_attention_prefix_comes_back_from_the_host_tier() -> None:
    coord = HybridCoordinator([KVCacheGroup(FullAttentionSpec(4))], 6, host_blocks=17)
    model = ContentModel()
    a = list(range(1, 18))  # 4 full blocks + 1 token
    _prefill(coord, model, "a", a)
    coord.free("a")
    _prefill(coord, model, "b", list(range(100, 117)))  # takes every device block: a's are offloaded
    coord.free("b")
    request = CacheRequest("a2", a, coord.hash_block_size)
    assert coord.find_longest_cache_hit(request.block_hashes, 16, include_host=False).num_tokens == 0
    hit = coord.get_computed_blocks(request)
    assert hit.num_tokens == 16 and all(block.pool == HOST_POOL_BASE for block in hit.blocks[0])
    assert coord.allocate_slots(request, 1, hit) is not None
    copies = coord.take_tier_copies()
    assert [c.to_host for c in copies].count(False) >= 1
    model.run(copies)
    _check_reads(coord, model, request, 16)
    coord.check_invariants()
    # the promoted blocks are device blocks again, cached under their hashes
    assert coord.find_longest_cache_hit(request.block_hashes, 16, include_host=False).num_tokens == 16


def test_a_sliding_group_promotes_only_its_window_and_a_mamba_group_its_boundary_state() -> None:
    specs = [FullAttentionSpec(4), SlidingWindowSpec(4, 6), MambaSpec(4)]
    coord = HybridCoordinator([KVCacheGroup(s) for s in specs], 40, host_blocks=120)
    model = ContentModel()
    rng = random.Random(3)
    a = [rng.randrange(1000) for _ in range(33)]
    request = CacheRequest("a", a, coord.hash_block_size)
    assert coord.allocate_slots(request, 32, coord.get_computed_blocks(request)) is not None
    model.run(coord.take_tier_copies())
    _write(coord, model, request, 0, 32)  # the chunk ends on a boundary: the state at 32 is cached
    request.num_computed_tokens = 32
    coord.remove_skipped_blocks("a", 32)
    coord.new_step()
    coord.free("a")
    for i in range(3):  # unrelated prompts evict every cached block of a from the device
        _prefill(coord, model, f"x{i}", [5000 + 100 * i + k for k in range(36)])
        coord.free(f"x{i}")
    again = CacheRequest("a2", a, coord.hash_block_size)
    assert coord.find_longest_cache_hit(again.block_hashes, 32, include_host=False).num_tokens == 0
    assert check_two_tier_hit(coord, again.block_hashes, 32) == 32
    hit = coord.get_computed_blocks(again)
    live = [[i for i, b in enumerate(blocks) if not b.is_null] for blocks in hit.blocks]
    assert live == [list(range(8)), [6, 7], [7]]  # window 6 needs 2 blocks; the state at 32 only
    promoted_before = coord.host.counters.promoted if coord.host else 0
    assert coord.allocate_slots(again, 1, hit) is not None
    assert coord.host is not None and coord.host.counters.promoted - promoted_before == 8 + 2 + 1
    model.run(coord.take_tier_copies())
    _check_reads(coord, model, again, 32)
    coord.check_invariants()


def test_host_tier_lru_keeps_the_most_recently_offloaded_blocks() -> None:
    coord = HybridCoordinator([KVCacheGroup(FullAttentionSpec(4))], 6, host_blocks=5)  # 4 host blocks
    model = ContentModel()
    prompts = [[1000 * i + k for k in range(17)] for i in range(1, 4)]
    for i, prompt in enumerate(prompts):
        _prefill(coord, model, f"r{i}", prompt)
        coord.free(f"r{i}")
    host = coord.host
    assert host is not None
    # r0's 4 blocks were offloaded, then r1's replaced them: the host holds r1's, the device r2's
    hashes = [CacheRequest("q", p, 4).block_hashes for p in prompts]
    assert coord.find_longest_cache_hit(hashes[0], 16).num_tokens == 0
    assert coord.find_longest_cache_hit(hashes[1], 16).num_tokens == 16
    assert coord.find_longest_cache_hit(hashes[1], 16, include_host=False).num_tokens == 0
    assert coord.find_longest_cache_hit(hashes[2], 16, include_host=False).num_tokens == 16
    coord.check_invariants()


def test_reset_clears_both_tiers_and_no_host_tier_means_unchanged_lookups() -> None:
    coord = HybridCoordinator([KVCacheGroup(FullAttentionSpec(4))], 6, host_blocks=9)
    model = ContentModel()
    for i in range(2):
        _prefill(coord, model, f"r{i}", [1000 * i + k for k in range(17)])
        coord.free(f"r{i}")
    assert coord.host is not None and coord.host.num_cached_blocks(0) > 0
    assert coord.reset_prefix_cache()
    assert coord.host.num_cached_blocks(0) == 0
    coord.check_invariants()
    plain = HybridCoordinator([KVCacheGroup(FullAttentionSpec(4))], 6)
    assert plain.host is None and plain.take_tier_copies() == []


# -- pins in the host tier ----------
PIN_MIXES = {
    "full": [FullAttentionSpec(4)],
    "full+sliding+mamba": [FullAttentionSpec(4), SlidingWindowSpec(4, 6), MambaSpec(4)],
}


def _prefill_to_boundary(coord: HybridCoordinator, model: ContentModel, rid: str, tokens: list[int]) -> CacheRequest:
    """Compute all of ``tokens`` but the last in one chunk ending on a block boundary (so a
    recurrent group caches its state there), then keep the request (not freed)."""
    request = CacheRequest(rid, tokens, coord.hash_block_size)
    hit = coord.get_computed_blocks(request)
    end = len(tokens) - 1
    assert end % coord.alignment == 0
    assert coord.allocate_slots(request, end - hit.num_tokens, hit) is not None
    model.run(coord.take_tier_copies())
    _write(coord, model, request, hit.num_tokens, end)
    request.num_computed_tokens = end
    coord.remove_skipped_blocks(rid, end)
    coord.new_step()
    coord.check_invariants()
    return request


def _needed(coord: HybridCoordinator, hashes: list[bytes], length: int) -> list[tuple[int, int, bytes]]:
    """(pool, group, hash) of every block a hit of ``length`` needs (the oracle's rule)."""
    out = []
    for g, manager in enumerate(coord.managers):
        view = manager.view(hashes)
        out += [(coord.group_pool[g], g, view[i]) for i in sorted(HitOracle.needed_blocks(manager, length))]
    return out


def _host_block(coord: HybridCoordinator, pool: int, group: int, block_hash: bytes) -> Block | None:
    assert coord.host is not None
    return coord.host.pools[pool].cached[group].get(block_hash)


def _flood(
    coord: HybridCoordinator,
    model: ContentModel,
    serial: int,
    until_gone: list[tuple[int, int, bytes]] = (),
    count: int = 0,
    sizes: tuple[int, ...] = (4, 8, 12),
) -> int:
    """Admit unrelated requests of ``sizes`` computed tokens in turn, held while they fit (at
    least ``count`` of them, and until the device has none of ``until_gone``: small ones of
    varying sizes, so the device runs short of free blocks by less than a request and demotes
    its pins); then free them. Returns the next serial."""
    held: list[CacheRequest] = []
    made, first = 0, serial
    while made < count or any(h in coord.managers[g].cached for _p, g, h in until_gone):
        serial += 1
        assert serial - first < 500, "the flood never evicted the pinned prefix"
        size = sizes[serial % len(sizes)]
        request = CacheRequest(f"x{serial}", [7000 + 97 * serial + k for k in range(size + 1)], coord.hash_block_size)
        if coord.allocate_slots(request, size, coord.get_computed_blocks(request)) is None:
            for old in held:  # the device is full of these: make room, keep flooding
                coord.free(old.request_id)
            held = []
            continue
        model.run(coord.take_tier_copies())
        _write(coord, model, request, 0, size)
        request.num_computed_tokens = size
        coord.remove_skipped_blocks(request.request_id, size)
        coord.new_step()
        coord.check_invariants()
        held.append(request)
        made += 1
    for request in held:
        coord.free(request.request_id)
    coord.check_invariants()
    return serial


@pytest.mark.parametrize("mix", sorted(PIN_MIXES))
def test_a_device_pin_survives_a_flood_in_the_host_tier_and_comes_back_pinned(mix: str) -> None:
    coord = HybridCoordinator([KVCacheGroup(s) for s in PIN_MIXES[mix]], 48, host_blocks=40)
    host = coord.host
    assert host is not None
    model = ContentModel()
    rng = random.Random(11)
    a = [rng.randrange(1000) for _ in range(33)]
    hashes = CacheRequest("a", a, coord.hash_block_size).block_hashes
    coord.free(_prefill_to_boundary(coord, model, "a", a).request_id)
    assert coord.pin_prefix(hashes, 32) == 32
    needed = _needed(coord, hashes, 32)
    _flood(coord, model, 0, needed)
    # the device gave the pinned blocks up: each sits in the host tier, pinned
    for p, g, h in needed:
        block = _host_block(coord, p, g, h)
        assert block is not None and block.tier == TIER_EXPLICIT, (g, block)
    assert host.counters.pins_dropped == 0
    # a flood of the host tier too (many more unpinned blocks than it holds) leaves the pins there
    _flood(coord, model, 1000, count=24, sizes=(32,))
    assert all(_host_block(coord, p, g, h) is not None for p, g, h in needed)
    # a hit: from the host tier, promoted, and pinned on the device again
    again = CacheRequest("a2", a, coord.hash_block_size)
    assert check_two_tier_hit(coord, again.block_hashes, 32) == 32
    hit = coord.get_computed_blocks(again)
    assert hit.num_tokens == 32 and any(HostTier.is_host(b) for blocks in hit.blocks for b in blocks)
    promoted = host.counters.promoted
    assert coord.allocate_slots(again, 1, hit) is not None
    assert host.counters.promoted - promoted == len(needed)
    model.run(coord.take_tier_copies())
    _check_reads(coord, model, again, 32)
    coord.check_invariants()
    for _p, g, h in needed:
        block = coord.managers[g].cached[h]
        assert block.tier == TIER_EXPLICIT, (g, block)
    coord.free("a2")
    coord.check_invariants()
    # the last unpin releases both tiers
    assert coord.unpin_prefix(hashes, 32)
    for p, g, h in needed:
        assert coord.managers[g].cached[h].tier == TIER_NONE
        block = _host_block(coord, p, g, h)
        assert block is None or block.tier == TIER_NONE
    coord.check_invariants()


@pytest.mark.parametrize("mix", sorted(PIN_MIXES))
def test_a_host_tier_pin_costs_no_device_block_and_comes_back_on_a_hit(mix: str) -> None:
    coord = HybridCoordinator([KVCacheGroup(s) for s in PIN_MIXES[mix]], 48, host_blocks=40)
    host = coord.host
    assert host is not None
    model = ContentModel()
    a = [3 + (17 * k) % 500 for k in range(33)]
    hashes = CacheRequest("a", a, coord.hash_block_size).block_hashes
    coord.free(_prefill_to_boundary(coord, model, "a", a).request_id)
    assert coord.pin_prefix(hashes, 32, tier="host") == 32
    coord.check_invariants()
    needed = _needed(coord, hashes, 32)
    assert all(coord.managers[g].cached[h].tier == TIER_NONE for _p, g, h in needed)  # nothing pinned on the device
    assert all(block.tier != TIER_EXPLICIT for pool in coord.pools for block in pool.blocks)
    model.run(coord.take_tier_copies())  # the copies into the host tier, as the engine runs them
    _flood(coord, model, 0, needed)
    _flood(coord, model, 1000, count=24, sizes=(32,))
    for p, g, h in needed:
        block = _host_block(coord, p, g, h)
        assert block is not None and block.tier == TIER_EXPLICIT
    again = CacheRequest("a2", a, coord.hash_block_size)
    assert coord.find_longest_cache_hit(again.block_hashes, 32, include_host=False).num_tokens == 0
    hit = coord.get_computed_blocks(again)
    assert hit.num_tokens == 32
    assert coord.allocate_slots(again, 1, hit) is not None
    model.run(coord.take_tier_copies())
    _check_reads(coord, model, again, 32)
    coord.free("a2")
    coord.check_invariants()
    # promoted, the device copies are ordinary cached blocks; the host copies stay pinned
    assert all(coord.managers[g].cached[h].tier == TIER_NONE for _p, g, h in needed)
    assert all(_host_block(coord, p, g, h).tier == TIER_EXPLICIT for p, g, h in needed)  # type: ignore[union-attr]
    assert not coord.unpin_prefix(hashes, 32)  # the device tier holds no such pin
    assert coord.unpin_prefix(hashes, 32, tier="host")
    assert all(_host_block(coord, p, g, h).tier == TIER_NONE for p, g, h in needed)  # type: ignore[union-attr]
    coord.check_invariants()


def test_a_host_tier_full_of_pins_refuses_a_host_pin_and_drops_further_pinned_blocks() -> None:
    coord = HybridCoordinator([KVCacheGroup(FullAttentionSpec(4))], 12, host_blocks=5)  # 4 host blocks
    host = coord.host
    assert host is not None
    model = ContentModel()
    prompts = [[100 * i + k for k in range(17)] for i in range(1, 4)]
    hashes = [CacheRequest("q", p, 4).block_hashes for p in prompts]
    coord.free(_prefill_to_boundary(coord, model, "r0", prompts[0]).request_id)
    assert coord.pin_prefix(hashes[0], 16, tier="host") == 16  # the host tier is now full of pins
    assert host.room(0) == 0
    coord.free(_prefill_to_boundary(coord, model, "r1", prompts[1]).request_id)
    assert coord.pin_prefix(hashes[1], 16, tier="host") == 0  # no room: nothing pinned
    assert coord.pin_prefix(hashes[1], 16) == 16  # a device pin
    coord.check_invariants()
    # the device gives the device pin up: the host tier, full of pins, drops its blocks
    _flood(coord, model, 0, _needed(coord, hashes[1], 16))
    assert host.counters.pins_dropped == 4 and host.counters.dropped >= 4
    assert coord.find_longest_cache_hit(hashes[1], 16).num_tokens == 0
    assert coord.find_longest_cache_hit(hashes[0], 16).num_tokens == 16  # the older pin stays whole
    coord.check_invariants()


def test_pin_tier_is_checked() -> None:
    with_host = HybridCoordinator([KVCacheGroup(FullAttentionSpec(4))], 6, host_blocks=5)
    with pytest.raises(ValueError, match=r"tier: must be one of device, host \(got 'disk'\)"):
        with_host.pin_prefix([b"x"], 4, tier="disk")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"tier: must be one of"):
        with_host.unpin_prefix([b"x"], 4, tier="gpu")  # type: ignore[arg-type]
    plain = HybridCoordinator([KVCacheGroup(FullAttentionSpec(4))], 6)
    with pytest.raises(ValueError, match=r"tier: 'host' needs a host tier \(kv_cache\.offload\.enabled"):
        plain.pin_prefix([b"x"], 4, tier="host")


# -- the state machine ----------
MIX_NAMES = sorted(m for m in MIXES if "chunked" not in m)
MAX_TOKENS = 40
BASES = 5
SUFFIX = st.lists(st.integers(0, 2), max_size=6)
# small chunks mostly: aligned chunk ends are where recurrent groups cache their states
CHUNK = st.one_of(st.sampled_from([4, 8, 12, 16]), st.integers(1, MAX_TOKENS))


class HostTierMachine(RuleBasedStateMachine):
    """Scheduler-level operations on a coordinator with a host tier; after each one the invariants
    of both tiers, the two-tier hit oracle at every admission, and the content model at every
    claimed hit (after the queued copies ran, as the engine runs them before the forward)."""

    coord: HybridCoordinator

    @initialize(
        mix=st.sampled_from(MIX_NAMES),
        extra=st.integers(0, 12),
        host=st.integers(2, 40),
        seed=st.integers(0, 1 << 16),
    )
    def setup(self, mix: str, extra: int, host: int, seed: int) -> None:
        specs = MIXES[mix]
        pools = mix_pools(mix)
        groups = [KVCacheGroup(spec, pool=p) for spec, p in zip(specs, pools, strict=True)]
        # each pool fits about one request of MAX_TOKENS (+ decode) and ``extra`` blocks: the
        # device evicts (and offloads) all the time, so hits come from both tiers
        need = [1] * (max(pools) + 1)
        for spec, p in zip(specs, pools, strict=True):
            need[p] += 3 if isinstance(spec, MambaSpec) else -(-(MAX_TOKENS + 8) // spec.block_size) + 1
        self.coord = HybridCoordinator(groups, [n + extra for n in need], host_blocks=host, enable_events=True)
        self.model = ContentModel()
        self.replay = TierReplay(len(groups))
        rng = random.Random(seed)
        self.bases = [[rng.randrange(3) for _ in range(MAX_TOKENS)] for _ in range(BASES)]
        self.requests: dict[str, CacheRequest] = {}
        self.serial = 0
        self.pins: list[tuple[list[bytes], int, PinTier]] = []  # held pins, released by ``unpin``

    def _copies(self) -> None:
        self.model.run(self.coord.take_tier_copies())

    def _chunk(self, request: CacheRequest, chunk: int, aligned: bool) -> int:
        """Tokens of the next chunk; ``aligned``: ending on an alignment boundary where one lies
        ahead (so recurrent groups cache their state there, as the scheduler's align mode does)."""
        start = request.num_computed_tokens
        end = min(start + chunk, request.num_tokens)
        align = self.coord.alignment
        if aligned and end < request.num_tokens and end - end % align > start:
            end -= end % align
        return end - start

    def _compute(self, request: CacheRequest, count: int) -> None:
        start = request.num_computed_tokens
        self._copies()
        _write(self.coord, self.model, request, start, start + count)
        request.num_computed_tokens = start + count
        self.coord.remove_skipped_blocks(request.request_id, request.num_computed_tokens)

    def _admit(self, base: int, cut: int, suffix: list[int], chunk: int, aligned: bool) -> CacheRequest | None:
        tokens = (self.bases[base][:cut] + suffix)[:MAX_TOKENS]
        if len(tokens) < 2:
            return None
        self.serial += 1
        request = CacheRequest(f"r{self.serial}", tokens, self.coord.hash_block_size)
        expected = check_two_tier_hit(self.coord, request.block_hashes, request.num_tokens - 1)
        hit = self.coord.get_computed_blocks(request)
        assert hit.num_tokens == expected
        assert self.coord.host_hit_tokens(hit) == host_tokens_oracle(self.coord, request.block_hashes, expected)
        request.num_computed_tokens = hit.num_tokens
        count = self._chunk(request, chunk, aligned)
        request.num_computed_tokens = 0
        if self.coord.allocate_slots(request, count, hit) is None:
            return None
        self._copies()
        _check_reads(self.coord, self.model, request, hit.num_tokens)
        request.num_computed_tokens = hit.num_tokens
        self._compute(request, count)
        self.coord.new_step()
        self.requests[request.request_id] = request
        return request

    @rule(
        base=st.integers(0, BASES - 1),
        cut=st.integers(2, MAX_TOKENS),
        suffix=SUFFIX,
        chunk=CHUNK,
        aligned=st.booleans(),
    )
    def admit(self, base: int, cut: int, suffix: list[int], chunk: int, aligned: bool) -> None:
        self._admit(base, cut, suffix, chunk, aligned)

    @rule(base=st.integers(0, BASES - 1), cut=st.integers(2, MAX_TOKENS), suffix=SUFFIX, chunk=CHUNK)
    def serve(self, base: int, cut: int, suffix: list[int], chunk: int) -> None:
        """A whole request: admitted, prefilled in aligned chunks (one step each), freed."""
        request = self._admit(base, cut, suffix, chunk, True)
        if request is None:
            return
        rid = request.request_id
        while request.num_computed_tokens < request.num_tokens:
            count = self._chunk(request, chunk, True)
            if self.coord.allocate_slots(request, count) is None:
                break
            self._compute(request, count)
            self.coord.new_step()
        self.coord.free(rid)
        del self.requests[rid]

    @precondition(lambda self: bool(self.requests))
    @rule(index=st.integers(0, 63), chunk=CHUNK, token=st.integers(0, 2), aligned=st.booleans())
    def advance(self, index: int, chunk: int, token: int, aligned: bool) -> None:
        rid = sorted(self.requests)[index % len(self.requests)]
        request = self.requests[rid]
        left = request.num_tokens - request.num_computed_tokens
        if left == 0:  # decode: the sampled token joins the sequence
            if request.num_tokens >= MAX_TOKENS + 8:
                return
            request.append_token_ids([token])
            left = 1
        count = min(left, self._chunk(request, chunk, aligned)) if left > 1 else 1
        if self.coord.allocate_slots(request, count) is None:  # preempt it
            self.coord.free(rid)
            del self.requests[rid]
            return
        self._compute(request, count)

    @precondition(lambda self: bool(self.requests))
    @rule(index=st.integers(0, 63))
    def finish(self, index: int) -> None:
        rid = sorted(self.requests)[index % len(self.requests)]
        self.coord.free(rid)
        del self.requests[rid]

    @rule()
    def new_step(self) -> None:
        self.coord.new_step()

    @rule(
        base=st.integers(0, BASES - 1),
        length=st.integers(0, MAX_TOKENS),
        tier=st.sampled_from(PIN_TIERS),
        hold=st.booleans(),
    )
    def pin(self, base: int, length: int, tier: PinTier, hold: bool) -> None:
        """Pin a prefix (device or host tier): the pinned length is the two-tier oracle's hit (a
        host-tier pin may find no room: 0); then every block that hit needs is pinned in the host
        tier where it has a copy; ``hold``: kept until ``unpin``, else released at once."""
        hashes = CacheRequest("p", self.bases[base], self.coord.hash_block_size).block_hashes
        expected = two_tier_oracle(self.coord, hashes, length)
        pinned = self.coord.pin_prefix(hashes, length, tier)
        assert pinned == expected or (tier == "host" and pinned == 0), (pinned, expected, tier)
        host = self.coord.host
        assert host is not None
        for p, g, h in _needed(self.coord, hashes, pinned):
            block = host.pools[p].cached[g].get(h)
            assert block is not None or tier == "device", (g, h)
            assert block is None or block.tier == TIER_EXPLICIT
            if tier == "device" and h in self.coord.managers[g].cached:
                assert self.coord.managers[g].cached[h].tier == TIER_EXPLICIT
        if hold:
            self.pins.append((hashes, length, tier))
        else:
            assert self.coord.unpin_prefix(hashes, length, tier)

    @precondition(lambda self: bool(self.pins))
    @rule(index=st.integers(0, 63))
    def unpin(self, index: int) -> None:
        hashes, length, tier = self.pins.pop(index % len(self.pins))
        assert self.coord.unpin_prefix(hashes, length, tier)

    @rule()
    def reset(self) -> None:
        if not self.requests:
            assert self.coord.reset_prefix_cache()
            self.pins.clear()

    @invariant()
    def consistent(self) -> None:
        if hasattr(self, "coord"):
            self.coord.check_invariants()
            self.replay.apply(self.coord.take_events())
            self.replay.check(self.coord)

    def teardown(self) -> None:
        if not hasattr(self, "coord"):
            return
        for rid in list(self.requests):
            self.coord.free(rid)
        self._copies()
        self.coord.check_invariants()
        for hashes, length, tier in self.pins:
            assert self.coord.unpin_prefix(hashes, length, tier)
        self.coord.check_invariants()
        assert not any(block.tier == TIER_EXPLICIT for pool in self.coord.host.pools for block in pool.blocks)  # type: ignore[union-attr]
        for pool in self.coord.pools:
            assert pool.num_free_blocks == pool.num_blocks - 1


HostTierMachine.TestCase.settings = settings(
    max_examples=400, stateful_step_count=50, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestHostTierStateful = HostTierMachine.TestCase
