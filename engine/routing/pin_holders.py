"""A cluster pin's record (``Pin``) and its holders' life cycle: the ``PinTable`` methods that add
PENDING holders (``fill``), settle them from pin results (``on_result``, ``verify``), drop them on
lost blocks, cleared caches, removed workers and timeouts (``on_lost``, ``on_cleared``,
``on_worker_removed``, ``expire``), with the back-off and per-worker block accounting that goes
with it. The holder state diagram is in ``engine.routing.pins``' docstring.

Split out of ``engine.routing.pins``: ``PinHolders`` is a mixin of ``PinTable`` and owns no state.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from engine.routing.index import GroupHash, PrefixIndex
from engine.routing.types import (
    Action,
    PinInfo,
    PinOn,
    Role,
    Unpin,
    WorkerId,
)

PENDING = "pending"
ACTIVE = "active"


@dataclass
class _Holder:
    """One worker holding a pin: PENDING (``PinOn`` sent) or ACTIVE (pinned), since when, the keys
    watched for it there (the pin's ``needed`` once ACTIVE) and the event seq to verify against."""

    state: str
    since: float
    watch: list[GroupHash] = field(default_factory=list)
    verify_seq: int | None = None


@dataclass
class Pin:
    """A cluster pin: its prefix (chained ``block_hashes``, ``length`` aligned tokens), the keys a
    holder must keep (``needed``, ``blocks_per_replica`` of them), how many holders it wants, and
    per worker its holders and recent failures, with the back-off state after losses."""

    pin_id: int
    block_hashes: list[bytes]
    length: int
    replicas: int
    blocks_per_replica: int
    token_ids: tuple[int, ...] | None
    expires_at: float | None
    auto: bool
    needed: list[GroupHash]
    role: Role = "prefill"  # the pool its holders come from (decode: automatic pins in P/D only)
    holders: dict[WorkerId, _Holder] = field(default_factory=dict)
    failed: dict[WorkerId, float] = field(default_factory=dict)
    short_since: float | None = None
    losses: int = 0  # holders lost to memory pressure since the pin was last stable
    retry_at: float = 0.0  # no new holder before this time (back-off after such losses)
    full_since: float | None = None

    @property
    def key(self) -> bytes:
        return self.block_hashes[-1]

    def active(self) -> list[WorkerId]:
        return [w for w, h in self.holders.items() if h.state == ACTIVE]

    def info(self) -> PinInfo:
        return PinInfo(
            self.pin_id,
            self.length,
            self.replicas,
            self.blocks_per_replica,
            self.active(),
            [w for w, h in self.holders.items() if h.state == PENDING],
            self.expires_at,
            self.auto,
        )


#: chooser(pin, exclude) -> the best new holder, or None when no worker can take it.
Chooser = Callable[[Pin, set[WorkerId]], WorkerId | None]


class PinHolders:
    """The ``PinTable`` methods that move holders through their life cycle (mixin, no state of its own).

    Works on the table's ``pins``, ``watch``, ``worker_blocks``, ``auto_worker_blocks``,
    ``recoveries`` and ``_retired``, and reads its ``index`` and timing settings. Invariants: a pin
    has at most ``replicas`` holders, each PENDING or ACTIVE; ``worker_blocks[w]`` is the sum of
    ``blocks_per_replica`` over the pins ``w`` holds (``auto_worker_blocks[w]``: over the automatic
    ones); ``watch[w][key]`` holds a pin's id iff ``w`` is an ACTIVE holder of it and ``key`` is in
    its ``needed``, with no empty entry; a dropped holder yields an ``Unpin`` unless nothing can be
    pinned there (a removed worker, a result of 0 tokens); no holder is added before ``retry_at``.
    """

    # The table's state these methods work on (``PinTable.__init__`` creates it).
    index: PrefixIndex
    pending_timeout_s: float
    retry_after_s: float
    backoff_s: float
    max_backoff_s: float
    stable_s: float
    pins: dict[int, Pin]
    watch: dict[WorkerId, dict[GroupHash, set[int]]]
    worker_blocks: dict[WorkerId, int]
    auto_worker_blocks: dict[WorkerId, int]
    recoveries: list[tuple[int, float, float]]
    _retired: dict[int, tuple[list[bytes], int]]
    remove: Callable[[int], list[Action]]

    # -- holders ----------------------------------------------------------------------------------------
    def fill(self, pin: Pin, now: float, choose: Chooser) -> list[Action]:
        """Add PENDING holders until the pin has ``replicas`` (active + pending) or no worker fits
        (nothing while the pin backs off after losing holders to memory pressure)."""
        actions: list[Action] = []
        if now < pin.retry_at:
            return actions
        while len(pin.holders) < pin.replicas:
            exclude = set(pin.holders)
            exclude.update(w for w, t in pin.failed.items() if now - t < self.retry_after_s)
            worker = choose(pin, exclude)
            if worker is None:
                break
            source = next(iter(pin.active()), None)
            pin.holders[worker] = _Holder(PENDING, now)
            self._charge(worker, pin, pin.blocks_per_replica)
            actions.append(PinOn(worker, pin.pin_id, pin.block_hashes, pin.length, pin.token_ids, source))
        return actions

    def on_result(self, worker: WorkerId, pin_id: int, pinned: int, now: float, seq: int | None) -> list[Action]:
        """A holder's ``pin_prefix`` returned ``pinned`` tokens (``seq``: the worker's event seq then)."""
        pin = self.pins.get(pin_id)
        holder = pin.holders.get(worker) if pin is not None else None
        if pin is None or holder is None or holder.state != PENDING:
            # The pin (or this holder) was dropped while the PinOn was in flight: undo what it did.
            if pinned <= 0:
                return []
            if pin is not None:
                return [Unpin(worker, pin_id, pin.block_hashes, pin.length)]
            retired = self._retired.get(pin_id)
            return [Unpin(worker, pin_id, retired[0], retired[1])] if retired is not None else []
        if pinned < pin.length:
            pin.failed[worker] = now
            action = self._drop_holder(pin, worker)
            return [action] if pinned > 0 else []
        holder.state = ACTIVE
        holder.since = now
        holder.watch = pin.needed
        holder.verify_seq = seq
        watch = self.watch.setdefault(worker, {})
        for key in pin.needed:
            watch.setdefault(key, set()).add(pin.pin_id)
        if len(pin.active()) >= pin.replicas:
            pin.full_since = now
            if pin.short_since is not None:
                self.recoveries.append((pin.pin_id, pin.short_since, now))
                pin.short_since = None
        return []

    def verify(self, worker: WorkerId, now: float) -> list[GroupHash]:
        """Keys of ACTIVE holders on ``worker`` whose pin the index does not show (checked once the
        index has caught up with the event seq reported with the pin result)."""
        if worker not in self.index:
            return []
        last = self.index.last_seq(worker)
        missing: list[GroupHash] = []
        for pin in self.pins.values():
            holder = pin.holders.get(worker)
            if holder is None or holder.state != ACTIVE or holder.verify_seq is None or holder.verify_seq > last:
                continue
            holder.verify_seq = None
            for g, block_hash in pin.needed:
                if self.index.pin_level(worker, g, block_hash) != 2:
                    missing.append((g, block_hash))
        return missing

    def on_lost(self, worker: WorkerId, keys: Sequence[GroupHash], now: float) -> list[Action]:
        """Watched blocks on ``worker`` lost their pin or their cache entry: every pin needing one
        of them loses this holder."""
        watch = self.watch.get(worker)
        if not watch:
            return []
        hit: set[int] = set()
        for key in keys:
            hit.update(watch.get(key, ()))
        return self._lose(worker, hit, now)

    def on_cleared(self, worker: WorkerId, now: float) -> list[Action]:
        return self._lose(worker, {p.pin_id for p in self.pins.values() if worker in p.holders}, now)

    def on_worker_removed(self, worker: WorkerId, now: float) -> None:
        """The worker is gone: drop it from every pin without sending it anything."""
        for pin in self.pins.values():
            if worker in pin.holders:
                self._drop_holder(pin, worker)
                if pin.short_since is None:
                    pin.short_since = now
            pin.failed.pop(worker, None)
        self.watch.pop(worker, None)
        self.worker_blocks.pop(worker, None)
        self.auto_worker_blocks.pop(worker, None)

    def _lose(self, worker: WorkerId, pin_ids: set[int], now: float) -> list[Action]:
        actions: list[Action] = []
        for pin_id in pin_ids:
            pin = self.pins.get(pin_id)
            if pin is None or worker not in pin.holders:
                continue
            actions.append(self._drop_holder(pin, worker))
            pin.failed[worker] = now  # evicted under pressure there: prefer another worker
            if pin.short_since is None:
                pin.short_since = now
            # Memory pressure evicted it: re-establish at once the first time, then back off
            # exponentially while losses repeat, so pins cannot thrash a cluster short of memory.
            if pin.full_since is not None and now - pin.full_since >= self.stable_s:
                pin.losses = 0
            pin.full_since = None
            if pin.losses:
                pin.retry_at = now + min(self.max_backoff_s, self.backoff_s * 2 ** (pin.losses - 1))
            pin.losses += 1
        return actions

    def _charge(self, worker: WorkerId, pin: Pin, blocks: int) -> None:
        """Count ``blocks`` (negative: release) of ``pin`` against ``worker``."""
        self.worker_blocks[worker] = self.worker_blocks.get(worker, 0) + blocks
        if pin.auto:
            self.auto_worker_blocks[worker] = self.auto_worker_blocks.get(worker, 0) + blocks

    def _drop_holder(self, pin: Pin, worker: WorkerId) -> Action:
        holder = pin.holders.pop(worker)
        self._charge(worker, pin, -pin.blocks_per_replica)
        watch = self.watch.get(worker)
        if watch is not None:
            for key in holder.watch:
                ids = watch.get(key)
                if ids is not None:
                    ids.discard(pin.pin_id)
                    if not ids:
                        del watch[key]
        return Unpin(worker, pin.pin_id, pin.block_hashes, pin.length)

    def expire(self, now: float) -> list[Action]:
        """Remove pins past their TTL; time out PENDING holders that never reported."""
        actions: list[Action] = []
        for pin in [p for p in self.pins.values() if p.expires_at is not None and p.expires_at <= now]:
            actions.extend(self.remove(pin.pin_id))
        for pin in self.pins.values():
            for worker, holder in list(pin.holders.items()):
                if holder.state == PENDING and now - holder.since > self.pending_timeout_s:
                    pin.failed[worker] = now
                    actions.append(self._drop_holder(pin, worker))
        return actions
