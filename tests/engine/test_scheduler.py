"""The scheduler over a real coordinator with a deterministic fake model: continuous batching,
chunked prefill, prefix hits, preemption and Mamba-aligned chunks never change the tokens."""

from __future__ import annotations

import random

import pytest

from configs.schema import SchedulerConfig
from engine.kv_cache import FullAttentionSpec, HybridCoordinator, KVCacheGroup, MambaSpec, SlidingWindowSpec
from engine.request import Request, RequestStatus, UncheckedRequestError
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, aligned_chunk

VOCAB = 50


def fake_next_token(tokens: list[int]) -> int:
    """A deterministic 'model': the next token depends on the whole history."""
    return (sum((i + 1) * t for i, t in enumerate(tokens)) * 2654435761) % VOCAB


def run_engine(specs, num_blocks, prompts, max_tokens, config: SchedulerConfig, seed: int = 0):
    coord = HybridCoordinator([KVCacheGroup(s) for s in specs], num_blocks)
    scheduler = Scheduler(config, coord, max_model_len=4096)
    rng = random.Random(seed)
    pending = list(enumerate(prompts))
    outputs: dict[str, list[int]] = {}
    steps = 0
    while pending or scheduler.has_work:
        # Requests arrive over time.
        for _ in range(rng.randint(0, 2)):
            if pending:
                i, prompt = pending.pop(0)
                scheduler.add_request(
                    Request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens[i]), coord.hash_block_size)
                )
        out = scheduler.schedule()
        assert out.num_tokens <= config.max_num_batched_tokens
        assert len(scheduler.running) <= config.max_num_seqs
        sampled = {}
        for chunk in out.chunks:
            request = chunk.request
            # A chunk must only cover tokens the request knows, starting where KV ends.
            assert chunk.start + chunk.num_tokens <= request.num_tokens
            if chunk.sample:
                sampled[request.request_id] = fake_next_token(request.token_ids)
        for result in scheduler.update(out, sampled):
            outputs.setdefault(result.request_id, []).extend(result.new_token_ids)
        coord.check_invariants()
        steps += 1
        assert steps < 20000, "scheduler made no progress"
    assert coord.num_free_blocks == num_blocks - 1
    return outputs, scheduler


def expected_outputs(prompts, max_tokens):
    result = {}
    for i, prompt in enumerate(prompts):
        tokens = list(prompt)
        for _ in range(max_tokens[i]):
            tokens.append(fake_next_token(tokens))
        result[f"r{i}"] = tokens[len(prompt) :]
    return result


def _workload(seed: int, n: int = 24):
    rng = random.Random(seed)
    prefixes = [[rng.randrange(VOCAB) for _ in range(rng.randint(8, 40))] for _ in range(3)]
    prompts = [rng.choice(prefixes) + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 30))] for _ in range(n)]
    max_tokens = [rng.randint(1, 20) for _ in range(n)]
    return prompts, max_tokens


SPECS = {
    "full": [FullAttentionSpec(4)],
    "swa": [FullAttentionSpec(4), SlidingWindowSpec(4, 8)],
    "mamba": [FullAttentionSpec(4), SlidingWindowSpec(4, 12), MambaSpec(4)],
}


@pytest.mark.parametrize("kind", sorted(SPECS))
@pytest.mark.parametrize("num_blocks", [40, 400])
def test_tokens_are_independent_of_batching_and_memory_pressure(kind: str, num_blocks: int) -> None:
    prompts, max_tokens = _workload(seed=len(kind) + num_blocks)
    config = SchedulerConfig(max_num_batched_tokens=48, max_num_seqs=6, prefill_chunk_size=16)
    outputs, scheduler = run_engine(SPECS[kind], num_blocks, prompts, max_tokens, config)
    assert outputs == expected_outputs(prompts, max_tokens)
    assert scheduler.hit_tokens > 0
    if num_blocks == 40:
        assert scheduler.num_preemptions > 0


def test_abort_frees_blocks_anywhere() -> None:
    coord = HybridCoordinator([KVCacheGroup(FullAttentionSpec(4)), KVCacheGroup(SlidingWindowSpec(4, 8))], 64)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=4, prefill_chunk_size=16), coord, 512)
    for i in range(3):
        scheduler.add_request(Request(f"r{i}", list(range(30)), SamplingParams(max_tokens=5), coord.hash_block_size))
    scheduler.schedule()
    assert scheduler.abort("r0") and scheduler.abort("r2")
    assert not scheduler.abort("r0") and not scheduler.abort("unknown")
    scheduler.abort("r1")
    coord.check_invariants()
    assert coord.num_free_blocks == 63 and not scheduler.has_work


