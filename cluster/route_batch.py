"""The driver's routing calls, merged: while one call to a router replica is in flight, the
requests that come to be routed by that replica wait and then go together, in one call
(``Router.route_many``), in the order they came. A request that finds no call in flight goes at
once, alone, so a lone request waits for nothing; under load a replica gets one call per round
trip instead of one per request, which is what the driver, the router and Ray pay per call.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from cluster.handles import RouterHandle

if TYPE_CHECKING:
    from engine.routing import Decision

#: one request to route: its id, its prompt's block hashes, its token count, its max_tokens
RouteArgs = tuple[str, list[bytes], int, int | None]


class RouteBatcher:
    """Owns the routing requests waiting for a call to their router replica, per replica, and the
    task sending each replica's calls while any are waiting.

    Invariants: a replica has a sending task exactly while some of its requests wait or its call
    is in flight; each waiting request's future is answered once (its decision, or the call's
    error) unless its caller gave it up (cancelled) first; the requests of one call are routed
    in the order they were asked for. Used from one event loop (the driver's).
    """

    def __init__(self) -> None:
        self._waiting: dict[int, list[tuple[RouteArgs, asyncio.Future[Decision]]]] = {}
        self._sending: dict[int, asyncio.Task[None]] = {}

    async def route(
        self,
        router: RouterHandle,
        request_id: str,
        block_hashes: list[bytes],
        num_tokens: int,
        max_tokens: int | None = None,
    ) -> Decision:
        """``router``'s decision for this request (the router's error when its call fails)."""
        key = id(router)
        future: asyncio.Future[Decision] = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(key, []).append(((request_id, block_hashes, num_tokens, max_tokens), future))
        if key not in self._sending:
            self._sending[key] = asyncio.ensure_future(self._send(key, router))
        return await future

    async def _send(self, key: int, router: RouterHandle) -> None:
        try:
            while batch := self._waiting.pop(key, None):
                futures = [future for _, future in batch]
                try:
                    if len(batch) == 1:
                        decisions = [await router.route.remote(*batch[0][0])]
                    else:
                        decisions = await router.route_many.remote([args for args, _ in batch])
                except Exception as exc:  # noqa: BLE001 - the call's error goes to each of its callers
                    for future in futures:
                        if not future.done():
                            future.set_exception(exc)
                    continue
                for future, decision in zip(futures, decisions, strict=True):
                    if not future.done():
                        future.set_result(decision)
        finally:
            del self._sending[key]
            for _, future in self._waiting.pop(key, []):  # stopped while sending: nobody routes these
                if not future.done():
                    future.set_exception(RuntimeError("the driver stopped routing"))
