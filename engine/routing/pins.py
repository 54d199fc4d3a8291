"""Cluster-wide pinned prefixes: kept resident on ``replicas`` workers, within a block budget.

A pin names a token prefix by its chained block hashes and a length ``L`` (aligned to the
coordinators' LCM block size). Holding it costs every holder the blocks a hit at ``L`` needs in
every group (``blocks_needed_at(L)``: the whole full-attention prefix, one window per sliding
group, one Mamba state), which is what ``HybridCoordinator.pin_prefix`` pins there, in the pin's
``tier``: "device" (the holder keeps it in device memory; under pressure its device gives the
blocks up into its host tier still pinned, and a hit promotes them and pins them again) or
"host" (the holder keeps it in its host tier only, where pressure never evicts it).

Whether a holder still holds a pin is one rule, ``PinTable.key_tier``, read from the holder's
events in both tiers (docs/architecture.md, "The hybrid KV cache": pins in the host tier): a
needed (group, hash) of a device-tier pin is held on the device while the device pins it
explicitly, else in the host tier while the host tier has it (where the holder keeps it pinned);
one of a host-tier pin is held while the host tier has it. A holder holds a pin while every
needed key is held, and keeps it in the host tier (``holder_tier``) while some key is held only
there. So a device-tier pin whose holder offloaded it stays on that holder, in its host tier,
until a hit promotes it back; only a key gone from both tiers loses the holder.

Holder life cycle (per pin, per worker)::

    (choose) --PinOn--> PENDING --pin_result(pinned == L)--> ACTIVE
                           |                                   | events: a needed key of this pin
                           | pinned < L / timeout               | is no longer held (key_tier),
                           v                                   | cache cleared, worker removed
                        failed (retry elsewhere; Unpin)  <-----+  (Unpin; re-establish elsewhere)

The table is pure bookkeeping: it emits ``PinOn`` / ``Unpin`` actions and never talks to workers.
It keeps the pins (``Pin`` records), their budget and the lookup by prefix, and moves holders
through the life cycle above: ``fill`` adds PENDING holders, ``on_result`` and ``verify`` settle
them from pin results, ``on_lost``, ``on_cleared``, ``on_worker_removed`` and ``expire`` drop
them, with the back-off and per-worker block accounting that goes with it. The traffic counting
behind automatic pins is ``HotPrefixes`` in ``engine.routing.hot_prefixes``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from engine.kv_cache.block_queue import TIER_EXPLICIT
from engine.kv_cache.coordinator_types import PinTier
from engine.routing.index import GroupHash, PrefixIndex
from engine.routing.types import (
    Action,
    PinCapacityError,
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
    watched for it there (the pin's ``needed`` once ACTIVE) and the event seq to verify against
    (None once verified)."""

    state: str
    since: float
    watch: list[GroupHash] = field(default_factory=list)
    verify_seq: int | None = None


@dataclass
class Pin:
    """A cluster pin: its prefix (chained ``block_hashes``, ``length`` aligned tokens), the keys a
    holder must keep (``needed``, ``blocks_per_replica`` of them), how many holders it wants, the
    tier they keep it in, and per worker its holders and recent failures, with the back-off state
    after losses."""

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
    tier: PinTier = "device"
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

    def info(self, holder_tiers: dict[WorkerId, PinTier]) -> PinInfo:
        """A view of the pin; ``holder_tiers``: where each active holder keeps it now."""
        return PinInfo(
            self.pin_id,
            self.length,
            self.replicas,
            self.blocks_per_replica,
            self.active(),
            [w for w, h in self.holders.items() if h.state == PENDING],
            self.expires_at,
            self.auto,
            self.tier,
            holder_tiers,
        )


#: chooser(pin, exclude) -> the best new holder, or None when no worker can take it.
Chooser = Callable[[Pin, set[WorkerId]], WorkerId | None]


