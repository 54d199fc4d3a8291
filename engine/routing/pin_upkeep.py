"""The routing policy's pin upkeep: placing, re-placing and revising cluster-wide pins.

``PinKeeper`` is owned by ``RoutingPolicy`` (``policy.PinKeeper`` at ``RoutingPolicy.pin_keeper``):
the policy forwards its public pin calls (``pin``, ``unpin``, ``pin_result``, ``pin_info``,
``pin_configured``, ``tick``) here and asks ``fill`` to place pins short of replicas after a
membership change or a lost holder. Rules of choosing a holder and of automatic pinning are in
the docstrings below; the pin table itself (holders, states, capacity) is ``pins.PinTable``.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

from configs.schema import PinConfig, RouterConfig
from engine.kv_cache.coordinator_types import PinTier
from engine.kv_cache.hashing import block_hashes as hash_tokens
from engine.routing.hot_prefixes import HotPrefixes
from engine.routing.index import PrefixIndex
from engine.routing.pins import Pin, PinTable
from engine.routing.types import Action, PinInfo, Role, WorkerId


class PinKeeper:
    """The pin table (``pins``), the hot-prefix counts (``hot``, None without automatic pinning)
    and the automatic pins it made, with the rules that place them.

    It reads the policy's membership (``roles``, ``num_blocks``, ``candidates``) and load costs (``load_cost``)
    through the dicts it is given (the policy's own, never replaced) and draws ties from the
    policy's ``rng``. Invariant: a key is in ``_auto_pins`` / ``_auto_decode_pins`` exactly while
    its automatic pin exists in ``pins``."""

    def __init__(
        self,
        index: PrefixIndex,
        config: RouterConfig,
        rng: random.Random,
        roles: dict[WorkerId, Role],
        num_blocks: dict[WorkerId, int | None],
        load_cost: dict[WorkerId, float],
        candidates: Callable[[Role], list[WorkerId]],
    ):
        self.index = index
        self.rules = index.rules
        self.config = config
        self.rng = rng
        self._roles = roles
        self._num_blocks = num_blocks
        self._load_cost = load_cost
        self.candidates = candidates  # the workers that may hold a pin for a role
        self.pins = PinTable(index, config.pin_capacity_blocks)
        auto = config.auto_pin
        self.hot = HotPrefixes(self.rules.hash_block_size, self.rules.alignment) if auto.enabled else None
        self._auto_pins: dict[bytes, int] = {}  # hot prefix key -> pin id (prefill-capable workers)
        self._auto_decode_pins: dict[bytes, int] = {}  # the same on decode workers (P/D, on_decode_workers)
        self._last_auto: float | None = None

    def pin_configured(
        self, pins: Sequence[PinConfig], tokenize: Callable[[str], list[int]] | None, now: float
    ) -> None:
        """Pin the prefixes of ``router.pins`` (text needs ``tokenize``)."""
        for i, pin in enumerate(pins):
            if pin.token_ids is not None:
                tokens = list(pin.token_ids)
            elif tokenize is None:
                raise ValueError(f"router.pins.{i}.text: pinning text needs a tokenizer (pass tokenize=...)")
            else:
                tokens = tokenize(pin.text or "")
            self.pin(tokens, replicas=pin.replicas, ttl_s=pin.ttl_s, now=now)

    def pin(
        self,
        token_ids: Sequence[int] | None = None,
        *,
        block_hashes: Sequence[bytes] | None = None,
        num_tokens: int | None = None,
        replicas: int = 1,
        ttl_s: float | None = None,
        now: float = 0.0,
        pin_id: int | None = None,
        tier: PinTier = "device",
    ) -> tuple[int, list[Action]]:
        """Pin a prefix cluster-wide on ``replicas`` workers, optionally for ``ttl_s`` seconds
        (under ``pin_id`` when restoring a pin a restarted router had), each holder keeping it in
        ``tier`` (``HybridCoordinator.pin_prefix``).

        Give ``token_ids`` (then new holders can compute it) or ``block_hashes`` (+ ``num_tokens``;
        holders must already have it or copy it from another holder). Returns the pin id and the
        actions placing it. Raises ``PinCapacityError`` beyond ``pin_capacity_blocks``.
        """
        if token_ids is not None:
            hashes = hash_tokens(token_ids, self.rules.hash_block_size)
            length = len(token_ids) if num_tokens is None else min(num_tokens, len(token_ids))
        elif block_hashes is not None:
            hashes = list(block_hashes)
            length = num_tokens if num_tokens is not None else len(hashes) * self.rules.hash_block_size
        else:
            raise ValueError("pin: give token_ids or block_hashes")
        if self._roles and replicas > len(self.candidates("prefill")):
            raise ValueError(
                f"replicas: replicas={replicas} but only {len(self.candidates('prefill'))} workers can hold pins"
            )
        pin = self.pins.create(hashes, length, replicas, now, ttl_s, token_ids, pin_id=pin_id, tier=tier)
        return pin.pin_id, self.pins.fill(pin, now, self._choose_holder)

    def unpin(self, pin_id: int, now: float = 0.0) -> list[Action]:
        """Remove a pin everywhere (its capacity is released)."""
        for pinned in (self._auto_pins, self._auto_decode_pins):
            key = next((k for k, p in pinned.items() if p == pin_id), None)
            if key is not None:
                del pinned[key]
        return self.pins.remove(pin_id)

    def pin_result(
        self, worker: WorkerId, pin_id: int, pinned_tokens: int, now: float = 0.0, seq: int | None = None
    ) -> list[Action]:
        """A ``PinOn`` finished on ``worker``: ``pin_prefix`` returned ``pinned_tokens``; ``seq`` is
        the worker's last KV event number at that moment (lets the router verify the pin)."""
        actions = self.pins.on_result(worker, pin_id, pinned_tokens, now, seq)
        pin = self.pins.pins.get(pin_id)
        if pin is not None and pinned_tokens < pin.length:
            actions.extend(self.pins.fill(pin, now, self._choose_holder))
        if worker in self._roles:
            missing = self.pins.verify(worker, now)
            if missing:
                actions.extend(self.pins.on_lost(worker, missing, now))
                actions.extend(self.fill(now))
        return actions

    def pin_info(self) -> list[PinInfo]:
        """Every pin, with the tier each active holder keeps it in now (``PinTable.info``)."""
        return [self.pins.info(pin) for pin in self.pins.pins.values()]

    def fill(self, now: float) -> list[Action]:
        """Place every pin short of its replicas on its best new holders (``_choose_holder``)."""
        actions: list[Action] = []
        for pin in list(self.pins.pins.values()):
            if len(pin.holders) < pin.replicas:
                actions.extend(self.pins.fill(pin, now, self._choose_holder))
        return actions

    def _choose_holder(self, pin: Pin, exclude: set[WorkerId]) -> WorkerId | None:
        """Best new holder: a worker that already caches the prefix, then the one with the fewest
        pinned blocks, then the least loaded; never beyond ``pin_worker_fraction`` of its pool
        (for an explicit pin, counting explicit pins only: automatic ones give way, and the
        worker's pinned tier demotes the oldest under pressure)."""
        hits = self.index.predict(pin.block_hashes, pin.length)
        can_build = pin.token_ids is not None or bool(pin.active())
        best: tuple[int, int, float, float] | None = None
        choice: WorkerId | None = None
        for worker in self.candidates(pin.role):
            if worker in exclude:
                continue
            resident = hits.get(worker, 0) >= pin.length
            if not resident and not can_build:
                continue
            pinned = self.pins.worker_blocks.get(worker, 0)
            if not pin.auto:  # the user's pins come first: automatic ones are best effort
                pinned -= self.pins.auto_worker_blocks.get(worker, 0)
            limit = self._num_blocks.get(worker)
            if limit is not None and pinned + pin.blocks_per_replica > self.config.pin_worker_fraction * limit:
                continue
            key = (0 if resident else 1, pinned, self._load_cost.get(worker, 0.0), self.rng.random())
            if best is None or key < best:
                best, choice = key, worker
        return choice

    def tick(self, now: float) -> list[Action]:
        """Time-driven work: pin TTLs, PENDING timeouts, retries, automatic pinning."""
        actions = self.pins.expire(now)
        due = self._last_auto is None or now - self._last_auto >= self.config.auto_pin.interval_s
        if self.hot is not None and due:
            self._last_auto = now
            actions.extend(self._auto_pin(now))
        actions.extend(self.fill(now))
        return actions

    def _auto_pin(self, now: float) -> list[Action]:
        """Pin the hottest shared prefixes (>= ``auto_pin_min_requests`` recent requests) within
        the budget (``auto_pin_budget_blocks``, else ``auto_pin_budget_fraction`` of the
        prefill-capable workers' pools); unpin automatic pins that fell out of that set. With
        dedicated decode workers and ``auto_pin.on_decode_workers``, the same on the decode
        workers' caches (their own budget: that fraction of their pools)."""
        hot = self.hot
        assert hot is not None
        hot.decay(now)
        cfg = self.config.auto_pin
        actions = self._revise_auto(self._auto_pins, "prefill", now)
        if any(r == "prefill" for r in self._roles.values()) and cfg.on_decode_workers:
            actions.extend(self._revise_auto(self._auto_decode_pins, "decode", now))
        elif self._auto_decode_pins:
            for key in list(self._auto_decode_pins):
                actions.extend(self.pins.remove(self._auto_decode_pins.pop(key)))
        return actions

    def _revise_auto(self, pinned: dict[bytes, int], role: Role, now: float) -> list[Action]:
        """One revision of the automatic pins held by ``role``'s workers (``pinned``: key -> id)."""
        hot = self.hot
        assert hot is not None
        cfg = self.config.auto_pin
        holders = self.candidates(role)
        budget = cfg.budget_blocks or int(cfg.budget_fraction * sum(self._num_blocks.get(w) or 0 for w in holders))

        def rank(key: bytes) -> float:
            count = hot.counts[key].count
            return count * 1.5 if key in pinned else count  # hysteresis for current pins

        chosen: list[bytes] = []
        used = 0
        replicas = min(cfg.replicas, max(1, len(holders)))
        for key in sorted(hot.counts, key=rank, reverse=True):
            prefix = hot.counts[key]
            if prefix.count < cfg.min_requests and key not in pinned:
                break
            cost = self.pins.cost_blocks(prefix.block_hashes, prefix.length) * replicas
            if used + cost <= budget:
                chosen.append(key)
                used += cost
        actions: list[Action] = []
        keep = set(chosen)
        for key in [k for k in pinned if k not in keep]:
            actions.extend(self.pins.remove(pinned.pop(key)))
        for key in chosen:
            if key in pinned:
                continue
            prefix = hot.counts[key]
            pin = self.pins.create(prefix.block_hashes, prefix.length, replicas, now, auto=True, role=role)
            pinned[key] = pin.pin_id
            actions.extend(self.pins.fill(pin, now, self._choose_holder))
        return actions
