"""Chained block hashes: block i's hash fingerprints the whole prefix ``tokens[: (i + 1) * B]``.

``hash(parent, token ids, extra keys)`` with sha256 over a fixed byte encoding, so the same
tokens give the same hashes in every process (the router, prefill and decode workers all agree).
A cache salt enters the first block only, isolating tenants.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

ROOT_HASH = hashlib.sha256(b"kvfleet/block-hash/v1").digest()


def hash_block(parent: bytes, token_ids: Sequence[int], extra: bytes = b"") -> bytes:
    """Hash of one full block given its parent's hash, its token ids and optional extra keys."""
    payload = array("q", token_ids).tobytes()
    return hashlib.sha256(parent + payload + b"|" + extra).digest()


def extend_block_hashes(
    hashes: list[bytes], token_ids: Sequence[int], block_size: int, cache_salt: str | None = None
) -> list[bytes]:
    """Append the hashes of every newly completed full block of ``token_ids`` to ``hashes``.

    Hashing resumes at ``len(hashes) * block_size``, so calling this after each append hashes
    every block exactly once. Returns ``hashes``.
    """
    start = len(hashes) * block_size
    parent = hashes[-1] if hashes else ROOT_HASH
    for begin in range(start, len(token_ids) - block_size + 1, block_size):
        extra = cache_salt.encode() if (begin == 0 and cache_salt) else b""
        parent = hash_block(parent, token_ids[begin : begin + block_size], extra)
        hashes.append(parent)
    return hashes


def block_hashes(token_ids: Sequence[int], block_size: int, cache_salt: str | None = None) -> list[bytes]:
    """Hashes of all full blocks of ``token_ids``."""
    return extend_block_hashes([], token_ids, block_size, cache_salt)


def coarse_view(hashes: list[bytes], factor: int) -> list[bytes]:
    """Hashes at ``factor`` times the hash granularity: coarse block j is fine hash ``(j+1)*factor-1``,
    which already chains over the whole coarse prefix."""
    if factor == 1:
        return hashes
    return hashes[factor - 1 :: factor]
