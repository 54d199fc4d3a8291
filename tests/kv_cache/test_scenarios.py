"""Scenario tests of the coordinator (T1-T8, T11, T12) and the behaviours listed in
docs/architecture.md, The hybrid KV cache."""

from __future__ import annotations

import pytest

from engine.kv_cache import (
    BlockPinned,
    BlockRemoved,
    BlockStored,
    BlockUnpinned,
    FullAttentionSpec,
    HybridCoordinator,
    KVCacheGroup,
    KVCacheInvariantError,
    MambaSpec,
    SlidingWindowSpec,
)
from engine.kv_cache.mamba_manager import MambaManager
from tests.kv_cache.helpers import coordinator, request, retention, run_prefill

PROMPT = list(range(100, 164))


def _free_order(coord: HybridCoordinator) -> list[int]:
    return [b.block_id for b in coord.pool.free_queue]


# -- T1 / T2: full attention sharing and eviction ----------------------------------------------------
def test_t1_shared_prefix_full_attention() -> None:
    coord = coordinator([FullAttentionSpec(4)], num_blocks=32)
    a = request(coord, "a", PROMPT[:18])
    run_prefill(coord, a)
    b = request(coord, "b", [*PROMPT[:16], 7, 7, 7, 7])
    hit = coord.get_computed_blocks(b)
    assert hit.num_tokens == 16 == ((b.num_tokens - 1) // 4) * 4
    run_prefill(coord, b)
    shared = coord.block_ids("a")[0][:4]
    assert coord.block_ids("b")[0][:4] == shared
    assert all(coord.pool.blocks[i].ref_cnt == 2 for i in shared)
    coord.free("a")
    coord.free("b")
    coord.check_invariants()
    assert all(coord.pool.blocks[i].block_hash is not None for i in shared)
    order = _free_order(coord)
    # Chain tails are evicted first: within each freed request, higher indices come earlier.
    assert order.index(shared[3]) < order.index(shared[2]) < order.index(shared[1]) < order.index(shared[0])


def test_t2_eviction_takes_least_recent_tail_first_and_forgets_hashes() -> None:
    coord = coordinator([FullAttentionSpec(4)], num_blocks=9, enable_events=True)  # 8 usable
    a = request(coord, "a", PROMPT[:16])
    run_prefill(coord, a)
    a_blocks = coord.block_ids("a")[0]
    coord.free("a")
    b = request(coord, "b", PROMPT[32:48])
    run_prefill(coord, b)
    coord.free("b")
    coord.take_events()
    c = request(coord, "c", PROMPT[48:60])  # 3 blocks: 4 uncached-free first? none; evicts from a
    run_prefill(coord, c)
    taken = coord.block_ids("c")[0]
    # a was freed first and its chain tail (blocks 3, 2, ...) goes first.
    assert taken == [a_blocks[3], a_blocks[2], a_blocks[1]]
    removed = [e for e in coord.take_events() if isinstance(e, BlockRemoved)]
    assert removed and len(removed[0].block_hashes) == 3
    hashes = a.block_hashes
    assert hashes[3] not in coord.pool.cached[0] and hashes[0] in coord.pool.cached[0]
    assert coord.get_computed_blocks(request(coord, "d", PROMPT[:16])).num_tokens == 4


# -- T3: sliding window --------------------------------------------------------------------------------
def test_t3_sliding_window_drops_and_tail_hit() -> None:
    coord = coordinator([FullAttentionSpec(4), SlidingWindowSpec(4, 8)], num_blocks=64)
    a = request(coord, "a", PROMPT[:40])
    hit = coord.get_computed_blocks(a)
    for end in (12, 24, 40):  # chunked prefill
        assert coord.allocate_slots(a, end - a.num_computed_tokens, hit if end == 12 else None) is not None
        a.num_computed_tokens = end
        coord.remove_skipped_blocks("a", end)
        coord.check_invariants()
        swa = coord.block_ids("a")[1]
        first_live = (end - 8 + 1) // 4
        assert all(b == coord.null_block_id for b in swa[:first_live])
        assert all(b != coord.null_block_id for b in swa[first_live:])
    b = request(coord, "b", [*PROMPT[:40], 1, 2, 3, 4])
    hit = coord.get_computed_blocks(b)
    assert hit.num_tokens == 40
    layout = [blk.is_null for blk in hit.blocks[1]]
    assert layout == [True] * 8 + [False] * 2  # need = cdiv(7, 4) = 2 blocks of window tail


# -- T4: Mamba align ----------------------------------------------------------------------------------------
def test_t4_mamba_states_cached_at_block_boundaries_and_same_step_deferral() -> None:
    coord = coordinator([FullAttentionSpec(4), MambaSpec(4)], num_blocks=64)
    a = request(coord, "a", PROMPT[:22])
    coord.new_step()
    for end in (8, 20, 22):  # chunks end on block boundaries up to the last cacheable one
        assert coord.allocate_slots(a, end - a.num_computed_tokens) is not None
        a.num_computed_tokens = end
        coord.remove_skipped_blocks("a", end)
        coord.check_invariants()
        live = [b for b in coord.block_ids("a")[1] if b != coord.null_block_id]
        assert len(live) == 1
    mamba: MambaManager = coord.managers[1]  # type: ignore[assignment]
    cached_states = {i for i, h in enumerate(a.block_hashes) if h in mamba.cached}
    assert cached_states == {1, 4}  # states after 8 and 20 tokens; 22 is mid-block
    b = request(coord, "b", [*PROMPT[:22], 5])
    hit = coord.get_computed_blocks(b)
    assert hit.num_tokens == 20
    # The state after 20 tokens was cached in this very step: b must wait for the next step.
    assert coord.allocate_slots(b, b.num_tokens - 20, hit) is None
    coord.new_step()
    assert coord.allocate_slots(b, b.num_tokens - 20, hit) is not None
    coord.check_invariants()


# -- T6: two-phase allocation ---------------------------------------------------------------------------
class InterleavedCoordinator(HybridCoordinator):
    """The pre-fix ordering: each group claims its hit and allocates external blocks in turn."""

    def _admit(self, request_id, hit_blocks, num_local, num_external, partial):  # type: ignore[override]
        for g, manager in enumerate(self.managers):
            manager.claim_hit(request_id, hit_blocks[g], num_local + num_external)
            if num_external > 0:
                manager.allocate_external(request_id, num_local, num_external)


def _local_and_external(coord: HybridCoordinator, preempt: bool) -> None:
    """A cached prompt whose later groups' hit blocks sit at the free-queue head, then a request
    with that local hit plus external tokens (optionally preempted and reallocated)."""
    a = request(coord, "a", PROMPT[:16])
    run_prefill(coord, a)
    coord.free("a")
    pool = coord.pool
    b = request(coord, "b", PROMPT[:16] + list(range(500, 532)))
    hit = coord.get_computed_blocks(b)
    assert hit.num_tokens == 16
    later_hits = [blk for g in range(1, len(coord.managers)) for blk in hit.blocks[g] if not blk.is_null]
    assert later_hits
    for blk in reversed(later_hits):  # move them to the head, where external allocation pops first
        pool.free_queue.remove(blk)
        pool.free_queue.prepend_n([blk])
    rounds = 2 if preempt else 1
    for _ in range(rounds):
        hit = coord.get_computed_blocks(b)
        # Two external tokens keep the sliding-window hit blocks inside the window.
        assert coord.allocate_slots(b, 4, hit, num_external_tokens=2, delay_cache=True) is not None
        coord.check_invariants()
        for g in range(len(coord.managers)):
            table = coord.block_ids("b")[g]
            assert [x for x in table if x != coord.null_block_id], "every group holds real blocks"
        if preempt:
            coord.free("b")
            b.num_computed_tokens = 0
            coord.check_invariants()
            preempt = False
    coord.free("b")
    coord.check_invariants()
    assert coord.num_free_blocks == coord.pool.num_blocks - 1


THREE_GROUPS = [FullAttentionSpec(4), SlidingWindowSpec(4, 8), SlidingWindowSpec(4, 12)]
TWO_GROUPS = [FullAttentionSpec(4), SlidingWindowSpec(4, 8)]


@pytest.mark.parametrize(
    ("specs", "preempt"),
    [(THREE_GROUPS, False), (THREE_GROUPS, True), (TWO_GROUPS, True)],
    ids=["three_groups", "three_groups_preempt_reallocate", "two_groups_preempt_reallocate"],
)
def test_seed000_local_hits_claimed_before_external_blocks(specs, preempt) -> None:
    _local_and_external(coordinator(specs, num_blocks=20), preempt)
    # The same scenario with the phases interleaved places one block in two groups.
    with pytest.raises(KVCacheInvariantError):
        _local_and_external(InterleavedCoordinator([KVCacheGroup(s) for s in specs], 20), preempt)


# -- T7: sliding window + external tokens ------------------------------------------------------------
def test_t7_sliding_window_allocates_only_in_window_blocks_for_external_tokens() -> None:
    coord = coordinator([FullAttentionSpec(4), SlidingWindowSpec(4, 8)], num_blocks=64)
    req = request(coord, "r", list(range(41)))
    hit = coord.get_computed_blocks(req)
    assert hit.num_tokens == 0
    free_before = coord.num_free_blocks
    assert coord.allocate_slots(req, 1, hit, num_external_tokens=40, delay_cache=True) is not None
    coord.check_invariants()  # includes: blocks taken == blocks predicted
    full, swa = coord.block_ids("r")
    null = coord.null_block_id
    assert len(full) == 11 and null not in full
    # skipped(40) = 33 tokens -> 8 null slots; in-window slots 8, 9 get real blocks, plus slot 10
    # for the token computed now.
    assert swa[:8] == [null] * 8 and null not in swa[8:] and len(swa) == 11
    assert free_before - coord.num_free_blocks == 11 + 3
    assert coord.unhashed_block_ids("r")[1] == swa[8:]


# -- T8: preemption and resume ---------------------------------------------------------------------------------
def test_t8_preempted_request_resumes_from_its_own_cached_blocks() -> None:
    coord = coordinator([FullAttentionSpec(4), SlidingWindowSpec(4, 8)], num_blocks=64)
    req = request(coord, "r", PROMPT[:30])
    run_prefill(coord, req)
    for token in (1, 2, 3):
        req.append_token_ids([token])
        assert coord.allocate_slots(req, 1) is not None
        req.num_computed_tokens += 1
    coord.free("r")  # preempted
    req.num_computed_tokens = 0
    coord.check_invariants()
    assert coord.num_free_blocks == 63
    hit = coord.get_computed_blocks(req)
    assert hit.num_tokens == 32  # 33 tokens known; its own cached chain up to the last full block
    assert coord.allocate_slots(req, req.num_tokens - hit.num_tokens, hit) is not None
    coord.check_invariants()


# -- T11: uncached blocks are reused before cached ones --------------------------------------------------------
def test_t11_uncached_freed_blocks_are_reused_first() -> None:
    coord = coordinator([FullAttentionSpec(4)], num_blocks=32)
    req = request(coord, "r", PROMPT[:10])  # blocks 0, 1 full (cached); block 2 partial (uncached)
    run_prefill(coord, req)
    table = coord.block_ids("r")[0]
    coord.free("r")
    order = _free_order(coord)
    assert order[0] == table[2]
    assert order[-2:] == [table[1], table[0]]


# -- T12: the pinned retention tier ----------------------------------------------------------------------
def _shared_prefix_churn(coord: HybridCoordinator, rounds: int) -> list[int]:
    prefix = PROMPT[:32]
    hits = []
    for i in range(rounds):
        req = request(coord, f"r{i}", prefix + [1000 + i] * 8)
        hits.append(coord.get_computed_blocks(req).num_tokens)
        run_prefill(coord, req)
        coord.free(req.request_id)
        # unrelated traffic between reuses of the prefix
        other = request(coord, f"o{i}", [2000 + 50 * i + j for j in range(36)])
        run_prefill(coord, other)
        coord.free(other.request_id)
        coord.check_invariants()
    return hits


def test_t12_pinned_window_survives_churn_and_keeps_hits() -> None:
    specs = [FullAttentionSpec(4), SlidingWindowSpec(4, 8)]
    # Plain LRU: the churn between reuses evicts the prefix's window tail, so hits fall short.
    plain = _shared_prefix_churn(coordinator(specs, num_blocks=34), 6)
    assert all(hit < 32 for hit in plain[2:])
    pinned = _shared_prefix_churn(coordinator(specs, num_blocks=34, retention=retention(budget=8)), 6)
    assert pinned[2:] == [32] * 4  # from the third request on, the shared prefix hits fully


def test_t12_pinned_blocks_are_demoted_under_pressure_never_failing_allocation() -> None:
    coord = coordinator([FullAttentionSpec(4), SlidingWindowSpec(4, 8)], num_blocks=34, retention=retention())
    _shared_prefix_churn(coord, 3)
    pool = coord.pool
    pinned_before = pool.retained.size
    assert pinned_before > 0
    # A request needing more blocks than the free queue holds still fits: pins are demoted.
    capacity = pool.num_free_blocks
    per_group = capacity // 2
    big = request(coord, "big", [3000 + i for i in range(4 * per_group - 1)])
    assert 2 * per_group > pool.free_queue.size
    assert coord.allocate_slots(big, big.num_tokens, coord.get_computed_blocks(big)) is not None
    coord.check_invariants()
    assert pool.retained.size < pinned_before
    assert pool.num_free_blocks == capacity - 2 * per_group


def test_pin_events_and_min_drop_size() -> None:
    specs = [FullAttentionSpec(4), SlidingWindowSpec(4, 8)]
    coord = coordinator(specs, num_blocks=64, retention=retention(min_drop=100), enable_events=True)
    _shared_prefix_churn(coord, 3)
    retained_groups = [b.group for b in coord.pool.retained]
    assert 1 not in retained_groups  # every window drop was smaller than the minimum
    assert retained_groups.count(0) == 8  # the shared 32-token prefix of full attention is retained
    coord = coordinator(specs, num_blocks=64, retention=retention(), enable_events=True)
    _shared_prefix_churn(coord, 3)
    events = coord.take_events()
    assert any(isinstance(e, BlockPinned) and not e.explicit for e in events)
    assert any(isinstance(e, BlockStored) for e in events)
    seqs = [e.seq for e in events]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))


