"""The trace of ``benchmarks/kv_cache_vs_vllm.py`` and the configurations it is replayed under.

Owns drive.py's trace parameters (they must stay equal on both sides for the comparison to hold),
the two retention configurations (``RETENTION``: the pinned tier of ``pinned_hit_rate``;
``NO_RETENTION``), the timed call names (``CALLS``), the deterministic trace itself
(``make_trace``), its hit-rate ceiling (``max_token_hit_rate``) and the KV cache groups of each
kind (``make_groups``).
"""

from __future__ import annotations

import random

from engine.kv_cache import (
    FullAttentionSpec,
    KVCacheGroup,
    RetentionOptions,
    SlidingWindowSpec,
)

# -- trace parameters: drive.py's defaults (they must stay equal for the comparison to hold) --------
VOCAB = 30000
SEED = 0
NUM_PREFIXES = 20
PREFIX_LEN = 1024
SUFFIX_LEN = 256
DECODE_STEPS = 32
BLOCK_SIZE = 16
WINDOW = 32
NUM_BLOCKS = 2048

# The one retention configuration behind ``pinned_hit_rate``: the engine's default tier (no cap, so
# the retained tier may hold the whole pool and is demoted oldest-first under allocation pressure).
# Retained on this trace: each request's shared full-attention prefix at free time, and the
# sliding-window anchors at the 1024-token junction when the prefill-to-decode drop releases them.
# Measured (2000 requests, C=1 / C=16, hit rates are deterministic): cap 256 -> 0.560 / 0.433,
# cap 1024 -> 0.702 / 0.713, no cap -> 0.782 / 0.713 (ceiling 0.792).
RETENTION = RetentionOptions(enabled=True, budget_blocks=None, pin_sliding_window=True, min_drop_blocks=2)
NO_RETENTION = RetentionOptions(enabled=False)

CALLS = ("lookup", "prefill_alloc", "decode_alloc", "free")

Trace = list[tuple[int, list[int]]]


# -- trace ----------------------------------------------------------------------------------------
def make_trace(num_requests: int, seed: int = SEED) -> tuple[list[list[int]], Trace]:
    """Prefixes and (prefix index, suffix) per request, drawing from the rng in drive.py's order."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(VOCAB) for _ in range(PREFIX_LEN)] for _ in range(NUM_PREFIXES)]
    trace: Trace = []
    for i in range(num_requests):
        p = rng.randrange(NUM_PREFIXES)
        suffix = [VOCAB + i] + [rng.randrange(VOCAB) for _ in range(SUFFIX_LEN - 1)]
        trace.append((p, suffix))
    return prefixes, trace


def max_token_hit_rate(trace: Trace) -> float:
    """Every reuse of a prefix hits all of it; first uses hit nothing."""
    first_uses = len({p for p, _ in trace})
    return (len(trace) - first_uses) * PREFIX_LEN / (len(trace) * (PREFIX_LEN + SUFFIX_LEN))


def make_groups(kind: str) -> list[KVCacheGroup]:
    full = KVCacheGroup(FullAttentionSpec(BLOCK_SIZE), ("layer.full",))
    if kind == "full":
        return [full]
    if kind == "hybrid":
        swa = SlidingWindowSpec(BLOCK_SIZE, window=WINDOW)
        return [full, KVCacheGroup(swa, ("layer.swa1",)), KVCacheGroup(swa, ("layer.swa2",))]
    raise ValueError(f"kind: expected 'full' or 'hybrid' (got {kind!r})")
