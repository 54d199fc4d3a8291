"""The KV-handle side of P/D for ``EngineCore``: pulling a handle's KV into a request's blocks
(decode), exporting held blocks as a handle (a prefill's result, or a cached prefix a peer copies
for a pin), and progressing the reads and releases of the transfer each step.

A mixin of ``EngineCore``; everything here runs on the engine's thread.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from engine.disagg import NULL_BLOCK, KVHandle, handle_usable, token_digest
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import RequestOutput
from engine.transfer import DONE, FAILED
from engine.validation import check_request_id, check_token_ids

log = logging.getLogger(__name__)


class PDTransferMixin:
    """Reads of handles, exports of held blocks, and their progress (state: none of its own; it
    works on EngineCore's ``transfer``, ``loads``, ``held`` and ``transfer_stats``).

    Invariants: a block exported in a handle stays held (``held``, ``scheduler.held``) until its
    reader's notification or ``transfer.release_timeout_s``; a request whose read is in flight
    (``loads.reads``) keeps its blocks until that read has ended, even when aborted meanwhile
    (``loads.aborted``); every handle received is either read or answered with a notification.
    """

    scheduler: Any
    coordinator: Any
    transfer: Any
    config: Any
    name: str
    kv_role: Any
    info: Any
    held: Any
    loads: Any
    transfer_stats: Any
    agent_info: Any
    _read_into: Any

    def _start_load(self, request: Request, handle: KVHandle) -> None:
        assert self.transfer is not None
        request_id = request.request_id
        cfg = self.config.transfer
        if not handle_usable(handle, cfg.read_timeout_s, cfg.release_timeout_s):
            # Its owner frees (or already freed) the blocks before a read could end: reading
            # them could copy another request's KV. Compute the prompt here instead.
            self.transfer_stats.expired_handles += 1
            late = time.time() - (handle.expires_at - cfg.release_timeout_s)
            self._notify_only(handle)  # the owner may free at once
            if cfg.on_failure == "fail":
                raise ValueError(
                    f"kv_handle.expires_at: handle of {request_id!r} arrived {late:.1f} s after its export; "
                    f"its owner frees the blocks {cfg.release_timeout_s:g} s after it (transfer.on_failure=fail)"
                )
            log.warning("%s: handle of %s arrived %.1f s after its export, too late to read; recomputing",
                        self.name, request_id, late)  # fmt: skip
            request.remote_prefill = False
            self.scheduler.add_request(request)
            return
        if self.scheduler.add_transferred_request(request, handle.num_tokens) is None:
            self._notify_only(handle)  # nothing to read: still tell the owner so it frees at once
            return
        self._read_into(request_id, handle)

    def _notify_only(self, handle: KVHandle) -> None:
        """Tell the owner it may free the handle's blocks, reading nothing."""
        assert self.transfer is not None
        tid = self.transfer.start_read(handle.agent, [], notify=handle.notify_key)
        self.loads.notify_only.add(tid)
        self.transfer_stats.notify_only += 1

    def _export(self, request_id: str, num_tokens: int | None = None) -> KVHandle:
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

    def _progress_transfers(self) -> list[RequestOutput]:
        transfer = self.transfer
        assert transfer is not None
        results: list[RequestOutput] = []
        if self.kv_role != "decode" or self.held:  # a decode engine holds only exported prefixes
            notified, expired = self.held.due(transfer.owner_notifications())
            for request_id in notified:
                self.scheduler.release_held(request_id)
            for request_id in expired:
                log.warning("%s: no reader for %s within %.1f s; freeing its blocks", self.name, request_id,
                            self.held.release_timeout_s)  # fmt: skip
                self.scheduler.release_held(request_id)
            self.transfer_stats.released_by_notification += len(notified)
            self.transfer_stats.released_by_timeout += len(expired)
        loads = self.loads
        if loads.notify_only:
            for tid, status in transfer.poll(list(loads.notify_only)).items():
                if status in (DONE, FAILED):
                    loads.notify_only.discard(tid)
                    transfer.release(tid)
        if loads.reads:
            for tid, status in transfer.poll(list(loads.reads)).items():
                if status not in (DONE, FAILED):
                    continue
                request_id = loads.reads.pop(tid)
                record = transfer.read_record(tid)
                transfer.release(tid)
                result = self._load_ended(request_id, status == DONE, record)
                if result is not None:
                    results.append(result)
        return results

    def _load_ended(self, request_id: str, ok: bool, record: Any) -> RequestOutput | None:
        stats = self.transfer_stats
        if request_id in self.loads.aborted:
            self.loads.aborted.discard(request_id)
            self.scheduler.abort(request_id)
            return None
        if ok:
            stats.blocks += record.num_blocks
            stats.bytes += record.nbytes
            stats.seconds += time.monotonic() - record.started
            self.scheduler.finish_kv_load(request_id, ok=True)
            return None
        stats.failures += 1
        if self.config.transfer.on_failure == "fail":
            log.error("%s: KV read for %s failed (%s); failing the request", self.name, request_id, record.error)
            self.scheduler.abort(request_id)
            return RequestOutput(request_id, [], True, RequestStatus.FINISHED_ERROR.value,
                                 error=f"KV read from the prefill worker failed ({record.error})")  # fmt: skip
        log.warning("%s: KV read for %s failed (%s); recomputing locally", self.name, request_id, record.error)
        self.scheduler.finish_kv_load(request_id, ok=False)
        return None

    def export_prefix(self, request_id: str, token_ids: list[int]) -> KVHandle | None:
        """Hold the cached prefix ``token_ids`` for a peer to copy (a pin re-established by
        transfer): a handle like a prefill's, whose blocks stay held until the reader's
        notification or ``transfer.release_timeout_s``. The reader loads it as the decode side
        of P/D does (``add_request(token_ids + [t], ..., kv_handle=handle)``). None when this
        cache no longer serves the whole prefix, or the hold does not fit (the reader computes)."""
        if self.transfer is None:
            raise ValueError(f"kv_role: engine {self.name!r} was built without one, so it cannot export a prefix")
        check_request_id(request_id)
        prefix = check_token_ids(token_ids, self.info.arch.vocab_size, "token_ids")
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
        return self._export(request_id, len(prefix))
