"""The host tier through the real EngineCore (``kv_cache.offload``): a prefix the device pools
evicted is served from host memory, and its greedy tokens are those of a cold engine.

Per preset (tiny: sliding window + full attention; tiny-hybrid: Mamba2 + attention;
tiny-qwen3-next: Gated DeltaNet + attention), a small device KV: request A is computed, a flood of
unrelated prompts evicts its blocks from the device (they are offloaded), then B (A's first
PREFIX tokens + its own suffix) and A again arrive. The device alone has no hit for them, both
tiers together do; the engine promotes the host part and its tokens must equal, exactly, those of
an engine with prefix caching off (oracle: the cold computation). A router index fed only the
engine's KV events predicts B's hit and its host part: the engine's per-request and total
per-tier hit counters must say exactly that.
A pinned prefix (either tier) survives a flood that evicts it from the device, in the host tier,
and is served from there.
"""

from __future__ import annotations

import random

import pytest
import torch

from configs import load_config
from engine.core import EngineCore
from engine.kv_cache.block_pool import TIER_EXPLICIT, TIER_NONE
from engine.kv_cache.hashing import block_hashes
from engine.routing import PrefixIndex
from engine.sampling_params import SamplingParams
from tests.engine.test_pd import run_to_end

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PREFIX = 128  # a chunk end (chunk 64), so the recurrent groups cache a state there
TIERED = ["kv_cache.num_blocks=96", "kv_cache.offload.enabled=true", "kv_cache.offload.size_mib=16"]


def workload() -> tuple[list[int], list[int], list[list[int]]]:
    rng = random.Random(7)
    a = [rng.randrange(3, 250) for _ in range(150)]
    b = a[:PREFIX] + [rng.randrange(3, 250) for _ in range(11)]
    flood = [[rng.randrange(3, 250) for _ in range(150)] for _ in range(4)]
    return a, b, flood


def scribble_uncached_blocks(engine: EngineCore) -> None:
    """Overwrite every free, uncached device block with random bytes: nothing may read them, so a
    promoted block whose copy did not run holds garbage rather than a stale, right-looking page."""
    generator = torch.Generator().manual_seed(0)
    for p, pool in enumerate(engine.coordinator.pools):
        ids = [b.block_id for b in pool.blocks if not b.is_null and not b.ref_cnt and b.block_hash is None]
        for slot, of in zip(engine.runner.slots, engine.layout.slot_pool, strict=True):
            if of == p and ids:
                noise = torch.randint(0, 256, (len(ids), slot.shape[1]), dtype=torch.uint8, generator=generator)
                slot[ids] = noise.to(slot.device)


def generate(engine: EngineCore, name: str, prompt: list[int]) -> tuple[list[int], int]:
    request = engine.add_request(name, prompt, GREEDY)
    tokens = run_to_end(engine, {name})[name][0]
    engine.coordinator.check_invariants()
    return tokens, request.num_cached_tokens


@pytest.mark.parametrize(
    ("preset", "extra"),
    [("tiny", ()), ("tiny", ("scheduler.async_scheduling=true",)), ("tiny-hybrid", ()), ("tiny-qwen3-next", ())],
    ids=["tiny", "tiny-async", "tiny-hybrid", "tiny-qwen3-next"],
)
def test_a_prefix_served_from_the_host_tier_gives_the_cold_tokens(preset: str, extra: tuple[str, ...]) -> None:
    a, b, flood = workload()
    cold = EngineCore(load_config(preset, ["kv_cache.prefix_caching=false"]))
    cold_a, _ = generate(cold, "a", a)
    cold_b, _ = generate(cold, "b", b)

    engine = EngineCore(load_config(preset, [*TIERED, *extra]))
    coordinator = engine.coordinator
    host = coordinator.host
    assert host is not None
    tokens_a, cached = generate(engine, "a", a)
    assert (tokens_a, cached) == (cold_a, 0)
    for i, prompt in enumerate(flood):
        generate(engine, f"flood{i}", prompt)
    assert host.counters.offloaded > 0
    hashes = block_hashes(b, coordinator.hash_block_size)
    device_only = coordinator.find_longest_cache_hit(hashes, len(b) - 1, include_host=False).num_tokens
    both = coordinator.find_longest_cache_hit(hashes, len(b) - 1).num_tokens
    assert device_only < PREFIX <= both, (device_only, both)
    index = PrefixIndex(coordinator.groups)
    index.add_worker("w")
    assert not index.apply_events("w", engine.take_events()).needs_resync
    predicted = index.tiered_hit("w", hashes, len(b) - 1)
    assert predicted.tokens == both and predicted.host_tokens > 0

    promoted = host.counters.promoted
    scribble_uncached_blocks(engine)
    request = engine.add_request("b", b, GREEDY)
    tokens_b = run_to_end(engine, {"b"})["b"][0]
    coordinator.check_invariants()
    assert (request.num_cached_tokens, request.num_host_cached_tokens) == (predicted.tokens, predicted.host_tokens)
    assert host.counters.promoted > promoted
    assert tokens_b == cold_b
    tokens_a, cached = generate(engine, "a2", a)
    assert cached >= PREFIX
    assert tokens_a == cold_a
    stats = engine.worker_view.stats()["host_tier"]
    assert stats["promoted"] == host.counters.promoted and stats["bytes_promoted"] > 0
    tiers = stats["hit_tokens"]
    assert tiers["device"] + tiers["host"] == engine.worker_view.stats()["hit_tokens"]
    assert tiers["host"] >= predicted.host_tokens > 0
    assert engine.worker_view.load()[3] > 0  # the promote seconds per token the worker reports to the router
    assert stats["bytes_offloaded"] > 0 and stats["pools"][0]["cached_blocks"] > 0


