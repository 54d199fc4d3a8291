"""Explicit prefix pins of a ``HybridCoordinator``, and the prefix-cache reset that forgets them.

A prefix pin keeps, in every group, the blocks a hit at the prefix's end needs in the pool's
explicit tier. Pins of one prefix are counted; a block several prefixes pin stays pinned until the
last of them is unpinned.
"""

from __future__ import annotations

from engine.kv_cache.block_pool import PIN_EXPLICIT, Block
from engine.kv_cache.events import AllBlocksCleared


class _PrefixPin:
    """Explicit pins of one prefix: how many are held, and every (group, hash) they pinned."""

    __slots__ = ("count", "blocks")

    def __init__(self) -> None:
        self.count = 0
        self.blocks: set[tuple[int, bytes]] = set()


class PrefixPins:
    """The ``HybridCoordinator`` methods that pin and unpin prefixes (mixin; state set up by its ``__init__``).

    Owns ``_prefix_pins`` (per prefix key: its pin count and every (group, hash) it pinned) and
    ``_explicit_pins`` (per (group, hash): how many prefixes pinned it). Invariants: a block is
    explicitly pinned in its pool while some prefix record lists it; ``_explicit_pins[key]``
    equals the number of records listing ``key``; ``reset_prefix_cache`` empties both.
    """


    # -- explicit prefix pins ------------------------------------------------------------------------------
    def pin_prefix(self, block_hashes: list[bytes], num_tokens: int) -> int:
        """Pin, in every group, the blocks a hit at the prefix's end needs; returns the pinned
        length (the longest aligned cached hit <= num_tokens; 0 if nothing is cached yet).

        Pins of one prefix (same hashes and ``num_tokens``) are counted: the blocks stay pinned
        until as many ``unpin_prefix`` calls with the same arguments as there were pins.
        """
        key = self._prefix_key(block_hashes, num_tokens)
        record = self._prefix_pins.setdefault(key, _PrefixPin())
        record.count += 1
        hit = self.find_longest_cache_hit(block_hashes, num_tokens)
        if hit.num_tokens == 0:
            return 0
        for g, manager in enumerate(self.managers):
            needed = [hit.blocks[g][i] for i in manager.blocks_needed_at(hit.num_tokens)]
            for block in needed:
                block_key = (g, block.block_hash)
                if block_key not in record.blocks:
                    record.blocks.add(block_key)  # type: ignore[arg-type]
                    self._explicit_pins[block_key] += 1  # type: ignore[index]
            manager.pool.pin(needed, PIN_EXPLICIT)
        return hit.num_tokens

    def unpin_prefix(self, block_hashes: list[bytes], num_tokens: int) -> bool:
        """Undo one ``pin_prefix(block_hashes, num_tokens)``; the prefix's blocks are released
        with its last pin, and blocks other prefixes' pins need stay pinned. False if not pinned."""
        key = self._prefix_key(block_hashes, num_tokens)
        record = self._prefix_pins.get(key)
        if record is None:
            return False
        record.count -= 1
        if record.count:
            return True
        del self._prefix_pins[key]
        release: dict[int, list[Block]] = {}
        for block_key in record.blocks:
            count = self._explicit_pins[block_key] - 1
            if count > 0:
                self._explicit_pins[block_key] = count
                continue
            del self._explicit_pins[block_key]
            block = self.managers[block_key[0]].cached.get(block_key[1])
            if block is not None:
                release.setdefault(block_key[0], []).append(block)
        for g, blocks in release.items():
            self.managers[g].pool.unpin(blocks, PIN_EXPLICIT)
        return True

    def _prefix_key(self, block_hashes: list[bytes], num_tokens: int) -> tuple[int, bytes]:
        full = min(num_tokens // self.hash_block_size, len(block_hashes))
        return num_tokens, block_hashes[full - 1] if full else b""

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash and pin in every pool; refused (False) while any pool has a
        block in use. One ``AllBlocksCleared`` event covers all pools."""
        if not all(pool.idle for pool in self.pools):
            return False
        for pool in self.pools:
            pool.clear_prefix_cache()
        self.events.emit(AllBlocksCleared(self.events.next_seq()))
        self._explicit_pins.clear()
        self._prefix_pins.clear()
        return True
