"""The batched sampler on handmade logits: every rule against a direct computation on the logits.

Oracles: penalties, ``logit_bias``, the ``allowed`` mask, ``min_p``, ``top_k`` and ``top_p``
computed here row by row from their definitions (OpenAI's for presence / frequency, vLLM's for
repetition); the distribution a sampled row draws from checked by many independent draws against
the softmax of those directly processed logits; logprobs against ``torch.log_softmax`` of the raw
logits (the engine-level test against Hugging Face is tests/engine/test_logprobs_vs_hf.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from engine.sampler import NO_TOKEN, NON_FINITE, Sampler, draw_seed
from engine.sampling_params import SamplingParams

VOCAB = 12
CPU = torch.device("cpu")


@dataclass
class Row:
    """A request as the sampler reads it: prompt then outputs, all computed."""

    request_id: str
    sampling: SamplingParams
    token_ids: list[int] = field(default_factory=lambda: [1])
    prompt_len: int = 1
    num_computed_tokens: int = -1

    def __post_init__(self) -> None:
        if self.num_computed_tokens < 0:
            self.num_computed_tokens = len(self.token_ids)


def logits_rows(count: int, seed: int = 0, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randn(count, vocab, generator=torch.Generator().manual_seed(seed)) * 2


def direct(logits: torch.Tensor, row: Row) -> np.ndarray:
    """The processed logits of one row, straight from each rule's definition (float64)."""
    x = logits.double().numpy().copy()
    sp = row.sampling
    prompt, output = row.token_ids[: row.prompt_len], row.token_ids[row.prompt_len :]
    for token in set(prompt) | set(output):
        x[token] = x[token] / sp.repetition_penalty if x[token] > 0 else x[token] * sp.repetition_penalty
    for token in set(output):
        count = output.count(token)
        x[token] -= count * sp.frequency_penalty + sp.presence_penalty
    for token, bias in sp.logit_bias:
        x[token] += bias
    if sp.temperature > 0:
        x = x / sp.temperature
    if sp.min_p > 0:
        p = np.exp(x - x.max())
        p /= p.sum()
        x[p < sp.min_p * p.max()] = -np.inf
    if sp.top_k:
        kth = np.sort(x)[::-1][sp.top_k - 1]
        x[x < kth] = -np.inf
    if sp.top_p < 1:
        p = np.exp(x - x.max())
        p /= p.sum()
        order = np.argsort(-x, kind="stable")
        above = 0.0
        for token in order:
            if above > sp.top_p:
                x[token] = -np.inf
            above += p[token]
    return x


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


HISTORY = [3, 5, 5, 7, 3, 9, 9, 9]  # prompt [3, 5, 5], outputs [7, 3, 9, 9, 9]


@pytest.mark.parametrize(
    "params",
    [
        {"repetition_penalty": 1.7},
        {"repetition_penalty": 0.6},
        {"frequency_penalty": 0.8},
        {"presence_penalty": -1.3},
        {"frequency_penalty": 0.5, "presence_penalty": 1.0, "repetition_penalty": 1.3},
        {"logit_bias": {2: 5.0, 7: -100.0}},
        {"temperature": 0.7, "min_p": 0.2},
        {"temperature": 1.3, "top_k": 4},
        {"temperature": 0.9, "top_p": 0.6},
        {"temperature": 0.9, "top_k": 6, "top_p": 0.7, "min_p": 0.05, "frequency_penalty": 0.4},
    ],
)
def test_processed_logits_follow_each_rule_s_definition(params: dict) -> None:
    logits = logits_rows(3, seed=1)
    rows = [
        Row("a", SamplingParams(**params), HISTORY, 3),
        Row("plain", SamplingParams(temperature=0.5), [4], 1),
        Row("b", SamplingParams(**params), [1, 2], 1),
    ]
    got = Sampler(CPU).processed_logits(logits, rows)
    for i, row in enumerate(rows):
        want = direct(logits[i], row)
        finite = np.isfinite(want)
        assert (torch.isfinite(got[i]).numpy() == finite).all(), (row, got[i], want)
        np.testing.assert_allclose(got[i].numpy()[finite], want[finite], rtol=1e-5, atol=1e-5)


