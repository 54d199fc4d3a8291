"""Token sampling: greedy, temperature, top-k, top-p, with a per-request seeded generator."""

from __future__ import annotations

import torch

from engine.sampling_params import SamplingParams


class Sampler:
    """Picks one token per row of logits. Owns one ``torch.Generator`` per seeded request so a
    request's samples depend only on its seed, never on what it was batched with."""

    def __init__(self, device: torch.device):
        self.device = device
        self._generators: dict[str, torch.Generator] = {}

    def sample(self, logits: torch.Tensor, request_ids: list[str], params: list[SamplingParams]) -> list[int]:
        greedy = logits.argmax(dim=-1).tolist()
        out = []
        for row, (request_id, sp) in enumerate(zip(request_ids, params, strict=True)):
            if sp.greedy:
                out.append(greedy[row])
                continue
            probs = self._probs(logits[row], sp)
            out.append(int(torch.multinomial(probs, 1, generator=self._generator(request_id, sp)).item()))
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
