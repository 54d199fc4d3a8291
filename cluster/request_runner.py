"""One request's way through the cluster, driven from the driver: admit it (check and tokenize the
prompt once), route it, tell the decode worker at once when it is split, relay the prefill
worker's KV handle, stream and detokenize the decode worker's tokens, wait for the router to hold
the request's blocks, and route it again when a worker is lost: from its prompt before it
streamed a token, else from its prompt and the tokens it streamed (a migration, bounded by
``serve.migration_limit``; see docs/architecture.md, One request). See cluster/api.py's docstring
for the whole picture; ``ClusterCompletion.hops`` is built here.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

from actors.hops import pd_breakdown, whole_breakdown
from cluster.driver_loop import NOT_STARTED
from cluster.handles import WorkerHandle
from cluster.in_flight import ClusterRequest, InFlight, NoSharedDecision, SharedPlacements
from cluster.results import ClusterCompletion, Delta
from cluster.route_batch import RouteBatcher
from cluster.served_model import ServedModel
from cluster.supervisor import Supervisor, describe_failure
from configs import ClusterConfig
from engine.logprobs import TokenLogprob
from engine.request import RequestStatus, stop_status
from engine.sampling_params import SamplingParams
from engine.structured_spec import validate_structured
from engine.validation import InvalidRequestError, ValidatedPrompt, check_request_id, problem, prompt_batch

if TYPE_CHECKING:
    from ray import ObjectRef, ObjectRefGenerator

    from actors.worker_types import ExpectedHit, PrefillResult, TokenChunk
    from engine.routing import Decision
    from engine.tokenizer import IncrementalDetokenizer

log = logging.getLogger(__name__)

ROUTER_ACK_TIMEOUT_S = 30.0  # how long a finished request waits for the router to apply its blocks
#: times a request is routed again because its predicted hit was evicted before it arrived (the
#: last attempt runs on whatever hit it finds)
MAX_STALE_ROUTES = 3
FINISHED_REPORT_S = 0.5  # a finished request reaches the router's metrics within this, batched


class StreamedOutput:
    """What one request has sent its client so far, over all its attempts: a request that moves
    to another worker mid-stream goes on from here (the same detokenizer, so stop strings and
    held-back text carry over and the client sees one unbroken stream). It holds the output
    tokens (in ``detok``), their logprobs, the prompt's logprobs, when the first token came with
    that attempt's hop breakdown and prefix hit, where the last attempt ran, and how many times
    the request migrated.

    Invariants: ``logprobs`` is None unless the sampling asks for them, else it has one entry per
    token of ``token_ids`` that the workers sent logprobs for (all of them, once the engine
    computes logprobs); ``prompt_logprobs`` is taken once, from the first attempt that sends it;
    ``first_token``, ``hops`` and ``cached_tokens`` are set once, by the first token."""

    def __init__(self, detok: IncrementalDetokenizer, sampling: SamplingParams) -> None:
        self.detok = detok
        self.logprobs: list[TokenLogprob] | None = [] if sampling.logprobs is not None else None
        self.prompt_logprobs: list[TokenLogprob | None] | None = None
        self.first_token: float | None = None
        self.hops: dict[str, float] = {}
        self.cached_tokens = 0
        self.migrations = 0
        self.prefill_worker = ""
        self.decode_worker = ""
        self.decision: Decision | None = None

    @property
    def token_ids(self) -> list[int]:
        """The output tokens the client has been sent."""
        return self.detok.token_ids

    def placed(self, prefill_worker: str, decode_worker: str, decision: Decision) -> None:
        """The current attempt runs there."""
        self.prefill_worker, self.decode_worker, self.decision = prefill_worker, decode_worker, decision

    def first(self, at: float, hops: dict[str, float], cached_tokens: int) -> None:
        """The request's first token arrived ``at``, with its hops and prefix hit."""
        self.first_token, self.hops, self.cached_tokens = at, hops, cached_tokens

    def add(self, chunk: TokenChunk) -> Delta:
        """Take a chunk's tokens and logprobs; the ``Delta`` its client gets."""
        text = self.detok.add(chunk.token_ids)
        logprobs = tuple(chunk.logprobs or ())
        if self.logprobs is not None:
            self.logprobs.extend(logprobs)
        return Delta(text, len(chunk.token_ids), tuple(chunk.token_ids), logprobs)

    def done_reason(self, sampling: SamplingParams, eos_token_id: int | None) -> str | None:
        """Why the request needs no more tokens by the engine's own rule (``stop_status``; "stop"
        also for a stop string the detokenizer saw), else None."""
        tokens = self.detok.token_ids
        if self.detok.stopped:
            return RequestStatus.FINISHED_STOPPED.value
        status = stop_status(sampling, tokens[-1], len(tokens), eos_token_id) if tokens else None
        return status.value if status is not None else None


