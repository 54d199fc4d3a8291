"""``RouterLink.ack``: what a finished request waits for before it counts as finished. With KV
events not sent yet, a new report carrying them (its refs); with none, the refs of the last
report that carried events while some replica has not answered it, and nothing once every
replica answered it or a later report. No Ray: the engine and the router replicas are fakes,
and the test answers each report."""

from __future__ import annotations

import concurrent.futures
from types import SimpleNamespace
from typing import Any

from actors.router_link import RouterLink, unpack_report


class FakeRef:
    """A report's ref: ``future()`` is answered when the test calls ``answer``."""

    def __init__(self) -> None:
        self._future: concurrent.futures.Future[None] = concurrent.futures.Future()

    def future(self) -> concurrent.futures.Future[None]:
        return self._future

    def answer(self) -> None:
        self._future.set_result(None)


class FakeRouter:
    def __init__(self) -> None:
        self.reports: list[tuple[list[Any], FakeRef]] = []
        self.report = SimpleNamespace(remote=self._report)

    def _report(self, worker_id: str, packed: bytes) -> FakeRef:
        events, _ = unpack_report(packed)  # what the Router actor reads
        ref = FakeRef()
        self.reports.append((events, ref))
        return ref


class FakeEngine:
    def __init__(self) -> None:
        self.events: list[str] = []
        self.worker_view = SimpleNamespace(load=lambda: (0.0, 0, 0.0, 0.0))

    def take_events(self) -> list[str]:
        events, self.events = self.events, []
        return events


def link(replicas: int) -> tuple[RouterLink, FakeEngine, list[FakeRouter]]:
    engine = FakeEngine()
    rl = RouterLink(engine, "decode-0", None, lambda *a: None, lambda *a: None, replicas)  # type: ignore[arg-type]
    routers = [FakeRouter() for _ in range(replicas)]
    for replica, router in enumerate(routers):
        rl.connect(router, replica)  # type: ignore[arg-type]
    return rl, engine, routers


def test_new_events_are_sent_and_their_report_is_the_ack() -> None:
    rl, engine, (router,) = link(1)
    engine.events = ["stored"]
    ack = rl.ack()
    assert router.reports[-1][0] == ["stored"] and ack == (router.reports[-1][1],)


def test_no_new_events_waits_for_the_last_report_until_every_replica_answered_it() -> None:
    rl, engine, routers = link(2)
    engine.events = ["stored"]
    rl.report(force=True)
    sent = sum(len(r.reports) for r in routers)
    pending = tuple(r.reports[-1][1] for r in routers)
    assert rl.ack() == pending  # nothing new: no report, the last one's refs
    assert sum(len(r.reports) for r in routers) == sent
    pending[0].answer()
    assert rl.ack() == pending  # one replica has not answered yet
    pending[1].answer()
    for r in routers:  # the connect reports, answered too
        for _, ref in r.reports[:-1]:
            if not ref.future().done():
                ref.answer()
    assert rl.ack() == ()  # every replica holds every event: nothing to wait for
    assert sum(len(r.reports) for r in routers) == sent


def test_an_older_report_answered_late_does_not_stand_for_a_newer_one() -> None:
    rl, engine, (router,) = link(1)
    connect_ref = router.reports[-1][1]
    engine.events = ["stored"]
    rl.report()
    newer = router.reports[-1][1]
    connect_ref.answer()
    assert rl.ack() == (newer,)
    newer.answer()
    assert rl.ack() == ()


def test_not_connected_means_nothing_to_wait_for() -> None:
    engine = FakeEngine()
    rl = RouterLink(engine, "decode-0", None, lambda *a: None, lambda *a: None, 1)  # type: ignore[arg-type]
    engine.events = ["stored"]
    assert rl.ack() == ()


def test_a_load_only_report_after_the_events_is_not_waited_for() -> None:
    rl, engine, (router,) = link(1)
    engine.events = ["stored"]
    rl.report()
    with_events = router.reports[-1][1]
    rl.report(force=True)  # load only
    load_only = router.reports[-1][1]
    assert rl.ack() == (with_events,)
    with_events.answer()
    assert rl.ack() == ()  # the load-only report still in flight carries no events
    assert not load_only.future().done()
