"""``Decision`` is a value object: its own ``__init__`` (faster than the frozen dataclass's) must
keep every dataclass behaviour callers rely on: positional and keyword fields with their
defaults, equality and hashing by value, immutability, ``replace`` and pickling (Ray ships it)."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from engine.routing.types import Decision

FIELDS = (
    "prefill_worker",
    "decode_worker",
    "predicted_hit",
    "num_tokens",
    "reason",
    "pin_id",
    "predicted_decode_hit",
    "best_hit",
    "predicted_host_hit",
)


def test_fields_positional_keyword_and_defaults() -> None:
    assert tuple(f.name for f in dataclasses.fields(Decision)) == FIELDS
    full = Decision("p", "d", 48, 100, "prefix", 7, 32, 64, 16)
    assert dataclasses.astuple(full) == ("p", "d", 48, 100, "prefix", 7, 32, 64, 16)
    by_name = Decision(
        prefill_worker="p",
        decode_worker="d",
        predicted_hit=48,
        num_tokens=100,
        reason="prefix",
        pin_id=7,
        predicted_decode_hit=32,
        best_hit=64,
        predicted_host_hit=16,
    )
    assert by_name == full
    short = Decision("w", "w", 0, 10)
    assert dataclasses.astuple(short) == ("w", "w", 0, 10, "cost", None, 0, 0, 0)
    assert short.uncached_tokens == 10
    with pytest.raises(TypeError):
        Decision("w", "w", 0)  # type: ignore[call-arg]


def test_equality_hash_immutability_replace_and_pickle() -> None:
    a = Decision("w0", "w1", 16, 40, "cost", None, 8, 32, 0)
    b = Decision("w0", "w1", 16, 40, "cost", None, 8, 32, 0)
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    for name in FIELDS:
        other = dataclasses.replace(a, **{name: "changed"})
        assert other != a and getattr(other, name) == "changed"
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(a, name, "changed")
    assert a != ("w0", "w1", 16, 40, "cost", None, 8, 32, 0)
    assert pickle.loads(pickle.dumps(a)) == a
    assert repr(a).startswith("Decision(prefill_worker='w0', decode_worker='w1', predicted_hit=16")
