"""EngineCore: one worker's synchronous engine — scheduler + coordinator + model runner, and
(with a ``kv_role``) the KV transfer object of prefill/decode disaggregation.

``add_request`` / ``step`` / ``abort``; no threads, no ray. ``step`` progresses transfers,
schedules, runs the model and returns the tokens each request gained, with finish flags.
P/D (see ``engine.disagg``): ``add_request(prefill_only=True)`` on the prefill engine finishes
with ``finish_reason="remote_decode"`` and a ``KVHandle``; ``add_request(kv_handle=...)`` on the
decode engine pulls that KV, then decodes.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Literal

import torch

from configs.schema import ClusterConfig
from configs.models import SourceKind
from engine.disagg import (
    NULL_BLOCK,
    HeldBlocks,
    KVHandle,
    PendingLoads,
    TransferStats,
    check_handle,
    handle_usable,
    token_digest,
)
from engine.kv_cache.coordinator import HybridCoordinator, RetentionOptions
from engine.kv_cache.events import KVEvent
from engine.kv_cache.spec import KVCacheGroup
from engine.model.arch import ModelArch
from engine.model.kv_budget import blocks_per_pool
from engine.model.kv_layout import build_kv_layout
from engine.model.loader import CheckpointError, build_model, load_hf_directory
from engine.remote_prefill import Expected, RemotePrefillMixin
from engine.request import Request, RequestStatus
from engine.runner import TORCH_DTYPES, ModelRunner
from engine.sampling_params import SamplingParams
from engine.scheduler import RequestOutput, Scheduler, SchedulerOutput
from engine.transfer import DONE, FAILED, AgentInfo, KVTransfer, transfer_from_config
from engine.validation import InvalidRequestError, check_request_id, check_token_ids, problem

KVRole = Literal["prefill", "decode", "both"]
#: batches in a row whose forward raised before an engine counts as broken (``EngineBroken``)
MAX_CONSECUTIVE_FAILED_STEPS = 3
_TRANSFER_ROLE = {"prefill": "owner", "decode": "reader", "both": "both"}

log = logging.getLogger(__name__)


class EngineBroken(RuntimeError):
    """The engine cannot go on (its state is inconsistent, or every step fails): the worker
    owning it must be taken out of service and replaced."""


def cache_root() -> Path:
    return Path(os.environ.get("KVFLEET_CACHE", Path.home() / ".cache" / "kvfleet"))


def resolve_model_directory(config: ClusterConfig) -> Path:
    """The Hugging Face directory to load for ``config.model.source`` (building tiny models)."""
    model = config.model
    kind = model.source_kind
    if kind is SourceKind.HF_DIRECTORY:
        return Path(model.source).expanduser()
    if kind is SourceKind.TINY_RANDOM:
        from engine.model.tiny import build_tiny_checkpoint

        directory = Path(model.weights_cache_dir or cache_root() / "tiny") / f"{model.source}-seed{model.seed}"
        if not (directory / "config.json").is_file():
            log.info("building tiny random checkpoint %s in %s", model.source, directory)
            build_tiny_checkpoint(model.source, directory, seed=model.seed)
        return directory
    from engine.model.gguf import ensure_hf_directory

    cache = Path(model.weights_cache_dir) if model.weights_cache_dir else None
    return ensure_hf_directory(model.source, cache)


@dataclass(frozen=True)
class EngineInfo:
    arch: ModelArch
    num_blocks: int
    block_size: int
    max_model_len: int
    pool_blocks: tuple[int, ...] = ()  # blocks per pool (null included); num_blocks is pool 0's


class EngineCore(RemotePrefillMixin):
    """Owns the scheduler, the KV-cache coordinator, the model runner and (with a ``kv_role``)
    the transfer object of one worker.

    Invariants: every block is owned by exactly one of: a running / waiting-for-KV request, a
    prefill-only request held for its reader (released on the reader's notification or after
    ``transfer.release_timeout_s``), or the pool; a transfer only writes blocks the coordinator
    allocated to the request it serves, and those stay allocated until the read has ended.
    """

    def __init__(
        self,
        config: ClusterConfig,
        model_directory: str | Path | None = None,
        threads: int | None = None,
        *,
        name: str | None = None,
        kv_role: KVRole | None = None,
    ):
        self.config = config
        if threads:
            torch.set_num_threads(threads)
        if kv_role is not None and kv_role not in _TRANSFER_ROLE:
            raise ValueError(f"kv_role: expected one of {sorted(_TRANSFER_ROLE)} or None, got {kv_role!r}")
        directory = Path(model_directory) if model_directory else resolve_model_directory(config)
        arch, weights = load_hf_directory(directory, config.model.sliding_window_override)
        dtype = "float32" if config.model.dtype == "auto" else config.model.dtype
        device = torch.device(config.model.device)
        cache = config.kv_cache
        layout = build_kv_layout(arch, cache.block_size, dtype)
        model = build_model(arch, layout.layer_group, weights, TORCH_DTYPES[dtype], device, str(directory))
        del weights
        num_blocks = blocks_per_pool(layout, cache, config.scheduler.max_num_seqs)
        max_model_len = config.model.max_model_len or arch.max_position_embeddings
        pinning = cache.pinning
        self.coordinator = HybridCoordinator(
            layout.groups,
            num_blocks,
            enable_caching=cache.prefix_caching,
            retention=RetentionOptions(
                pinning.enabled, pinning.budget_blocks, pinning.pin_sliding_window, pinning.min_drop_blocks
            ),
            enable_events=True,
            max_model_len=max_model_len,
        )
        self.scheduler = Scheduler(config.scheduler, self.coordinator, max_model_len)
        self.name = name or (kv_role or "engine")
        self.kv_role = kv_role
        self.transfer: KVTransfer | None = None
        if kv_role is not None:
            self.transfer = transfer_from_config(config.transfer, self.name, role=_TRANSFER_ROLE[kv_role])  # type: ignore[arg-type]
        try:
            allocate = self.transfer.allocate_slots if self.transfer is not None else None
            self.runner = ModelRunner(arch, layout, model, num_blocks, device, dtype, allocate_slots=allocate)
            self._agent_info = (
                self.transfer.register(self.runner.slots, layout.slot_pool) if self.transfer is not None else None
            )
        except BaseException:
            if self.transfer is not None:
                self.transfer.close()
            raise
        self.layout = layout
        self.layout_key = "|".join([arch.architecture, dtype, layout.describe()])
        self.held = HeldBlocks(config.transfer.release_timeout_s)
        self.loads = PendingLoads()
        self.expected: dict[str, Expected] = {}  # announced remote prefills (engine.remote_prefill)
        self.transfer_stats = TransferStats()
        self.consecutive_failed_steps = 0
        #: called right after each step's scheduling, before the forward (the owner reports the
        #: cache events of that scheduling: the blocks it evicted are gone already)
        self.on_scheduled: Callable[[], None] | None = None
        self.failed_steps = 0
        self.failed_requests = 0
        self.info = EngineInfo(arch, num_blocks[0], cache.block_size, max_model_len, num_blocks)
        self.model_directory = directory
        eos = arch.eos_token_ids
        self.eos_token_id = eos[0] if eos else None
        log.info(
            "engine %s ready: %s, %d layers, %d KV groups, blocks per pool %s (%s), %d-token pages%s",
            self.name, arch.architecture, arch.num_layers, len(layout.groups), list(num_blocks),
            ", ".join(f"{p.kind} {p.page_bytes} B x {p.num_slots}" for p in layout.pools), cache.block_size,
            f", kv_role={kv_role} ({config.transfer.backend})" if kv_role else "",
        )  # fmt: skip

    @property
    def agent_info(self) -> AgentInfo:
        """This worker's transfer registration (plain data a peer needs to read its blocks)."""
        if self._agent_info is None:
            raise ValueError(f"engine {self.name!r}: no kv_role, so no transfer registration")
        return self._agent_info

    # -- requests ----------------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        *,
        prefill_only: bool = False,
        kv_handle: KVHandle | None = None,
    ) -> Request:
        """Queue a request. ``prefill_only``: compute its prompt's KV for a decode worker (the
        result carries a ``KVHandle``); ``kv_handle``: pull that KV instead of computing it.
        Raises ValueError naming the argument for a bad id, token ids or sampling parameters."""
        if prefill_only and kv_handle is not None:
            raise ValueError("prefill_only and kv_handle: a request is either prefilled here or pulled, not both")
        if (prefill_only or kv_handle is not None) and self.transfer is None:
            raise ValueError(f"kv_role: engine {self.name!r} was built without one, so it cannot do P/D transfers")
        if prefill_only:
            request = self._checked_request(request_id, prompt_token_ids, sampling, prefill_only=True)
            self.scheduler.add_request(request)
            return request
        request = self._checked_request(request_id, prompt_token_ids, sampling, remote_prefill=kv_handle is not None)
        if kv_handle is not None:
            check_handle(kv_handle, self.layout_key, request.token_ids)
        if kv_handle is None:
            self.scheduler.add_request(request)
        else:
            self._start_load(request, kv_handle)
        return request

    def _checked_request(
        self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams, **kwargs: Any
    ) -> Request:
        """A new Request after the argument checks (ValueError naming the argument); a
        ``prefill_only`` one covers all but the prompt's last token."""
        check_request_id(request_id)
        if request_id in self.expected:
            raise ValueError(f"request_id: {request_id!r} is already in this engine")
        prompt = check_token_ids(prompt_token_ids, self.info.arch.vocab_size, "prompt_token_ids")
        if not prompt:
            raise InvalidRequestError(problem("prompt_token_ids", "must not be empty", prompt_token_ids))
        sampling = SamplingParams.coerce(sampling)
        if kwargs.get("prefill_only"):
            if len(prompt) < 2:
                raise ValueError(
                    f"prompt_token_ids: a prefill-only request needs >= 2 tokens (got {len(prompt)}); run it colocated"
                )
            prompt = prompt[:-1]
        return Request(request_id, list(prompt), sampling, self.coordinator.hash_block_size, self.eos_token_id,
                       **kwargs)  # fmt: skip

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

    def abort(self, request_id: str) -> bool:
        """Stop a request wherever it is and free its blocks (once any read into them has ended)."""
        self.runner.sampler.forget(request_id)
        if self.forget_expected(request_id):  # announced, no read started: its blocks free now
            return True
        if request_id in self.scheduler.waiting_for_kv:  # a read into its blocks is in flight
            self.loads.aborted.add(request_id)
            return True
        self.held.forget(request_id)
        return self.scheduler.abort(request_id)

    # -- one step ----------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Progress transfers, run one scheduled batch, return what each request gained.

        Fault isolation: a row that cannot be sampled fails only its request; a forward that
        raises fails only the requests of that batch (their blocks freed, anything the failed
        step registered in the prefix cache taken out) and the engine goes on. ``EngineBroken``
        is raised only when it cannot go on: its bookkeeping no longer holds, or
        ``MAX_CONSECUTIVE_FAILED_STEPS`` batches in a row failed."""
        results = self._progress_transfers() if self.transfer is not None else []
        scheduler = self.scheduler
        if scheduler.running or scheduler.waiting:
            output = scheduler.schedule()
            if self.on_scheduled is not None:
                self.on_scheduled()
            try:
                sampled = self.runner.execute(output)
            except Exception as exc:  # noqa: BLE001 - a failed batch must not stop the engine
                results.extend(self._fail_batch(output, exc))
                return results
            self.consecutive_failed_steps = 0
            for request_id, why in sampled.failures.items():
                results.append(self._fail_request(request_id, why))
            for result in scheduler.update(output, sampled.tokens):
                if result.finished:
                    self.runner.sampler.forget(result.request_id)
                if result.finish_reason == RequestStatus.FINISHED_REMOTE_DECODE.value:
                    result = replace(result, kv_handle=self._export(result.request_id))
                results.append(result)
        return results

    def _fail_batch(self, output: SchedulerOutput, exc: Exception) -> list[RequestOutput]:
        self.consecutive_failed_steps += 1
        self.failed_steps += 1
        why = f"engine step failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        log.error("%s: %s (%d requests in the batch)", self.name, why, len(output.chunks), exc_info=exc)
        results = []
        for chunk in output.chunks:
            request_id = chunk.request.request_id
            self.coordinator.discard_uncomputed(request_id, chunk.start)
            results.append(self._fail_request(request_id, why))
        try:
            self.coordinator.check_invariants()
        except Exception as broken:
            raise EngineBroken(f"{self.name}: KV cache inconsistent after a failed step ({broken})") from exc
        if self.consecutive_failed_steps >= MAX_CONSECUTIVE_FAILED_STEPS:
            raise EngineBroken(f"{self.name}: {self.consecutive_failed_steps} steps in a row failed ({why})") from exc
        return results

    def _fail_request(self, request_id: str, why: str) -> RequestOutput:
        """End one request with ``finish_reason="error"``, freeing its blocks."""
        self.failed_requests += 1
        self.runner.sampler.forget(request_id)
        self.scheduler.finish(request_id, RequestStatus.FINISHED_ERROR)
        return RequestOutput(request_id, [], True, RequestStatus.FINISHED_ERROR.value, error=why)

    def _export(self, request_id: str, num_tokens: int | None = None) -> KVHandle:
        """The handle of a prefilled request (of its first ``num_tokens`` tokens: all by default);
        its blocks stay held until the reader is done."""
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

    # -- state -------------------------------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        """Anything outstanding: requests to compute, reads in flight, or blocks held for readers."""
        return self.scheduler.has_work or bool(self.loads) or bool(self.held)

    @property
    def has_compute_work(self) -> bool:
        """Requests the next ``step`` will run the model for."""
        return bool(self.scheduler.running or self.scheduler.waiting)

    def take_events(self) -> list[KVEvent]:
        """KV events (stored / removed / pinned / ...) since the last call, for the router."""
        return self.coordinator.take_events()

    # -- what a worker actor reports and asks (it never reaches into the scheduler or the cache) ---
    def load(self) -> tuple[float, int, float]:
        """(tokens still to compute, requests holding KV, fraction of the tightest pool in use)."""
        scheduler = self.scheduler
        queued = sum(r.num_tokens - r.num_computed_tokens for r in scheduler.waiting)
        queued += sum(max(0, r.num_tokens - r.num_computed_tokens - 1) for r in scheduler.running)
        running = len(scheduler.running) + len(scheduler.waiting_for_kv)
        return float(queued), running, min(1.0, max(0.0, self.coordinator.usage))

    def cache_gauges(self) -> dict[str, float]:
        """Free and pinned-free blocks (tightest pool), prefix-cache hit rate, running and waiting."""
        scheduler, coordinator = self.scheduler, self.coordinator
        pool = coordinator.pools[coordinator.tightest_pool]
        queried = scheduler.queried_tokens
        return {
            "free_blocks": pool.num_free_blocks,
            "pinned_free_blocks": pool.num_pinned_free_blocks,
            "hit_rate": scheduler.hit_tokens / queried if queried else 0.0,
            "running": len(scheduler.running),
            "waiting": len(scheduler.waiting) + len(scheduler.waiting_for_kv),
        }

    @property
    def kv_groups(self) -> list[KVCacheGroup]:
        """The KV-cache groups of this engine (the router predicts hits with the same ones)."""
        return list(self.coordinator.groups)

    def cached_prefix_tokens(self, block_hashes: list[bytes], num_tokens: int) -> int:
        """Tokens of the prefix ``block_hashes`` (up to ``num_tokens``) this cache could serve now."""
        return self.coordinator.find_longest_cache_hit(block_hashes, num_tokens).num_tokens

    def pin_prefix(self, block_hashes: list[bytes], num_tokens: int) -> int:
        """Pin the cached prefix; returns the tokens pinned."""
        return self.coordinator.pin_prefix(block_hashes, num_tokens)

    def unpin_prefix(self, block_hashes: list[bytes], num_tokens: int) -> bool:
        return self.coordinator.unpin_prefix(block_hashes, num_tokens)

    def refresh_prefix(self, block_hashes: list[bytes], num_tokens: int) -> int:
        """Mark the cached blocks a hit of ``num_tokens`` tokens needs as just used (each pool's
        free queue evicts them last, a prefix's tail before its head), so the hit the router
        predicted for a request routed here survives the allocations of the requests ahead of
        it; returns the tokens that hit covers now (0: nothing to refresh)."""
        hit = self.coordinator.find_longest_cache_hit(block_hashes, num_tokens)
        if hit.num_tokens <= 0:
            return 0
        for g, manager in enumerate(self.coordinator.managers):
            blocks = [block for block in hit.blocks[g] if not block.is_null]
            if blocks:
                manager.pool.touch(blocks)
                manager.pool.free_blocks(blocks[::-1])
        return hit.num_tokens

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

    @property
    def event_seq(self) -> int:
        """Sequence number of the last KV event emitted."""
        return self.coordinator.event_seq

    def cache_snapshot(self) -> tuple[int, tuple[dict[bytes, int], ...]]:
        """(event seq, per group every cached hash and its pin level): a router resync."""
        return self.coordinator.snapshot()

    def stats(self) -> dict[str, Any]:
        """Queue lengths, block counts, hit counters and transfer counters (plain data).

        ``num_blocks`` / ``free_blocks`` / ``pinned_blocks`` describe pool 0 (the attention pool
        of a hybrid layout, the only pool otherwise); ``capacity.pools`` has every pool."""
        scheduler, pool = self.scheduler, self.coordinator.pool
        return {
            "running": len(scheduler.running),
            "waiting": len(scheduler.waiting),
            "waiting_for_kv": len(scheduler.waiting_for_kv),
            "held_for_transfer": len(scheduler.held),
            "expecting_handles": len(self.expected),
            "queued_tokens": sum(r.num_tokens - r.num_computed_tokens for r in scheduler.waiting),
            "num_blocks": self.info.num_blocks - 1,
            "free_blocks": pool.num_free_blocks,
            "capacity": self.capacity(),
            "pinned_blocks": pool.num_pinned_free_blocks,  # explicit pins + retained window/state anchors
            "explicitly_pinned_blocks": pool.explicit.size,
            "hit_tokens": scheduler.hit_tokens,
            "queried_tokens": scheduler.queried_tokens,
            "num_preemptions": scheduler.num_preemptions,
            "failed_steps": self.failed_steps,
            "failed_requests": self.failed_requests,
            "transfer": asdict(self.transfer_stats),
        }

    def capacity(self) -> dict[str, Any]:
        """What this worker's KV memory holds: ``tokens`` of attention KV, ``recurrent_states``
        (requests' full recurrent states), and per pool its kind, page size and blocks."""
        coordinator, layout = self.coordinator, self.layout
        pools = [
            {"kind": pool.kind, "page_bytes": pool.page_bytes, "slots": pool.num_slots,
             "num_blocks": coordinator.num_blocks_in(p), "free_blocks": coordinator.num_free_blocks_in(p)}
            for p, pool in enumerate(layout.pools)
        ]  # fmt: skip
        return {**layout.capacity(self.info.pool_blocks), "bytes": layout.pool_bytes(self.info.pool_blocks),
                "pools": pools}  # fmt: skip

    def close(self) -> None:
        """Release the transfer registration (pending reads are cancelled). Idempotent."""
        if self.transfer is not None:
            self.transfer.close()
