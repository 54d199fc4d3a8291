"""Which router replica decides the cluster's pins: a lease in Ray's GCS key-value store.

With ``router.replicas`` > 1 every replica routes, but one alone keeps the pin table (explicit
and automatic pins, their holders, TTLs, re-pinning): the replica holding the lease. A lease is
one key per *term*, ``kvfleet/<cluster_key>/pin-lease/<term>``, whose value names the replica
and the wall-clock time it expires. The newest term is the lease. Its holder renews it from a
thread every ``RENEW_INTERVAL_S``; a replica that finds the newest term expired (its holder died
or hung) claims the next term with a put that fails when the key exists, so of two replicas
claiming at once exactly one wins. The other replicas see the pins as the workers report them
(explicitly pinned blocks in their prefix index).
"""

from __future__ import annotations

import json
import logging
import threading
import time

from actors.pin_journal import NAMESPACE

log = logging.getLogger(__name__)

LEASE_TTL_S = 5.0  # a lease not renewed for this long may be taken over
RENEW_INTERVAL_S = 1.0


class PinLease:
    """Owns one replica's claim on the pin leadership of one cluster (keys under ``prefix``).

    Invariants: ``term`` is the term this replica holds, None while it holds none; a term is
    claimed only when the newest one expired (or none exists) and only by a put that creates
    its key; the renewal thread only touches the GCS store and ``term`` (under ``_lock``)."""

    def __init__(self, cluster_key: str, replica: int):
        self.prefix = f"kvfleet/{cluster_key}/pin-lease/"
        self.replica = replica
        self.term: int | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew_loop, name=f"pin-lease-{replica}", daemon=True)

    def start(self) -> None:
        """Claim the lease if it is free, then keep renewing (or claiming) it from a thread."""
        self.refresh()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def held(self) -> bool:
        with self._lock:
            return self.term is not None

    def leader(self) -> int | None:
        """The replica holding a live lease (None: none does now)."""
        newest = self._newest()
        if newest is None:
            return None
        _, replica, expires_at = newest
        return replica if expires_at > time.time() else None

    def refresh(self) -> bool:
        """Renew the lease this replica holds, or claim it when it is free; whether held now."""
        try:
            held = self._refresh()
        except Exception as exc:  # noqa: BLE001 - the GCS store failing must not stop the router
            log.warning("pin lease: GCS store unavailable (%s)", exc)
            held = self.held()
        return held

    def _refresh(self) -> bool:
        from ray.experimental import internal_kv

        now = time.time()
        newest = self._newest()
        value = json.dumps({"replica": self.replica, "expires_at": now + LEASE_TTL_S})
        with self._lock:
            # this replica's term (held by an earlier process of it when Ray restarted it: one
            # process per replica at a time, so it is this one's now)
            if newest is not None and newest[1] == self.replica:
                internal_kv._internal_kv_put(self._key(newest[0]), value, overwrite=True, namespace=NAMESPACE)
                self.term = newest[0]
                return True
            if newest is not None and newest[2] > now:  # another replica's live lease
                if self.term is not None:
                    log.error("pin lease: replica %d lost term %d to replica %d", self.replica, self.term, newest[1])
                self.term = None
                return False
            term = 0 if newest is None else newest[0] + 1
            existed = internal_kv._internal_kv_put(self._key(term), value, overwrite=False, namespace=NAMESPACE)
            self.term = None if existed else term
        if not existed:
            log.warning("pin lease: replica %d decides the pins (term %d)", self.replica, term)
            if newest is not None:
                internal_kv._internal_kv_del(self._key(newest[0]), namespace=NAMESPACE)
        return not existed

    def _newest(self) -> tuple[int, int, float] | None:
        """The newest term: (term, replica, expires_at), None when there is none."""
        from ray.experimental import internal_kv

        terms = []
        for key in internal_kv._internal_kv_list(self.prefix, namespace=NAMESPACE):
            text = key.decode() if isinstance(key, bytes) else key
            tail = text[len(self.prefix) :]
            if tail.isdigit():
                terms.append(int(tail))
        for term in sorted(terms, reverse=True):
            raw = internal_kv._internal_kv_get(self._key(term), namespace=NAMESPACE)
            if raw is not None:
                data = json.loads(raw)
                return term, int(data["replica"]), float(data["expires_at"])
        return None

    def _key(self, term: int) -> str:
        return f"{self.prefix}{term}"

    def _renew_loop(self) -> None:
        while not self._stop.wait(RENEW_INTERVAL_S):
            self.refresh()
