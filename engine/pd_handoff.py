"""The P/D hand-off of one engine: the KV that crosses between a prefill and a decode engine.

Prefill side: a prefilled request's blocks are exported as a ``KVHandle`` and held until the
reader's notification or ``transfer.release_timeout_s`` (``export``); a cached prefix is exported
the same way for a peer that copies it (``export_prefix``).

Decode side: a handle's KV is pulled into a request's fresh blocks (``start_load``), and the
request waits in the scheduler's ``waiting_for_kv`` until the read ends (``progress``). The
driver may announce a P/D request right after routing, while the prefill worker computes it
(``expect``): its blocks are reserved at once (two-phase, in-window only, one state block per
Mamba group, as ``Scheduler.add_transferred_request``) and, when a ``peer`` is named, the
transfer connection to it is opened; the handle then arrives (``provide_handle``) and the read
starts at once. An announced request is in one of two states:

* reserved: its blocks are allocated and it sits in the scheduler's ``waiting_for_kv`` with no
  read in flight (an abort frees the blocks at once; nothing can write into them);
* unreserved: the blocks did not fit (or nothing is to be read): it is not in the scheduler at
  all; the handle takes the usual path (allocate then, or compute locally).

A handle that arrives for a request no longer expected (aborted, failed, unknown) is answered
with a notification only, so its owner frees the blocks at once (``discard_handle``).
Everything here runs on the engine's thread; see ``engine.disagg`` for the token-count
convention and a handle's lifetime.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.disagg import (
    NULL_BLOCK,
    CompletedRead,
    HeldBlocks,
    KVHandle,
    PendingLoads,
    TransferStats,
    check_handle,
    handle_usable,
    plan_read,
    token_digest,
)
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import RequestOutput, Scheduler
from engine.transfer import DONE, FAILED, AgentInfo, KVTransfer, ReadRecord

if TYPE_CHECKING:
    from configs.schema import TransferConfig
    from engine.kv_cache.coordinator import HybridCoordinator
    from engine.runner import ModelRunner
    from engine.transfer.ranked import RankReads

log = logging.getLogger(__name__)


@dataclass
class Expected:
    """An announced remote-prefill request waiting for its handle (``reserved``: blocks held)."""

    request: Request
    reserved: bool


class PDHandoff:
    """Owns the P/D transfer state of one engine: the blocks held for readers (``held``), the
    reads in flight (``loads``), the announced remote prefills (``expected``), the peers a
    warm-up was tried for, and the transfer counters (``stats``). It works on the engine's
    scheduler, coordinator, runner and transfer object, which it is given and does not own.

    Invariants: a block exported in a handle stays held (``held``, ``scheduler.held``) until its
    reader's notification or ``transfer.release_timeout_s``; a request whose read is in flight
    (``loads.reads``) keeps its blocks until that read has ended, even when aborted meanwhile
    (``loads.aborted``); every handle received is either read or answered with a notification;
    a request id is in ``expected`` from its announcement until its handle arrives or it is
    aborted, and while reserved it is in ``scheduler.waiting_for_kv`` with no read in flight.
    """

    def __init__(
        self,
        name: str,
        config: TransferConfig,
        transfer: KVTransfer,
        agent_info: AgentInfo,
        layout_key: str,
        group_pools: Sequence[int],
        scheduler: Scheduler,
        coordinator: HybridCoordinator,
        runner: ModelRunner,
        *,
        exports_prefills: bool,
    ):
        """``group_pools[g]``: the block pool of KV group ``g``; ``exports_prefills``: this
        engine exports prefilled requests, so it takes its owner notifications every step (one
        that does not takes them only while it holds an exported prefix)."""
        self.name = name
        self.config = config
        self.transfer = transfer
        self.agent_info = agent_info
        self.layout_key = layout_key
        self.group_pools = list(group_pools)
        self.scheduler = scheduler
        self.coordinator = coordinator
        self.runner = runner
        self.exports_prefills = exports_prefills
        self.held = HeldBlocks(config.release_timeout_s)
        self.loads = PendingLoads()
        self.expected: dict[str, Expected] = {}
        self.stats = TransferStats()
        #: reads that ended well since the owner last took them (``take_completed_reads``)
        self.completed_reads: list[CompletedRead] = []
        #: peers a warm-up was started for (one that did not stay a peer is not tried again)
        self.warm_attempted: set[str] = set()
        #: on rank 0 of a worker split over tensor-parallel ranks (``engine.rank_group.lead_ranks``):
        #: the reads every rank makes with this one; None on one rank
        self.ranks: RankReads | None = None

    # -- state -------------------------------------------------------------------------------------
    def take_completed_reads(self) -> list[CompletedRead]:
        """The reads that ended well since the last call (each once), for the worker's metrics."""
        reads, self.completed_reads = self.completed_reads, []
        return reads

    @property
    def has_work(self) -> bool:
        """Reads in flight or blocks held for readers."""
        return bool(self.loads) or bool(self.held)

    @property
    def only_awaiting_handles(self) -> bool:
        """No read in flight, no blocks held for a reader, and every request waiting for KV is
        an announced one whose handle has not come yet."""
        if self.loads or self.held:
            return False
        return all(request_id in self.expected for request_id in self.scheduler.waiting_for_kv)

    def expects(self, request_id: str) -> bool:
        """Whether ``request_id`` is announced here and waits for its handle."""
        return request_id in self.expected

    def is_reserved(self, request_id: str) -> bool:
        """Whether an announced request holds its blocks while it waits for its handle."""
        expected = self.expected.get(request_id)
        return expected is not None and expected.reserved

    def abort(self, request_id: str) -> bool:
        """Take ``request_id`` out of the hand-off; True when that ended it (announced: its
        reserved blocks free at once; read in flight: its blocks free when the read ends). False:
        the scheduler still has to abort it (its held blocks, if any, are no longer held)."""
        expected = self.expected.pop(request_id, None)
        if expected is not None:
            if expected.reserved:
                self.scheduler.abort(request_id)
            return True
        if request_id in self.scheduler.waiting_for_kv:  # a read into its blocks is in flight
            self.loads.aborted.add(request_id)
            return True
        self.held.forget(request_id)
        return False

    # -- decode side: announcement and handles -------------------------------------------------------
    def expect(self, request: Request, peer: AgentInfo | None) -> None:
        """Announce ``request`` (checked, ``remote_prefill``), whose prompt KV (all but the last
        token) a prefill worker is computing now: reserve its blocks (if they fit) and warm the
        connection to ``peer``."""
        if len(request.token_ids) < 2:
            raise ValueError("prompt_token_ids: a remote prefill needs >= 2 tokens; run it here")
        if peer is not None:
            self.warm_peer(peer)
        tables = self.scheduler.reserve_transferred(request, request.num_tokens - 1)
        self.expected[request.request_id] = Expected(request, tables is not None)

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
            self._check_ranks(handle)
        except ValueError as exc:
            self._notify_only(handle)
            if expected.reserved:
                self.scheduler.abort(request_id)
            return RequestOutput(request_id, [], True, RequestStatus.FINISHED_ERROR.value, error=str(exc))
        if not expected.reserved:
            self.start_load(request, handle)
            return None
        cfg = self.config
        if not handle_usable(handle, cfg.read_timeout_s, cfg.release_timeout_s):
            self.stats.expired_handles += 1
            self._notify_only(handle)
            if cfg.on_failure == "fail":
                self.scheduler.abort(request_id)
                why = (
                    f"kv_handle.expires_at: handle of {request_id!r} arrived too late to read "
                    "(transfer.on_failure=fail)"
                )
                return RequestOutput(request_id, [], True, RequestStatus.FINISHED_ERROR.value, error=why)
            log.warning("%s: handle of %s arrived too late to read; recomputing", self.name, request_id)
            self.scheduler.finish_kv_load(request_id, ok=False)
            return None
        self._read_into(request_id, handle)
        return None

    def discard_handle(self, handle: KVHandle) -> None:
        """A handle nobody will read (its request ended here): let its owner free at once."""
        self._notify_only(handle)

    def start_load(self, request: Request, handle: KVHandle) -> None:
        """Admit ``request`` (checked against ``handle``) and start reading the handle's KV into
        its blocks; a handle too late to read is notified and the prompt computed here."""
        request_id = request.request_id
        self._check_ranks(handle)
        cfg = self.config
        if not handle_usable(handle, cfg.read_timeout_s, cfg.release_timeout_s):
            # Its owner frees (or already freed) the blocks before a read could end: reading
            # them could copy another request's KV. Compute the prompt here instead.
            self.stats.expired_handles += 1
            late = time.time() - (handle.expires_at - cfg.release_timeout_s)
            self._notify_only(handle)  # the owner may free at once
            if cfg.on_failure == "fail":
                raise ValueError(
                    f"kv_handle.expires_at: handle of {request_id!r} arrived {late:.1f} s after its export; "
                    f"its owner frees the blocks {cfg.release_timeout_s:g} s after it (transfer.on_failure=fail)"
                )
            log.warning(
                "%s: handle of %s arrived %.1f s after its export, too late to read; recomputing",
                self.name,
                request_id,
                late,
            )
            request.remote_prefill = False
            self.scheduler.add_request(request)
            return
        if self.scheduler.add_transferred_request(request, handle.num_tokens) is None:
            self._notify_only(handle)  # nothing to read: still tell the owner so it frees at once
            return
        self._read_into(request_id, handle)

    def _read_into(self, request_id: str, handle: KVHandle) -> None:
        """Start reading ``handle``'s blocks into the request's fresh blocks (it waits for KV)."""
        tables = self.coordinator.block_ids(request_id)
        fresh = [set(group) for group in self.coordinator.unhashed_block_ids(request_id)]
        try:
            pairs = plan_read(handle, tables, fresh, self.group_pools)
        except ValueError as e:
            log.warning("%s: cannot read %s from %s (%s); recomputing", self.name, request_id, handle.agent.name, e)
            self.scheduler.finish_kv_load(request_id, ok=False)
            self._notify_only(handle)
            return
        if handle.agent.name not in self.transfer.peers:
            self.stats.cold_reads += 1  # this read pays the connection setup
        ranks = self.ranks
        # split over ranks: the owner is notified once every rank's read ended (``progress``)
        tid = self.transfer.start_read(handle.agent, pairs, notify=b"" if ranks else handle.notify_key)
        if ranks is not None:
            ranks.start(tid, handle.agent, pairs, handle.notify_key)
        self.loads.reads[tid] = request_id
        self.stats.reads += 1

    def _check_ranks(self, handle: KVHandle) -> None:
        """ValueError naming the field unless the handle's owner is split over as many
        tensor-parallel ranks as this worker (each rank reads its own shard from its peer)."""
        if self.ranks is not None:
            self.ranks.check(handle.agent)
        elif handle.agent.tensor_parallel_size != 1:
            raise ValueError(
                f"workers.tensor_parallel_size: the prefill worker {handle.agent.name!r} runs "
                f"{handle.agent.tensor_parallel_size} ranks, this decode worker 1; a P/D transfer needs the same "
                "size on both sides"
            )

    def _notify_only(self, handle: KVHandle) -> None:
        """Tell the owner it may free the handle's blocks, reading nothing."""
        tid = self.transfer.start_read(handle.agent, [], notify=handle.notify_key)
        self.loads.notify_only.add(tid)
        self.stats.notify_only += 1

    def warm_peer(self, peer: AgentInfo) -> bool:
        """Open the connection to a prefill worker's transfer agent now (its descriptors and the
        transport's endpoint and every memory region's keys), so the first real read from it
        pays no setup (``KVTransfer.warm_up``). False if the peer is known already (or unusable:
        the real read then fails or recomputes as before)."""
        transfer = self.transfer
        if peer.name in transfer.peers or peer.name == transfer.agent_info.name:
            return False
        if peer.name in self.warm_attempted:  # tried before and it did not stay a peer (e.g. a dead agent)
            return False
        self.warm_attempted.add(peer.name)
        started = time.perf_counter()
        tid = transfer.warm_up(peer)
        self.loads.notify_only.add(tid)
        self.stats.warm_ups += 1
        log.debug(
            "%s: warmed the connection to %s in %.1f ms", self.name, peer.name, 1e3 * (time.perf_counter() - started)
        )
        return True

    # -- prefill side: exports -----------------------------------------------------------------------
    def export(self, request_id: str, num_tokens: int | None = None) -> KVHandle:
        """The handle of a prefilled request (of its first ``num_tokens`` tokens: all by default);
        its blocks stay held until the reader is done. Returns only once the forward that wrote
        those blocks has finished on the device (a reader's copy is not ordered after it)."""
        self.runner.wait_kv_written()
        request = self.scheduler.held[request_id]
        num_tokens = request.num_tokens if num_tokens is None else num_tokens
        null = self.coordinator.null_block_id
        tables = tuple(
            tuple(NULL_BLOCK if b == null else b for b in group) for group in self.coordinator.block_ids(request_id)
        )
        expires_at = self.held.hold(request_id)
        return KVHandle(
            request_id,
            num_tokens,
            token_digest(request.token_ids[:num_tokens]),
            tables,
            self.agent_info,
            self.layout_key,
            expires_at,
        )

    def export_prefix(self, request_id: str, prefix: list[int]) -> KVHandle | None:
        """Hold the cached prefix ``prefix`` (checked token ids) for a peer to copy, as
        ``EngineCore.export_prefix`` describes; None when this cache no longer serves the whole
        prefix, or the hold does not fit."""
        if not prefix or request_id in self.scheduler.held or request_id in self.scheduler.requests:
            return None
        # One token past the prefix, so the lookup may return all of it (a hit stops before a
        # request's last token); that token is never computed.
        request = Request(request_id, [*prefix, 0], SamplingParams(max_tokens=1), self.coordinator.hash_block_size)
        hit = self.coordinator.get_computed_blocks(request)
        if hit.num_tokens < len(prefix):
            return None
        if self.coordinator.allocate_slots(request, 1, hit, delay_cache=True) is None:
            return None
        request.num_computed_tokens = hit.num_tokens
        self.coordinator.remove_skipped_blocks(request_id, hit.num_tokens)
        request.status = RequestStatus.FINISHED_REMOTE_DECODE
        self.scheduler.held[request_id] = request
        return self.export(request_id, len(prefix))

    # -- every step ----------------------------------------------------------------------------------
    def progress(self) -> list[RequestOutput]:
        """Release the blocks whose reader is done (or late), and end the reads that finished;
        returns the outputs of requests that failed on their read."""
        transfer = self.transfer
        results: list[RequestOutput] = []
        if self.exports_prefills or self.held:
            notified, expired = self.held.due(transfer.owner_notifications())
            for request_id in notified:
                self.scheduler.release_held(request_id)
            for request_id in expired:
                log.warning(
                    "%s: no reader for %s within %.1f s; freeing its blocks",
                    self.name,
                    request_id,
                    self.held.release_timeout_s,
                )
                self.scheduler.release_held(request_id)
            self.stats.released_by_notification += len(notified)
            self.stats.released_by_timeout += len(expired)
        loads = self.loads
        if loads.notify_only:
            for tid, status in transfer.poll(list(loads.notify_only)).items():
                if status in (DONE, FAILED):
                    loads.notify_only.discard(tid)
                    transfer.release(tid)
        if loads.reads:
            ended = {tid: s for tid, s in transfer.poll(list(loads.reads)).items() if s in (DONE, FAILED)}
            if self.ranks is not None and ended:
                ended = self.ranks.settle(ended)  # only those ended on every rank
            for tid, status in ended.items():
                request_id = loads.reads.pop(tid)
                record = transfer.read_record(tid)
                transfer.release(tid)
                if self.ranks is not None:  # no rank reads the owner's blocks any more: it may free them
                    peer, notify = self.ranks.take(tid)
                    loads.notify_only.add(transfer.start_read(peer, [], notify=notify))
                result = self._load_ended(request_id, status == DONE, record)
                if result is not None:
                    results.append(result)
        return results

    def _load_ended(self, request_id: str, ok: bool, record: ReadRecord) -> RequestOutput | None:
        stats = self.stats
        if request_id in self.loads.aborted:
            self.loads.aborted.discard(request_id)
            self.scheduler.abort(request_id)
            return None
        if ok:
            seconds = time.monotonic() - record.started
            stats.blocks += record.num_blocks
            stats.bytes += record.nbytes
            stats.seconds += seconds
            self.completed_reads.append(CompletedRead(record.nbytes, seconds))
            self.scheduler.finish_kv_load(request_id, ok=True)
            return None
        stats.failures += 1
        if self.config.on_failure == "fail":
            log.error("%s: KV read for %s failed (%s); failing the request", self.name, request_id, record.error)
            self.scheduler.abort(request_id)
            return RequestOutput(
                request_id,
                [],
                True,
                RequestStatus.FINISHED_ERROR.value,
                error=f"KV read from the prefill worker failed ({record.error})",
            )
        log.warning("%s: KV read for %s failed (%s); recomputing locally", self.name, request_id, record.error)
        self.scheduler.finish_kv_load(request_id, ok=False)
        return None
