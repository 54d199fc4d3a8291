"""The cluster's operator calls: pins, stats and worker health, each awaitable in the caller's
event loop (``apin_prefix``, ``astats``, ...) and blocking (``pin_prefix``, ``stats``, ...) for
the driver API. A mixin of ``Cluster``: it reads the router and worker handles, the tokenizer and
the started state that ``Cluster`` owns."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")


class ClusterAdmin:
    """Pins, stats and health over a started cluster (see ``Cluster`` for the state it owns)."""

    router: Any
    workers: dict[str, Any]
    infos: dict[str, Any]
    tokenizer: Any
    lost: dict[str, str]  # worker id -> why it was taken out (see ClusterSupervision)

    def _sync(self, coro: Coroutine[Any, Any, T]) -> T:
        raise NotImplementedError

    def _require_started(self) -> None:
        raise NotImplementedError

    def _check_ids(self, name: str, ids: Sequence[int]) -> list[int]:
        raise NotImplementedError

    def _forget_worker(self, worker_id: str, why: str = "its actor died", handle: Any = None) -> None:
        raise NotImplementedError

    def pin_prefix(
        self,
        prefix: str | Sequence[int],
        replicas: int = 1,
        ttl: float | None = None,
        *,
        wait: bool = True,
        timeout_s: float = 120.0,
    ) -> int:
        """Keep ``prefix`` (text or token ids) resident on ``replicas`` workers, for ``ttl``
        seconds or until ``unpin``; returns the pin id. ``wait``: until every replica holds it."""
        return self._sync(self.apin_prefix(prefix, replicas, ttl, wait=wait, timeout_s=timeout_s))

    async def apin_prefix(
        self,
        prefix: str | Sequence[int],
        replicas: int = 1,
        ttl: float | None = None,
        *,
        wait: bool = True,
        timeout_s: float = 120.0,
    ) -> int:
        """``pin_prefix`` awaited in the caller's event loop."""
        from ray.exceptions import RayTaskError

        self._require_started()
        if isinstance(prefix, str):
            if not prefix:
                raise ValueError("prefix: must not be empty (got '')")
            token_ids = list(self.tokenizer.encode(prefix))
        else:
            token_ids = self._check_ids("prefix", prefix)
        if not token_ids:
            raise ValueError(f"prefix: encodes to no tokens (got {prefix!r})")
        if isinstance(replicas, bool) or not isinstance(replicas, int):
            raise ValueError(f"replicas: must be an integer (got {replicas!r})")
        if replicas < 1:
            raise ValueError(f"replicas: must be >= 1 (got {replicas})")
        if ttl is not None:
            if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or math.isnan(ttl):
                raise ValueError(f"ttl: must be a number of seconds (got {ttl!r})")
            if ttl <= 0:
                raise ValueError(f"ttl: must be > 0 seconds (got {ttl})")
            if math.isinf(ttl):
                raise ValueError(f"ttl: must be finite (got {ttl}); leave it out for a pin without expiry")
        try:
            pin_id = int(await self.router.pin.remote(token_ids, replicas, ttl))
        except RayTaskError as exc:  # the policy's own check (e.g. more replicas than holders)
            if isinstance(exc.cause, ValueError):
                raise ValueError(str(exc.cause)) from None
            raise
        if wait:
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                pin = {p["pin_id"]: p for p in await self.router.pins.remote()}.get(pin_id)
                if pin is None or len(pin["active"]) >= pin["replicas"]:
                    break
                await asyncio.sleep(0.05)
            else:
                log.warning("pin %d: not on %d replicas after %.0f s", pin_id, replicas, timeout_s)
        return pin_id

    def unpin(self, pin_id: int) -> bool:
        """Remove a pin everywhere; False if no such pin."""
        return self._sync(self.aunpin(pin_id))

    async def aunpin(self, pin_id: int) -> bool:
        self._require_started()
        return bool(await self.router.unpin.remote(pin_id))

    def pins(self) -> list[dict[str, Any]]:
        return self._sync(self.apins())

    async def apins(self) -> list[dict[str, Any]]:
        self._require_started()
        return list(await self.router.pins.remote())

    def stats(self) -> dict[str, Any]:
        """Per worker: running, queued, free / total / pinned blocks, hit rate; totals; router."""
        return self._sync(self.astats())

    async def astats(self, timeout_s: float = 60.0) -> dict[str, Any]:
        """``stats`` awaited in the caller's event loop."""
        from ray.exceptions import RayActorError

        from cluster.supervision import await_ref, describe_failure

        self._require_started()
        raw = []
        unhealthy: dict[str, str] = {wid: f"lost: {why}" for wid, why in self.lost.items()}
        handles = dict(self.workers)
        refs = {worker_id: handle.stats.remote() for worker_id, handle in handles.items()}
        for worker_id, ref in refs.items():
            try:
                raw.append(await asyncio.wait_for(await_ref(ref), timeout_s))
            except TimeoutError:
                unhealthy[worker_id] = f"stats did not answer within {timeout_s:g} s"
            except Exception as exc:  # a dead actor, a stopped engine: report it, never raise
                unhealthy[worker_id] = describe_failure(exc)
                if isinstance(exc, RayActorError):
                    self._forget_worker(worker_id, unhealthy[worker_id], handles[worker_id])
        workers = {stats["worker_id"]: _worker_summary(stats) for stats in raw}
        keys = ("running", "queued", "held_for_transfer", "free_blocks", "num_blocks", "pinned_blocks",
                "capacity_tokens", "capacity_recurrent_states",
                "explicitly_pinned_blocks", "hit_tokens", "queried_tokens", "transfer_bytes", "requests_finished",
                "requests_aborted")  # fmt: skip
        totals: dict[str, Any] = {k: sum(w[k] for w in workers.values()) for k in keys}
        totals["hit_rate"] = totals["hit_tokens"] / totals["queried_tokens"] if totals["queried_tokens"] else 0.0
        router = await self.router.stats.remote()
        return {"workers": workers, "unhealthy": unhealthy, "totals": totals, "router": router}

    def health(self, timeout_s: float = 5.0) -> dict[str, str]:
        """Every worker this cluster started: "ok", or why it is not healthy."""
        return self._sync(self.ahealth(timeout_s))

    async def ahealth(self, timeout_s: float = 5.0) -> dict[str, str]:
        """Every worker this cluster started, with "ok" or why it is not healthy (an engine
        thread that stopped, an actor that died or did not answer within ``timeout_s``)."""
        from cluster.supervision import probe

        self._require_started()
        names = list(self.infos)

        async def one(worker_id: str) -> str:
            handle = self.workers.get(worker_id)
            if handle is None:
                return f"lost: {self.lost.get(worker_id, 'removed from the router')}"
            return await probe(handle, timeout_s)

        return dict(zip(names, await asyncio.gather(*(one(w) for w in names)), strict=True))


