"""The mixed-length request mix and Hugging Face ``generate`` over it in left-padded batches: the
baseline side of ``benchmarks/engine_vs_hf.py`` (CPU) and ``benchmarks/engine_gpu.py`` (GPU).

``workload`` draws the requests (prompt lengths uniform in [64, 1024], output lengths uniform in
[16, 256], token ids in [3, vocab), seeded); ``generate_batch`` runs one batch greedily with every
row kept going to the batch's longest max_tokens (EOS suppressed), so each request's own
max_tokens of output is a prefix of its row.
"""

from __future__ import annotations

import random
from typing import Any

import torch


def workload(
    num_requests: int,
    vocab: int,
    seed: int,
    prompt_lens: tuple[int, int] = (64, 1024),
    output_lens: tuple[int, int] = (16, 256),
) -> list[tuple[list[int], int]]:
    """``num_requests`` (prompt token ids, max_tokens) pairs; the defaults are the mixed-length mix."""
    rng = random.Random(seed)
    out = []
    for _ in range(num_requests):
        prompt_len = rng.randint(*prompt_lens)
        out.append(([rng.randrange(3, vocab) for _ in range(prompt_len)], rng.randint(*output_lens)))
    return out


def left_padded(
    group: list[tuple[list[int], int]], pad: int, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompts of ``group`` as left-padded ``input_ids`` and their ``attention_mask``."""
    width = max(len(p) for p, _ in group)
    ids = torch.full((len(group), width), pad, dtype=torch.long)
    mask = torch.zeros((len(group), width), dtype=torch.long)
    for row, (prompt, _) in enumerate(group):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    return ids.to(device), mask.to(device)


def generate_batch(model: Any, group: list[tuple[list[int], int]], pad: int, new_tokens: int | None = None) -> Any:
    """Greedy ``model.generate`` of one left-padded batch on the model's device: exactly
    ``new_tokens`` new tokens per row (default: the group's longest max_tokens)."""
    ids, mask = left_padded(group, pad, model.device)
    longest = new_tokens if new_tokens is not None else max(m for _, m in group)
    with torch.inference_mode():
        return model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=longest,
            min_new_tokens=longest,
            do_sample=False,
            pad_token_id=pad,
        )