def test_penalties_change_the_sampled_distribution_as_defined() -> None:
    """20000 rows of the same penalised, biased, min-p filtered request, each drawing once
    (unseeded: one batched draw), and 4000 seeded ones: their token frequencies are the softmax
    of the directly processed logits (4 standard errors)."""
    base = torch.tensor([1.0, 2.0, 0.5, 1.5, -1.0, 0.0, 2.5, 1.2])
    sp = SamplingParams(
        temperature=1.2,
        frequency_penalty=0.4,
        presence_penalty=0.3,
        repetition_penalty=1.2,
        logit_bias={4: 2.0},
        min_p=0.05,
        max_tokens=100,
    )
    history, prompt_len = [6, 1, 6, 6, 3], 2
    want = softmax(direct(base, Row("x", sp, history, prompt_len)))
    sampler = Sampler(CPU)
    for count, seeded in ((20000, False), (4000, True)):
        rows = [Row(f"r{i}", sp.replace(seed=i) if seeded else sp, history, prompt_len) for i in range(count)]
        sampled = sampler.sample(base.repeat(count, 1), rows)
        assert not sampled.failures
        freq = np.bincount(list(sampled.tokens.values()), minlength=len(base)) / count
        error = np.sqrt(want * (1 - want) / count)
        assert (np.abs(freq - want) <= 4 * error + 1e-9).all(), (freq, want)
        assert freq[want == 0].sum() == 0  # min_p dropped them: never drawn


def test_greedy_rows_take_the_argmax_of_the_processed_logits() -> None:
    logits = torch.tensor([[5.0, 4.0, 1.0, 0.0], [5.0, 4.0, 1.0, 0.0], [5.0, 4.0, 1.0, 0.0], [5.0, 4.0, 1.0, 0.0]])
    rows = [
        Row("plain", SamplingParams()),
        Row("biased", SamplingParams(logit_bias={2: 4.5})),
        Row("penalised", SamplingParams(repetition_penalty=2.0), [0], 1),  # 5 / 2 < 4
        Row("masked", SamplingParams()),
    ]
    allowed = torch.ones(4, 4, dtype=torch.bool)
    allowed[3, :2] = False
    sampled = Sampler(CPU).sample(logits, rows, allowed)
    assert sampled.tokens == {"plain": 0, "biased": 2, "penalised": 1, "masked": 2}


def test_allowed_mask_limits_sampled_rows() -> None:
    logits = logits_rows(500, seed=4)
    allowed = torch.zeros(500, VOCAB, dtype=torch.bool)
    allowed[:, [1, 6, 10]] = True
    rows = [Row(f"r{i}", SamplingParams(temperature=1.5, seed=i if i % 2 else None)) for i in range(500)]
    sampled = Sampler(CPU).sample(logits, rows, allowed)
    assert set(sampled.tokens.values()) == {1, 6, 10}


def test_seeded_draws_depend_on_seed_and_output_index_only() -> None:
    """The same seeded row gives the same token alone, at another position in another batch,
    and on a fresh sampler (another worker); its next output index draws afresh."""
    row_logits = logits_rows(1, seed=9, vocab=64)[0]
    sp = SamplingParams(temperature=1.0, seed=7, top_p=0.95)
    alone = Sampler(CPU).sample(row_logits[None], [Row("s", sp, [1, 2, 3], 2)]).tokens["s"]
    others = logits_rows(5, seed=10, vocab=64)
    batch = torch.cat([others[:3], row_logits[None], others[3:]])
    rows = [Row(f"o{i}", SamplingParams(temperature=1.0, seed=i if i % 2 else None)) for i in range(5)]
    rows.insert(3, Row("s", sp, [1, 2, 3], 2))
    sampler = Sampler(CPU)
    assert sampler.sample(batch, rows).tokens["s"] == alone
    assert sampler.sample(batch, rows).tokens["s"] == alone  # no state carried between steps
    # the draw of output index k depends on k: across 40 indices the tokens vary
    tokens = {Sampler(CPU).sample(row_logits[None], [Row("s", sp, [1] * (2 + k), 2)]).tokens["s"] for k in range(40)}
    assert len(tokens) > 3
    assert draw_seed(7, 0) != draw_seed(7, 1) != draw_seed(8, 1)


