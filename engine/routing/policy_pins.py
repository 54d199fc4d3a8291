"""Pin upkeep of kvfleet's routing policy: configured, explicit and automatic pins, their holders.

A mixin of ``engine.routing.policy.RoutingPolicy`` (split out of it, not used alone): the pin
table (``engine.routing.pins.PinTable``) keeps the pins' state; this decides who holds them and
when the automatic ones change. Every method returns the actions the caller must execute.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from configs.schema import PinConfig, RouterConfig
from engine.kv_cache.hashing import block_hashes as hash_tokens
from engine.routing.pins import HotPrefixes, Pin, PinTable
from engine.routing.types import Action, PinInfo, Role, WorkerId


class PinMaintenance:
    """Places, re-places and revises pins for ``RoutingPolicy`` (state: the policy's ``pins``,
    ``hot`` and automatic-pin maps). Invariant: a key is in ``_auto_pins`` /
    ``_auto_decode_pins`` exactly while its automatic pin exists in ``pins``."""

    config: RouterConfig
    pins: PinTable
    hot: HotPrefixes | None
    rules: Any
    index: Any
    rng: Any
    roles: dict[WorkerId, Role]
    num_blocks: dict[WorkerId, int | None]
    _auto_pins: dict[bytes, int]
    _auto_decode_pins: dict[bytes, int]
    _last_auto: float | None
    _load_cost: dict[WorkerId, float]
    _disaggregated: bool
    _candidates: Callable[[Role], list[WorkerId]]

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
    ) -> tuple[int, list[Action]]:
        """Pin a prefix cluster-wide on ``replicas`` workers, optionally for ``ttl_s`` seconds
        (under ``pin_id`` when restoring a pin a restarted router had).

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
        if self.roles and replicas > len(self._candidates("prefill")):
            raise ValueError(
                f"replicas: replicas={replicas} but only {len(self._candidates('prefill'))} workers can hold pins"
            )
        pin = self.pins.create(hashes, length, replicas, now, ttl_s, token_ids, pin_id=pin_id)
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
        if worker in self.roles:
            missing = self.pins.verify(worker, now)
            if missing:
                actions.extend(self.pins.on_lost(worker, missing, now))
                actions.extend(self._fill_pins(now))
        return actions

    def pin_info(self) -> list[PinInfo]:
        return [pin.info() for pin in self.pins.pins.values()]

    def _fill_pins(self, now: float) -> list[Action]:
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
        for worker in self._candidates(pin.role):
            if worker in exclude:
                continue
            resident = hits.get(worker, 0) >= pin.length
            if not resident and not can_build:
                continue
            pinned = self.pins.worker_blocks.get(worker, 0)
            if not pin.auto:  # the user's pins come first: automatic ones are best effort
                pinned -= self.pins.auto_worker_blocks.get(worker, 0)
            limit = self.num_blocks.get(worker)
            if limit is not None and pinned + pin.blocks_per_replica > self.config.pin_worker_fraction * limit:
                continue
            key = (0 if resident else 1, pinned, self._load_cost.get(worker, 0.0), self.rng.random())
            if best is None or key < best:
                best, choice = key, worker
        return choice

    def tick(self, now: float) -> list[Action]:
        """Time-driven work: pin TTLs, PENDING timeouts, retries, automatic pinning."""
        actions = self.pins.expire(now)
        if self.hot is not None and (self._last_auto is None or now - self._last_auto >= self.config.auto_pin.interval_s):
            self._last_auto = now
            actions.extend(self._auto_pin(now))
        actions.extend(self._fill_pins(now))
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
        if self._disaggregated and cfg.on_decode_workers:
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
        holders = self._candidates(role)
        budget = cfg.budget_blocks or int(cfg.budget_fraction * sum(self.num_blocks.get(w) or 0 for w in holders))

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

