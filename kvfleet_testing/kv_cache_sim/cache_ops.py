"""The prefix-cache operations (each ends with ``check()``): explicit pins and their undo
(``pin``, ``pin_key``, ``unpin``), ``reset`` of the prefix cache and ``drain``, which must leave
every pool whole with no explicit pin.
"""

from __future__ import annotations

from engine.kv_cache.block_queue import TIER_EXPLICIT
from kvfleet_testing.kv_cache_sim.records import PinRecord


class CacheOperations:
    """Mixin of ``Sim`` (owns no state; uses ``Sim.pins`` and ``Sim.held``): a pin pins exactly what
    the oracle hit at the pinned length needs; pins of one prefix are counted and released with the
    last unpin; a reset succeeds exactly when every block is free."""

    def pin(self, source: int, length: int) -> str:
        reqs = [r.req for r in self.reqs.values()] + [r.req for r in self.finished]
        if not reqs:
            return "pin_none"
        req = reqs[source % len(reqs)]
        hashes = list(req.block_hashes)
        n = 1 + length % req.num_tokens
        pinned = self.coord.pin_prefix(hashes, n)
        self.note(f"pin_prefix({req.request_id}, {n}) -> {pinned}")
        expected = self.oracle_hit(hashes, n, False)
        if pinned != expected:
            self.fail(f"pin_prefix({req.request_id}, {n}) pinned {pinned} tokens, the oracle hit is {expected}")
        if pinned:
            for g, m in enumerate(self.managers):
                view = m.view(hashes)
                for i in self.needed_blocks(m, pinned):
                    block = m.cached.get(view[i])
                    if block is None or block.tier != TIER_EXPLICIT:
                        self.fail(f"pin_prefix({n}) -> {pinned}: group {g} index {i} is {block!r}, not pinned")
            self.tag("pin")
        else:
            self.tag("pin_nothing")
        self.pins.append(PinRecord(hashes, n, pinned))
        self.held[self.pin_key(hashes, n)] += 1  # every call counts, even one that pinned nothing
        self.check()
        return "pin" if pinned else "pin_nothing"

    def pin_key(self, hashes: list[bytes], n: int) -> tuple:
        """Pins with the same token count over the same chain of full hash blocks are the same prefix."""
        full = min(n // self.coord.hash_block_size, len(hashes))
        return (n, hashes[full - 1] if full else b"")

    def unpin(self, index: int) -> str:
        if not self.pins:
            return "unpin_none"
        rec = self.pins.pop(index % len(self.pins))
        # The documented undo: the same arguments as the pin_prefix call.
        key = self.pin_key(rec.hashes, rec.num_tokens)
        # Pins of one prefix are counted; its blocks are released with the last unpin.
        expected = self.held[key] > 0
        if expected:
            self.held[key] -= 1
        held = self.coord.unpin_prefix(rec.hashes, rec.num_tokens)
        self.note(f"unpin_prefix(n={rec.num_tokens}) -> {held} (pinned {rec.pinned})")
        if held is not None and held != expected:
            self.fail(f"unpin_prefix(n={rec.num_tokens}) returned {held}, {expected} pins of that prefix are held")
        self.tag("unpin" if rec.pinned else "unpin_nothing")
        self.check()
        return "unpin"

    def reset(self) -> str:
        idle = all(pool.num_free_blocks == pool.num_blocks - 1 for pool in self.pools)
        ok = self.coord.reset_prefix_cache()
        self.note(f"reset_prefix_cache -> {ok}")
        if ok != idle:
            self.fail(f"reset_prefix_cache() returned {ok} with idle={idle}")
        if ok:
            if any(m.cached for m in self.managers) or any(
                b.block_hash is not None or b.tier for pool in self.pools for b in pool.blocks
            ):
                self.fail("reset_prefix_cache left hashes or pins behind")
            self.pins.clear()
            self.held.clear()
            self.tag("reset")
        self.check()
        return "reset" if ok else "reset_refused"

    def drain(self) -> str:
        """Abort everything, release every explicit pin: the pool must be whole again."""
        for r in list(self.reqs.values()):
            self.finish(r, "abort")
            self.check()
        while self.pins:
            self.unpin(0)
        for p, pool in enumerate(self.pools):
            if pool.num_free_blocks != pool.num_blocks - 1:
                self.fail(
                    f"after draining pool {p} has {pool.num_free_blocks} free blocks, expected {pool.num_blocks - 1}"
                )
            if any(b.ref_cnt for b in pool.blocks if not b.is_null):
                self.fail(f"after draining some block of pool {p} is still referenced")
        left = [b for pool in self.pools for b in pool.blocks if b.tier == TIER_EXPLICIT]
        explicit = sum(pool.explicit.size for pool in self.pools)
        # The coordinator's pin bookkeeping (``PrefixPins``) must be empty too.
        books = {"device pins": len(self.coord.pins.device), "pin records": len(self.coord.pins.records)}
        if left or explicit or any(books.values()):
            self.fail(
                f"after unpinning every pin: {len(left)} blocks still explicitly pinned, explicit tiers "
                f"{explicit}, pin bookkeeping {books}"
            )
        self.commit()
        self.scheduled.clear()
        self.preempted_this_step = False
        self.coord.new_step()
        self.check()
        self.tag("drain")
        return "drain"
