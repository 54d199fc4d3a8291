"""Token sampling for one step's batch of logits rows, every rule applied to the whole batch.

Order (``Sampler.processed_logits``): raw logprobs (log-softmax of the raw logits, when a row
asks for ``logprobs``), ``repetition_penalty`` over prompt and output tokens (a positive logit is
divided by it, a negative one multiplied), ``frequency_penalty`` / ``presence_penalty`` over the
output tokens (``logit -= count * frequency + (count > 0) * presence``), ``logit_bias`` (added),
the ``allowed`` token mask (structured output: False gives -inf), temperature, ``min_p``,
``top_k``, ``top_p``. Greedy rows (temperature 0) take the argmax of the processed logits;
sampled rows draw from the softmax of theirs by inverse transform (one uniform ``u`` per row:
the first token whose cumulative probability exceeds ``u``). A seeded row's uniform for its
``k``-th output token comes from a generator seeded from ``(seed, k)`` alone, so its tokens
depend neither on what it is batched with nor on the worker that runs it (a request resumed
elsewhere after ``k`` tokens continues as it would have, on the same kind of device).

A row that cannot be sampled (non-finite raw logits, or parameters that leave no token) fails
only its own request: ``SampledTokens.failures`` names it and every other row is sampled.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from engine.logprobs import TokenLogprob
from engine.model.uploads import to_device
from engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)

#: why a row whose raw logits hold a NaN or an infinity fails its request
NON_FINITE = "the model produced non-finite logits for this request"
#: why a row whose processed logits leave no token to pick fails its request
NO_TOKEN = "sampling failed: no token can be sampled with this request's parameters"
#: ids ``pick`` gives a failed row: non-finite raw logits, or nothing left after processing
FAILED_NON_FINITE, FAILED_NO_TOKEN = -1, -2
#: positions of prompt logprobs computed per logits call (bounds the [rows, vocab] temporaries)
PROMPT_LOGPROBS_ROWS = 256
_MASK64 = (1 << 64) - 1


class SamplingRow(Protocol):
    """What the sampler reads of a request (``engine.request.Request`` is one): its parameters,
    its known tokens (prompt then outputs: the penalties' history) and ``num_computed_tokens``.
    The row samples output token number ``num_computed_tokens - prompt_len`` (0-based): the
    token after the last position computed (with async scheduling that position may hold a
    placeholder whose token is not in ``token_ids`` yet)."""

    @property
    def request_id(self) -> str: ...
    @property
    def sampling(self) -> SamplingParams: ...
    @property
    def token_ids(self) -> list[int]: ...
    @property
    def prompt_len(self) -> int: ...
    @property
    def num_computed_tokens(self) -> int: ...


@dataclass
class SampledTokens:
    """One step's samples: the token of each request that sampled, and why each failed one did
    not (a request is in exactly one of the two); ``logprobs`` for each sampled request that
    asks for them; ``prompt_logprobs`` (one per prompt token, None for the first) for each
    request whose first token this step sampled and that asks for them."""

    tokens: dict[str, int] = field(default_factory=dict)
    failures: dict[str, str] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprob] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[TokenLogprob | None]] = field(default_factory=dict)


def sampling_failure(request_id: str, exc: RuntimeError) -> str:
    """Log why a row could not be sampled; the reason its request fails with."""
    log.warning("sampling %s failed: %s", request_id, exc)
    first_line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return f"sampling failed: {first_line}"


def failure_reason(code: int) -> str:
    """Why a row ``pick`` marked with ``code`` (< 0) failed."""
    return NON_FINITE if code == FAILED_NON_FINITE else NO_TOKEN


def greedy_ids(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax (int64, on the logits' device), or -1 where the row's maximum is not
    finite (a NaN anywhere in a row is its maximum: NaN propagates through both reductions).
    Never waits for the device; on the CPU numpy's argmax (3-4x faster than torch's on
    [64, 4k-32k] fp32 logits)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        values = logits.detach().numpy()
        ids = values.argmax(axis=1)
        best = values[np.arange(values.shape[0]), ids]
        return torch.from_numpy(np.where(np.isfinite(best), ids, FAILED_NON_FINITE).astype(np.int64))
    best, ids = logits.max(dim=-1)
    return torch.where(torch.isfinite(best), ids, FAILED_NON_FINITE)


def draw_seed(seed: int, index: int) -> int:
    """The generator seed of a seeded request's ``index``-th output token's draw: a 64-bit mix
    (splitmix64's finaliser) of the request's seed and the index, nothing else."""
    z = ((seed & _MASK64) + (index + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def token_logprobs(raw: torch.Tensor, chosen: torch.Tensor, ks: Sequence[int]) -> list[TokenLogprob]:
    """``TokenLogprob`` of ``chosen[i]`` in row ``i`` of ``raw`` (float32 log-softmax of raw
    logits), with the ``ks[i]`` most likely tokens. One host read for the batch."""
    picked = raw.gather(1, chosen[:, None])
    ranks = (raw > picked).sum(dim=1) + 1
    top = max(ks, default=0)
    values: list[list[float]] = []
    ids: list[list[int]] = []
    if top:
        top_values, top_ids = raw.topk(min(top, raw.shape[1]), dim=1)
        values, ids = top_values.tolist(), top_ids.tolist()
    out = []
    rows = zip(chosen.tolist(), picked[:, 0].tolist(), ranks.tolist(), ks, strict=True)
    for i, (token, logprob, rank, k) in enumerate(rows):
        pairs = tuple(zip(ids[i][:k], values[i][:k], strict=True)) if k else ()
        out.append(TokenLogprob(token, logprob, rank, pairs))
    return out


class PendingTokens:
    """One launched step's sampled ids on their way to the host (``ModelRunner.launch``).

    Owns the ids on the device (the next step's input ids read them there), the pinned host
    buffer a non-blocking copy fills, and the event recorded after that copy. Invariants: the
    host buffer is read only after the event (``result``); a negative row (``failure_reason``)
    or one named in ``failures`` (sampling raised) fails its request, every other row is its
    token."""

    def __init__(self, request_ids: list[str], ids: torch.Tensor, failures: dict[str, str], host: torch.Tensor | None):
        """``host``: a pinned buffer of at least ``len(request_ids)`` int64 (CUDA), else None
        (the ids are on the CPU already)."""
        self.request_ids = request_ids
        self.ids = ids
        self.failures = failures
        self._host = host
        self._copied: torch.cuda.Event | None = None
        if host is not None:
            host[: len(request_ids)].copy_(ids, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()

    def result(self) -> SampledTokens:
        """Wait for the copy (not for later work on the stream), then the step's samples."""
        count = len(self.request_ids)
        if self._copied is not None and self._host is not None:
            self._copied.synchronize()
            values = self._host[:count].tolist()
        else:
            values = self.ids.tolist()
        out = SampledTokens()
        for request_id, token in zip(self.request_ids, values, strict=True):
            why = self.failures.get(request_id)
            if why is None and token < 0:
                why = failure_reason(token)
            if why is not None:
                out.failures[request_id] = why
            else:
                out.tokens[request_id] = token
        return out


class Sampler:
    """Picks one token per row of logits and computes the logprobs rows ask for.

    Owns one reusable ``torch.Generator`` that each seeded row reseeds from ``(seed, k)``
    (``draw_seed``) before its draw, so it holds no per-request state: a request's draws depend
    only on its seed and its output index."""

    def __init__(self, device: torch.device):
        self.device = device
        self._generator = torch.Generator(device=device)

    def all_plain_greedy(self, rows: Iterable[SamplingRow]) -> bool:
        """Whether every row is plain greedy (``SamplingParams.plain_greedy``): the argmax fast path."""
        return all(row.sampling.plain_greedy for row in rows)

    def all_launchable(self, rows: Iterable[SamplingRow]) -> bool:
        """Whether every row can be sampled before the host knows its last token
        (``SamplingParams.launchable``)."""
        return all(row.sampling.launchable for row in rows)

    # -- the step's samples --------------------------------------------------------------------------
    def sample(
        self, logits: torch.Tensor, rows: Sequence[SamplingRow], allowed: torch.Tensor | None = None
    ) -> SampledTokens:
        """One token per row (and its ``TokenLogprob`` where the row asks for ``logprobs``); a row
        with non-finite raw logits, or one left with no token, fails its request alone.
        ``allowed``: an optional bool [rows, vocab] mask (False: the token may not be picked).
        A step of plain greedy rows and no mask costs one argmax (``greedy_ids``)."""
        out = SampledTokens()
        if allowed is None and self.all_plain_greedy(rows):
            ids = greedy_ids(logits).tolist()
        else:
            try:
                picked = self.pick(logits, rows, allowed)
            except RuntimeError as exc:  # a torch error on these rows: fail each, the step goes on
                for row in rows:
                    out.failures[row.request_id] = sampling_failure(row.request_id, exc)
                return out
            ids = picked.tolist()
            asking = [i for i, row in enumerate(rows) if row.sampling.logprobs is not None and ids[i] >= 0]
            if asking:
                index = to_device(asking, logits.device)
                raw = torch.log_softmax(logits[index].float(), dim=-1)
                ks = [rows[i].sampling.logprobs or 0 for i in asking]
                for i, entry in zip(asking, token_logprobs(raw, picked[index], ks), strict=True):
                    out.logprobs[rows[i].request_id] = entry
        tokens, failures = out.tokens, out.failures
        for row, token in zip(rows, ids, strict=True):
            if token < 0:
                failures[row.request_id] = failure_reason(token)
            else:
                tokens[row.request_id] = token
        return out

    def sample_on_device(
        self, logits: torch.Tensor, rows: Sequence[SamplingRow], allowed: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, dict[str, str]]:
        """``sample`` without reading anything back (no logprobs): one id per row on the device
        (negative where the row fails, ``failure_reason``) and the requests whose sampling
        raised. The same tokens as ``sample``."""
        if allowed is None and self.all_plain_greedy(rows):
            return greedy_ids(logits), {}
        try:
            return self.pick(logits, rows, allowed), {}
        except RuntimeError as exc:  # a torch error on these rows: fail each
            ids = torch.full((len(rows),), FAILED_NO_TOKEN, dtype=torch.long, device=logits.device)
            return ids, {row.request_id: sampling_failure(row.request_id, exc) for row in rows}

    def pick(
        self, logits: torch.Tensor, rows: Sequence[SamplingRow], allowed: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Each row's token (int64 on the logits' device) from ``processed_logits``: the argmax
        for greedy rows, an inverse-transform draw for sampled ones; ``FAILED_NON_FINITE`` where the
        raw logits' maximum is not finite, ``FAILED_NO_TOKEN`` where the processed row has no
        finite maximum (everything masked, a NaN temperature past validation)."""
        raw_ok = torch.isfinite(logits.max(dim=-1).values)
        x = self.processed_logits(logits, rows, allowed)
        best, ids = x.max(dim=-1)
        sampled = [i for i, row in enumerate(rows) if row.sampling.temperature != 0.0]
        if sampled:
            index = to_device(sampled, x.device)
            # inverse transform: the first token whose cumulative probability exceeds u * total,
            # one uniform per row (a vocabulary of random clocks per row costs ~100x more on a CPU)
            cumulative = torch.softmax(x[index], dim=-1).cumsum_(dim=-1)
            uniforms = torch.rand(len(sampled), 1, device=x.device)
            for j, i in enumerate(sampled):
                sp = rows[i].sampling
                if sp.seed is not None:
                    self._generator.manual_seed(draw_seed(sp.seed, rows[i].num_computed_tokens - rows[i].prompt_len))
                    uniforms[j].uniform_(generator=self._generator)
            drawn = torch.searchsorted(cumulative, uniforms * cumulative[:, -1:], right=True)[:, 0]
            # u * total rounded up to the total: the most likely token (a vanishing case)
            ids[index] = torch.where(drawn < x.shape[1], drawn, ids[index])
        ids = torch.where(torch.isfinite(best), ids, FAILED_NO_TOKEN)
        return torch.where(raw_ok, ids, FAILED_NON_FINITE)

    def processed_logits(
        self, logits: torch.Tensor, rows: Sequence[SamplingRow], allowed: torch.Tensor | None = None
    ) -> torch.Tensor:
        """A float32 copy of ``logits`` with every rule before the pick applied (the module
        docstring's order): -inf where a token is dropped. Softmax of a sampled row is the
        distribution its token is drawn from; a greedy row's argmax is its token."""
        x = logits.float().clone()
        params = [row.sampling for row in rows]
        penalised = [i for i, sp in enumerate(params) if sp.penalises]
        if penalised:
            self._apply_penalties(x, rows, penalised)
        vocab = x.shape[1]
        biased = [(i, token, bias) for i, sp in enumerate(params) for token, bias in sp.logit_bias if token < vocab]
        if biased:
            at_rows, tokens, biases = zip(*biased, strict=True)
            x.index_put_(
                (to_device(at_rows, x.device), to_device(tokens, x.device)),
                to_device(biases, x.device, x.dtype),
                accumulate=True,
            )
        if allowed is not None:
            x.masked_fill_(~allowed.to(x.device), -math.inf)
        if any(sp.temperature != 0.0 for sp in params):
            temperature = [sp.temperature or 1.0 for sp in params]
            x.div_(to_device(temperature, x.device, x.dtype)[:, None])
        if any(sp.min_p > 0.0 for sp in params):
            log_min_p = to_device(
                [math.log(sp.min_p) if sp.min_p > 0 else -math.inf for sp in params], x.device, x.dtype
            )
            # p < min_p * p_max  <=>  logit < max logit + log(min_p) (softmax shares the denominator)
            x.masked_fill_(x < x.max(dim=-1, keepdim=True).values + log_min_p[:, None], -math.inf)
        top_k = [sp.top_k if 0 < sp.top_k < x.shape[1] else 0 for sp in params]
        top_p = [sp.top_p for sp in params]
        if any(p < 1.0 for p in top_p):
            self._apply_top_k_top_p(x, top_k, top_p)
        elif any(top_k):
            kth = self._kth_largest(x.topk(max(top_k), dim=-1).values, top_k)
            x.masked_fill_(x < kth, -math.inf)
        return x

    def _apply_penalties(self, x: torch.Tensor, rows: Sequence[SamplingRow], penalised: list[int]) -> None:
        """Repetition, frequency and presence penalties of the ``penalised`` rows, in place, in
        O(history) work: gathers and scatters at the history's ids, never a [rows, vocab] count.

        The histories are padded to one [rows, longest] id array per step. A repeated id (and the
        padding, which repeats a real id of the row) writes the same value each time, so the
        writes are idempotent: repetition divides or multiplies each seen token once, presence
        subtracts once per output token; frequency adds ``-frequency`` per output occurrence
        (padding adds 0)."""
        count = len(penalised)
        histories = [rows[i].token_ids[: rows[i].num_computed_tokens] for i in penalised]
        longest = max(1, *(len(h) for h in histories))
        seen = np.empty((count, longest), dtype=np.int64)
        outputs = np.empty((count, longest), dtype=np.int64)
        occurrences = np.zeros((count, longest), dtype=np.float32)  # 1 per real output position
        has_output = np.zeros((count, 1), dtype=np.float32)
        for j, (i, history) in enumerate(zip(penalised, histories, strict=True)):
            seen[j, : len(history)] = history
            seen[j, len(history) :] = history[0] if history else 0
            produced = history[rows[i].prompt_len :]
            outputs[j, : len(produced)] = produced
            outputs[j, len(produced) :] = produced[0] if produced else seen[j, 0]
            occurrences[j, : len(produced)] = 1.0
            has_output[j] = 1.0 if produced else 0.0
        device, dtype = x.device, x.dtype
        at = to_device(penalised, device)[:, None]
        params = [rows[i].sampling for i in penalised]
        seen_ids = torch.from_numpy(seen).to(device)
        repetition = to_device([sp.repetition_penalty for sp in params], device, dtype)[:, None]
        values = x[at, seen_ids]
        x[at, seen_ids] = torch.where(values > 0, values / repetition, values * repetition)
        output_ids = torch.from_numpy(outputs).to(device)
        frequency = to_device([sp.frequency_penalty for sp in params], device, dtype)[:, None]
        x.index_put_(
            (at.expand_as(output_ids), output_ids),
            torch.from_numpy(occurrences).to(device) * -frequency,
            accumulate=True,
        )
        presence = to_device([sp.presence_penalty for sp in params], device, dtype)[:, None]
        x[at, output_ids] = x[at, output_ids] - presence * torch.from_numpy(has_output).to(device)

    @staticmethod
    def _kth_largest(descending: torch.Tensor, top_k: list[int]) -> torch.Tensor:
        """Each row's ``top_k``-th largest value from its values sorted descending ([rows, 1]);
        -inf for a row without top-k (0)."""
        k = to_device([max(k, 1) for k in top_k], descending.device)
        kth = descending.gather(1, (k - 1)[:, None])
        off = to_device([k == 0 for k in top_k], descending.device)[:, None]
        return kth.masked_fill(off, -math.inf)

    def _apply_top_k_top_p(self, x: torch.Tensor, top_k: list[int], top_p: list[float]) -> None:
        """``top_k`` then ``top_p`` (the smallest set of most likely tokens whose probability
        reaches ``top_p``), in place, over one descending sort."""
        descending, order = x.sort(dim=-1, descending=True)
        if any(top_k):
            descending.masked_fill_(descending < self._kth_largest(descending, top_k), -math.inf)
        probs = torch.softmax(descending, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs  # probability of the tokens ranked above
        limit = to_device(top_p, x.device, x.dtype)[:, None]
        descending.masked_fill_(before > limit, -math.inf)
        x.scatter_(1, order, descending)

    # -- prompt logprobs -----------------------------------------------------------------------------
    @staticmethod
    def prompt_logprobs(
        hidden: torch.Tensor, targets: Sequence[int], k: int, logits: Callable[[torch.Tensor], torch.Tensor]
    ) -> list[TokenLogprob]:
        """``TokenLogprob`` of each ``targets[i]`` (with the ``k`` most likely tokens) under
        ``logits(hidden[i])``, ``PROMPT_LOGPROBS_ROWS`` rows at a time."""
        out: list[TokenLogprob] = []
        for begin in range(0, len(targets), PROMPT_LOGPROBS_ROWS):
            end = min(begin + PROMPT_LOGPROBS_ROWS, len(targets))
            raw = torch.log_softmax(logits(hidden[begin:end]).float(), dim=-1)
            chosen = to_device(targets[begin:end], raw.device, torch.long)
            out.extend(token_logprobs(raw, chosen, [k] * (end - begin)))
        return out