def test_offload_off_by_default_builds_no_host_tier() -> None:
    engine = EngineCore(load_config("tiny", ["kv_cache.num_blocks=96"]))
    assert engine.coordinator.host is None and engine.runner.host_kv is None
    assert engine.worker_view.stats()["host_tier"] is None


@pytest.mark.parametrize("preset", ["tiny", "tiny-hybrid"])
def test_pd_decode_side_promotes_its_host_hit_and_reads_only_the_rest(preset: str) -> None:
    """P/D: the decode worker holds A's prefix only in its host tier; B arrives with a prefill
    worker's handle. Admission claims the device hit, promotes the host part (two-phase, before
    the blocks for the transferred tokens), and the read brings only the rest: B's tokens are
    the cold engine's."""
    a, b, flood = workload()
    cold = EngineCore(load_config(preset, ["kv_cache.prefix_caching=false"]))
    cold_b, _ = generate(cold, "b", b)
    overrides = ["transfer.backend=local", *TIERED]
    prefill = EngineCore(load_config(preset, overrides), name="prefill", kv_role="prefill")
    decode = EngineCore(load_config(preset, overrides), name="decode", kv_role="decode")
    try:
        generate(decode, "a", a)
        for i, prompt in enumerate(flood):
            generate(decode, f"flood{i}", prompt)
        host = decode.coordinator.host
        assert host is not None
        promoted = host.counters.promoted
        scribble_uncached_blocks(decode)
        prefill.add_request("b", b, GREEDY, prefill_only=True)
        handle = next(r.kv_handle for r in run_until_finished(prefill, "b"))
        request = decode.add_request("b", b, GREEDY, kv_handle=handle)
        tokens = run_to_end(decode, {"b"})["b"][0]
        decode.coordinator.check_invariants()
        assert host.counters.promoted > promoted
        assert request.num_cached_tokens == len(b) - 1 and decode.worker_view.transfer_stats.reads == 1
        assert tokens == cold_b
    finally:
        prefill.close()
        decode.close()


def run_until_finished(engine: EngineCore, request_id: str) -> list:
    while True:
        done = [r for r in engine.step() if r.request_id == request_id and r.finished]
        if done:
            return done


def test_the_host_tier_splits_its_size_between_pools_as_the_device_memory_is() -> None:
    engine = EngineCore(load_config("tiny-hybrid", TIERED))
    layout, device = engine.layout, engine.info.pool_blocks
    host = [pool.num_blocks for pool in engine.coordinator.host.pools]  # type: ignore[union-attr]
    size = 16 * 2**20
    assert len(host) == len(device) == 2
    for p, pool in enumerate(layout.pools):
        share = device[p] * pool.block_bytes / layout.pool_bytes(list(device))
        assert host[p] - 1 == int(size * share) // pool.block_bytes
    assert engine.runner.host_kv is not None
    assert engine.runner.host_kv.nbytes == layout.pool_bytes(host) <= size + layout.pool_bytes(1)
    with pytest.raises(ValueError, match=r"kv_cache\.offload\.size_mib"):
        layout.host_blocks(list(device), 1)


