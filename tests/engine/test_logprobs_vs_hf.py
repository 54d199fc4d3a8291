"""Logprobs the engine reports equal Hugging Face transformers' log-softmax of the same fp32
checkpoint's logits (atol 1e-4): sampled tokens' logprobs and their top alternatives, greedy and
seeded, and prompt logprobs across prefill chunks, with a cached prefix the request must not use.

Oracle: one full HF forward over each request's final sequence (tests/model/logits_harness.py),
``torch.log_softmax`` of its logits at every position.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.core import EngineCore
from engine.logprobs import TokenLogprob
from engine.model.checkpoints.tiny import build_tiny_checkpoint
from engine.sampling_params import SamplingParams
from tests.model import logits_harness as harness

ATOL = harness.ATOL
NAMES = ["tiny-llama", "tiny-bamba"]  # attention only, and hybrid (Mamba + attention)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {name: build_tiny_checkpoint(name, root / name, seed=3) for name in NAMES}


def run(engine: EngineCore, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, dict]:
    """Run to the end: per request its tokens, logprobs, prompt logprobs and cached tokens."""
    got: dict[str, dict] = {rid: {"tokens": [], "logprobs": [], "prompt": None} for rid in requests}
    for rid, (prompt, sampling) in requests.items():
        engine.add_request(rid, prompt, sampling)
    while engine.has_work:
        for out in engine.step():
            assert out.error is None, out.error
            entry = got[out.request_id]
            entry["tokens"].extend(out.new_token_ids)
            if out.logprobs is not None:
                entry["logprobs"].extend(out.logprobs)
            if out.prompt_logprobs is not None:
                assert entry["prompt"] is None, "prompt logprobs come once"
                entry["prompt"] = out.prompt_logprobs
            entry["cached"] = out.num_cached_tokens
    return got


def reference(directory: Path, sequence: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = harness.hf_model(directory)(torch.tensor([sequence])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def check_entry(entry: TokenLogprob, row: torch.Tensor, token: int, k: int) -> None:
    assert entry.token_id == token
    assert abs(entry.logprob - row[token].item()) < ATOL
    # the rank may differ from HF's only where another logprob lies within ATOL of the token's
    above, near = int((row > row[token] + ATOL).sum()), int(((row - row[token]).abs() <= ATOL).sum())
    assert above + 1 <= entry.rank <= above + near
    assert len(entry.top) == k
    values = row.topk(k).values if k else torch.empty(0)
    for (top_id, top_value), want in zip(entry.top, values.tolist(), strict=True):
        assert abs(top_value - want) < ATOL and abs(row[top_id].item() - top_value) < ATOL


@pytest.mark.parametrize("name", NAMES)
def test_sampled_and_greedy_logprobs_equal_hf(name: str, checkpoints) -> None:
    directory = checkpoints[name]
    prompts = harness.random_prompts(11, (7, 23, 14))
    requests = {
        "greedy": (prompts[0], SamplingParams(max_tokens=9, ignore_eos=True, logprobs=5)),
        "seeded": (prompts[1], SamplingParams(max_tokens=9, ignore_eos=True, temperature=1.0, seed=4, logprobs=20)),
        "penalised": (
            prompts[2],
            SamplingParams(
                max_tokens=9,
                ignore_eos=True,
                temperature=0.7,
                seed=5,
                logprobs=0,
                frequency_penalty=1.5,
                logit_bias={17: 3.0},
            ),
        ),
    }
    got = run(harness.make_engine(directory), requests)
    for rid, (prompt, sampling) in requests.items():
        tokens, entries = got[rid]["tokens"], got[rid]["logprobs"]
        assert len(entries) == len(tokens) == 9
        rows = reference(directory, prompt + tokens)
        for i, (entry, token) in enumerate(zip(entries, tokens, strict=True)):
            check_entry(entry, rows[len(prompt) - 1 + i], token, sampling.logprobs or 0)
        assert got[rid]["prompt"] is None


@pytest.mark.parametrize("name", NAMES)
def test_prompt_logprobs_equal_hf_across_chunks_without_a_prefix_hit(name: str, checkpoints) -> None:
    directory = checkpoints[name]
    engine = harness.make_engine(directory, "scheduler.prefill_chunk_size=8", "scheduler.max_num_batched_tokens=24")
    prompt = harness.random_prompts(12, (37,))[0]
    warm = run(engine, {"warm": ([*prompt, 9], SamplingParams(max_tokens=2, ignore_eos=True))})
    assert warm["warm"]["cached"] == 0
    sampling = SamplingParams(max_tokens=4, ignore_eos=True, prompt_logprobs=3, logprobs=1)
    got = run(engine, {"echo": (prompt, sampling), "plain": ([*prompt[:20], 5, 6], SamplingParams(max_tokens=3))})
    assert got["plain"]["cached"] >= 16  # the cache does serve this prompt's prefix
    assert got["echo"]["cached"] == 0  # ... but the request scoring its prompt computed all of it
    scored = got["echo"]["prompt"]
    assert scored is not None and len(scored) == len(prompt) and scored[0] is None
    rows = reference(directory, prompt + got["echo"]["tokens"])
    for position in range(1, len(prompt)):
        check_entry(scored[position], rows[position - 1], prompt[position], 3)
    check_entry(got["echo"]["logprobs"][0], rows[len(prompt) - 1], got["echo"]["tokens"][0], 1)


def test_llm_reports_logprobs_and_prompt_logprobs() -> None:
    """The offline API carries both per completion: the same entries the engine computed, the
    sampled tokens' matching ``token_ids`` and HF's log-softmax of the tiny preset's model."""
    from engine.llm import LLM

    llm = LLM("tiny")
    prompt = harness.random_prompts(13, (11,))[0]
    sampling = SamplingParams(max_tokens=5, ignore_eos=True, temperature=0.9, seed=2, logprobs=2, prompt_logprobs=1)
    (completion,) = llm.generate([prompt], sampling)
    assert completion.logprobs is not None and completion.prompt_logprobs is not None
    assert [entry.token_id for entry in completion.logprobs] == completion.token_ids
    rows = reference(llm.engine.model_directory, prompt + completion.token_ids)
    for i, entry in enumerate(completion.logprobs):
        check_entry(entry, rows[len(prompt) - 1 + i], completion.token_ids[i], 2)
    assert completion.prompt_logprobs[0] is None and len(completion.prompt_logprobs) == len(prompt)
    for position in range(1, len(prompt)):
        check_entry(completion.prompt_logprobs[position], rows[position - 1], prompt[position], 1)
    assert llm.generate([prompt], SamplingParams(max_tokens=2))[0].logprobs is None