class RequestRunner:
    """Owns the requests of the driver API from admission to their last token: the served model
    it checks prompts against (``model``, from ``start``), the registry of requests in flight it
    shares with the ``Supervisor`` (which cuts them loose from lost workers), the placements
    requests share by key (``SharedPlacements``), and each request's attempts (route, prefill,
    decode, retry, migration).

    Invariants: it admits requests only between ``start`` and ``stop``; ``collect`` always takes
    its request out of the in-flight registry and reports it to the router once, however many
    attempts it took and however they ended; a request that streamed tokens runs again only
    from those tokens (its client never sees a token twice), at most ``serve.migration_limit``
    times.
    """

    def __init__(self, config: ClusterConfig, supervisor: Supervisor, in_flight: InFlight) -> None:
        self.config = config
        self.model: ServedModel | None = None  # the last model served (kept after stop)
        self.accepting = False
        self._supervisor = supervisor
        self._in_flight = in_flight
        self._placements = SharedPlacements()
        self._routes = RouteBatcher()  # concurrent routing calls to one replica go as one
        #: finished requests not yet reported to the router: (TTFT s, output tokens, ok)
        self._finished: list[tuple[float, int, bool]] = []
        self._report_due: float | None = None  # when the report of those is timed to go
        self._finished_lock = threading.Lock()

    def start(self, model: ServedModel) -> None:
        """Admit requests for ``model`` from now on."""
        self.model = model
        self.accepting = True

    def stop(self) -> None:
        self.accepting = False
        self.report_finished()

    def _note_finished(self, ttft_s: float, num_out: int, ok: bool) -> None:
        """Queue a request's end for the router's metrics, sent with the others that end within
        ``FINISHED_REPORT_S`` (one router call for many requests, not one each). The timer
        runs in the caller's loop; a timer whose loop ended before it fired is set again."""
        now = time.monotonic()
        with self._finished_lock:
            self._finished.append((ttft_s, num_out, ok))
            due = self._report_due
            schedule = due is None or now > due + FINISHED_REPORT_S
            if schedule:
                self._report_due = now + FINISHED_REPORT_S
        if schedule:
            asyncio.get_running_loop().call_later(FINISHED_REPORT_S, self.report_finished)

    def report_finished(self) -> None:
        """Send the queued request ends to router replica 0 (its metrics count them)."""
        import ray

        with self._finished_lock:
            batch, self._finished, self._report_due = self._finished, [], None
        router = self._supervisor.router
        if not batch or router is None or not ray.is_initialized():
            return
        try:
            router.finished.remote(batch)
        except Exception as exc:  # noqa: BLE001 - metrics only: a router going away loses them
            log.debug("router metrics: %d finished requests not reported (%s)", len(batch), exc)

    def served(self) -> ServedModel:
        """The model requests run on; raises RuntimeError when not started."""
        if not self.accepting or self.model is None:
            raise RuntimeError(NOT_STARTED)
        return self.model

    # -- admission: every check a request gets, once, before it runs -------------------------------
    def check_prompt(self, prompt: object, cache_salt: object = None) -> ValidatedPrompt:
        """``ServedModel.check_prompt`` on the model served now."""
        return self.served().check_prompt(prompt, cache_salt)

    def admit(
        self,
        prompt: object,
        sampling: SamplingParams | dict[str, Any] | None,
        request_id: str | None,
        cache_salt: object = None,
        share_placement: object = None,
    ) -> ClusterRequest:
        """One request, checked and tokenized (ValueError naming the field and the value); a
        ``ValidatedPrompt`` was checked by its entry point already and is taken as it is.
        ``share_placement``: a non-empty string key; the requests in flight with the same key run
        where the first of them was routed (``SharedPlacements``)."""
        if share_placement is not None and (not isinstance(share_placement, str) or not share_placement):
            raise InvalidRequestError(problem("share_placement", "must be a non-empty string", share_placement))
        request = self._admit(prompt, SamplingParams.coerce(sampling), request_id, cache_salt)
        request.share_placement = share_placement
        return request

    def admit_batch(
        self,
        prompts: object,
        sampling: SamplingParams | dict[str, Any] | Sequence[SamplingParams] | None,
        request_ids: Sequence[str] | None,
        cache_salt: object = None,
    ) -> list[ClusterRequest]:
        """A batch of requests (see ``Cluster.generate``), every one checked before any runs."""
        batch = prompt_batch(prompts)
        if isinstance(sampling, (list, tuple)):
            if len(sampling) != len(batch):
                raise InvalidRequestError(f"sampling: {len(sampling)} sampling params for {len(batch)} prompts")
            samplings = [SamplingParams.coerce(s) for s in sampling]
        else:
            samplings = [SamplingParams.coerce(sampling)] * len(batch)
        if request_ids is not None:
            if isinstance(request_ids, str) or not isinstance(request_ids, Sequence):
                raise InvalidRequestError(problem("request_ids", "must be a list of strings", request_ids))
            if len(request_ids) != len(batch):
                raise InvalidRequestError(f"request_ids: {len(request_ids)} ids for {len(batch)} prompts")
            seen: set[str] = set()
            for request_id in request_ids:
                if check_request_id(request_id, "request_ids") in seen:
                    raise InvalidRequestError(problem("request_ids", "must be unique", request_id))
                seen.add(request_id)
        return [
            self._admit(prompt, samplings[i], request_ids[i] if request_ids else None, cache_salt)
            for i, prompt in enumerate(batch)
        ]

    def _admit(
        self, prompt: object, sampling: SamplingParams, request_id: str | None, cache_salt: object
    ) -> ClusterRequest:
        model = self.served()
        validate_structured(sampling.structured, "sampling.structured")
        if request_id is not None:
            check_request_id(request_id)
        if isinstance(prompt, ValidatedPrompt):  # its entry point checked it (and chose its salt)
            assert len(prompt.token_ids) < model.max_model_len, "a validated prompt fits the model"
            validated = prompt
        else:
            validated = model.check_prompt(prompt, cache_salt)
        request_id = request_id or f"req-{uuid.uuid4().hex[:16]}"
        if request_id in self._in_flight:
            raise InvalidRequestError(f"request_id: {request_id!r} is already in flight")
        return ClusterRequest(request_id, validated, sampling)

    # -- running admitted requests ------------------------------------------------------------------
    async def run_batch(
        self,
        requests: list[ClusterRequest],
        on_completion: Callable[[ClusterCompletion], None] | None,
        return_exceptions: bool,
    ) -> list[ClusterCompletion]:
        """Run ``requests`` together; results (or, with ``return_exceptions``, exceptions) in order."""

        async def one(request: ClusterRequest) -> ClusterCompletion:
            result = await self.collect(request)
            if on_completion is not None:
                on_completion(result)
            return result

        results = await asyncio.gather(*(one(r) for r in requests), return_exceptions=return_exceptions)
        # with return_exceptions a failed request's exception stands in its place (Cluster.generate says so)
        return cast("list[ClusterCompletion]", list(results))

    async def run(self, request: ClusterRequest, on_delta: Callable[[Delta], None] | None = None) -> ClusterCompletion:
        """``collect`` for a caller that may be cancelled: then the request is aborted on its
        workers (freeing its blocks) and its attempt ends before the cancellation goes on.

        The attempt and the aborts are awaited as one shielded future that takes their outcome
        whatever the caller does: a caller cancelled again while it waits (anyio's cancel scopes,
        under Starlette's streaming responses, cancel at every await) leaves no task whose error
        nobody retrieves. An aborted attempt may end in an error (Ray Serve cancels a disconnected
        request's worker calls with it: ``TaskCancelledError``); nobody waits for its result."""
        task = asyncio.ensure_future(self.collect(request, on_delta))
        try:
            return await asyncio.shield(task)
        finally:
            if not task.done():
                request.aborted = True
                aborts = [w.abort.remote(request.engine_id) for w in request.workers]
                await asyncio.shield(asyncio.gather(task, *aborts, return_exceptions=True))

    async def stream(
        self,
        prompt: object,
        sampling: SamplingParams | dict[str, Any] | None,
        request_id: str | None,
        cache_salt: object = None,
        share_placement: object = None,
    ) -> AsyncIterator[Delta | ClusterCompletion]:
        """Admit one request when iteration starts, then yield a ``Delta`` whenever output tokens
        arrive and its ``ClusterCompletion`` last. Leaving the iteration early (or cancelling the
        task that iterates) aborts the request on its workers and frees its blocks (``run``)."""
        request = self.admit(prompt, sampling, request_id, cache_salt, share_placement)
        items: asyncio.Queue[Delta | ClusterCompletion | None] = asyncio.Queue()

        async def produce() -> None:
            try:
                items.put_nowait(await self.run(request, items.put_nowait))
            finally:
                items.put_nowait(None)

        task = asyncio.ensure_future(produce())
        try:
            while (item := await items.get()) is not None:
                yield item
            task.result()  # raise what the request raised
        finally:
            if not task.done():
                task.cancel()  # ``run`` aborts the request and waits for its attempt to end
                await asyncio.gather(task, return_exceptions=True)

    def abort(self, request_id: str) -> bool:
        """Stop a request in flight and free its blocks everywhere (blocking); False if unknown."""
        import ray

        request = self._in_flight.get(request_id)
        if request is None:
            return False
        request.aborted = True
        refs = [w.abort.remote(request.engine_id) for w in request.workers]
        if refs:
            ray.get(refs, timeout=60)
        return True

    async def collect(
        self, request: ClusterRequest, on_delta: Callable[[Delta], None] | None = None
    ) -> ClusterCompletion:
        """Route, (prefill,) decode and detokenize one request; always leaves the in-flight registry.

        A worker that dies is removed from the router and the request is routed again: from its
        prompt if it had streamed no token yet, else from its prompt and the tokens it streamed
        (a migration, at most ``serve.migration_limit`` times; beyond that it fails with a
        RuntimeError naming the worker). Either way the client sees one unbroken stream."""
        from engine.tokenizer import IncrementalDetokenizer

        model = self.model
        assert model is not None, "a request runs only after start"
        rid = request.request_id
        supervisor = self._supervisor
        limit = self.config.serve.migration_limit
        sampling = request.sampling
        output = StreamedOutput(
            IncrementalDetokenizer(model.tokenizer, sampling.stop, sampling.include_stop_str_in_output), sampling
        )
        self._in_flight.add(request)
        if request.share_placement is not None:
            self._placements.join(request.share_placement)
        ok, ttft_s, num_out = False, 0.0, 0
        try:
            for _ in range(max(1, len(supervisor.infos)) + limit + MAX_STALE_ROUTES):
                try:
                    result = await self._attempt_supervised(request, output, on_delta)
                except _StalePrediction as stale:
                    # the worker held nothing and ran nothing; once the router has its evictions
                    # (the worker's report), the request is routed again under a fresh id
                    await _await_acks(list(stale.acks))
                    request.stale_routes += 1
                    request.attempt += 1
                    log.debug("%s: predicted hit gone on arrival; routing it again", rid)
                    continue
                except _WorkerLost as lost:
                    if lost.handle is not None:  # never its replacement, if one holds the id by now
                        supervisor.forget_worker(lost.worker_id, lost.why, lost.handle)
                    for handle in supervisor.workers.values():  # e.g. the prefill worker's held blocks
                        handle.abort.remote(request.engine_id)
                    request.attempt += 1
                    failed = f"{lost.worker_id}: worker failed while running {rid} ({lost.why})"
                    done = output.done_reason(sampling, model.eos_token_id)
                    if done is not None:  # it had all its tokens: nothing to run
                        _flush(output, on_delta)
                        result = self._completion(request, output, done)
                    elif not supervisor.workers:
                        raise RuntimeError(failed) from lost.__cause__
                    elif output.token_ids:
                        if output.migrations >= limit:
                            raise RuntimeError(
                                f"{failed} after streaming output; not migrated again (serve.migration_limit={limit})"
                            ) from lost.__cause__
                        output.migrations += 1
                        log.warning(
                            "%s failed after %s streamed %d tokens (%s); migrating it (%d of at most %d)",
                            lost.worker_id,
                            rid,
                            len(output.token_ids),
                            lost.why,
                            output.migrations,
                            limit,
                        )
                        continue
                    else:
                        log.warning(
                            "%s failed before %s produced a token (%s); routing it again", lost.worker_id, rid, lost.why
                        )
                        continue
                ok, ttft_s, num_out = True, result.ttft_s, len(result.token_ids)
                return result
            raise RuntimeError(f"request {rid}: every worker it was routed to died")
        finally:
            self._in_flight.remove(rid)
            if request.share_placement is not None:
                self._placements.leave(request.share_placement)
            # once per request, however many attempts it took (replica 0's metrics)
            self._note_finished(ttft_s, num_out, ok)

    async def _attempt_supervised(
        self, request: ClusterRequest, output: StreamedOutput, on_delta: Callable[[Delta], None] | None
    ) -> ClusterCompletion:
        """``_attempt`` as a task the health loop can cut loose from a lost worker (then this
        raises ``_WorkerLost``); cancelling the caller still cancels the attempt."""
        request.lost_worker, request.streamed, request.worker_ids = None, False, []
        task = asyncio.ensure_future(self._attempt(request, output, on_delta))
        request.task = task
        try:
            return await task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if request.lost_worker is None or (current is not None and current.cancelling()):
                raise
            why = self._supervisor.lost.get(request.lost_worker, "lost")
            ids = request.worker_ids
            handle = request.workers[ids.index(request.lost_worker)] if request.lost_worker in ids else None
            raise _WorkerLost(request.lost_worker, request.streamed, why, handle) from None
        finally:
            request.task = None

    async def _attempt(
        self, request: ClusterRequest, output: StreamedOutput, on_delta: Callable[[Delta], None] | None
    ) -> ClusterCompletion:
        """One attempt: route the request, (prefill,) decode, stream into ``output``. A migrated
        request (``output`` holds tokens already) goes on after those tokens, whole on one
        worker; so does one that asks for its prompt's logprobs (a prefill worker samples
        nothing)."""
        from ray.exceptions import RayActorError, RayTaskError

        from actors.worker_types import STALE_PREDICTION, ExpectedHit, WorkerUnavailableError
        from engine.kv_cache.hashing import block_hashes

        model = self.model
        assert model is not None, "a request runs only after start"
        rid, prompt_ids = request.engine_id, request.token_ids
        sent_ids = tuple(output.token_ids)  # what the client has: a migrated request goes on after them
        ids = prompt_ids + list(sent_ids)
        started = time.monotonic()
        # a request scoring its prompt (prompt logprobs, nothing sent yet) computes every prompt
        # position and takes no prefix hit (``Request.scores_prompt``): placed by load alone, with
        # no hit predicted for it
        scores_prompt = request.sampling.prompt_logprobs is not None and not sent_ids
        hashes = [] if scores_prompt else block_hashes(ids, model.hash_block_size, request.prompt.cache_salt)
        # the tokens still to generate: a one-token request may run whole on any worker (``RouteRequest``)
        decision = await self._route(request, hashes, len(ids), request.sampling.max_tokens - len(sent_ids))
        prefill_id, decode_id = str(decision.prefill_worker), str(decision.decode_worker)
        whole = len(ids) < 2 or bool(sent_ids) or request.sampling.prompt_logprobs is not None
        if prefill_id != decode_id and whole:  # one token cannot be split; the others run whole on D
            prefill_id = decode_id
        cached = decision.predicted_decode_hit if prefill_id == decode_id else 0
        # the hit the router predicted where the prompt is computed, held there until it runs
        predicted = decision.predicted_hit > 0 and prefill_id == str(decision.prefill_worker)
        strict = request.stale_routes < MAX_STALE_ROUTES
        expected = ExpectedHit(hashes, decision.predicted_hit, strict) if predicted else None
        output.placed(prefill_id, decode_id, decision)
        detok = output.detok
        stopped = False  # a stop string matched before the worker finished it: aborted there
        reason = "abort"
        error: str | None = None
        acks: list[ObjectRef[None] | None] = []
        stream: AsyncIterator[TokenChunk] | None = None
        # one token is one chunk: the decode worker answers with one plain call (``complete``),
        # which costs less than a stream
        single = request.sampling.max_tokens == 1
        prefill: PrefillResult | None = None  # the prefill worker's result (P/D)
        prefill_call_s = 0.0
        sent = time.monotonic()
        if not request.aborted:
            decoder = self._worker(decode_id)
            if prefill_id != decode_id:
                prefiller = self._worker(prefill_id)
                request.on(decode_id, decoder, (prefill_id, prefiller))
                # the decode worker hears of the request now: it reserves the prompt's blocks and
                # warms its connection to the prefill worker while the prefill runs
                peer = getattr(self._supervisor.infos.get(prefill_id), "agent", None)
                salt = request.prompt.cache_salt
                stream = _decode(decoder, single, rid, prompt_ids, request.sampling, None, True, peer, salt)
                sent = time.monotonic()
                prefill = await self._prefill(request, prefiller, prefill_id, decoder, expected)
                prefill_call_s = time.monotonic() - sent
                cached = prefill.num_cached_tokens
                acks.extend(prefill.router_ack)
            request.on(decode_id, decoder)
        if not request.aborted:
            try:
                if stream is None:
                    stream = _decode(
                        decoder,
                        single,
                        rid,
                        prompt_ids,
                        request.sampling,
                        cache_salt=request.prompt.cache_salt,
                        output_token_ids=sent_ids,
                        expected=expected,
                    )
                async for chunk in stream:
                    if chunk.finish_reason == STALE_PREDICTION:
                        raise _StalePrediction(chunk.router_ack)
                    if prefill_id == decode_id and chunk.num_cached_tokens >= 0:
                        cached = chunk.num_cached_tokens
                    if chunk.worker_failed and not detok.stopped:
                        why = chunk.error or "its engine stopped"
                        raise _WorkerLost(decode_id, request.streamed, why, decoder)
                    if output.prompt_logprobs is None and chunk.prompt_logprobs is not None:
                        output.prompt_logprobs = chunk.prompt_logprobs
                    if chunk.token_ids and not detok.stopped:
                        if output.first_token is None:
                            now = time.monotonic()
                            hops = _hops(request, started, sent, now, prefill, prefill_call_s, chunk.hops)
                            output.first(now, hops, cached)
                            log.debug(
                                "hops %s (%s -> %s): %s",
                                rid,
                                prefill_id,
                                decode_id,
                                " ".join(f"{k}={1e3 * v:.1f}ms" for k, v in hops.items()),
                            )
                        request.streamed = True
                        delta = output.add(chunk)
                        if on_delta is not None:
                            on_delta(delta)
                        if detok.stopped and not chunk.finished:
                            stopped = True
                            await decoder.abort.remote(rid)
                    if chunk.finished:
                        reason = "stop" if stopped else (chunk.finish_reason or "stop")
                        error = chunk.error
                        acks.extend(chunk.router_ack)
                        break
            except (RayActorError, RayTaskError) as exc:
                if not detok.stopped:  # a request that matched its stop string needs nothing more
                    raise _lost_or_raise(decode_id, decoder, request.streamed, exc, WorkerUnavailableError) from exc
                reason = "stop"
        _flush(output, on_delta)
        await _await_acks(acks)  # the router holds this request's blocks before it counts as finished
        if reason == "error":
            raise RequestFailedError(f"{decode_id}: request {rid} failed on the worker: {error or 'no reason given'}")
        return self._completion(request, output, reason, cached)

    def _completion(
        self, request: ClusterRequest, output: StreamedOutput, reason: str, cached: int = 0
    ) -> ClusterCompletion:
        """The finished request: ``output``'s text, tokens and logprobs, placed where its last
        attempt ran (``cached``: that attempt's prefix hit, used when no token came)."""
        model = self.model
        assert model is not None and output.decision is not None, "a completion follows an attempt"
        now = time.monotonic()
        decision = output.decision
        return ClusterCompletion(
            model.prompt_text(request.prompt),
            output.detok.text,
            list(output.token_ids),
            reason,
            request_id=request.request_id,
            prompt_token_ids=tuple(request.prompt.token_ids),
            prefill_worker=output.prefill_worker,
            decode_worker=output.decode_worker,
            route_reason=decision.reason,
            predicted_hit=decision.predicted_hit,
            cached_tokens=max(output.cached_tokens if output.first_token is not None else cached, 0),
            ttft_s=(output.first_token or now) - request.submitted,
            latency_s=now - request.submitted,
            hops=output.hops,
            logprobs=output.logprobs,
            prompt_logprobs=output.prompt_logprobs,
            migrations=output.migrations,
        )

    async def _route(
        self, request: ClusterRequest, hashes: list[bytes], num_tokens: int, max_tokens: int | None = None
    ) -> Decision:
        """Where this attempt runs: the router's decision; for a first attempt with a
        ``share_placement`` key, the decision of the key's first request (``SharedPlacements``).
        A retry or a migration asks the router itself (the shared placement lost a worker)."""
        key = request.share_placement
        if key is None or request.attempt:
            return await self._ask_router(request.engine_id, hashes, num_tokens, max_tokens)
        future, decides = self._placements.claim(key)
        if not decides:
            try:  # shielded: a follower's cancellation must not cancel the key's decision
                return await asyncio.shield(asyncio.wrap_future(future))
            except NoSharedDecision:
                return await self._route(request, hashes, num_tokens, max_tokens)  # this one may decide now
        try:
            decision = await self._ask_router(request.engine_id, hashes, num_tokens, max_tokens)
        except BaseException:
            self._placements.abandon(future)
            raise
        self._placements.decided(future, decision)
        return decision

    async def _ask_router(
        self, request_id: str, hashes: list[bytes], num_tokens: int, max_tokens: int | None = None
    ) -> Decision:
        """The decision of the router replica the prompt's first block picks, else of the next
        replica that answers (``Supervisor.route_order``), or (every replica restarting, no
        workers registered yet) the supervisor's fallback."""
        from ray.exceptions import RayActorError, RayTaskError

        supervisor = self._supervisor
        for router in supervisor.route_order(hashes):
            try:
                return await asyncio.wait_for(
                    self._routes.route(router, request_id, hashes, num_tokens, max_tokens),
                    self.config.workers.health_check_timeout_s,
                )
            except (RayActorError, RayTaskError, TimeoutError) as exc:
                log.warning("router could not place %s (%s)", request_id, describe_failure(exc))
        log.warning("no router replica placed %s; running it without the router", request_id)
        return supervisor.fallback_decision(request_id, num_tokens)

    async def _prefill(
        self,
        request: ClusterRequest,
        prefiller: WorkerHandle,
        prefill_id: str,
        decoder: WorkerHandle,
        expected: ExpectedHit | None = None,
    ) -> PrefillResult:
        """The prefill worker's result for ``request``; sends its handle to the decode worker told
        of the request (which, whenever no handle comes, is aborted here so it frees its blocks).
        ``expected``: the prompt's block hashes and the hit the router predicted there."""
        from ray.exceptions import RayActorError, RayTaskError

        from actors.worker_types import STALE_PREDICTION, WorkerUnavailableError

        rid = request.engine_id
        handed = False
        try:
            try:
                salt = request.prompt.cache_salt
                result: PrefillResult = await prefiller.prefill.remote(rid, request.token_ids, salt, expected)
            except (RayActorError, RayTaskError) as exc:
                raise _lost_or_raise(prefill_id, prefiller, False, exc, WorkerUnavailableError) from exc
            if result.kv_handle is None:
                if result.finish_reason == STALE_PREDICTION:
                    raise _StalePrediction(result.router_ack)
                if result.worker_failed:
                    raise _WorkerLost(prefill_id, False, result.error or "its engine stopped", prefiller)
                request.aborted = request.aborted or result.finish_reason == "abort"
                if not request.aborted:
                    raise RequestFailedError(
                        f"{prefill_id}: prefill of {rid} ended with {result.finish_reason!r}"
                        + (f": {result.error}" if result.error else "")
                    )
                return result
            decoder.deliver.remote(rid, result.kv_handle)
            handed = True
            return result
        finally:
            if not handed:
                decoder.abort.remote(rid)

    def _worker(self, worker_id: str) -> WorkerHandle:
        handle = self._supervisor.workers.get(worker_id)
        if handle is None:  # removed after the router chose it
            raise _WorkerLost(worker_id, False, self._supervisor.lost.get(worker_id, "removed from the router"))
        return handle