def pinned_keys(engine: EngineCore, hashes: list[bytes], length: int) -> list[tuple[int, int, bytes]]:
    """(pool, group, hash) of every block a hit of ``length`` tokens needs, where it is cached now."""
    coordinator = engine.coordinator
    hit = coordinator.find_longest_cache_hit(hashes, length)
    assert hit.num_tokens == length
    keys = []
    for g, manager in enumerate(coordinator.managers):
        for i in manager.blocks_needed_at(length):
            block_hash = hit.blocks[g][i].block_hash
            assert block_hash is not None
            keys.append((coordinator.group_pool[g], g, block_hash))
    return keys


def flood(engine: EngineCore, seed: int, rounds: int = 1, until_missed: tuple[list[bytes], int] | None = None) -> None:
    """Run ``rounds`` rounds of unrelated requests side by side (together more than the device
    holds, so admissions demote its pins), or, with ``until_missed`` (hashes, length), as many
    as it takes for the device alone to miss that hit."""
    rng = random.Random(seed)
    coordinator = engine.coordinator
    for round_ in range(12):
        if until_missed is None and round_ == rounds:
            return
        missed = until_missed is not None and (
            coordinator.find_longest_cache_hit(*until_missed, include_host=False).num_tokens < until_missed[1]
        )
        if missed:
            return
        names = set()
        for i in range(6):
            name = f"flood{seed}-{round_}-{i}"
            engine.add_request(name, [rng.randrange(3, 250) for _ in range(150)], GREEDY)
            names.add(name)
        run_to_end(engine, names)
        coordinator.check_invariants()
    raise AssertionError("the flood never evicted the pinned prefix from the device")


@pytest.mark.parametrize("tier", ["device", "host"])
@pytest.mark.parametrize("preset", ["tiny", "tiny-hybrid"])
def test_a_pinned_prefix_survives_a_flood_in_the_host_tier_and_gives_the_cold_tokens(preset: str, tier: str) -> None:
    """Pin A's first PREFIX tokens (device tier: kept on the device; host tier: kept in host
    memory only), flood the device with requests that need its blocks: the pinned blocks sit in
    the host tier, pinned, through the flood; B (the prefix + its own suffix) hits them there, the
    engine promotes them, and B's greedy tokens are the cold engine's. A device-tier pin is pinned
    on the device again once promoted; a host-tier pin stays in the host tier only."""
    a, b, _flood = workload()
    cold = EngineCore(load_config(preset, ["kv_cache.prefix_caching=false"]))
    cold_b, _ = generate(cold, "b", b)

    engine = EngineCore(load_config(preset, TIERED))
    coordinator = engine.coordinator
    host = coordinator.host
    assert host is not None
    generate(engine, "a", a)
    hashes = block_hashes(b, coordinator.hash_block_size)
    assert engine.worker_view.pin_prefix(hashes, PREFIX, tier) == PREFIX  # type: ignore[arg-type]
    coordinator.check_invariants()
    keys = pinned_keys(engine, hashes, PREFIX)
    flood(engine, seed=1, until_missed=(hashes, PREFIX))
    flood(engine, seed=2)  # and one more round: the host tier takes what the device evicts
    moved = 0
    for p, g, h in keys:  # every block the hit needs: in the host tier pinned, or still pinned on the device
        block = host.pools[p].cached[g].get(h)
        on_device = coordinator.managers[g].cached.get(h)
        if tier == "device" and on_device is not None and on_device.tier == TIER_EXPLICIT:
            continue  # (a pool the flood did not fill, e.g. tiny-hybrid's Mamba pool, kept its pin)
        assert block is not None and block.tier == TIER_EXPLICIT, (g, block)
        moved += on_device is None
    assert moved > 0 and host.counters.pins_dropped == 0
    assert coordinator.find_longest_cache_hit(hashes, PREFIX, include_host=False).num_tokens < PREFIX

    promoted = host.counters.promoted
    scribble_uncached_blocks(engine)
    tokens_b, cached = generate(engine, "b", b)
    assert cached >= PREFIX and host.counters.promoted - promoted >= moved
    assert tokens_b == cold_b
    explicit = {coordinator.managers[g].cached[h].tier == TIER_EXPLICIT for _p, g, h in keys}
    assert explicit == {tier == "device"}  # (a retention policy may keep them in its own tier)
    assert engine.worker_view.unpin_prefix(hashes, PREFIX, tier)  # type: ignore[arg-type]
    coordinator.check_invariants()
    assert all(block.tier == TIER_NONE for pool in host.pools for block in pool.blocks)
    assert all(block.tier != TIER_EXPLICIT for pool in coordinator.pools for block in pool.blocks)
