"""Continuous batching over one HybridCoordinator: chunked prefill, prefix hits, preemption.

Each ``schedule()`` builds one step: running requests first (decode tokens and prefill chunks,
preempting the newest running request when blocks run out), then waiting requests in arrival
order while the token budget and ``max_num_seqs`` allow. ``update()`` takes the sampled tokens,
applies stop conditions and frees finished requests. Requests whose prompt KV arrives by
transfer wait in ``waiting_for_kv`` (blocks held, nothing computed) until ``finish_kv_load``.

Never raises or hangs on memory pressure: a request that cannot get blocks waits; a running one
is preempted (its blocks freed, recomputed later, usually from its own cached prefix).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from configs.schema import SchedulerConfig
from engine.kv_cache.block_queue import Block
from engine.kv_cache.coordinator import CacheHit, HybridCoordinator
from engine.kv_cache.request import CacheRequest
from engine.kv_cache.spec import MambaSpec
from engine.logprobs import TokenLogprob
from engine.request import Request, RequestStatus, UncheckedRequestError

log = logging.getLogger(__name__)


@dataclass(slots=True)
class ScheduledChunk:
    """``num_tokens`` tokens of ``request`` starting at position ``start`` run this step.

    ``tables`` is the request's block table per group, the coordinator's live lists
    (``HybridCoordinator.live_tables``): valid for the step that scheduled the chunk, never
    copied, so scheduling a decode token does no per-block work; ``block_ids`` copies them out as
    ids. ``sample`` says whether this chunk reaches the end of the known tokens, so the last
    position's logits are sampled.
    """

    request: Request
    start: int
    num_tokens: int
    tables: list[list[Block]]
    sample: bool

    @property
    def block_ids(self) -> list[list[int]]:
        """The block table per group as block ids (a copy)."""
        return [[block.block_id for block in table] for table in self.tables]


@dataclass
class SchedulerOutput:
    """One step's work: chunks to run, and requests preempted or finished while scheduling."""

    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def prompt_tokens(self) -> int:
        """Tokens of the chunks that are not one decode token."""
        return sum(c.num_tokens for c in self.chunks if c.num_tokens > 1)


