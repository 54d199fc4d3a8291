"""The TTFT breakdown of one request, hop by hop.

Every duration is measured where its hop happens, on that process's monotonic clock: the
workers send durations (``hops`` of a prefill result or of the first tokens' chunk), the driver
measures its own intervals, and the breakdown combines durations only (no two clocks are ever
subtracted). What no single clock sees (a Ray call crossing between processes) is a round trip
measured by the caller minus the callee's own duration, split evenly between the two legs.

P/D request, in order (the critical-path hops sum to the driver's TTFT):
    route          driver: attempt start -> decision received, decode worker told, prefill sent
    prefill_queue  prefill worker: call arrived -> first scheduled (+ the call's leg)
    prefill        prefill worker: first scheduled -> KV computed (handle exported)
    handle         prefill done -> decode worker's engine thread has the handle (the result's leg
                   back to the driver, the relay's leg to the decode worker, the pickup there)
    transfer       decode worker: handle taken -> KV loaded
    first_token    decode worker: KV loaded -> first token (+ the token's leg to the driver)
Off the critical path (the decode worker's allocation overlaps the prefill):
    decode_admission  decode worker: told of the request -> blocks reserved
    decode_lead       decode worker: blocks reserved -> handle arrived (> 0: ready before it)
Whole request on one worker: route, queue, prefill (first scheduled -> first token), first_token.
``retry`` is the time earlier attempts took (when a worker was lost before the first token).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from actors.worker_types import TrackedRequest

PD_CRITICAL = ("route", "prefill_queue", "prefill", "handle", "transfer", "first_token")
WHOLE_CRITICAL = ("route", "queue", "prefill", "first_token")


def prefill_hops(tracked: TrackedRequest, now: float) -> dict[str, float]:
    """A prefill-only request's hops on its worker: ``prefill_queue`` (the call arrived -> first
    scheduled), ``prefill`` (-> done), ``since_arrival`` (their sum, for the driver's residual)."""
    scheduled = getattr(tracked.request, "scheduled_at", None) or tracked.arrival
    return {
        "prefill_queue": scheduled - tracked.arrival,
        "prefill": now - scheduled,
        "since_arrival": now - tracked.arrival,
    }


def token_hops(tracked: TrackedRequest, now: float) -> dict[str, float]:
    """A request's hops on its decode (or only) worker up to its first token (``now``).

    Whole here: ``queue`` (call arrived -> first scheduled), ``prefill`` (-> first token),
    ``since_arrival``. Remote prefill: ``decode_admission``, ``decode_lead``, ``handle_pickup``
    (handle arrived -> the engine thread took it), ``transfer`` (-> KV loaded), ``decode_first``
    (-> first token), ``since_handle`` (handle arrived -> first token).
    """
    request = tracked.request
    if tracked.handle_at is None:
        scheduled = getattr(request, "scheduled_at", None) or tracked.arrival
        return {
            "queue": scheduled - tracked.arrival,
            "prefill": now - scheduled,
            "since_arrival": now - tracked.arrival,
        }
    taken = tracked.handle_taken_at or tracked.handle_at
    hops = {
        "handle_pickup": taken - tracked.handle_at,
        "since_handle": now - tracked.handle_at,
    }
    if tracked.reserved_at is not None:
        hops["decode_admission"] = tracked.reserved_at - tracked.arrival
        hops["decode_lead"] = tracked.handle_at - tracked.reserved_at
    loaded = getattr(request, "kv_loaded_at", None)
    if loaded is not None and loaded >= taken:
        hops["transfer"] = loaded - taken
        hops["decode_first"] = now - loaded
    else:  # computed here after all (no room for the blocks, or the read failed)
        hops["decode_first"] = now - taken
    return hops


def pd_breakdown(
    route_s: float,
    prefill_call_s: float,
    after_prefill_s: float,
    prefill: dict[str, float],
    decode: dict[str, float],
    retry_s: float = 0.0,
) -> dict[str, float]:
    """The hops of a P/D request from the driver's intervals (``prefill_call_s``: prefill sent ->
    its result; ``after_prefill_s``: result -> first token) and the workers' durations."""
    call_legs = max(0.0, prefill_call_s - prefill["since_arrival"])  # driver <-> prefill worker, both ways
    relay_legs = max(0.0, after_prefill_s - decode["since_handle"])  # handle to D, first token back
    hops = {
        "route": route_s,
        "prefill_queue": prefill["prefill_queue"] + call_legs / 2,
        "prefill": prefill["prefill"],
        "handle": call_legs / 2 + relay_legs / 2 + decode["handle_pickup"],
        "transfer": decode.get("transfer", 0.0),
        "first_token": decode["decode_first"] + relay_legs / 2,
    }
    for name in ("decode_admission", "decode_lead"):
        if name in decode:
            hops[name] = decode[name]
    if retry_s > 0:
        hops["retry"] = retry_s
    return hops


def whole_breakdown(route_s: float, call_s: float, worker: dict[str, float], retry_s: float = 0.0) -> dict[str, float]:
    """The hops of a request run whole on one worker (``call_s``: generate sent -> first token)."""
    legs = max(0.0, call_s - worker["since_arrival"])
    hops = {
        "route": route_s,
        "queue": worker["queue"] + legs / 2,
        "prefill": worker["prefill"],
        "first_token": legs / 2,
    }
    if retry_s > 0:
        hops["retry"] = retry_s
    return hops
