"""The prefix-cache operations (each ends with ``check()``): explicit pins and their undo
(``pin``, ``pin_key``, ``unpin``, ``unpin_all``) and ``reset`` of the prefix cache.
"""

from __future__ import annotations

from collections import Counter

from engine.kv_cache import HybridCoordinator
from engine.kv_cache.block_queue import TIER_EXPLICIT
from engine.kv_cache.manager_base import SingleTypeManager
from kvfleet_testing.kv_cache_sim.checks import SimChecks
from kvfleet_testing.kv_cache_sim.log import SimLog
from kvfleet_testing.kv_cache_sim.oracle import HitOracle
from kvfleet_testing.kv_cache_sim.records import PinRecord
from kvfleet_testing.kv_cache_sim.request_book import RequestBook


class CacheOperations:
    """Explicit prefix pins and resets of one coordinator. Owns ``_pins`` (the ``pin_prefix`` calls
    not yet undone, in call order) and ``_held`` (per prefix, see ``pin_key``, how many of them are
    held). A pin pins exactly what the oracle hit at the pinned length needs; pins of one prefix are
    counted and released with the last unpin; a reset succeeds exactly when every block is free,
    and then forgets every pin."""

    def __init__(
        self, coord: HybridCoordinator, requests: RequestBook, oracle: HitOracle, checks: SimChecks, log: SimLog
    ) -> None:
        self._coord = coord
        self._managers: list[SingleTypeManager] = coord.managers
        self._pools = coord.pools
        self._requests = requests
        self._oracle = oracle
        self._checks = checks
        self._log = log
        self._pins: list[PinRecord] = []
        self._held: Counter[tuple] = Counter()  # pins that pinned something, per prefix (same arguments)

    def pin(self, source: int, length: int) -> str:
        reqs = [r.req for r in self._requests.known()]
        if not reqs:
            return "pin_none"
        req = reqs[source % len(reqs)]
        hashes = list(req.block_hashes)
        n = 1 + length % req.num_tokens
        pinned = self._coord.pin_prefix(hashes, n)
        self._log.note(f"pin_prefix({req.request_id}, {n}) -> {pinned}")
        expected = self._oracle.oracle_hit(hashes, n, False)
        if pinned != expected:
            self._log.fail(f"pin_prefix({req.request_id}, {n}) pinned {pinned} tokens, the oracle hit is {expected}")
        if pinned:
            for g, m in enumerate(self._managers):
                view = m.view(hashes)
                for i in self._oracle.needed_blocks(m, pinned):
                    block = m.cached.get(view[i])
                    if block is None or block.tier != TIER_EXPLICIT:
                        self._log.fail(f"pin_prefix({n}) -> {pinned}: group {g} index {i} is {block!r}, not pinned")
            self._log.tag("pin")
        else:
            self._log.tag("pin_nothing")
        self._pins.append(PinRecord(hashes, n, pinned))
        self._held[self.pin_key(hashes, n)] += 1  # every call counts, even one that pinned nothing
        self._checks.check()
        return "pin" if pinned else "pin_nothing"

    def pin_key(self, hashes: list[bytes], n: int) -> tuple:
        """Pins with the same token count over the same chain of full hash blocks are the same prefix."""
        full = min(n // self._coord.hash_block_size, len(hashes))
        return (n, hashes[full - 1] if full else b"")

    def unpin(self, index: int) -> str:
        if not self._pins:
            return "unpin_none"
        rec = self._pins.pop(index % len(self._pins))
        # The documented undo: the same arguments as the pin_prefix call.
        key = self.pin_key(rec.hashes, rec.num_tokens)
        # Pins of one prefix are counted; its blocks are released with the last unpin.
        expected = self._held[key] > 0
        if expected:
            self._held[key] -= 1
        held = self._coord.unpin_prefix(rec.hashes, rec.num_tokens)
        self._log.note(f"unpin_prefix(n={rec.num_tokens}) -> {held} (pinned {rec.pinned})")
        if held is not None and held != expected:
            self._log.fail(f"unpin_prefix(n={rec.num_tokens}) returned {held}, {expected} pins of that prefix are held")
        self._log.tag("unpin" if rec.pinned else "unpin_nothing")
        self._checks.check()
        return "unpin"

    def reset(self) -> str:
        idle = all(pool.num_free_blocks == pool.num_blocks - 1 for pool in self._pools)
        ok = self._coord.reset_prefix_cache()
        self._log.note(f"reset_prefix_cache -> {ok}")
        if ok != idle:
            self._log.fail(f"reset_prefix_cache() returned {ok} with idle={idle}")
        if ok:
            if any(m.cached for m in self._managers) or any(
                b.block_hash is not None or b.tier for pool in self._pools for b in pool.blocks
            ):
                self._log.fail("reset_prefix_cache left hashes or pins behind")
            self._pins.clear()
            self._held.clear()
            self._log.tag("reset")
        self._checks.check()
        return "reset" if ok else "reset_refused"

    def unpin_all(self) -> None:
        """Undo every pin still held, oldest first."""
        while self._pins:
            self.unpin(0)