@dataclass(slots=True)
class RequestOutput:
    """Tokens a request gained in one step, and whether (and why) it finished. A prefill-only
    request finishes with ``finish_reason="remote_decode"`` and (from EngineCore) a ``kv_handle``."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    kv_handle: Any = None
    num_cached_tokens: int = -1  # the request's local prefix hit (+ transferred tokens) at admission
    error: str | None = None  # why a request finished with "error"
    # one per new token when its sampling asks for ``logprobs`` (engine.logprobs), else None
    logprobs: list[TokenLogprob] | None = None
    # with ``prompt_logprobs``, on the request's first output: one per prompt token, None for the
    # first (nothing predicts it)
    prompt_logprobs: list[TokenLogprob | None] | None = None


def recurrent_checkpoint(coordinator: HybridCoordinator, request: CacheRequest, hit: CacheHit) -> int:
    """Where a hybrid request's prefill must end a chunk so a recurrent state gets cached: the
    attention-only hit when it lies beyond ``hit`` (the hit every group serves), else 0.

    Align mode caches a recurrent state only at a chunk end on a block boundary. A request that
    shares a cached prefix but diverges inside one of that prefix's chunks hits its attention
    groups up to the divergence block and its recurrent groups only at the earlier chunk end, so
    ``hit`` stops there. Ending a chunk at the attention-only hit caches the state at that
    boundary, and the next request of the same prefix hits all of it.

    Example (block 16, chunk 64): request 1 = P + U1 cached states at 64 and 128; request 2 =
    P[:112] + U2 hits 64 (attention could serve 112); its chunk [64, 128) ends at 112 instead,
    so request 3 = P[:112] + U3 hits 112, not 64.
    """
    if hit.partial or hit.shared_prefix_tokens <= hit.num_tokens:
        return 0  # no group had cache beyond the hit (or the recurrent groups were left out)
    attention = coordinator.find_longest_cache_hit(request.block_hashes, request.num_tokens - 1, skip_mamba=True)
    return attention.num_tokens if attention.num_tokens > hit.num_tokens else 0


def aligned_chunk(start: int, num_new: int, num_tokens: int, align: int, stop: int = 0) -> int:
    """Tokens of a prefill chunk of at most ``num_new`` tokens from ``start`` in align mode
    (``align``: the coordinator's alignment), possibly 0 (wait for more budget).

    Chunks end on block boundaries up to the last one before the sequence end, so every chunk's
    final state is a cacheable checkpoint, and never cross ``stop`` (``recurrent_checkpoint``).
    This holds for 1-token chunks too: a budget remainder of 1 used to start a prefill with
    [0, 1) (or continue one with [64, 65)), leaving a state between boundaries in a block that the
    next chunk moved past (see MambaManager.cache_blocks); such a request now waits a step.
    """
    end = start + num_new
    last_boundary = num_tokens - num_tokens % align
    if start < last_boundary < end:
        end = last_boundary
    elif end < num_tokens:
        aligned = end - end % align
        if aligned > start:
            end = aligned
        elif start % align == 0:
            return 0  # not enough budget left to reach the next boundary this step
    if start < stop < end:
        end = stop
    return end - start


class Scheduler:
    """Owns the waiting / running / waiting-for-KV queues of one engine.

    Invariants: a request is in exactly one of ``waiting``, ``running``, ``waiting_for_kv`` or
    ``finished`` order; only running and waiting-for-KV requests hold blocks; the tokens scheduled
    in a step never exceed ``max_num_batched_tokens`` and running requests never exceed
    ``max_num_seqs``.
    """

    def __init__(self, config: SchedulerConfig, coordinator: HybridCoordinator, max_model_len: int):
        self.config = config
        self.coordinator = coordinator
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.waiting_for_kv: dict[str, Request] = {}
        self.requests: dict[str, Request] = {}
        self.held: dict[str, Request] = {}  # prefill-only requests whose blocks await a reader
        #: the predicted hits of requests routed here, held from arrival to admission
        self.leases = coordinator.leases
        mamba = [g.spec.block_size for g in coordinator.groups if isinstance(g.spec, MambaSpec)]
        self.mamba_align = coordinator.alignment if mamba else 0
        self.num_preemptions = 0
        self.hit_tokens = 0
        self.host_hit_tokens = 0  # the part of ``hit_tokens`` the host tier served
        self.queried_tokens = 0

    def _count_hit(self, request: Request, hit: CacheHit) -> None:
        """Count a first admission's hit, per tier (the request keeps its host part)."""
        host = self.coordinator.host_hit_tokens(hit)
        request.num_host_cached_tokens = host
        self.hit_tokens += hit.num_tokens
        self.host_hit_tokens += host

    # -- intake -------------------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        self.check_new(request)
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def lease_hit(self, request_id: str, block_hashes: list[bytes], num_tokens: int) -> int:
        """Hold the cached blocks of a hit of up to ``num_tokens`` tokens for ``request_id`` until
        its admission (``HitLeases.take``: a request routed here on that predicted hit); returns
        the tokens held."""
        return self.leases.take(request_id, block_hashes, num_tokens, time.monotonic())

    def check_new(self, request: Request) -> None:
        """Assert ``request`` may enter: an id this engine does not hold and room to generate.
        Its entry point checked the length (``engine.validation.check_room``) and the worker keeps
        ids unique, so a failure is an internal error (``UncheckedRequestError``)."""
        rid = request.request_id
        if rid in self.requests or rid in self.held:
            raise UncheckedRequestError(f"request {rid!r} is already in this engine")
        if request.num_tokens >= self.max_model_len:
            raise UncheckedRequestError(
                f"request {rid!r}: {request.num_tokens} tokens reached the engine unchecked "
                f"(max_model_len={self.max_model_len})"
            )

    def abort(self, request_id: str) -> bool:
        """Stop a request wherever it is and free its blocks; False if unknown or finished."""
        self.leases.release(request_id)
        if self.release_held(request_id):
            return True
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        if request in self.waiting:
            self.waiting.remove(request)
        if request in self.running:
            self.running.remove(request)
        self.waiting_for_kv.pop(request_id, None)
        self.coordinator.free(request_id)
        request.status = RequestStatus.FINISHED_ABORTED
        return True

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.waiting_for_kv)

    def is_running(self, request_id: str) -> bool:
        """Whether ``request_id`` is here and running (not finished, waiting or preempted)."""
        request = self.requests.get(request_id)
        return request is not None and request.status == RequestStatus.RUNNING

    # -- one step -------------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        coord = self.coordinator
        coord.new_step()
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        preempted = False
        if self.leases:
            self.leases.expire(time.monotonic())

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            start = request.num_computed_tokens
            # a decoding request computes its one new token (every chunking rule gives 1 here)
            num_new = 1 if len(request.token_ids) - start == 1 else self._chunk_size(request, start, budget)
            if num_new == 0:
                i += 1
                continue
            while coord.allocate_slots(request, num_new) is None:
                if self.leases.break_newest() is not None:
                    continue  # a waiting request's held hit gives way before a running one is preempted
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim.request_id)
                preempted = True
                if victim is request:
                    break
            else:
                out.chunks.append(self._chunk(request, num_new))
                budget -= num_new
                i += 1
                continue
            break  # the request itself was preempted; later ones were popped already

        if not preempted:
            self._admit(out, budget)
        return out

    def schedule_continuation(
        self, previous: SchedulerOutput, mixed: bool, launchable: Callable[[Request], bool]
    ) -> SchedulerOutput | None:
        """The step after ``previous``, scheduled while ``previous`` runs and before its tokens are
        known, as ``schedule`` would schedule it once they are: running requests first (in order,
        the same chunk sizes), then waiting requests while the budget and ``max_num_seqs`` allow.
        Each request that samples in ``previous`` and still runs gets one *placeholder* token
        (``num_computed_tokens`` runs one past ``token_ids`` until ``update`` appends the token
        the device sampled, whose id the step reads on the device): a decode, or the first decode
        of a request whose last prompt chunk is in ``previous``. Every other chunk's tokens are
        known (a prompt chunk, a running request ``previous`` left out for budget).

        ``mixed``: the step may hold prompt chunks (the runner launches token-bucket steps); if
        not, only the decode continuation of exactly the requests ``previous`` decodes is taken,
        and a waiting request ends the chain. ``launchable``: whether a request's rows may be
        sampled before the host knows their last token; a running or waiting request that is
        not ends the chain.

        A request that finishes by ``max_tokens`` or the model length on ``previous``'s token is
        left out (its seat counts as free; its blocks are freed by ``update``, so an admission
        that needs them waits a step). A request that stops on ``previous``'s token (EOS, a stop
        token) is computed once more for nothing: ``update`` skips it, as it skips every request
        no longer running. None, with nothing changed that the next ``schedule`` would not do
        alike, when a block cannot be had (the synchronous ``schedule`` then preempts) or
        nothing is left to schedule.
        """
        running = self.running
        if not running:
            return None
        pending = {
            c.request.request_id for c in previous.chunks if c.sample and c.request.status == RequestStatus.RUNNING
        }
        if not mixed and (self.waiting or len(pending) != len(running)):
            return None
        if not all(launchable(request) for request in running) or not all(launchable(r) for r in self.waiting):
            return None
        # requests that finish by length on ``previous``'s token: ``update`` ends them, so the
        # step leaves them out and admits as if their seats were free already
        leaving: set[str] = set()
        for request in running:
            if request.request_id not in pending:
                continue
            known = len(request.token_ids)
            if request.num_computed_tokens != known:  # ``previous`` computes the last known token
                return None
            if known + 1 >= self.max_model_len or known + 1 - request.prompt_len >= request.sampling.max_tokens:
                leaving.add(request.request_id)
        coord = self.coordinator
        coord.new_step()
        budget = self.config.max_num_batched_tokens
        planned: list[tuple[Request, int, int]] = []
        for request in running:
            if budget <= 0:
                break
            if request.request_id in leaving:
                continue
            start = request.num_computed_tokens
            known = len(request.token_ids) + (request.request_id in pending)
            num_new = 1 if known - start == 1 else self._chunk_size(request, start, budget)
            if num_new == 0:
                continue
            # blocks for this chunk; when one does not fit, those given so far serve the same
            # positions in the synchronous step that follows
            if coord.allocate_slots(request, num_new) is None:
                return None
            planned.append((request, num_new, known))
            budget -= num_new
        out = SchedulerOutput()
        for request, num_new, known in planned:
            out.chunks.append(self._chunk(request, num_new, known))
        if mixed:
            self._admit(out, budget, len(leaving))
        return out if out.chunks else None

    def _admit(self, out: SchedulerOutput, budget: int, leaving: int = 0) -> None:
        """Admit waiting requests in arrival order into ``out`` while ``budget`` tokens,
        ``max_num_seqs`` and the blocks allow (``leaving``: running requests about to finish,
        whose seats count as free)."""
        coord = self.coordinator
        while self.waiting and budget > 0 and len(self.running) - leaving < self.config.max_num_seqs:
            request = self.waiting[0]
            # its hit lease ends where its admission claims the same blocks (nothing runs between)
            leased = self.leases.release(request.request_id)
            # a request reporting prompt logprobs computes every prompt position (no prefix hit)
            hit = coord.find_longest_cache_hit([], 0) if request.scores_prompt else coord.get_computed_blocks(request)
            request.chunk_stop = self.chunk_stop(request, hit)
            num_new = self._chunk_size(request, hit.num_tokens, budget)
            if num_new == 0 or coord.allocate_slots(request, num_new, hit) is None:
                if leased:  # it waits: held again
                    self.lease_hit(request.request_id, request.block_hashes, leased)
                # with nothing running, no block comes free: the leases of requests behind it give way
                if num_new == 0 or self.running or self.leases.break_newest(keep=request.request_id) is None:
                    break
                continue
            self.waiting.popleft()
            if request.num_cached_tokens < 0:
                request.scheduled_at = time.monotonic()
                request.num_cached_tokens = hit.num_tokens
                self._count_hit(request, hit)
                self.queried_tokens += request.num_tokens
            request.num_computed_tokens = hit.num_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.chunks.append(self._chunk(request, num_new))
            budget -= num_new

    def chunk_stop(self, request: Request, hit: CacheHit) -> int:
        """The block boundary where a prefill chunk of ``request``, admitted with ``hit``, must end
        (0: none): ``recurrent_checkpoint`` for hybrid models; attention-only models have none."""
        return recurrent_checkpoint(self.coordinator, request, hit) if self.mamba_align else 0

    def _chunk_size(self, request: Request, start: int, budget: int) -> int:
        num_new = min(request.num_tokens - start, budget, self.config.prefill_chunk_size)
        if num_new <= 0 or not self.mamba_align:
            return max(num_new, 0)
        return aligned_chunk(start, num_new, request.num_tokens, self.mamba_align, request.chunk_stop)

    def _chunk(self, request: Request, num_new: int, known: int | None = None) -> ScheduledChunk:
        """``num_new`` tokens of ``request`` from its computed ones; ``known``: its tokens counting a
        placeholder (``schedule_continuation``), else ``token_ids``."""
        known = len(request.token_ids) if known is None else known
        start = request.num_computed_tokens
        end = start + num_new
        request.num_computed_tokens = end
        return ScheduledChunk(
            request,
            start,
            num_new,
            self.coordinator.live_tables(request.request_id),
            end == known and not request.prefill_only,
        )

    def _preempt(self, request: Request) -> None:
        self.coordinator.free(request.request_id)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        log.debug("preempted %s (%d tokens)", request.request_id, request.num_tokens)

    # -- results ----------------------------------------------------------------------------------------
    def update(self, output: SchedulerOutput, sampled: dict[str, int]) -> list[RequestOutput]:
        """Append each sampled token, apply stop conditions, free finished requests."""
        results: list[RequestOutput] = []
        for chunk in output.chunks:
            request = chunk.request
            if request.status != RequestStatus.RUNNING:
                continue
            if not chunk.sample:
                if request.prefill_only and chunk.start + chunk.num_tokens == request.num_tokens:
                    self._hold_prefilled(request)
                    results.append(
                        RequestOutput(
                            request.request_id, [], True, request.status.value, None, request.num_cached_tokens
                        )
                    )
                continue
            request_id = request.request_id
            token = sampled[request_id]
            request.append_token_ids((token,))
            status = request.check_stop_token(token)
            if status is None and len(request.token_ids) >= self.max_model_len:
                status = RequestStatus.FINISHED_LENGTH
            if status is None:
                results.append(RequestOutput(request_id, [token], False, None, None, request.num_cached_tokens))
                continue
            self.finish(request_id, status)
            results.append(RequestOutput(request_id, [token], True, status.value, None, request.num_cached_tokens))
        return results

    def _hold_prefilled(self, request: Request) -> None:
        """A prefill-only request computed all its tokens: keep its in-window blocks for a reader."""
        request_id = request.request_id
        self.running.remove(request)
        del self.requests[request_id]
        self.coordinator.remove_skipped_blocks(request_id, request.num_tokens)
        request.status = RequestStatus.FINISHED_REMOTE_DECODE
        self.held[request_id] = request

    def release_held(self, request_id: str) -> bool:
        """Free the blocks of a prefill-only request once its reader is done (or gave up)."""
        if self.held.pop(request_id, None) is None:
            return False
        self.coordinator.free(request_id)
        return True

    def finish(self, request_id: str, status: RequestStatus) -> None:
        """Finish a running request (e.g. a stop string matched): free its blocks."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        if request in self.running:
            self.running.remove(request)
        self.coordinator.free(request_id)
        request.status = status

    # -- transferred KV ------------------------------------------------------------------------------------
    def add_transferred_request(self, request: Request, num_external_tokens: int) -> list[list[int]] | None:
        """Admit a ``remote_prefill`` request whose first ``num_external_tokens`` tokens' KV a
        transfer will write (beyond the local hit): allocate its blocks now (two-phase, in-window
        only, one state block per Mamba group) and park it in ``waiting_for_kv``.

        Returns the block table per group to read into, or None when nothing is to be read (the
        local hit covers it, or the blocks do not fit now): the request then waits to be computed
        locally from its reconciled hit, like any other request.
        """
        tables = self.reserve_transferred(request, num_external_tokens)
        if tables is None:
            # A Mamba group has no state at an attention-only hit: drop the remote-prefill view so
            # the local lookup reconciles every group.
            request.remote_prefill = False
            self.add_request(request)
        return tables

    def reserve_transferred(self, request: Request, num_external_tokens: int) -> list[list[int]] | None:
        """``add_transferred_request`` without the fallback: None (and the request is not queued,
        nothing changed) when nothing is to be read or the blocks do not fit now."""
        self.check_new(request)
        self.leases.release(request.request_id)  # a lease ends at admission, as in ``_admit``
        coord = self.coordinator
        hit = coord.get_computed_blocks(request)
        num_external = max(0, min(num_external_tokens, request.num_tokens - 1) - hit.num_tokens)
        if num_external == 0 or coord.allocate_slots(request, 0, hit, num_external, delay_cache=True) is None:
            return None
        self.requests[request.request_id] = request
        request.scheduled_at = time.monotonic()
        request.num_cached_tokens = hit.num_tokens + num_external
        request.num_computed_tokens = hit.num_tokens
        request.num_external_tokens = num_external
        request.status = RequestStatus.WAITING_FOR_KV
        self._count_hit(request, hit)
        self.queried_tokens += request.num_tokens
        self.waiting_for_kv[request.request_id] = request
        return coord.block_ids(request.request_id)

    def finish_kv_load(self, request_id: str, ok: bool) -> None:
        """A transfer into ``request_id``'s blocks completed (``ok``) or failed (recompute)."""
        request = self.waiting_for_kv.pop(request_id, None)
        if request is None:
            return
        request.remote_prefill = False  # any later recompute (preemption) uses the local view
        if ok:
            request.kv_loaded_at = time.monotonic()
            request.num_computed_tokens += request.num_external_tokens
            self.coordinator.cache_blocks(request, request.num_computed_tokens)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
        else:
            self.coordinator.free(request_id)
            request.num_computed_tokens = 0
            request.status = RequestStatus.WAITING
            self.waiting.appendleft(request)
        request.num_external_tokens = 0
