"""Explicit prefix pins of one coordinator: which prefixes are pinned, how often, in which tier,
and how many pins hold each (group, block hash).

A prefix pin holds, in every group, the blocks a hit at the prefix's end needs
(``SingleTypeManager.blocks_needed_at``). ``tier="device"`` keeps them in their device pool's
explicit tier (and their host copies pinned); ``tier="host"`` keeps them pinned in the host tier
only (docs/architecture.md, "The hybrid KV cache").
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from engine.kv_cache.block_pool import TIER_EXPLICIT, Block
from engine.kv_cache.coordinator_types import PIN_TIERS, CacheHit, PinTier
from engine.kv_cache.host_tier import HostTier
from engine.kv_cache.manager_base import SingleTypeManager

FindHit = Callable[[list[bytes], int], CacheHit]  # (block hashes, max length) -> the hit over both tiers


class _PrefixPin:
    """Explicit pins of one prefix in one tier: how many are held, and every (group, hash) they
    pinned."""

    __slots__ = ("blocks", "count")

    def __init__(self) -> None:
        self.count = 0
        self.blocks: set[tuple[int, bytes]] = set()


class PrefixPins:
    """Owns the coordinator's prefix-pin records and the per-(group, hash) pin counts.

    Invariants (``engine.kv_cache.invariants``): a device block is explicitly pinned in its pool
    only while some device-tier record lists it (the pool demotes pins under pressure), a host
    block exactly while some record of either tier does; ``device[key]`` / ``host[key]`` equal
    the number of device- / host-tier records listing ``key``; ``clear`` empties all three.
    Pins of one prefix (same hashes, ``num_tokens`` and tier) are counted: the blocks stay pinned
    until as many ``unpin`` calls as there were ``pin`` calls.
    """

    def __init__(
        self,
        managers: list[SingleTypeManager],
        group_pool: list[int],
        hash_block_size: int,
        host: HostTier | None,
        find_hit: FindHit,
    ) -> None:
        self.managers = managers
        self.group_pool = group_pool
        self.num_pools = max(group_pool) + 1
        self.hash_block_size = hash_block_size
        self.host = host
        self.find_hit = find_hit
        self.device: Counter[tuple[int, bytes]] = Counter()  # device-tier pins per (group, hash)
        self.host_counts: Counter[tuple[int, bytes]] = Counter()  # host-tier pins per (group, hash)
        self.records: dict[tuple[int, bytes, PinTier], _PrefixPin] = {}

    def is_pinned(self, group: int, block_hash: bytes) -> bool:
        """Whether a prefix pin of either tier holds (group, hash) (the host tier pins it there)."""
        key = (group, block_hash)
        return key in self.device or key in self.host_counts

    def pinned_on_device(self, group: int, block_hash: bytes) -> bool:
        """Whether a device-tier prefix pin holds (group, hash)."""
        return (group, block_hash) in self.device

    def pin(self, block_hashes: list[bytes], num_tokens: int, tier: PinTier) -> int:
        """One pin of the prefix in ``tier``; the pinned length (``HybridCoordinator.pin_prefix``)."""
        if tier not in PIN_TIERS:
            raise ValueError(f"tier: must be one of {', '.join(PIN_TIERS)} (got {tier!r})")
        host = self.host
        if tier == "host" and host is None:
            raise ValueError("tier: 'host' needs a host tier (kv_cache.offload.enabled; got tier='host')")
        record = self.records.setdefault(self._key(block_hashes, num_tokens, tier), _PrefixPin())
        record.count += 1
        hit = self.find_hit(block_hashes, num_tokens)
        if hit.num_tokens == 0:
            return 0
        needed = [[hit.blocks[g][i] for i in m.blocks_needed_at(hit.num_tokens)] for g, m in enumerate(self.managers)]
        if tier == "host":
            return hit.num_tokens if self._pin_in_host(record, needed) else 0
        for g, blocks in enumerate(needed):
            hashes = self._record(record, g, blocks, self.device)
            self.managers[g].pool.retain([b for b in blocks if not HostTier.is_host(b)], TIER_EXPLICIT)
            if host is not None:
                host.pin(self.group_pool[g], g, hashes)
        return hit.num_tokens

    def unpin(self, block_hashes: list[bytes], num_tokens: int, tier: PinTier) -> bool:
        """Undo one ``pin`` with the same arguments; False if the prefix is not pinned there."""
        if tier not in PIN_TIERS:
            raise ValueError(f"tier: must be one of {', '.join(PIN_TIERS)} (got {tier!r})")
        key = self._key(block_hashes, num_tokens, tier)
        record = self.records.get(key)
        if record is None:
            return False
        record.count -= 1
        if record.count:
            return True
        del self.records[key]
        counts = self.device if tier == "device" else self.host_counts
        release: dict[int, list[Block]] = {}
        release_host: dict[int, list[bytes]] = {}
        for block_key in record.blocks:
            count = counts[block_key] - 1
            if count > 0:
                counts[block_key] = count
                continue
            del counts[block_key]
            g, block_hash = block_key
            if tier == "device":
                block = self.managers[g].cached.get(block_hash)
                if block is not None:
                    release.setdefault(g, []).append(block)
            if self.host is not None and not self.is_pinned(g, block_hash):
                release_host.setdefault(g, []).append(block_hash)
        for g, blocks in release.items():
            self.managers[g].pool.release_tier(blocks, TIER_EXPLICIT)
        if self.host is not None:
            for g, hashes in release_host.items():
                self.host.release(self.group_pool[g], g, hashes)
        return True

    def clear(self) -> None:
        """Forget every pin (the pools forget their pinned tiers themselves)."""
        self.device.clear()
        self.host_counts.clear()
        self.records.clear()

    def _key(self, block_hashes: list[bytes], num_tokens: int, tier: PinTier) -> tuple[int, bytes, PinTier]:
        full = min(num_tokens // self.hash_block_size, len(block_hashes))
        return num_tokens, block_hashes[full - 1] if full else b"", tier

    @staticmethod
    def _record(record: _PrefixPin, group: int, blocks: list[Block], counts: Counter[tuple[int, bytes]]) -> list[bytes]:
        """Count the (group, hash) of ``blocks`` the record does not list yet; returns their hashes."""
        hashes = []
        for block in blocks:
            if block.block_hash is None:  # never: hit blocks come from the prefix-cache maps
                continue
            block_key = (group, block.block_hash)
            hashes.append(block.block_hash)
            if block_key not in record.blocks:
                record.blocks.add(block_key)
                counts[block_key] += 1
        return hashes

    def _pin_in_host(self, record: _PrefixPin, needed: list[list[Block]]) -> bool:
        """A host-tier pin of the hit's ``needed`` blocks per group: pin the host copies, copy the
        device-only blocks into unpinned host blocks (pinned at once); False, pinning nothing,
        when some host pool has too few unpinned blocks for them."""
        host = self.host
        assert host is not None, "a host-tier pin needs a host tier"
        copies = [0] * self.num_pools  # device-only blocks to copy, per pool
        held = [0] * self.num_pools  # needed host copies in the LRU queue now (the copies must not evict them)
        for g, blocks in enumerate(needed):
            p = self.group_pool[g]
            hosted = host.pools[p].cached[g]
            for block in blocks:
                copy = block if HostTier.is_host(block) else hosted.get(block.block_hash)  # type: ignore[arg-type]  # hit blocks are cached
                if copy is None:
                    copies[p] += 1
                elif not copy.tier and not copy.ref_cnt:
                    held[p] += 1
        if any(copies[p] > host.room(p) - held[p] for p in range(self.num_pools)):
            return False
        for g, blocks in enumerate(needed):  # first the copies there (out of the LRU queue), then the rest
            host.pin(self.group_pool[g], g, self._record(record, g, blocks, self.host_counts))
        for g, blocks in enumerate(needed):
            p = self.group_pool[g]
            hosted = host.pools[p].cached[g]
            for block in blocks:
                if not HostTier.is_host(block) and block.block_hash not in hosted:
                    host.offload(p, block.block_id, g, block.block_hash)  # type: ignore[arg-type]  # cached
        return True
