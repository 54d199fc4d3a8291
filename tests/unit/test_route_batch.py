"""``RouteBatcher``: a lone request is routed by its own call at once; requests that come while a
call to the same replica is in flight go together in one ``route_many`` call, in order; a failed
call fails each of its requests; replicas are batched apart. No Ray: the routers are fakes whose
calls the test answers."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from cluster.route_batch import RouteBatcher


class FakeRouter:
    """Records each call (``route`` or ``route_many``, its requests) and answers it when the
    test releases it: a decision is the request id with the replica's name."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.calls: list[tuple[str, list[str]]] = []
        self.release = asyncio.Event()
        self.fail: Exception | None = None
        router = self

        class Method:
            def __init__(self, many: bool) -> None:
                self.many = many

            def remote(self, *args: Any) -> Any:
                requests = args[0] if self.many else [args]
                router.calls.append(("route_many" if self.many else "route", [r[0] for r in requests]))
                return router._answer([f"{router.name}:{r[0]}" for r in requests], self.many)

        self.route = Method(False)
        self.route_many = Method(True)

    async def _answer(self, decisions: list[str], many: bool) -> Any:
        await self.release.wait()
        if self.fail is not None:
            raise self.fail
        return decisions if many else decisions[0]


def test_a_lone_request_goes_alone_and_the_ones_behind_it_go_together_in_order() -> None:
    async def scenario() -> None:
        batcher = RouteBatcher()
        router = FakeRouter("r0")
        first = asyncio.ensure_future(batcher.route(router, "a", [b"x"], 4))
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert router.calls == [("route", ["a"])]  # sent at once, alone
        rest = [asyncio.ensure_future(batcher.route(router, rid, [b"x"], 4)) for rid in "bcd"]
        await asyncio.sleep(0.01)
        assert router.calls == [("route", ["a"])]  # they wait for the call in flight
        router.release.set()
        assert await first == "r0:a"
        assert await asyncio.gather(*rest) == ["r0:b", "r0:c", "r0:d"]
        assert router.calls == [("route", ["a"]), ("route_many", ["b", "c", "d"])]
        assert not batcher._sending and not batcher._waiting  # nothing left running or waiting

    asyncio.run(scenario())


def test_replicas_are_batched_apart_and_a_failed_call_fails_each_of_its_requests() -> None:
    async def scenario() -> None:
        batcher = RouteBatcher()
        r0, r1 = FakeRouter("r0"), FakeRouter("r1")
        r1.fail = RuntimeError("replica gone")
        calls = [asyncio.ensure_future(batcher.route(r, rid, [b"x"], 4)) for r, rid in ((r0, "a"), (r1, "b"))]
        await asyncio.sleep(0)
        later = [asyncio.ensure_future(batcher.route(r1, rid, [b"x"], 4)) for rid in "cd"]
        await asyncio.sleep(0.01)
        assert r0.calls == [("route", ["a"])] and r1.calls == [("route", ["b"])]
        r0.release.set()
        r1.release.set()
        assert await calls[0] == "r0:a"
        for failed in (calls[1], *later):
            with pytest.raises(RuntimeError, match="replica gone"):
                await failed
        assert r1.calls == [("route", ["b"]), ("route_many", ["c", "d"])]

    asyncio.run(scenario())


def test_a_caller_that_gives_up_leaves_the_others_answered() -> None:
    async def scenario() -> None:
        batcher = RouteBatcher()
        router = FakeRouter("r0")
        first = asyncio.ensure_future(batcher.route(router, "a", [b"x"], 4))
        await asyncio.sleep(0)
        waiting = [asyncio.ensure_future(batcher.route(router, rid, [b"x"], 4)) for rid in "bc"]
        await asyncio.sleep(0)
        waiting[0].cancel()  # e.g. its wait_for timed out
        router.release.set()
        assert await first == "r0:a"
        assert await waiting[1] == "r0:c"
        assert waiting[0].cancelled()

    asyncio.run(scenario())