def test_explicit_prefix_pin_keeps_every_group_hittable() -> None:
    specs = [FullAttentionSpec(4), SlidingWindowSpec(4, 8), MambaSpec(4)]
    coord = coordinator(specs, num_blocks=48, retention=retention(), enable_events=True)
    prefix = PROMPT[:24]
    req = request(coord, "p", [*prefix, 9])
    for end in (24, 25):  # chunk ends on a block boundary so the Mamba state is cached at 24
        assert coord.allocate_slots(req, end - req.num_computed_tokens) is not None
        req.num_computed_tokens = end
        coord.remove_skipped_blocks("p", end)
    coord.free("p")
    assert coord.pin_prefix(req.block_hashes, 24) == 24
    assert coord.pool.explicit.size == 6 + 2 + 1
    for i in range(6):  # churn with unrelated requests that fit beside the pinned blocks
        other = request(coord, f"o{i}", [5000 + 50 * i + j for j in range(60)])
        run_prefill(coord, other)
        coord.free(other.request_id)
    probe = request(coord, "probe", [*prefix, 1, 2])
    assert coord.get_computed_blocks(probe).num_tokens == 24
    coord.unpin_prefix(req.block_hashes, 24)
    assert coord.pool.explicit.size == 0
    assert any(isinstance(e, BlockUnpinned) for e in coord.take_events())
    coord.check_invariants()


