"""The host tier through the real EngineCore (``kv_cache.offload``): a prefix the device pools
evicted is served from host memory, and its greedy tokens are those of a cold engine.

Per preset (tiny: sliding window + full attention; tiny-hybrid: Mamba2 + attention;
tiny-qwen3-next: Gated DeltaNet + attention), a small device KV: request A is computed, a flood of
unrelated prompts evicts its blocks from the device (they are offloaded), then B (A's first
PREFIX tokens + its own suffix) and A again arrive. The device alone has no hit for them, both
tiers together do; the engine promotes the host part and its tokens must equal, exactly, those of
an engine with prefix caching off (oracle: the cold computation).
"""

from __future__ import annotations

import random

import pytest

from configs import load_config
from engine.core import EngineCore
from engine.kv_cache.hashing import block_hashes
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


def generate(engine: EngineCore, name: str, prompt: list[int]) -> tuple[list[int], int]:
    request = engine.add_request(name, prompt, GREEDY)
    tokens = run_to_end(engine, {name})[name][0]
    engine.coordinator.check_invariants()
    return tokens, request.num_cached_tokens


@pytest.mark.parametrize("preset", ["tiny", "tiny-hybrid", "tiny-qwen3-next"])
def test_a_prefix_served_from_the_host_tier_gives_the_cold_tokens(preset: str) -> None:
    a, b, flood = workload()
    cold = EngineCore(load_config(preset, ["kv_cache.prefix_caching=false"]))
    cold_a, _ = generate(cold, "a", a)
    cold_b, _ = generate(cold, "b", b)

    engine = EngineCore(load_config(preset, TIERED))
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

    promoted = host.counters.promoted
    tokens_b, cached = generate(engine, "b", b)
    assert cached == both and host.counters.promoted > promoted
    assert tokens_b == cold_b
    tokens_a, cached = generate(engine, "a2", a)
    assert cached >= PREFIX
    assert tokens_a == cold_a
    stats = engine.stats()["host_tier"]
    assert stats["promoted"] == host.counters.promoted and stats["bytes_promoted"] > 0
    assert stats["bytes_offloaded"] > 0 and stats["pools"][0]["cached_blocks"] > 0


def test_offload_off_by_default_builds_no_host_tier() -> None:
    engine = EngineCore(load_config("tiny", ["kv_cache.num_blocks=96"]))
    assert engine.coordinator.host is None and engine.runner.host_kv is None
    assert engine.stats()["host_tier"] is None
