"""The brute-force hit oracle: which blocks a hit at a length needs (``needed_blocks``), the largest
aligned length every group can serve (``oracle_hit``) and the check of a coordinator hit against it
(``check_hit``).
"""

from __future__ import annotations

from engine.kv_cache import CacheHit, CacheRequest, HybridCoordinator
from engine.kv_cache.attention_managers import ChunkedLocalManager, FullAttentionManager, SlidingWindowManager
from engine.kv_cache.mamba_manager import MambaManager
from engine.kv_cache.manager_base import SingleTypeManager
from kvfleet_testing.kv_cache_sim.log import SimLog
from kvfleet_testing.kv_cache_sim.records import cdiv


class HitOracle:
    """The hit rule of one coordinator, written out independently of the engine. Owns no state of
    its own: it reads the coordinator's managers (their ``cached`` maps) and pools. The oracle hit
    is the largest multiple of the alignment, at most the asked length, at which every
    participating group has all its needed blocks cached; ``hit_valid`` must agree with that rule
    at every length tried. A disagreement is reported through ``log.fail``."""

    def __init__(self, coord: HybridCoordinator, enable_caching: bool, log: SimLog) -> None:
        self._managers: list[SingleTypeManager] = coord.managers
        self._pools = coord.pools
        self._group_pool = coord.group_pool
        self._alignment = coord.alignment
        self._enable_caching = enable_caching
        self._has_mamba = any(isinstance(m, MambaManager) for m in self._managers)
        self._log = log

    @staticmethod
    def needed_blocks(m: SingleTypeManager, length: int) -> range:
        """Table indices whose cached blocks a hit at ``length`` needs (independent of the engine)."""
        bs = m.block_size
        end = length // bs
        if isinstance(m, FullAttentionManager):
            return range(end)
        if isinstance(m, SlidingWindowManager):
            need = cdiv(m.spec.window - 1, bs)
            return range(max(0, end - need), end)
        if isinstance(m, ChunkedLocalManager):
            chunk = m.spec.chunk_size
            return range(((length // chunk) * chunk) // bs, end)
        if isinstance(m, MambaManager):
            return range(end - 1, end) if end else range(0)
        raise TypeError(type(m))

    def oracle_hit(self, hashes: list[bytes], max_length: int, skip_mamba: bool) -> int:
        """Largest aligned L <= max_length at which every (participating) group's rule holds."""
        if not self._enable_caching or max_length <= 0:
            return 0
        groups = [
            (g, m, m.view(hashes))
            for g, m in enumerate(self._managers)
            if not (skip_mamba and isinstance(m, MambaManager))
        ]
        align = self._alignment
        for length in range(max_length - max_length % align, 0, -align):
            ok = True
            for g, m, view in groups:
                cached = m.cached
                mine = all(view[i] in cached for i in self.needed_blocks(m, length))
                if mine != m.hit_valid(view, length):
                    self._log.fail(f"group {g} hit_valid({length}) = {not mine} but the rule says {mine}")
                if not mine:
                    ok = False
                    break
            if ok:
                return length
        return 0

    def check_hit(self, req: CacheRequest, hit: CacheHit, max_length: int, skip_mamba: bool, what: str) -> None:
        """``hit`` (for ``req``, at most ``max_length`` tokens) is the oracle hit, with each group's
        list holding the cached block at every needed index and the null block elsewhere."""
        length = hit.num_tokens
        if length < 0 or length % self._alignment or length > max(max_length, 0):
            self._log.fail(f"{what} {req.request_id}: hit {length} not aligned to {self._alignment} or > {max_length}")
        expected = self.oracle_hit(req.block_hashes, max_length, skip_mamba)
        if length != expected:
            self._log.fail(
                f"{what} {req.request_id}: hit {length} tokens but the oracle says {expected} (max {max_length})"
            )
        if self._enable_caching and self._has_mamba and hit.partial != skip_mamba:
            self._log.fail(f"{what}: partial={hit.partial} for skip_mamba={skip_mamba}")
        if length and hit.shared_prefix_tokens < length:
            self._log.fail(f"{what}: shared_prefix_tokens {hit.shared_prefix_tokens} < hit {length}")
        for g, m in enumerate(self._managers):
            null = self._pools[self._group_pool[g]].null_block
            blocks = hit.blocks[g]
            if skip_mamba and isinstance(m, MambaManager):
                if blocks:
                    self._log.fail(f"{what}: skipped Mamba group {g} returned blocks")
                continue
            if len(blocks) != length // m.block_size:
                self._log.fail(f"{what}: group {g} list has {len(blocks)} blocks for a hit of {length}")
            view = m.view(req.block_hashes)
            needed = self.needed_blocks(m, length)
            for i, block in enumerate(blocks):
                if i in needed:
                    if block is null or block.block_hash != view[i] or m.cached.get(view[i]) is not block:
                        self._log.fail(f"{what}: group {g} index {i} of the hit is {block!r}, not the cached block")
                elif block is not null:
                    self._log.fail(f"{what}: group {g} index {i} outside the needed range holds {block!r}")
