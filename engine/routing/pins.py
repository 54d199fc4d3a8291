"""Cluster-wide pinned prefixes: kept resident on ``replicas`` workers, within a block budget.

A pin names a token prefix by its chained block hashes and a length ``L`` (aligned to the
coordinators' LCM block size). Holding it costs every holder the blocks a hit at ``L`` needs in
every group (``blocks_needed_at(L)``: the whole full-attention prefix, one window per sliding
group, one Mamba state), which is what ``HybridCoordinator.pin_prefix`` pins there.

Holder life cycle (per pin, per worker)::

    (choose) --PinOn--> PENDING --pin_result(pinned == L)--> ACTIVE
                           |                                   | events: a needed block of this pin
                           | pinned < L / timeout               | was unpinned (demoted) or removed,
                           v                                   | cache cleared, worker removed
                        failed (retry elsewhere; Unpin)  <-----+  (Unpin; re-establish elsewhere)

The table is pure bookkeeping: it emits ``PinOn`` / ``Unpin`` actions and never talks to workers.

The table itself (this module) keeps the pins, their budget and the lookup by prefix; the
holders' life cycle is its ``PinHolders`` mixin in ``pin_holders`` (with ``Pin``), the traffic
counting behind automatic pins ``HotPrefixes`` in ``hot_prefixes``.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.routing.hot_prefixes import HotPrefix, HotPrefixes
from engine.routing.index import GroupHash, PrefixIndex
from engine.routing.pin_holders import ACTIVE, PENDING, Chooser, Pin, PinHolders
from engine.routing.types import (
    Action,
    PinCapacityError,
    Role,
    WorkerId,
)


class PinTable(PinHolders):
    """All cluster pins, their holders, the watch map from (worker, group, hash) to pins, and the
    budget accounting (``capacity_blocks`` for explicit pins; auto pins have their own budget)."""

    def __init__(
        self,
        index: PrefixIndex,
        capacity_blocks: int | None = None,
        pending_timeout_s: float = 120.0,
        retry_after_s: float = 10.0,
        backoff_s: float = 5.0,
        max_backoff_s: float = 120.0,
        stable_s: float = 60.0,
    ):
        self.index = index
        self.capacity_blocks = capacity_blocks
        self.pending_timeout_s = pending_timeout_s
        self.retry_after_s = retry_after_s
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.stable_s = stable_s
        self.pins: dict[int, Pin] = {}
        self.by_key: dict[bytes, list[Pin]] = {}
        self.watch: dict[WorkerId, dict[GroupHash, set[int]]] = {}
        self.worker_blocks: dict[WorkerId, int] = {}  # pinned blocks per worker, all pins
        self.auto_worker_blocks: dict[WorkerId, int] = {}  # of which automatic pins'
        self.used_blocks = 0
        self.auto_blocks = 0
        self.recoveries: list[tuple[int, float, float]] = []  # (pin_id, short since, full again)
        self._next_id = 1
        self._retired: dict[int, tuple[list[bytes], int]] = {}  # removed pins, for late PinOn results

    # -- creation / removal ---------------------------------------------------------------------------
    def cost_blocks(self, block_hashes: Sequence[bytes], length: int) -> int:
        return len(self.index.rules.needed(block_hashes, length))

    def create(
        self,
        block_hashes: Sequence[bytes],
        num_tokens: int,
        replicas: int,
        now: float,
        ttl_s: float | None = None,
        token_ids: Sequence[int] | None = None,
        auto: bool = False,
        pin_id: int | None = None,
        role: Role = "prefill",
    ) -> Pin:
        """Register a pin (no holders yet; ``fill`` places them). Raises ``PinCapacityError`` when
        ``replicas`` copies would exceed the capacity, ValueError for an empty prefix or a taken
        ``pin_id`` (given when a restarted router restores a pin under the id clients know)."""
        if pin_id is not None and pin_id in self.pins:
            raise ValueError(f"pin_id: {pin_id} is already in use")
        rules = self.index.rules
        hbs = rules.hash_block_size
        length = rules.aligned(min(num_tokens, len(block_hashes) * hbs))
        if length <= 0:
            raise ValueError(
                f"pin: a prefix of {num_tokens} tokens ({len(block_hashes)} block hashes) is shorter than "
                f"one aligned block ({rules.alignment} tokens); nothing to pin"
            )
        if replicas < 1:
            raise ValueError(f"pin: replicas must be >= 1 (got {replicas})")
        hashes = list(block_hashes[: length // hbs])
        needed = rules.needed(hashes, length)
        cost = len(needed) * replicas
        if not auto and self.capacity_blocks is not None and self.used_blocks + cost > self.capacity_blocks:
            raise PinCapacityError(
                f"pin of {length} tokens x {replicas} replicas needs {cost} blocks "
                f"({len(needed)} per replica); {self.used_blocks} of the cluster pin capacity "
                f"{self.capacity_blocks} blocks are in use, {self.capacity_blocks - self.used_blocks} left "
                "(router.pin_capacity_blocks)"
            )
        pin = Pin(
            self._next_id if pin_id is None else pin_id,
            hashes,
            length,
            replicas,
            len(needed),
            tuple(token_ids[:length]) if token_ids is not None else None,
            now + ttl_s if ttl_s is not None else None,
            auto,
            needed,
            role,
            short_since=now,
        )
        self._next_id = max(self._next_id, pin.pin_id) + 1
        self.pins[pin.pin_id] = pin
        self.by_key.setdefault(pin.key, []).append(pin)
        if auto:
            self.auto_blocks += cost
        else:
            self.used_blocks += cost
        return pin

    def remove(self, pin_id: int) -> list[Action]:
        """Drop a pin: unpin it on every holder and release its budget. Unknown ids: no-op."""
        pin = self.pins.pop(pin_id, None)
        if pin is None:
            return []
        same = self.by_key[pin.key]
        same.remove(pin)
        if not same:
            del self.by_key[pin.key]
        cost = pin.blocks_per_replica * pin.replicas
        if pin.auto:
            self.auto_blocks -= cost
        else:
            self.used_blocks -= cost
        if any(h.state == PENDING for h in pin.holders.values()):
            self._retired[pin.pin_id] = (pin.block_hashes, pin.length)
        return [self._drop_holder(pin, worker) for worker in list(pin.holders)]

    # -- lookups ----------------------------------------------------------------------------------------
    def match(self, block_hashes: Sequence[bytes]) -> Pin | None:
        """The deepest pin whose prefix the request starts with. A pin is keyed by the hash of its
        last block, and hashes are chained, so any key among the request's hashes is a prefix of
        it; the intersection runs at C speed (one hash per block), the rest per match found."""
        by_key = self.by_key
        if not by_key:
            return None
        found = by_key.keys() & block_hashes
        if not found:
            return None
        # the deepest; at one depth an explicit pin before automatic ones (those never steer)
        return max((pin for key in found for pin in by_key[key]), key=lambda pin: (pin.length, not pin.auto))


__all__ = ["ACTIVE", "PENDING", "Chooser", "HotPrefix", "HotPrefixes", "Pin", "PinTable"]
