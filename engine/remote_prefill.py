"""Decode side of P/D before the handle arrives: a request announced when it is routed.

The driver tells the decode engine about a P/D request right after routing, while the prefill
worker computes it (``expect_remote_prefill``): the engine reserves the prompt's blocks at once
(two-phase, in-window only, one state block per Mamba group, as ``add_transferred_request``)
and, when a ``peer`` is named, opens the transfer connection to it; the handle then arrives
(``provide_handle``) and the read starts at once. An announced request is in one of two states:

* reserved: its blocks are allocated and it sits in the scheduler's ``waiting_for_kv`` with no
  read in flight (an abort frees the blocks at once; nothing can write into them);
* unreserved: the blocks did not fit (or nothing is to be read): it is not in the scheduler at
  all; the handle takes the usual path (allocate then, or compute locally).

A handle that arrives for a request no longer expected (aborted, failed, unknown) is answered
with a notification only, so its owner frees the blocks at once (``discard_handle``).
A mixin of ``EngineCore``; everything here runs on the engine's thread.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from engine.disagg import KVHandle, check_handle, handle_usable, plan_read
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import RequestOutput
from engine.transfer import AgentInfo

log = logging.getLogger(__name__)

@dataclass
class Expected:
    """An announced remote-prefill request waiting for its handle (``reserved``: blocks held)."""

    request: Request
    reserved: bool


class RemotePrefillMixin:
    """Announced remote prefills and peer warm-up (state: ``expected``; the rest is EngineCore's).

    Invariant: a request id is in ``expected`` from its announcement until its handle arrives or
    it is aborted; while reserved it is in ``scheduler.waiting_for_kv`` with no read in flight.
    """

    scheduler: Any
    coordinator: Any
    transfer: Any
    layout: Any
    layout_key: str
    config: Any
    name: str
    loads: Any
    transfer_stats: Any
    expected: dict[str, Expected]

    def _checked_request(
        self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams, **kwargs: Any
    ) -> Request:
        raise NotImplementedError

    def _notify_only(self, handle: KVHandle) -> None:
        raise NotImplementedError

    def _start_load(self, request: Request, handle: KVHandle) -> None:
        raise NotImplementedError

    # -- announcement --------------------------------------------------------------------------
    def expect_remote_prefill(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        peer: AgentInfo | None = None,
    ) -> Request:
        """Announce a request whose prompt KV (all but the last token) a prefill worker is
        computing now: reserve its blocks (if they fit) and warm the connection to ``peer``.
        Its handle comes later through ``provide_handle``."""
        if self.transfer is None:
            raise ValueError(f"kv_role: engine {self.name!r} was built without one, so it cannot do P/D transfers")
        request = self._checked_request(request_id, prompt_token_ids, sampling, remote_prefill=True)
        if len(request.token_ids) < 2:
            raise ValueError("prompt_token_ids: a remote prefill needs >= 2 tokens; run it here")
        if request_id in self.expected:
            raise ValueError(f"request_id: {request_id!r} is already in this engine")
        if peer is not None:
            self.warm_peer(peer)
        tables = self.scheduler.reserve_transferred(request, request.num_tokens - 1)
        self.expected[request_id] = Expected(request, tables is not None)
        return request

    def is_reserved(self, request_id: str) -> bool:
        """Whether an announced request holds its blocks while it waits for its handle."""
        expected = self.expected.get(request_id)
        return expected is not None and expected.reserved

    def provide_handle(self, request_id: str, handle: KVHandle) -> RequestOutput | None:
        """The handle of an announced request: start the read into its reserved blocks (or the
        usual path when none were reserved). A request no longer expected: notify the owner
        only. Returns an error output when the request fails here (a handle that does not fit)."""
        expected = self.expected.pop(request_id, None)
        if expected is None:
            self.discard_handle(handle)
            return None
        request = expected.request
        try:
            check_handle(handle, self.layout_key, request.token_ids)
        except ValueError as exc:
            self._notify_only(handle)
            if expected.reserved:
                self.scheduler.abort(request_id)
            return RequestOutput(request_id, [], True, RequestStatus.FINISHED_ERROR.value, error=str(exc))
        if not expected.reserved:
            self._start_load(request, handle)
            return None
        cfg = self.config.transfer
        if not handle_usable(handle, cfg.read_timeout_s, cfg.release_timeout_s):
            self.transfer_stats.expired_handles += 1
            self._notify_only(handle)
            if cfg.on_failure == "fail":
                self.scheduler.abort(request_id)
                why = f"kv_handle.expires_at: handle of {request_id!r} arrived too late to read (transfer.on_failure=fail)"
                return RequestOutput(request_id, [], True, RequestStatus.FINISHED_ERROR.value, error=why)
            log.warning("%s: handle of %s arrived too late to read; recomputing", self.name, request_id)
            self.scheduler.finish_kv_load(request_id, ok=False)
            return None
        self._read_into(request_id, handle)
        return None

    def _read_into(self, request_id: str, handle: KVHandle) -> None:
        """Start reading ``handle``'s blocks into the request's fresh blocks (it waits for KV)."""
        tables = self.coordinator.block_ids(request_id)
        fresh = [set(group) for group in self.coordinator.unhashed_block_ids(request_id)]
        try:
            pairs = plan_read(handle, tables, fresh, [group.pool for group in self.layout.groups])
        except ValueError as e:
            log.warning("%s: cannot read %s from %s (%s); recomputing", self.name, request_id, handle.agent.name, e)
            self.scheduler.finish_kv_load(request_id, ok=False)
            self._notify_only(handle)
            return
        if handle.agent.name not in self.transfer.peers:
            self.transfer_stats.cold_reads += 1  # this read pays the connection setup
        tid = self.transfer.start_read(handle.agent, pairs, notify=handle.notify_key)
        self.loads.reads[tid] = request_id
        self.transfer_stats.reads += 1

    def discard_handle(self, handle: KVHandle | None) -> None:
        """A handle nobody will read (its request ended here): let its owner free at once."""
        if handle is not None and self.transfer is not None:
            self._notify_only(handle)

    def forget_expected(self, request_id: str) -> bool:
        """Drop an announced request (abort): its reserved blocks are free again at once."""
        expected = self.expected.pop(request_id, None)
        if expected is None:
            return False
        if expected.reserved:
            self.scheduler.abort(request_id)
        return True

    @property
    def only_awaiting_handles(self) -> bool:
        """Nothing to poll: every request here waits for a handle, with no read in flight, no
        blocks held for a reader and nothing to compute (the worker may sleep until a call)."""
        scheduler = self.scheduler
        if scheduler.running or scheduler.waiting or self.loads or len(getattr(self, "held", ())):
            return False
        return all(request_id in self.expected for request_id in scheduler.waiting_for_kv)

    # -- peers ---------------------------------------------------------------------------------
    def warm_peer(self, peer: AgentInfo) -> bool:
        """Open the connection to a prefill worker's transfer agent now (its descriptors and the
        transport's endpoint and every memory region's keys), so the first real read from it
        pays no setup (``KVTransfer.warm_up``). False if the peer is known already (or unusable: the real read
        then fails or recomputes as before)."""
        transfer = self.transfer
        if transfer is None or peer.name in transfer.peers or peer.name == transfer.agent_info.name:
            return False
        attempted: set[str] = self.__dict__.setdefault("_warm_attempted", set())
        if peer.name in attempted:  # tried before and it did not stay a peer (e.g. a dead agent)
            return False
        attempted.add(peer.name)
        started = time.perf_counter()
        tid = transfer.warm_up(peer)
        self.loads.notify_only.add(tid)
        self.transfer_stats.warm_ups += 1
        log.debug("%s: warmed the connection to %s in %.1f ms", self.name, peer.name,
                  1e3 * (time.perf_counter() - started))  # fmt: skip
        return True