class PinTable:
    """Owns all cluster pins, their holders, the lookup by prefix key (``by_key``), the watch map
    from (worker, group, hash) to pins, and the budget accounting (``capacity_blocks`` for explicit
    pins; auto pins have their own budget).

    Invariants: a pin has at most ``replicas`` holders, each PENDING or ACTIVE; an ACTIVE holder
    holds every ``needed`` key of its pin by ``key_tier`` as far as the index has seen (checked
    when the index reaches its ``verify_seq``, then on each event touching a key); ``used_blocks`` /
    ``auto_blocks`` is the sum of ``blocks_per_replica * replicas`` over the explicit / automatic
    pins; ``worker_blocks[w]`` is the sum of ``blocks_per_replica`` over the pins ``w`` holds
    (``auto_worker_blocks[w]``: over the automatic ones); ``watch[w][key]`` holds a pin's id iff
    ``w`` is an ACTIVE holder of it and ``key`` is in its ``needed``, with no empty entry; a
    dropped holder yields an ``Unpin`` unless nothing can be pinned there (a removed worker, a
    result of 0 tokens); no holder is added before the pin's ``retry_at``.
    """

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
        self._retired: dict[int, tuple[list[bytes], int, PinTier]] = {}  # removed pins, for late PinOn results

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
        tier: PinTier = "device",
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
            tier,
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
            self._retired[pin.pin_id] = (pin.block_hashes, pin.length, pin.tier)
        return [self._drop_holder(pin, worker) for worker in list(pin.holders)]

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
            actions.append(PinOn(worker, pin.pin_id, pin.block_hashes, pin.length, pin.token_ids, source, pin.tier))
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
                return [Unpin(worker, pin_id, pin.block_hashes, pin.length, pin.tier)]
            retired = self._retired.get(pin_id)
            return [Unpin(worker, pin_id, *retired)] if retired is not None else []
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
        return self._settled(pin, now)

    def _settled(self, pin: Pin, now: float) -> list[Action]:
        """A holder of ``pin`` became ACTIVE: note when the pin has all its replicas again."""
        if len(pin.active()) >= pin.replicas:
            pin.full_since = now
            if pin.short_since is not None:
                self.recoveries.append((pin.pin_id, pin.short_since, now))
                pin.short_since = None
        return []

    def verify(self, worker: WorkerId, now: float) -> list[GroupHash]:
        """Keys of ACTIVE holders on ``worker`` that ``key_tier`` says it does not hold (checked
        once the index has caught up with the event seq reported with the pin result)."""
        if worker not in self.index:
            return []
        last = self.index.last_seq(worker)
        missing: list[GroupHash] = []
        for pin in self.pins.values():
            holder = pin.holders.get(worker)
            if holder is None or holder.state != ACTIVE or holder.verify_seq is None or holder.verify_seq > last:
                continue
            holder.verify_seq = None
            missing.extend(key for key in pin.needed if self.key_tier(worker, pin.tier, key) is None)
        return missing

    # -- the holding rule -------------------------------------------------------------------------------
    def key_tier(self, worker: WorkerId, tier: PinTier, key: GroupHash) -> PinTier | None:
        """Where ``worker`` holds ``key`` (one of a pin's ``needed``) for a pin of ``tier``, as its
        events say; None: not held. A device-tier pin's key is held on the device while the device
        pins it explicitly, else in the host tier while the host tier has it (the coordinator
        offloads a device-tier pin's demoted blocks pinned and pins every host copy of a pinned
        key); a host-tier pin's key only in the host tier."""
        g, block_hash = key
        index = self.index
        if tier == "device" and index.pin_level(worker, g, block_hash) == TIER_EXPLICIT:
            return "device"
        if index.host.holds(index.slot_of(worker), g, block_hash):
            return "host"
        return None

    def holder_tier(self, worker: WorkerId, pin: Pin) -> PinTier | None:
        """Where ``worker`` keeps ``pin`` now: "device" when every needed key is held there,
        "host" when every one is held and some only in the host tier, None when some is not."""
        if worker not in self.index:
            return None
        where: PinTier = "device"
        for key in pin.needed:
            tier = self.key_tier(worker, pin.tier, key)
            if tier is None:
                return None
            if tier == "host":
                where = "host"
        return where

    def info(self, pin: Pin) -> PinInfo:
        """A view of ``pin`` with the tier each active holder keeps it in (``holder_tier``; the
        pin's tier while the index has not yet seen a new holder's blocks)."""
        tiers: dict[WorkerId, PinTier] = {}
        for worker in pin.active():
            tiers[worker] = self.holder_tier(worker, pin) or pin.tier
        return pin.info(tiers)

    def on_lost(self, worker: WorkerId, keys: Sequence[GroupHash], now: float) -> list[Action]:
        """Events on ``worker`` touched these watched keys (a pin or a cache entry left one of its
        tiers): every pin needing one that ``key_tier`` no longer finds held loses this holder.
        Called once the whole batch of events is applied, so a block the device gave up and its
        host tier took in the same batch is still held."""
        watch = self.watch.get(worker)
        if not watch:
            return []
        hit: set[int] = set()
        for key in set(keys):
            for pin_id in watch.get(key, ()):
                pin = self.pins.get(pin_id)
                if pin is not None and pin_id not in hit and self.key_tier(worker, pin.tier, key) is None:
                    hit.add(pin_id)
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
        return Unpin(worker, pin.pin_id, pin.block_hashes, pin.length, pin.tier)

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


__all__ = ["ACTIVE", "PENDING", "Chooser", "Pin", "PinTable"]
