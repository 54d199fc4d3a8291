"""Per-type managers: one per KV-cache group, owning that group's block table per request.

Each manager answers the type's rules: which cached blocks make a hit at a given length
(``find_longest_cache_hit``), which leading blocks a request no longer needs
(``remove_skipped_blocks``), how many blocks an allocation will take, and how claimed hits and
external (transferred) tokens enter the table. Tables are append-only: a slot's block id never
changes except to the null block when the slot leaves the window.

Table index j covers tokens ``[j * block_size, (j + 1) * block_size)``.

The base lives in ``manager_base``, the attention types in ``attention_managers`` and the Mamba
type in ``mamba_manager``; this module maps each spec to its manager.
"""

from __future__ import annotations

from engine.kv_cache.attention_managers import (
    ChunkedLocalManager,
    FullAttentionManager,
    SlidingWindowManager,
)
from engine.kv_cache.mamba_manager import MambaManager
from engine.kv_cache.manager_base import SingleTypeManager
from engine.kv_cache.spec import (
    ChunkedLocalSpec,
    FullAttentionSpec,
    MambaSpec,
    SlidingWindowSpec,
)

MANAGER_FOR_SPEC: dict[type, type[SingleTypeManager]] = {
    FullAttentionSpec: FullAttentionManager,
    SlidingWindowSpec: SlidingWindowManager,
    ChunkedLocalSpec: ChunkedLocalManager,
    MambaSpec: MambaManager,
}
