"""Longest-hit search: worked examples (docs/architecture.md, The hybrid KV cache), and a brute-force oracle."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.kv_cache import ChunkedLocalSpec, FullAttentionSpec, MambaSpec, SlidingWindowSpec
from engine.kv_cache.hashing import block_hashes
from tests.kv_cache.helpers import coordinator, ids, request, seed_cached

TOKENS = list(range(1000, 1200))


def _single(spec, cached: set[int], max_length: int):
    coord = coordinator([spec], num_blocks=64)
    hashes = block_hashes(TOKENS, spec.block_size)
    placed = dict(zip(sorted(cached), seed_cached(coord, 0, hashes, sorted(cached)), strict=True))
    blocks, length = coord.managers[0].find_longest_cache_hit(hashes, max_length, spec.block_size)
    null = coord.pool.null_block
    layout = [None if b is null else next(i for i, p in placed.items() if p is b) for b in blocks]
    return layout, length


def test_sliding_window_examples() -> None:
    swa = SlidingWindowSpec(block_size=4, window=8)
    assert _single(swa, {0, 1, 3, 4}, 23) == ([None, None, None, 3, 4], 20)
    assert _single(swa, {0, 1, 4}, 23) == ([0, 1], 8)
    assert _single(swa, {0, 4}, 23) == ([0], 4)
    assert _single(swa, set(), 23) == ([], 0)


def test_chunked_local_examples() -> None:
    chunked = ChunkedLocalSpec(block_size=4, chunk_size=8)
    assert _single(chunked, {2}, 15) == ([None, None, 2], 12)
    assert _single(chunked, set(), 15) == ([None, None], 8)
    assert _single(chunked, set(), 16) == ([None] * 4, 16)


def test_full_attention_stops_at_first_miss() -> None:
    full = FullAttentionSpec(block_size=4)
    assert _single(full, {0, 1, 3}, 40) == ([0, 1], 8)
    assert _single(full, {0, 1, 2, 3}, 15) == ([0, 1, 2], 12)


def test_mamba_takes_the_deepest_state() -> None:
    mamba = MambaSpec(block_size=4)
    assert _single(mamba, {1, 3}, 23) == ([None, None, None, 3], 16)
    assert _single(mamba, {1, 3}, 15) == ([None, 1], 8)


def test_three_group_fixed_point_example() -> None:
    """The longest common hit as a fixed point (block 4): full hits blocks 0..4, SWA (window 8) has
    {0,1,3,4} cached, Mamba has states at {1,3}: the hit is 8 tokens."""
    coord = coordinator([FullAttentionSpec(4), SlidingWindowSpec(4, 8), MambaSpec(4)], num_blocks=64)
    req = request(coord, "r", TOKENS[:21])  # max_length = 20
    hashes = req.block_hashes
    full = seed_cached(coord, 0, hashes, range(5))
    swa = seed_cached(coord, 1, hashes, [0, 1, 3, 4])
    mamba = seed_cached(coord, 2, hashes, [1, 3])
    hit = coord.get_computed_blocks(req)
    assert hit.num_tokens == 8
    assert ids(hit.blocks[0]) == ids(full[:2])
    assert ids(hit.blocks[1]) == ids(swa[:2])
    assert ids(hit.blocks[2]) == [coord.null_block_id, mamba[0].block_id]
    assert hit.shared_prefix_tokens == 20


def test_lcm_alignment_example() -> None:
    """Full attention block 32 + SWA block 16 (window 32): hits are multiples of the LCM, 32 tokens."""
    specs = [FullAttentionSpec(32), SlidingWindowSpec(16, 32)]
    coord = coordinator(specs, num_blocks=64)
    assert (coord.hash_block_size, coord.alignment) == (16, 32)
    req = request(coord, "r", TOKENS[:100])
    fine = req.block_hashes
    seed_cached(coord, 0, coord.managers[0].view(fine), range(3))
    seed_cached(coord, 1, fine, [4, 5])
    hit = coord.get_computed_blocks(req)
    assert hit.num_tokens == 96
    assert [b.is_null for b in hit.blocks[1]] == [True] * 4 + [False] * 2

    coord = coordinator(specs, num_blocks=64)
    seed_cached(coord, 0, coord.managers[0].view(fine), range(3))
    seed_cached(coord, 1, fine, [3, 4])  # the run ending at 80 tokens is unaligned
    hit = coord.get_computed_blocks(req)
    assert hit.num_tokens == 0 and hit.blocks[0] == []


SPECS = st.one_of(
    st.builds(FullAttentionSpec, st.sampled_from([2, 4])),
    st.builds(SlidingWindowSpec, st.sampled_from([2, 4]), st.integers(2, 13)),
    st.builds(ChunkedLocalSpec, st.just(4), st.sampled_from([4, 8, 12])),
    st.builds(MambaSpec, st.sampled_from([2, 4])),
)


@settings(max_examples=400, deadline=None)
@given(
    specs=st.lists(SPECS, min_size=1, max_size=4),
    num_tokens=st.integers(1, 40),
    cached=st.lists(st.sets(st.integers(0, 20)), min_size=4, max_size=4),
    remote=st.booleans(),
)
def test_hit_equals_brute_force_oracle(specs, num_tokens, cached, remote) -> None:
    coord = coordinator(specs, num_blocks=200)
    req = request(coord, "r", TOKENS[:num_tokens], remote_prefill=remote)
    for g, manager in enumerate(coord.managers):
        view = manager.view(req.block_hashes)
        seed_cached(coord, g, view, [i for i in sorted(cached[g]) if i < len(view)])
    hit = coord.get_computed_blocks(req)

    considered = [(g, m) for g, m in enumerate(coord.managers) if not (remote and isinstance(m.spec, MambaSpec))]
    align = coord.alignment
    best = max(
        length
        for length in range(0, num_tokens, align)
        if all(m.hit_valid(m.view(req.block_hashes), length) for _, m in considered)
    )
    assert hit.num_tokens == best
    assert hit.num_tokens % align == 0 and hit.num_tokens <= max(num_tokens - 1, 0)
    for g, manager in considered:
        blocks = hit.blocks[g]
        bs = manager.block_size
        view = manager.view(req.block_hashes)
        assert len(blocks) == best // bs
        for i, block in enumerate(blocks):
            if not block.is_null:
                assert block.block_hash == view[i]
        if best and isinstance(manager.spec, MambaSpec):
            assert [b.is_null for b in blocks] == [True] * (best // bs - 1) + [False]
        if best and isinstance(manager.spec, SlidingWindowSpec):
            needed = manager.blocks_needed_at(best)
            assert all(not blocks[i].is_null for i in needed)
    coord.check_invariants()