def _decode(decoder: WorkerHandle, single: bool, *args: Any, **kwargs: Any) -> AsyncIterator[TokenChunk]:
    """Start the decode worker's call for a request (``EngineWorker.generate``'s arguments) now;
    its chunks as they arrive. ``single``: the request's output is one chunk (one token), asked
    for with one plain call (``EngineWorker.complete``) instead of a stream."""
    if single:
        return _one_chunk(decoder.complete.remote(*args, **kwargs))
    return _streamed_chunks(decoder.generate.options(num_returns="streaming").remote(*args, **kwargs))


async def _one_chunk(ref: ObjectRef[TokenChunk]) -> AsyncIterator[TokenChunk]:
    yield await ref


async def _streamed_chunks(stream: ObjectRefGenerator) -> AsyncIterator[TokenChunk]:
    async for ref in stream:
        yield await ref


def _flush(output: StreamedOutput, on_delta: Callable[[Delta], None] | None) -> None:
    """The request ended: send a held-back tail that turned out not to start a stop string."""
    tail = output.detok.flush()
    if tail and on_delta is not None:
        on_delta(Delta(tail, 0))


def _hops(
    request: ClusterRequest,
    started: float,
    sent: float,
    first_token: float,
    prefill: PrefillResult | None,
    prefill_call_s: float,
    worker_hops: dict[str, float] | None,
) -> dict[str, float]:
    """The TTFT breakdown per hop (``actors.hops``) of the attempt that produced the first token:
    routed at ``started``, sent to its worker(s) at ``sent``; ``worker_hops``: what the first
    tokens' chunk carried ({} when it carried nothing)."""
    if worker_hops is None:
        return {}
    retry_s = started - request.submitted if request.attempt else 0.0
    route_s = sent - (started if request.attempt else request.submitted)
    if prefill is not None and "since_handle" in worker_hops:
        return pd_breakdown(
            route_s, prefill_call_s, first_token - sent - prefill_call_s, prefill.hops, worker_hops, retry_s
        )
    if "since_arrival" in worker_hops:
        return whole_breakdown(route_s, first_token - sent, worker_hops, retry_s)
    return {}


