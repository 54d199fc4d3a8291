"""The pin lease between router replicas (``actors.pin_lease``): one holder at a time, a lease not
renewed is taken over once it expired (by exactly one claimant), a replica Ray restarted gets its
own live term back, a holder that was overtaken knows it.

Oracle: a dict standing in for the GCS key-value store with its put-if-absent semantics."""

from __future__ import annotations

import pytest

from actors import pin_lease
from actors.pin_lease import PinLease


class FakeKV:
    """The four internal_kv calls the lease makes, over a dict (put returns whether the key existed)."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def put(self, key: str, value: str, overwrite: bool = True, *, namespace: str | None = None) -> bool:
        existed = key in self.data
        if overwrite or not existed:
            self.data[key] = value.encode()
        return existed

    def get(self, key: str, *, namespace: str | None = None) -> bytes | None:
        return self.data.get(key)

    def delete(self, key: str, *, namespace: str | None = None) -> None:
        self.data.pop(key, None)

    def list(self, prefix: str, *, namespace: str | None = None) -> list[bytes]:
        return [k.encode() for k in self.data if k.startswith(prefix)]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def time(self) -> float:
        return self.now


@pytest.fixture
def kv(monkeypatch: pytest.MonkeyPatch) -> FakeKV:
    from ray.experimental import internal_kv

    fake = FakeKV()
    monkeypatch.setattr(internal_kv, "_internal_kv_put", fake.put)
    monkeypatch.setattr(internal_kv, "_internal_kv_get", fake.get)
    monkeypatch.setattr(internal_kv, "_internal_kv_del", fake.delete)
    monkeypatch.setattr(internal_kv, "_internal_kv_list", fake.list)
    return fake


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(pin_lease.time, "time", fake.time)
    return fake


def test_one_holder_and_takeover_after_expiry(kv: FakeKV, clock: Clock) -> None:
    first, second = PinLease("c", 0), PinLease("c", 1)
    assert first.refresh() and first.term == 0
    assert not second.refresh() and second.term is None
    assert second.leader() == 0 == first.leader()

    clock.now += pin_lease.LEASE_TTL_S / 2  # renewed in time: still the holder
    assert first.refresh() and not second.refresh()
    clock.now += pin_lease.LEASE_TTL_S / 2 + 0.1  # not yet expired: renewal moved it on
    assert not second.refresh()

    clock.now += pin_lease.LEASE_TTL_S  # the holder stopped renewing: the next term is claimed
    assert second.refresh() and second.term == 1
    assert list(kv.data) == ["kvfleet/c/pin-lease/1"]  # the expired term is erased
    assert not first.refresh() and first.term is None  # overtaken: it knows
    assert first.leader() == 1


def test_a_restarted_replica_takes_its_own_term_back(kv: FakeKV, clock: Clock) -> None:
    before = PinLease("c", 0)
    assert before.refresh()
    after = PinLease("c", 0)  # the same replica in a new process (Ray restarted it)
    assert after.refresh() and after.term == 0
    assert not PinLease("c", 1).refresh()


def test_two_claimants_of_an_expired_lease_one_wins(kv: FakeKV, clock: Clock) -> None:
    assert PinLease("c", 0).refresh()
    clock.now += pin_lease.LEASE_TTL_S + 1
    one, two = PinLease("c", 1), PinLease("c", 2)
    newest = one._newest()
    assert newest is not None
    # both saw term 0 expired; the first put of term 1 creates it, the second finds it there
    two._newest = lambda: newest  # type: ignore[method-assign]  # (read before one claimed)
    assert one.refresh() and one.term == 1
    assert not two.refresh() and two.term is None
