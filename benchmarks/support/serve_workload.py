"""The workload of ``benchmarks/serve_bench.py``: shared-prefix prompts in text, and the pools sized for them.

Owns the request mix (``Workload``), its prompts (``build_prompts``: ``num_prefixes`` documents of
pseudo-words, each asked ``requests_per_prefix`` questions, shuffled once), the warm-up prompts
every run starts with (``warmup_prompts``) and the ``--set`` overrides that size every worker's
pool as the cluster benchmark does (``sized_overrides``).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

SYLLABLES = (
    "ka",
    "lo",
    "mi",
    "ten",
    "ra",
    "vo",
    "sel",
    "dun",
    "pa",
    "ri",
    "ost",
    "eh",
    "ul",
    "bor",
    "fi",
    "gan",
    "te",
    "zu",
    "ni",
    "mar",
    "so",
    "quil",
    "ad",
    "nor",
)


@dataclass(frozen=True)
class Workload:
    """The shared-prefix request mix, in text; lengths are measured with the model's tokenizer."""

    num_prefixes: int = 5
    requests_per_prefix: int = 16
    prefix_tokens: int = 256
    suffix_tokens: int = 16
    max_tokens: int = 8
    in_flight: int = 2
    cache_fraction: float = 0.5
    warmup: int = 2
    warm_prefixes: bool = True
    seed: int = 0


def _words(rng: random.Random, tokenizer: Any, lead: str, target_tokens: int) -> str:
    """``lead`` followed by pseudo-words, grown until it encodes to ``target_tokens`` or more."""
    text = lead
    while len(tokenizer.encode(text)) < target_tokens:
        text += " " + "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 3)))
    return text


def build_prompts(workload: Workload, tokenizer: Any) -> tuple[list[str], list[str]]:
    """The prefixes, and every prefix asked ``requests_per_prefix`` distinct questions, shuffled
    once (seeded)."""
    rng = random.Random(workload.seed)
    prefixes = [
        _words(rng, tokenizer, f"Document {i}.", workload.prefix_tokens) + "\n" for i in range(workload.num_prefixes)
    ]
    prompts = [
        prefix + _words(rng, tokenizer, f"Question {j}:", workload.suffix_tokens) + "?"
        for prefix in prefixes
        for j in range(workload.requests_per_prefix)
    ]
    rng.shuffle(prompts)
    return prefixes, prompts


def warmup_prompts(workload: Workload, tokenizer: Any, prefixes: list[str]) -> list[str]:
    """``warmup`` short unrelated prompts, then (``warm_prefixes``) each prefix once with a question
    of its own: every policy then starts measuring with each prefix computed once, as it placed
    it, so the p90 reflects the routing rather than the first sight of each prefix."""
    rng = random.Random(workload.seed + 1)
    prompts = [_words(rng, tokenizer, f"Warm-up {i}:", workload.suffix_tokens + 4) for i in range(workload.warmup)]
    if workload.warm_prefixes:
        prompts += [
            prefix + _words(rng, tokenizer, "Warm-up question:", workload.suffix_tokens) + "?" for prefix in prefixes
        ]
    return prompts


def sized_overrides(config: Any, workload: Workload, prompt_tokens: int, prefix_tokens: int) -> list[str]:
    """``--set`` overrides that size every worker's pool as the cluster benchmark does
    (``kvfleet_testing.sizing.sized_config``)."""
    from engine.core import resolve_model_directory
    from engine.model.arch.hf_config import arch_from_hf_config
    from engine.model.checkpoints.loader import read_hf_config
    from engine.model.kv_layout import build_kv_layout
    from kvfleet_testing.sizing import sized_config
    from kvfleet_testing.workloads import SharedPrefixWorkload

    arch = arch_from_hf_config(read_hf_config(resolve_model_directory(config)), config.model.sliding_window_override)
    dtype = "float32" if config.model.dtype == "auto" else config.model.dtype
    groups = list(build_kv_layout(arch, config.kv_cache.block_size, dtype).groups)
    shape = SharedPrefixWorkload(
        num_prefixes=workload.num_prefixes,
        prefix_tokens=prefix_tokens,
        suffix_tokens=prompt_tokens - prefix_tokens,
        max_tokens=workload.max_tokens,
        concurrency=workload.in_flight,
        cache_fraction=workload.cache_fraction,
    )
    kv = sized_config(config, shape, groups).kv_cache
    if kv == config.kv_cache:
        return []
    out = [f"kv_cache.num_blocks={kv.num_blocks}", "kv_cache.memory_budget_mib=null"]
    if kv.pinning.budget_blocks != config.kv_cache.pinning.budget_blocks:
        out.append(f"kv_cache.pinning.budget_blocks={kv.pinning.budget_blocks}")
    return out