async def _await_acks(acks: list[ObjectRef[None] | None]) -> None:
    """Wait (bounded) until the router applied the workers' reports named by ``acks``."""
    refs = [ack for ack in acks if ack is not None]
    if not refs:
        return
    try:
        await asyncio.wait_for(asyncio.gather(*refs, return_exceptions=True), ROUTER_ACK_TIMEOUT_S)
    except TimeoutError:
        log.warning("router did not apply a worker's report within %.0f s; going on", ROUTER_ACK_TIMEOUT_S)


class RequestFailedError(RuntimeError):
    """A request failed on its worker (the worker itself serves on); the message says why."""


class _StalePrediction(Exception):
    """The worker an attempt was routed to no longer held the hit the router predicted there
    (``STALE_PREDICTION``): nothing ran; route it again once the router applied the reports named
    by ``acks``."""

    def __init__(self, acks: tuple[ObjectRef[None], ...]):
        super().__init__("predicted hit evicted before arrival")
        self.acks = acks


class _WorkerLost(Exception):
    """A worker died, stopped or hung during a request (``streamed``: this attempt had sent
    tokens; the request then migrates, see ``RequestRunner.collect``)."""

    def __init__(self, worker_id: str, streamed: bool, why: str = "its actor died", handle: WorkerHandle = None):
        super().__init__(worker_id)
        self.worker_id = worker_id
        self.streamed = streamed
        self.why = why
        self.handle = handle  # the actor that failed (None: it had already left this driver)


def _lost_or_raise(
    worker_id: str, handle: WorkerHandle, streamed: bool, exc: Exception, unavailable: type[Exception]
) -> Exception:
    """A Ray error of a worker call as ``_WorkerLost`` when the worker is gone or unhealthy;
    any other task error stays what it is."""
    from ray.exceptions import RayActorError

    if isinstance(exc, RayActorError) or isinstance(getattr(exc, "cause", None), unavailable):
        return _WorkerLost(worker_id, streamed, describe_failure(exc), handle)
    return exc
