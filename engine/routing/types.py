"""Plain data the router takes and gives: requests, loads, decisions and actions for its caller.

The router does no I/O. Whatever must happen on a worker comes back as an *action* the caller
(the Ray router actor, or the simulator) executes:

- ``PinOn(worker, pin_id, block_hashes, num_tokens, token_ids, source, tier)``: make the prefix
  resident on ``worker`` (compute it from ``token_ids`` or copy it from ``source`` when the worker's
  own hit is shorter), then ``coordinator.pin_prefix(block_hashes, num_tokens, tier)`` and report
  the returned length with ``policy.pin_result(worker, pin_id, pinned, now)``.
- ``Unpin(worker, pin_id, block_hashes, num_tokens, tier)``: ``coordinator.unpin_prefix(block_hashes,
  num_tokens, tier)``; nothing to report.
- ``RequestSnapshot(worker)``: the index lost events of ``worker``; run
  ``engine.routing.snapshot_coordinator`` there and hand the result to ``policy.apply_snapshot``.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Literal

from engine.kv_cache.coordinator_types import PinTier

WorkerId = Hashable
Role = Literal["both", "prefill", "decode"]


@dataclass(frozen=True)
class RouteRequest:
    """What the router needs of a request: its chained block hashes (computed once at the ingress,
    at the coordinator's hash granularity), its token count and, where the caller knows it, its
    ``max_tokens`` (None: unknown; a one-token request has nothing to decode, so a policy with
    dedicated prefill workers may run it whole on a worker of either role)."""

    request_id: str
    block_hashes: list[bytes]
    num_tokens: int
    max_tokens: int | None = None


@dataclass
class WorkerLoad:
    """A worker's load as its stats report it (the router also adds its own assignments).

    ``queued_tokens``: work queued or running there, in prefill-token equivalents;
    ``running_requests``: requests admitted there; ``used_block_fraction``: KV blocks in use / total;
    ``promote_s_per_token``: seconds it takes to copy one host-tier hit token's KV back to the
    device (its KV bytes per token over its measured promote bandwidth; 0: no host tier).
    """

    queued_tokens: float = 0.0
    running_requests: int = 0
    used_block_fraction: float = 0.0
    promote_s_per_token: float = 0.0


@dataclass(frozen=True, init=False)
class Decision:
    """Where a request runs. ``prefill_worker == decode_worker`` means no transfer (aggregated,
    or prefill on the decode worker); ``predicted_hit``: tokens the prefill worker will find
    cached (the router's prediction of its coordinator's ``get_computed_blocks``);
    ``best_hit``: the longest hit the policy predicted on any worker that could have prefilled
    it (kvfleet's policy; 0 where a policy does not know), so ``predicted_hit < best_hit`` marks
    a request sent away from a worker holding more of its prompt; ``predicted_host_hit``: the
    part of ``predicted_hit`` the prefill worker's host tier serves (its coordinator's
    ``host_hit_tokens``)."""

    prefill_worker: WorkerId
    decode_worker: WorkerId
    predicted_hit: int
    num_tokens: int
    reason: str = "cost"
    pin_id: int | None = None
    predicted_decode_hit: int = 0
    best_hit: int = 0
    predicted_host_hit: int = 0

    def __init__(
        self,
        prefill_worker: WorkerId,
        decode_worker: WorkerId,
        predicted_hit: int,
        num_tokens: int,
        reason: str = "cost",
        pin_id: int | None = None,
        predicted_decode_hit: int = 0,
        best_hit: int = 0,
        predicted_host_hit: int = 0,
    ):
        # One decision per request: the fields go straight into the instance dict (the frozen
        # dataclass's generated __init__ sets each through object.__setattr__, twice as slow);
        # equality, hashing, repr, replace() and the frozen __setattr__ stay the dataclass's.
        fields = self.__dict__
        fields["prefill_worker"] = prefill_worker
        fields["decode_worker"] = decode_worker
        fields["predicted_hit"] = predicted_hit
        fields["num_tokens"] = num_tokens
        fields["reason"] = reason
        fields["pin_id"] = pin_id
        fields["predicted_decode_hit"] = predicted_decode_hit
        fields["best_hit"] = best_hit
        fields["predicted_host_hit"] = predicted_host_hit

    @property
    def uncached_tokens(self) -> int:
        return self.num_tokens - self.predicted_hit


@dataclass(frozen=True)
class PinOn:
    worker: WorkerId
    pin_id: int
    block_hashes: list[bytes]
    num_tokens: int
    token_ids: tuple[int, ...] | None = None
    source: WorkerId | None = None
    tier: PinTier = "device"


@dataclass(frozen=True)
class Unpin:
    worker: WorkerId
    pin_id: int
    block_hashes: list[bytes]
    num_tokens: int
    tier: PinTier = "device"


@dataclass(frozen=True)
class RequestSnapshot:
    worker: WorkerId


Action = PinOn | Unpin | RequestSnapshot


class PinCapacityError(ValueError):
    """A pin would exceed the cluster-wide pinned-block budget."""


class NoWorkerError(RuntimeError):
    """No worker can take the request (none registered for the needed role)."""


@dataclass
class PinInfo:
    """A read-only view of one cluster pin for status pages and tests."""

    pin_id: int
    num_tokens: int
    replicas: int
    blocks_per_replica: int
    active: list[WorkerId] = field(default_factory=list)
    pending: list[WorkerId] = field(default_factory=list)
    expires_at: float | None = None
    auto: bool = False
    tier: PinTier = "device"  # the tier each holder pins it in (``HybridCoordinator.pin_prefix``)
    # where each active holder keeps it now: a device-tier pin its device gave up lives in the
    # holder's host tier until a hit promotes it (``PinTable.holder_tier``)
    holder_tiers: dict[WorkerId, PinTier] = field(default_factory=dict)