def _worker_summary(stats: dict[str, Any]) -> dict[str, Any]:
    """One worker's line of ``Cluster.stats()`` from its actor's raw stats."""
    metrics = stats.get("metrics") or {}
    return {
        "role": stats["role"],
        "running": stats["running"],
        "queued": stats["waiting"] + stats["waiting_for_kv"],
        "held_for_transfer": stats["held_for_transfer"],
        "free_blocks": stats["free_blocks"],
        "num_blocks": stats["num_blocks"],
        # KV memory in what it holds: attention tokens and full recurrent states (per pool below)
        "capacity_tokens": stats["capacity"]["tokens"],
        "capacity_recurrent_states": stats["capacity"]["recurrent_states"],
        "kv_pools": stats["capacity"]["pools"],
        "pinned_blocks": stats["pinned_blocks"],
        "explicitly_pinned_blocks": stats["explicitly_pinned_blocks"],
        "hit_rate": stats["hit_rate"],
        "hit_tokens": stats["hit_tokens"],
        "queried_tokens": stats["queried_tokens"],
        "num_preemptions": stats["num_preemptions"],
        "transfer": stats["transfer"],
        "transfer_bytes": int(stats["transfer"].get("bytes", 0)) if isinstance(stats["transfer"], dict) else 0,
        "requests_finished": int(metrics.get("kvfleet_requests_finished_total", 0)),
        "requests_aborted": int(metrics.get("kvfleet_requests_aborted_total", 0)),
    }
