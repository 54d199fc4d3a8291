"""Token sampling: greedy, temperature, top-k, top-p, with a per-request seeded generator.

A row that cannot be sampled (non-finite logits, probabilities torch refuses) fails only its own
request: ``sample`` reports it in ``SampledTokens.failures`` and samples every other row.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)


@dataclass
class SampledTokens:
    """One step's samples: the token of each request that sampled, and why each failed one did
    not (a request is in exactly one of the two)."""

    tokens: dict[str, int] = field(default_factory=dict)
    failures: dict[str, str] = field(default_factory=dict)


def greedy_or_failed(logits: torch.Tensor) -> list[int]:
    """Each row's argmax, or -1 where the row's maximum is not finite (a NaN anywhere in a row
    is its maximum: NaN propagates through both reductions). On CUDA one device-to-host read per
    step; on the CPU numpy's argmax (3-4x faster than torch's on [64, 4k-32k] fp32 logits)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        values = logits.detach().numpy()
        ids = values.argmax(axis=1)
        best = values[np.arange(values.shape[0]), ids]
        return np.where(np.isfinite(best), ids, -1).tolist()
    best, ids = logits.max(dim=-1)
    return torch.where(torch.isfinite(best), ids, -1).tolist()


class Sampler:
    """Picks one token per row of logits. Owns one ``torch.Generator`` per seeded request so a
    request's samples depend only on its seed, never on what it was batched with."""

    def __init__(self, device: torch.device):
        self.device = device
        self._generators: dict[str, torch.Generator] = {}

    def sample(self, logits: torch.Tensor, request_ids: list[str], params: list[SamplingParams]) -> SampledTokens:
        """One token per row; a row with non-finite logits, or one torch cannot sample from,
        fails its request alone (a NaN logit would otherwise be a silent argmax of 0)."""
        greedy = greedy_or_failed(logits)
        out = SampledTokens()
        tokens = out.tokens
        for row, (request_id, sp) in enumerate(zip(request_ids, params, strict=True)):
            token = greedy[row]
            if token < 0:
                out.failures[request_id] = "the model produced non-finite logits for this request"
                continue
            if sp.greedy:
                tokens[request_id] = token
                continue
            try:
                probs = self._probs(logits[row], sp)
                token = int(torch.multinomial(probs, 1, generator=self._generator(request_id, sp)).item())
            except RuntimeError as exc:  # e.g. probabilities torch refuses: this request only
                log.warning("sampling %s failed: %s", request_id, exc)
                first_line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                out.failures[request_id] = f"sampling failed: {first_line}"
                continue
            out.tokens[request_id] = int(token)
        return out

    def _probs(self, logits: torch.Tensor, sp: SamplingParams) -> torch.Tensor:
        logits = logits.float() / sp.temperature
        if sp.top_k:
            kth = torch.topk(logits, min(sp.top_k, logits.shape[-1])).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if sp.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            cumulative = torch.cumsum(sorted_probs, dim=-1)
            drop = cumulative - sorted_probs > sp.top_p  # keep the smallest set reaching top_p
            sorted_probs = sorted_probs.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
        return probs

    def _generator(self, request_id: str, sp: SamplingParams) -> torch.Generator | None:
        if sp.seed is None:
            return None
        gen = self._generators.get(request_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(sp.seed)
            self._generators[request_id] = gen
        return gen

    def forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)
