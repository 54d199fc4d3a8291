"""The brute-force hit oracle: which blocks a hit at a length needs (``needed_blocks``), the largest
aligned length every group can serve (``oracle_hit``) and the check of a coordinator hit against it
(``check_hit``).
"""

from __future__ import annotations

from engine.kv_cache import CacheHit, CacheRequest
from engine.kv_cache.attention_managers import ChunkedLocalManager, FullAttentionManager, SlidingWindowManager
from engine.kv_cache.mamba_manager import MambaManager
from engine.kv_cache.manager_base import SingleTypeManager
from kvfleet_testing.kv_cache_sim.records import cdiv


class HitOracle:
    """Mixin of ``Sim`` (owns no state): the oracle hit is the largest multiple of the alignment,
    at most the asked length, at which every participating group has all its needed blocks cached;
    ``hit_valid`` must agree with that rule at every length tried."""

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
        if not self.cfg.enable_caching or max_length <= 0:
            return 0
        groups = [
            (g, m, m.view(hashes))
            for g, m in enumerate(self.managers)
            if not (skip_mamba and isinstance(m, MambaManager))
        ]
        align = self.alignment
        for length in range(max_length - max_length % align, 0, -align):
            ok = True
            for g, m, view in groups:
                cached = m.cached
                mine = all(view[i] in cached for i in self.needed_blocks(m, length))
                if mine != m.hit_valid(view, length):
                    self.fail(f"group {g} hit_valid({length}) = {not mine} but the rule says {mine}")
                if not mine:
                    ok = False
                    break
            if ok:
                return length
        return 0

    def check_hit(self, req: CacheRequest, hit: CacheHit, max_length: int, skip_mamba: bool, what: str) -> None:
        length = hit.num_tokens
        if length < 0 or length % self.alignment or length > max(max_length, 0):
            self.fail(f"{what} {req.request_id}: hit {length} not aligned to {self.alignment} or > {max_length}")
        expected = self.oracle_hit(req.block_hashes, max_length, skip_mamba)
        if length != expected:
            self.fail(f"{what} {req.request_id}: hit {length} tokens but the oracle says {expected} (max {max_length})")
        if self.cfg.enable_caching and self.has_mamba and hit.partial != skip_mamba:
            self.fail(f"{what}: partial={hit.partial} for skip_mamba={skip_mamba}")
        if length and hit.shared_prefix_tokens < length:
            self.fail(f"{what}: shared_prefix_tokens {hit.shared_prefix_tokens} < hit {length}")
        for g, m in enumerate(self.managers):
            null = self.pools[self.group_pool[g]].null_block
            blocks = hit.blocks[g]
            if skip_mamba and isinstance(m, MambaManager):
                if blocks:
                    self.fail(f"{what}: skipped Mamba group {g} returned blocks")
                continue
            if len(blocks) != length // m.block_size:
                self.fail(f"{what}: group {g} list has {len(blocks)} blocks for a hit of {length}")
            view = m.view(req.block_hashes)
            needed = self.needed_blocks(m, length)
            for i, block in enumerate(blocks):
                if i in needed:
                    if block is null or block.block_hash != view[i] or m.cached.get(view[i]) is not block:
                        self.fail(f"{what}: group {g} index {i} of the hit is {block!r}, not the cached block")
                elif block is not null:
                    self.fail(f"{what}: group {g} index {i} outside the needed range holds {block!r}")