def test_an_unchecked_prompt_too_long_is_an_internal_error() -> None:
    coord = HybridCoordinator([KVCacheGroup(FullAttentionSpec(4))], 16)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=4, prefill_chunk_size=16), coord, 8)
    with pytest.raises(UncheckedRequestError, match="max_model_len=8"):
        scheduler.add_request(Request("r", list(range(8)), SamplingParams(), coord.hash_block_size))


def test_transferred_request_waits_for_kv_then_decodes() -> None:
    coord = HybridCoordinator([KVCacheGroup(FullAttentionSpec(4)), KVCacheGroup(MambaSpec(4))], 64)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=4, prefill_chunk_size=16), coord, 512)
    request = Request("r", list(range(21)), SamplingParams(max_tokens=3), coord.hash_block_size, remote_prefill=True)
    table = scheduler.add_transferred_request(request, num_external_tokens=20)
    assert table is not None and request.status is RequestStatus.WAITING_FOR_KV
    assert scheduler.schedule().chunks == []  # nothing runs while the KV is in flight
    scheduler.finish_kv_load("r", ok=True)
    out = scheduler.schedule()
    assert [(c.start, c.num_tokens, c.sample) for c in out.chunks] == [(20, 1, True)]
    coord.check_invariants()


def test_failed_transfer_recomputes_locally() -> None:
    coord = HybridCoordinator([KVCacheGroup(FullAttentionSpec(4))], 64)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=4, prefill_chunk_size=16), coord, 512)
    request = Request("r", list(range(21)), SamplingParams(max_tokens=3), coord.hash_block_size, remote_prefill=True)
    assert scheduler.add_transferred_request(request, num_external_tokens=20) is not None
    scheduler.finish_kv_load("r", ok=False)
    assert coord.num_free_blocks == 63
    out = scheduler.schedule()
    assert [(c.start, c.num_tokens) for c in out.chunks] == [(0, 16)]


def _run_alone(scheduler: Scheduler, request: Request) -> list[tuple[int, int]]:
    """Run ``request`` to its end alone; its chunks as (start, tokens)."""
    scheduler.add_request(request)
    chunks = []
    while scheduler.has_work:
        out = scheduler.schedule()
        chunks += [(c.start, c.num_tokens) for c in out.chunks]
        sampled = {c.request.request_id: fake_next_token(c.request.token_ids) for c in out.chunks if c.sample}
        scheduler.update(out, sampled)
    return chunks


@pytest.mark.parametrize("kind", sorted(SPECS))
def test_a_chunk_ends_where_the_attention_groups_alone_would_hit(kind: str) -> None:
    """Request 2 shares 24 tokens (inside request 1's chunk [16, 32)) and hits 16 with a Mamba
    group: its chunk ends at 24, so request 3 of that prefix hits 24. Attention-only models hit
    24 at once and chunk as before."""
    coord = HybridCoordinator([KVCacheGroup(s) for s in SPECS[kind]], 400)
    config = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, prefill_chunk_size=16)
    scheduler = Scheduler(config, coord, max_model_len=512)
    rng = random.Random(13)
    prefix = [rng.randrange(VOCAB) for _ in range(40)]
    prompts = [[*prefix, 1, 2, 3], [*prefix[:24], 4, 5, 6, 7, 8], [*prefix[:24], 9, 10, 11]]
    requests = [Request(f"r{i}", p, SamplingParams(max_tokens=3), coord.hash_block_size) for i, p in enumerate(prompts)]
    chunks = [_run_alone(scheduler, r) for r in requests]
    assert [r.output_token_ids for r in requests] == list(expected_outputs(prompts, [3, 3, 3]).values())
    coord.check_invariants()
    if kind == "mamba":
        assert [r.num_cached_tokens for r in requests] == [0, 16, 24]
        assert chunks[1][0] == (16, 8)  # ends at the attention-only hit, not at 32
    else:
        assert [r.num_cached_tokens for r in requests] == [0, 24, 24]
        assert chunks[1][0] == (24, 5)


@pytest.mark.parametrize(
    ("start", "num_new", "stop", "tokens"),
    [
        (16, 16, 24, 8),  # the stop cuts the chunk
        (16, 4, 24, 4),  # a budget short of the stop wins
        (16, 6, 24, 4),  # ... and still ends on a block boundary
        (16, 16, 16, 16),  # a stop at the start (already reached) does nothing
        (16, 16, 32, 16),  # a stop at the chunk end does nothing
        (16, 16, 0, 16),  # no stop
        (16, 3, 24, 0),  # no boundary reachable this step: wait
    ],
)
def test_aligned_chunk_never_crosses_the_stop_nor_exceeds_the_budget(start, num_new, stop, tokens) -> None:
    assert aligned_chunk(start, num_new, num_tokens=60, align=4, stop=stop) == tokens
