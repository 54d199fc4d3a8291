"""The part of a request the KV cache sees: its tokens, their block hashes and computed count."""

from __future__ import annotations

from collections.abc import Sequence

from engine.kv_cache.hashing import extend_block_hashes


class CacheRequest:
    """A request's token ids with chained block hashes kept in step (each block hashed once).

    ``num_computed_tokens`` is maintained by the scheduler; ``remote_prefill`` marks a request
    whose prompt KV arrives from a prefill worker (decode side of P/D), which lets attention
    groups keep their local hit when a Mamba group has no state there.
    """

    __slots__ = (
        "block_hashes",
        "cache_salt",
        "hash_block_size",
        "num_computed_tokens",
        "remote_prefill",
        "request_id",
        "token_ids",
    )

    def __init__(
        self,
        request_id: str,
        token_ids: Sequence[int],
        hash_block_size: int,
        cache_salt: str | None = None,
        remote_prefill: bool = False,
        block_hashes: list[bytes] | None = None,
    ):
        self.request_id = request_id
        self.token_ids = list(token_ids)
        self.hash_block_size = hash_block_size
        self.cache_salt = cache_salt
        self.num_computed_tokens = 0
        self.remote_prefill = remote_prefill
        if block_hashes is None:
            block_hashes = extend_block_hashes([], self.token_ids, hash_block_size, cache_salt)
        self.block_hashes = block_hashes

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def append_token_ids(self, token_ids: Sequence[int]) -> None:
        """Append generated tokens and hash any block they complete."""
        self.token_ids.extend(token_ids)
        if len(self.token_ids) >= (len(self.block_hashes) + 1) * self.hash_block_size:
            extend_block_hashes(self.block_hashes, self.token_ids, self.hash_block_size, self.cache_salt)

    def __repr__(self) -> str:
        return f"CacheRequest({self.request_id!r}, tokens={self.num_tokens}, computed={self.num_computed_tokens})"
