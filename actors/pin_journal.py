"""What a router must not forget when its process dies: the cluster's explicit pins.

The router's index and loads are rebuilt from the workers (snapshots and reports); the pins exist
only in the router, so each one is written to Ray's GCS key-value store when created and erased
when removed. A restarted router reads them back and places them again under the ids clients
hold. Automatic pins are not journaled: they come back from the traffic.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from engine.kv_cache.coordinator_types import PinTier

log = logging.getLogger(__name__)

NAMESPACE = "kvfleet"


@dataclass(frozen=True)
class JournaledPin:
    """One explicit pin as created: its prefix, replicas, wall-clock expiry (None: no TTL) and the
    tier its holders keep it in (records written before tiers existed read as "device")."""

    pin_id: int
    token_ids: tuple[int, ...]
    replicas: int
    expires_at: float | None
    tier: PinTier = "device"

    def ttl_left(self, now: float | None = None) -> float | None:
        """Seconds left of its TTL (None: none; <= 0: expired)."""
        return None if self.expires_at is None else self.expires_at - (time.time() if now is None else now)


class PinJournal:
    """Owns the GCS records of one cluster's pins (key prefix ``kvfleet/<cluster_key>/pin/``).

    Invariants: a record exists for every explicit pin the router holds and for no removed one;
    writes never raise (a failed write is logged: the pin still works until a restart).
    """

    def __init__(self, cluster_key: str):
        self.prefix = f"kvfleet/{cluster_key}/pin/"

    def record(
        self,
        pin_id: int,
        token_ids: Sequence[int],
        replicas: int,
        ttl_s: float | None,
        tier: PinTier = "device",
    ) -> None:
        entry = JournaledPin(
            pin_id, tuple(token_ids), replicas, time.time() + ttl_s if ttl_s is not None else None, tier
        )
        self._put(f"{self.prefix}{pin_id}", json.dumps(asdict(entry)))

    def forget(self, pin_id: int) -> None:
        from ray.experimental import internal_kv

        try:
            internal_kv._internal_kv_del(f"{self.prefix}{pin_id}", namespace=NAMESPACE)
        except Exception as exc:  # noqa: BLE001 - the GCS store failing must not stop the router
            log.warning("pin journal: could not erase pin %d (%s)", pin_id, exc)

    def load(self) -> list[JournaledPin]:
        """Every journaled pin, oldest id first."""
        from ray.experimental import internal_kv

        pins = []
        for key in internal_kv._internal_kv_list(self.prefix, namespace=NAMESPACE):
            raw = internal_kv._internal_kv_get(key, namespace=NAMESPACE)
            if raw is None:
                continue
            data = json.loads(raw)
            data["token_ids"] = tuple(data["token_ids"])
            pins.append(JournaledPin(**data))
        return sorted(pins, key=lambda pin: pin.pin_id)

    def _put(self, key: str, value: str) -> None:
        from ray.experimental import internal_kv

        try:
            internal_kv._internal_kv_put(key, value, overwrite=True, namespace=NAMESPACE)
        except Exception as exc:  # noqa: BLE001 - the GCS store failing must not stop the router
            log.warning("pin journal: could not record %s (%s); it will not survive a router restart", key, exc)
