"""Hit leases: the cached blocks a request was routed here for, held from its arrival until its
admission, so the hit the router predicted is still there when the scheduler claims it.

A request routed to a worker on a predicted prefix hit waits in the scheduler's queue behind the
requests ahead of it; their allocations evict free cached blocks from the head of each pool's free
queue. Marking the predicted blocks as just used only moves them to the tail, which a burst of
allocations still reaches. A lease instead takes one reference on each block the hit needs (and
locks its host-tier blocks), exactly as a block table would: referenced blocks are in no free
queue, so nothing evicts them. The admission claims the same blocks through its own hit (the
hashes map to the same blocks): the scheduler ends the lease right before it looks the hit up
and allocates (nothing runs in between on the engine's thread), so the coordinator counts the
blocks as its own cache's, and takes it again when the admission has to wait.

A lease ends at the request's admission or abort, when it expires (``lease_s`` after it was taken:
a request that never reaches admission cannot pin blocks for ever), or when the scheduler breaks it
because a running request would otherwise be preempted or an admission could never fit (the
leases are then the only blocks left; see ``Scheduler``).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from engine.kv_cache.block_queue import Block
from engine.kv_cache.host_tier import HostTier
from engine.kv_cache.manager_base import SingleTypeManager
from engine.kv_cache.prefix_pins import FindHit

#: seconds a lease holds its blocks at most (a request normally reaches admission far sooner)
DEFAULT_LEASE_S = 60.0


@dataclass(slots=True)
class _Lease:
    """One request's held blocks: per group its device blocks in hit order (null blocks left
    out), its host-tier blocks in hit order, the tokens the hit covers and when it expires."""

    device: list[list[Block]]
    host: list[Block]
    num_tokens: int
    expires: float


class HitLeases:
    """The leases of one coordinator's requests (request id -> held blocks); the coordinator owns
    it (``HybridCoordinator.leases``) and the scheduler ends leases at admission.

    Invariants: each leased device block holds exactly one reference per lease naming it (so a
    leased block is in no free or pinned queue and is never evicted), each leased host block is
    locked once per lease (``references`` counts both for the coordinator's invariant check);
    ``release`` drops exactly what ``take`` added, tail first (the prefix's tail is evicted before
    its head afterwards); a request holds at most one lease.
    """

    def __init__(
        self,
        managers: list[SingleTypeManager],
        host: HostTier | None,
        find_hit: FindHit,
        lease_s: float = DEFAULT_LEASE_S,
    ):
        if lease_s <= 0:
            raise ValueError(f"lease_s: must be > 0 (got {lease_s})")
        self.managers = managers
        self.host = host
        self.find_hit = find_hit
        self.lease_s = lease_s
        self._leases: dict[str, _Lease] = {}  # request id -> its lease, oldest first
        #: leases that found fewer tokens cached than asked for (the router's prediction was stale)
        self.short = 0
        #: leases broken before their admission (their hit may be evicted after all)
        self.broken = 0
        #: leases that ran out before their admission
        self.expired = 0

    def __len__(self) -> int:
        return len(self._leases)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._leases

    def take(self, request_id: str, block_hashes: list[bytes], num_tokens: int, now: float) -> int:
        """Hold the cached blocks a hit of up to ``num_tokens`` tokens of ``block_hashes`` needs
        for ``request_id`` (replacing a lease it held); returns the tokens that hit covers now
        (0: nothing cached, nothing held). Reads the cache only through ``find_longest_cache_hit``,
        the rule the admission uses."""
        self.release(request_id)
        hit = self.find_hit(block_hashes, num_tokens)
        self.short += hit.num_tokens < num_tokens
        if hit.num_tokens <= 0:
            return 0
        host = self.host
        device: list[list[Block]] = []
        hosted_all: list[Block] = []
        for g, manager in enumerate(self.managers):
            blocks = [block for block in hit.blocks[g] if not block.is_null]
            if host is not None:
                hosted = [block for block in blocks if host.is_host(block)]
                host.lock(hosted)
                hosted_all.extend(hosted)
                blocks = [block for block in blocks if not host.is_host(block)]
            manager.pool.touch(blocks)
            device.append(blocks)
        self._leases[request_id] = _Lease(device, hosted_all, hit.num_tokens, now + self.lease_s)
        return hit.num_tokens

    def release(self, request_id: str) -> int:
        """End ``request_id``'s lease (its blocks go back to their free queues as just used, a
        prefix's tail first); the tokens it held (0: it held none)."""
        lease = self._leases.pop(request_id, None)
        if lease is None:
            return 0
        for manager, blocks in zip(self.managers, lease.device, strict=True):
            if blocks:
                manager.pool.free_blocks(blocks[::-1])
        if lease.host:
            assert self.host is not None, "only a coordinator with a host tier leases host blocks"
            self.host.unlock(lease.host[::-1])
        return lease.num_tokens

    def counters(self) -> dict[str, int]:
        """Leases held now, and those that came short, broke or expired so far (plain data)."""
        return {"held": len(self._leases), "short": self.short, "broken": self.broken, "expired": self.expired}

    def references(self) -> Counter[tuple[int, int]]:
        """(``Block.pool``, block id) -> references the leases hold (host blocks under their host
        pool's number), for the coordinator's invariant check."""
        refs: Counter[tuple[int, int]] = Counter()
        for lease in self._leases.values():
            for blocks in lease.device:
                refs.update((block.pool, block.block_id) for block in blocks)
            refs.update((block.pool, block.block_id) for block in lease.host)
        return refs

    def expire(self, now: float) -> list[str]:
        """End the leases taken more than ``lease_s`` before ``now``; their request ids."""
        gone = [rid for rid, lease in self._leases.items() if lease.expires <= now]
        for request_id in gone:
            self.release(request_id)
        self.expired += len(gone)
        return gone

    def break_newest(self, keep: str | None = None) -> str | None:
        """Break the most recent lease other than ``keep``'s (to let an allocation fit); its
        request id, or None when there is none to break."""
        for request_id in reversed(self._leases):
            if request_id != keep:
                self.release(request_id)
                self.broken += 1
                return request_id
        return None