# -- partial-group hits on the decode side of a remote prefill ----------------------------------------------
def test_seed004_mamba_does_not_veto_attention_hit_for_remote_prefill() -> None:
    specs = [FullAttentionSpec(4), SlidingWindowSpec(4, 8), MambaSpec(4)]
    coord = coordinator(specs, num_blocks=64)
    # Decode side already holds the attention KV of a 16-token prefix, but no Mamba state there
    # (the prompt was computed in one unaligned chunk).
    warm = request(coord, "warm", PROMPT[:18])
    run_prefill(coord, warm)
    coord.free("warm")
    prompt = PROMPT[:16] + list(range(700, 710))  # N = 26
    local = request(coord, "local", prompt)
    assert coord.get_computed_blocks(local).num_tokens == 0  # Mamba vetoes without the flag
    remote = request(coord, "remote", prompt, remote_prefill=True)
    hit = coord.get_computed_blocks(remote)
    assert hit.num_tokens == 16 and hit.partial
    external = remote.num_tokens - 1 - hit.num_tokens  # prefill sends h(N-1); decode recomputes token N
    free_before = coord.num_free_blocks
    assert coord.allocate_slots(remote, 0, hit, num_external_tokens=external, delay_cache=True) is not None
    coord.check_invariants()
    _full, swa, mamba = coord.block_ids("remote")
    real_mamba = [b for b in mamba if b != coord.null_block_id]
    assert len(real_mamba) == 1 and mamba[-1] == real_mamba[0] and len(mamba) == -(-25 // 4)
    # Only the missing attention blocks are new: full gets blocks 4..6; SWA only the slots in the
    # window of token 25 (tokens 18..24: slots 4..6), never the out-of-window ones.
    unhashed = coord.unhashed_block_ids("remote")
    assert len(unhashed[0]) == 3
    assert swa[:4] == [coord.null_block_id] * 4 and unhashed[1] == swa[4:] and len(swa) == 7
    assert unhashed[2] == real_mamba
    # Taken from the pool: the 4 claimed local full-attention hits plus 3 + 3 + 1 fresh blocks.
    assert free_before - coord.num_free_blocks == 4 + 3 + 3 + 1