def test_a_non_finite_row_fails_only_its_request() -> None:
    logits = logits_rows(4, seed=2)
    logits[1, 3] = float("nan")
    logits[2, 0] = float("inf")
    for params in (SamplingParams(), SamplingParams(temperature=0.8, seed=1, frequency_penalty=0.5, logprobs=2)):
        rows = [Row(f"r{i}", params, [1, 4, 4], 1) for i in range(4)]
        sampler = Sampler(CPU)
        sampled = sampler.sample(logits, rows)
        assert sampled.failures == {"r1": NON_FINITE, "r2": NON_FINITE}
        assert set(sampled.tokens) == {"r0", "r3"}
        clean = torch.stack([logits[0], logits[3]])
        alone = sampler.sample(clean, [rows[0], rows[3]])
        assert alone.tokens == sampled.tokens
        ids, failures = sampler.sample_on_device(logits, rows)
        assert not failures and ids[[0, 3]].tolist() == [sampled.tokens["r0"], sampled.tokens["r3"]]
        assert (ids[[1, 2]] < 0).all()


def test_a_row_left_with_no_token_fails_alone() -> None:
    logits = logits_rows(3, seed=3)
    allowed = torch.ones(3, VOCAB, dtype=torch.bool)
    allowed[1] = False
    rows = [Row(f"r{i}", SamplingParams(temperature=0.5 * i)) for i in range(3)]
    sampled = Sampler(CPU).sample(logits, rows, allowed)
    assert sampled.failures == {"r1": NO_TOKEN} and set(sampled.tokens) == {"r0", "r2"}


def test_logprobs_are_the_raw_log_softmax_with_rank_and_top() -> None:
    logits = logits_rows(3, seed=5, vocab=40)
    rows = [
        Row("greedy", SamplingParams(logprobs=5)),
        Row("sampled", SamplingParams(temperature=2.0, seed=3, logprobs=0, logit_bias={0: 3.0})),
        Row("none", SamplingParams(temperature=1.0)),
    ]
    sampled = Sampler(CPU).sample(logits, rows)
    assert set(sampled.logprobs) == {"greedy", "sampled"}
    raw = torch.log_softmax(logits, dim=-1)
    for i, rid in enumerate(("greedy", "sampled")):
        entry = sampled.logprobs[rid]
        token = sampled.tokens[rid]
        assert entry.token_id == token
        assert math.isclose(entry.logprob, raw[i, token].item(), abs_tol=1e-6)
        assert entry.rank == int((raw[i] > raw[i, token]).sum()) + 1
        k = rows[i].sampling.logprobs
        values, ids = raw[i].topk(k) if k else (torch.empty(0), torch.empty(0, dtype=torch.long))
        assert [t for t, _ in entry.top] == ids.tolist()
        np.testing.assert_allclose([v for _, v in entry.top], values.numpy(), atol=1e-6)
    assert sampled.logprobs["greedy"].rank == 1


def test_plain_greedy_steps_take_the_argmax_fast_path(monkeypatch) -> None:
    sampler = Sampler(CPU)

    def no_pick(*args, **kwargs):
        raise AssertionError("a plain greedy step must not process the logits")

    monkeypatch.setattr(sampler, "pick", no_pick)
    logits = logits_rows(6, seed=6)
    rows = [Row(f"r{i}", SamplingParams(max_tokens=3, stop_token_ids=(1,))) for i in range(6)]
    sampled = sampler.sample(logits, rows)
    assert sampled.tokens == {f"r{i}": int(logits[i].argmax()) for i in range(6)}
