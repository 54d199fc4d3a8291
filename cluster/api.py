"""The driver API: ``Cluster(config)`` starts (or attaches to) Ray, starts the workers and the
router, and serves ``generate`` / ``stream`` / ``pin_prefix`` / ``unpin`` / ``stats`` / ``abort``.

One request (see ARCHITECTURE.md): the driver tokenizes and hashes the prompt once, asks the
router actor where it runs; when the router splits it, the driver tells the decode worker at
once (it reserves the prompt's blocks and warms its connection to the prefill worker while the
prefill runs), the prefill worker computes the prompt's KV and returns a handle, the driver
relays it and the decode worker pulls that KV and decodes; otherwise the decode (or aggregated)
worker runs it whole. Tokens stream back from the decode worker; the driver detokenizes and
applies stop strings (aborting the request on the worker when one matches). A request counts as
finished once the router applied the reports holding its blocks (the workers send them without
waiting; the driver awaits them). ``ClusterCompletion.hops`` breaks its TTFT down per hop.

    with Cluster("tiny") as cluster:
        print(cluster.generate(["Hello"], SamplingParams(max_tokens=8))[0].text)
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self, TypeVar

from actors.hops import pd_breakdown, whole_breakdown
from cluster.admin import ClusterAdmin
from cluster.supervision import ClusterSupervision, await_ref, describe_failure
from configs import ClusterConfig, load_config
from engine.llm import Completion
from engine.sampling_params import SamplingParams
from engine.validation import (
    InvalidRequestError,
    check_prompt,
    check_request_id,
    check_token_ids,
    problem,
    prompt_batch,
)

log = logging.getLogger(__name__)

T = TypeVar("T")
Prompt = str | Sequence[int]
ROUTER_ACK_TIMEOUT_S = 30.0  # how long a finished request waits for the router to apply its blocks
DEFAULT_START_TIMEOUT_S = 900.0  # the first use of Gemma-3-270M converts its GGUF (minutes)


@dataclass(frozen=True)
class ClusterCompletion(Completion):
    """A finished request with where it ran: the router's predicted prefix hit and the hit the
    worker that prefilled it actually found (``cached_tokens``), driver-side timings and the
    TTFT's breakdown per hop (``hops``, see ``actors.hops``)."""

    request_id: str = ""
    prompt_token_ids: tuple[int, ...] = ()
    prefill_worker: str = ""
    decode_worker: str = ""
    route_reason: str = ""
    predicted_hit: int = 0
    cached_tokens: int = 0
    ttft_s: float = 0.0
    latency_s: float = 0.0
    hops: dict[str, float] = field(default_factory=dict)  # TTFT per hop, s (actors.hops)

    @property
    def disaggregated(self) -> bool:
        return self.prefill_worker != self.decode_worker


@dataclass(frozen=True)
class ClusterHandles:
    """Everything another process needs to drive a started cluster (picklable): the config, the
    worker and router actor handles, what each worker reported at start, the model directory.
    The process that started the actors owns them; ``Cluster.attach`` only drives them."""

    config: ClusterConfig
    workers: dict[str, Any]
    infos: dict[str, Any]
    router: Any
    model_directory: str


@dataclass(frozen=True)
class Delta:
    """Text a request gained (``num_tokens`` new output tokens), as streamed to a client."""

    text: str
    num_tokens: int


@dataclass
class _Request:
    request_id: str
    prompt: str
    token_ids: list[int]
    sampling: SamplingParams
    submitted: float = field(default_factory=time.monotonic)
    workers: list[Any] = field(default_factory=list)
    worker_ids: list[str] = field(default_factory=list)  # where the current attempt waits
    aborted: bool = False
    attempt: int = 0
    streamed: bool = False  # the current attempt delivered output tokens
    task: asyncio.Task[Any] | None = None  # the current attempt
    lost_worker: str | None = None  # the worker the current attempt was cut loose from

    @property
    def engine_id(self) -> str:
        """The id the workers know this attempt by (a retry must not meet its first try's state)."""
        return self.request_id if not self.attempt else f"{self.request_id}#retry{self.attempt}"

    def on(self, worker_id: str, handle: Any, *more: tuple[str, Any]) -> None:
        """The current attempt now waits on this worker (and on ``more`` (id, handle) pairs)."""
        self.workers = [handle, *(h for _, h in more)]
        self.worker_ids = [worker_id, *(w for w, _ in more)]

    def cut_loose(self, worker_id: str) -> None:
        """The worker this attempt waits on is lost: stop waiting (``_collect`` decides what next)."""
        if self.task is not None and not self.task.done() and self.lost_worker is None:
            self.lost_worker = worker_id
            self.task.get_loop().call_soon_threadsafe(self.task.cancel)


class Cluster(ClusterSupervision, ClusterAdmin):
    """Owns a set of prefill/decode worker actors and a router actor on a Ray cluster (embedded
    or attached), the driver-side tokenizer, and the requests in flight.

    Invariants: between ``start`` and ``shutdown`` every worker is registered with the router
    and reports to it; a request is in ``_active`` from submission until its last token; an
    embedded Ray started here is shut down here (an attached one is left running).
    """

    def __init__(
        self,
        config: ClusterConfig | str = "local",
        overrides: Sequence[str] = (),
        *,
        start_timeout_s: float = DEFAULT_START_TIMEOUT_S,
    ):
        self.config = load_config(config, overrides) if isinstance(config, str) else config
        self.start_timeout_s = start_timeout_s
        self.workers: dict[str, Any] = {}
        self.infos: dict[str, Any] = {}
        self.router: Any = None
        self.tokenizer: Any = None
        self.max_model_len = 0
        self.vocab_size = 0
        self.model_directory = ""
        self._hash_block_size = 1
        self._owns_ray = False
        self._owns_actors = True
        self._active: dict[str, _Request] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: threading.Thread | None = None
        self._started = False
        self._init_supervision()

    # -- lifecycle ---------------------------------------------------------------------------------
    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def start(self) -> Self:
        """Connect to Ray (or start it), start the workers and the router; wait until ready."""
        if self._started:
            return self
        import ray

        from actors.router import Router
        from actors.worker import DecodeWorker, PrefillWorker
        from cluster.placement import (
            ROUTER_NUM_CPUS,
            check_capacity,
            embedded_init_kwargs,
            loopback_environment,
            worker_options,
        )
        from engine.core import resolve_model_directory

        config = self.config
        loopback_environment()
        if not ray.is_initialized():
            if config.ray.address:
                ray.init(address=config.ray.address, namespace=config.ray.namespace)
            else:
                ray.init(**embedded_init_kwargs(config))
                self._owns_ray = True
        try:
            resources = ray.cluster_resources()
            check_capacity(config, resources)
            model_directory = resolve_model_directory(config)  # built/converted once, here
            disaggregated = config.workers.num_prefill > 0
            for i in range(config.workers.num_prefill):
                options = worker_options(config, "prefill", resources)
                self.workers[f"prefill-{i}"] = PrefillWorker.options(**options).remote(config, f"prefill-{i}", True)
            for i in range(config.workers.num_decode):
                options = worker_options(config, "decode", resources)
                self.workers[f"decode-{i}"] = DecodeWorker.options(**options).remote(
                    config, f"decode-{i}", disaggregated
                )
            infos = self._wait_ready({wid: w.info.remote() for wid, w in self.workers.items()})
            self._adopt(infos, str(model_directory))
            first = next(iter(infos.values()))
            # Ray restarts a router that dies; this process then registers the workers with it again
            self.router = Router.options(num_cpus=ROUTER_NUM_CPUS, max_restarts=-1).remote(
                config, first.groups, uuid.uuid4().hex
            )
            ray.get(self.router.ready.remote(), timeout=120)
            ray.get([
                self.router.add_worker.remote(wid, info.router_role, info.num_blocks, self.workers[wid])
                for wid, info in infos.items()
            ])  # fmt: skip
            ray.get([w.set_router.remote(self.router) for w in self.workers.values()], timeout=120)
            self._warm_connections(infos)
            self._start_loop()
            self._started = True
            self._start_supervision()
            for pin in config.router.pins:
                self.pin_prefix(pin.text if pin.text is not None else list(pin.token_ids or []), pin.replicas,
                                pin.ttl_s, wait=False)  # fmt: skip
        except BaseException:
            self.shutdown()
            raise
        log.info(
            "cluster ready: %d prefill + %d decode workers, router policy %s, %s",
            config.workers.num_prefill, config.workers.num_decode, config.router.policy, config.model.source,
        )  # fmt: skip
        return self

    def _warm_connections(self, infos: dict[str, Any]) -> None:
        """Have every decode worker open its transfer connection to every prefill worker now, so
        no request's first read pays the setup (a worker that joins later is warmed when a
        decode worker first hears of it with a request)."""
        import ray

        agents = [info.agent for info in infos.values() if info.role == "prefill" and info.agent is not None]
        decoders = [self.workers[w] for w, info in infos.items() if info.role == "decode" and info.agent is not None]
        if agents and decoders:
            ray.get([d.warm_peers.remote(agents) for d in decoders], timeout=120)

    def _adopt(self, infos: dict[str, Any], model_directory: str) -> None:
        """Take the started workers' reports: check they share one KV layout, load the tokenizer."""
        from engine.kv_cache.spec import hash_block_size
        from engine.tokenizer import load_tokenizer

        self.infos = dict(infos)
        self.model_directory = model_directory
        first = next(iter(infos.values()))
        for info in infos.values():
            if info.groups != first.groups or info.block_size != first.block_size:
                raise RuntimeError(f"{info.worker_id}: KV layout differs from {first.worker_id}'s")
        self.max_model_len = min(info.max_model_len for info in infos.values())
        self.vocab_size = first.vocab_size
        self._hash_block_size = hash_block_size(list(first.groups))
        self.tokenizer = load_tokenizer(Path(model_directory), first.vocab_size)

    def handles(self) -> ClusterHandles:
        """What ``Cluster.attach`` needs to drive this cluster from another process."""
        self._require_started()
        return ClusterHandles(self.config, dict(self.workers), dict(self.infos), self.router, self.model_directory)

    @classmethod
    def attach(cls, handles: ClusterHandles) -> Cluster:
        """Drive a cluster another process started (its actors stay that process's: ``shutdown``
        here stops only this driver, never the actors or Ray)."""
        cluster = cls(handles.config)
        cluster._owns_actors = False
        cluster.workers = dict(handles.workers)
        cluster.router = handles.router
        cluster._adopt(handles.infos, handles.model_directory)
        cluster._start_loop()
        cluster._started = True
        cluster._start_supervision()
        return cluster

    def _wait_ready(self, refs: dict[str, Any]) -> dict[str, Any]:
        import ray

        pending = list(refs.values())
        _, pending = ray.wait(pending, num_returns=len(pending), timeout=self.start_timeout_s)
        if pending:
            waiting = [wid for wid, ref in refs.items() if ref in pending]
            raise TimeoutError(
                f"workers {waiting} not ready after {self.start_timeout_s:.0f} s (not enough Ray resources, "
                f"or the model is still loading); available: {ray.available_resources()}"
            )
        return {wid: ray.get(ref) for wid, ref in refs.items()}

    def shutdown(self) -> None:
        """Stop the workers and the router (and the embedded Ray, if started here). Idempotent."""
        import ray

        self._stop_supervision()
        if ray.is_initialized() and self._owns_actors:
            if self.workers:
                refs = [w.shutdown.remote() for w in self.workers.values()]
                try:
                    ray.wait(refs, num_returns=len(refs), timeout=30)
                except Exception as exc:  # dead actors: nothing to stop
                    log.debug("worker shutdown: %s", exc)
            for handle in [*self.workers.values(), self.router]:
                if handle is not None:
                    try:
                        ray.kill(handle)
                    except Exception as exc:
                        log.debug("kill: %s", exc)
        self.workers.clear()
        self.router = None
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            if self._loop_thread is not None:
                self._loop_thread.join(10)
            self._loop.close()
            self._loop = None
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()
        self._owns_ray = False
        self._started = False

    def _start_loop(self) -> None:
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, name="kvfleet-driver", daemon=True)
        thread.start()
        self._loop, self._loop_thread = loop, thread

    def _sync(self, coro: Coroutine[Any, Any, T]) -> T:
        if self._loop is None:
            coro.close()
            raise RuntimeError("cluster: not started (use `with Cluster(...)` or call start())")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    # -- requests ----------------------------------------------------------------------------------
    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling: SamplingParams | dict[str, Any] | Sequence[SamplingParams] | None = None,
        *,
        request_ids: Sequence[str] | None = None,
        on_completion: Callable[[ClusterCompletion], None] | None = None,
        return_exceptions: bool = False,
    ) -> list[ClusterCompletion]:
        """Run every prompt (text, or a list of token ids) to completion; results in input order.

        ``sampling``: one for all prompts, or one per prompt. Every prompt is checked before any
        runs: an empty prompt, one of max_model_len tokens or more, a token id outside the
        vocabulary or bad sampling values raise ValueError naming the field and the value.
        ``on_completion`` is called (on the driver's event-loop thread) as each request finishes.
        ``return_exceptions``: a request that fails (e.g. on a worker) gives its exception in its
        place and the others run on; by default the first failure raises.
        """
        batch = prompt_batch(prompts)
        if isinstance(sampling, (list, tuple)):
            if len(sampling) != len(batch):
                raise InvalidRequestError(f"sampling: {len(sampling)} sampling params for {len(batch)} prompts")
            samplings = [self._sampling(s) for s in sampling]
        else:
            samplings = [self._sampling(sampling)] * len(batch)
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
        requests = [
            self._prepare(prompt, samplings[i], request_ids[i] if request_ids else None)
            for i, prompt in enumerate(batch)
        ]

        async def run_all() -> list[ClusterCompletion]:
            async def one(request: _Request) -> ClusterCompletion:
                result = await self._collect(request)
                if on_completion is not None:
                    on_completion(result)
                return result

            return list(await asyncio.gather(*(one(r) for r in requests), return_exceptions=return_exceptions))

        return self._sync(run_all())

    async def agenerate(
        self, prompt: Prompt, sampling: SamplingParams | dict[str, Any] | None = None, *, request_id: str | None = None
    ) -> ClusterCompletion:
        """One request, awaited in the caller's event loop (the same checks as ``generate``)."""
        return await self._collect(self._prepare(prompt, self._sampling(sampling), request_id))

    async def stream(
        self, prompt: Prompt, sampling: SamplingParams | dict[str, Any] | None = None, *, request_id: str | None = None
    ) -> AsyncIterator[str]:
        """Text deltas of one request as its tokens arrive (an async iterator in the caller's
        loop). Leaving the iteration early aborts the request."""
        async for item in self.stream_completion(prompt, sampling, request_id=request_id):
            if isinstance(item, Delta) and item.text:
                yield item.text

    async def stream_completion(
        self, prompt: Prompt, sampling: SamplingParams | dict[str, Any] | None = None, *, request_id: str | None = None
    ) -> AsyncIterator[Delta | ClusterCompletion]:
        """One request as it runs: a ``Delta`` whenever output tokens arrive, then its
        ``ClusterCompletion`` last. Leaving the iteration early (or cancelling the task that
        iterates) aborts the request on its workers and frees its blocks."""
        request = self._prepare(prompt, self._sampling(sampling), request_id)
        items: asyncio.Queue[Delta | ClusterCompletion | None] = asyncio.Queue()

        async def produce() -> None:
            try:
                items.put_nowait(await self._collect(request, items.put_nowait))
            finally:
                items.put_nowait(None)

        task = asyncio.ensure_future(produce())
        try:
            while (item := await items.get()) is not None:
                yield item
            task.result()  # raise what the request raised
        finally:
            if not task.done():
                request.aborted = True
                aborts = asyncio.gather(*(w.abort.remote(request.engine_id) for w in request.workers),
                                        return_exceptions=True)  # fmt: skip
                await asyncio.shield(aborts)
                await asyncio.gather(task, return_exceptions=True)

    def abort(self, request_id: str) -> bool:
        """Stop a request in flight and free its blocks everywhere; False if it is unknown."""
        import ray

        request = self._active.get(request_id)
        if request is None:
            return False
        request.aborted = True
        refs = [w.abort.remote(request.engine_id) for w in request.workers]
        if refs:
            ray.get(refs, timeout=60)
        return True

    # -- internals ---------------------------------------------------------------------------------
    def _require_started(self) -> None:
        if not self._started:
            raise RuntimeError("cluster: not started (use `with Cluster(...)` or call start())")

    @staticmethod
    def _sampling(sampling: object) -> SamplingParams:
        return SamplingParams.coerce(sampling)  # raises "max_tokens: must be >= 1 (got 0)" etc.

    def _check_ids(self, name: str, ids: Sequence[int]) -> list[int]:
        return check_token_ids(ids, self.vocab_size, name)

    def check_prompt(self, prompt: object) -> tuple[str, list[int]]:
        """A prompt (text, or a list of token ids) as its text and token ids, after every check a
        request gets before it runs; raises ValueError naming the field and the value for an
        empty prompt, a wrong type, a token id outside the vocabulary, or a prompt of
        max_model_len tokens or more."""
        self._require_started()
        checked = check_prompt(prompt, self.vocab_size)
        if isinstance(checked, str):
            token_ids = list(self.tokenizer.encode(checked))
            text = checked
        else:
            token_ids, text = checked, self.tokenizer.decode(checked)
        if not token_ids:
            raise InvalidRequestError(problem("prompt", "encodes to no tokens", prompt))
        if len(token_ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt: {len(token_ids)} tokens leave no room to generate within "
                f"max_model_len={self.max_model_len} (got a prompt of {len(token_ids)} tokens)"
            )
        return text, token_ids

    def _prepare(self, prompt: object, sampling: SamplingParams, request_id: str | None) -> _Request:
        self._require_started()
        if request_id is not None:
            check_request_id(request_id)
        text, token_ids = self.check_prompt(prompt)
        request_id = request_id or f"req-{uuid.uuid4().hex[:16]}"
        if request_id in self._active:
            raise InvalidRequestError(f"request_id: {request_id!r} is already in flight")
        return _Request(request_id, text, token_ids, sampling)

    async def _collect(self, request: _Request, on_delta: Callable[[Delta], None] | None = None) -> ClusterCompletion:
        """Route, (prefill,) decode and detokenize one request; always leaves ``_active``.

        A worker that dies is removed from the router; the request is routed again if it had
        streamed no token yet (otherwise it fails with a RuntimeError naming the worker)."""
        rid = request.request_id
        self._active[rid] = request
        ok, ttft_s, num_out = False, 0.0, 0
        try:
            for _ in range(max(1, len(self.infos))):
                try:
                    result = await self._attempt_supervised(request, on_delta)
                except _WorkerLost as lost:
                    if lost.handle is not None:  # never its replacement, if one holds the id by now
                        self._forget_worker(lost.worker_id, lost.why, lost.handle)
                    for handle in self.workers.values():  # e.g. the prefill worker's held blocks
                        handle.abort.remote(request.engine_id)
                    request.attempt += 1
                    if lost.streamed or not self.workers:
                        raise RuntimeError(
                            f"{lost.worker_id}: worker failed while running {rid} ({lost.why})"
                            + (" after streaming output; not retried" if lost.streamed else "")
                        ) from lost.__cause__
                    log.warning("%s failed before %s produced a token (%s); routing it again",
                                lost.worker_id, rid, lost.why)  # fmt: skip
                    continue
                ok, ttft_s, num_out = True, result.ttft_s, len(result.token_ids)
                return result
            raise RuntimeError(f"request {rid}: every worker it was routed to died")
        finally:
            self._active.pop(rid, None)
            if self.router is not None:
                self.router.finished.remote(ttft_s, num_out, ok)

    async def _attempt_supervised(
        self, request: _Request, on_delta: Callable[[Delta], None] | None
    ) -> ClusterCompletion:
        """``_attempt`` as a task the health loop can cut loose from a lost worker (then this
        raises ``_WorkerLost``); cancelling the caller still cancels the attempt."""
        request.lost_worker, request.streamed, request.worker_ids = None, False, []
        task = asyncio.ensure_future(self._attempt(request, on_delta))
        request.task = task
        try:
            return await task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if request.lost_worker is None or (current is not None and current.cancelling()):
                raise
            why = self.lost.get(request.lost_worker, "lost")
            ids = request.worker_ids
            handle = request.workers[ids.index(request.lost_worker)] if request.lost_worker in ids else None
            raise _WorkerLost(request.lost_worker, request.streamed, why, handle) from None
        finally:
            request.task = None

    async def _attempt(self, request: _Request, on_delta: Callable[[Delta], None] | None) -> ClusterCompletion:
        from ray.exceptions import RayActorError, RayTaskError

        from actors.worker import WorkerUnavailableError
        from engine.kv_cache.hashing import block_hashes
        from engine.tokenizer import IncrementalDetokenizer

        rid, ids = request.engine_id, request.token_ids
        started = time.monotonic()
        hashes = block_hashes(ids, self._hash_block_size)
        try:
            decision = await asyncio.wait_for(await_ref(self.router.route.remote(rid, hashes, len(ids))),
                                              self.config.workers.health_check_timeout_s)  # fmt: skip
        except (RayActorError, RayTaskError, TimeoutError) as exc:  # restarting, or no workers registered yet
            log.warning("router could not place %s (%s); running it without the router", rid, describe_failure(exc))
            decision = self.fallback_decision(rid, len(ids))
        prefill_id, decode_id = str(decision.prefill_worker), str(decision.decode_worker)
        cached = decision.predicted_decode_hit if prefill_id == decode_id else 0
        if prefill_id != decode_id and len(ids) < 2:  # one token cannot be split: run it on D
            prefill_id = decode_id
        detok = IncrementalDetokenizer(self.tokenizer, request.sampling.stop,
                                       request.sampling.include_stop_str_in_output)  # fmt: skip
        reason = "abort"
        error: str | None = None
        first_token: float | None = None
        first_hops: dict[str, float] | None = None
        acks: list[Any] = []
        stream: Any = None
        prefill: Any = None  # the prefill worker's result (P/D)
        prefill_call_s = 0.0
        sent = time.monotonic()
        if not request.aborted:
            decoder = self._worker(decode_id)
            if prefill_id != decode_id:
                prefiller = self._worker(prefill_id)
                request.on(decode_id, decoder, (prefill_id, prefiller))
                # the decode worker hears of the request now: it reserves the prompt's blocks and
                # warms its connection to the prefill worker while the prefill runs
                peer = getattr(self.infos.get(prefill_id), "agent", None)
                stream = decoder.generate.options(num_returns="streaming").remote(rid, ids, request.sampling, None,
                                                                                  True, peer)  # fmt: skip
                sent = time.monotonic()
                prefill = await self._prefill(request, prefiller, prefill_id, decoder)
                prefill_call_s = time.monotonic() - sent
                cached = prefill.num_cached_tokens
                acks.append(prefill.router_ack)
            request.on(decode_id, decoder)
        if not request.aborted:
            stopped = False
            try:
                if stream is None:
                    stream = decoder.generate.options(num_returns="streaming").remote(rid, ids, request.sampling)
                async for ref in stream:
                    chunk = await ref
                    if prefill_id == decode_id and chunk.num_cached_tokens >= 0:
                        cached = chunk.num_cached_tokens
                    if chunk.worker_failed:
                        why = chunk.error or "its engine stopped"
                        raise _WorkerLost(decode_id, first_token is not None, why, decoder)
                    if chunk.hops:
                        first_hops = chunk.hops
                    if chunk.token_ids and not stopped:
                        first_token = first_token or time.monotonic()
                        request.streamed = True
                        delta = detok.add(chunk.token_ids)
                        if on_delta is not None:
                            on_delta(Delta(delta, len(chunk.token_ids)))
                        if detok.stopped and not chunk.finished:
                            stopped = True
                            await decoder.abort.remote(rid)
                    if chunk.finished:
                        reason = "stop" if stopped else (chunk.finish_reason or "stop")
                        error = chunk.error
                        acks.append(chunk.router_ack)
                        break
            except (RayActorError, RayTaskError) as exc:
                raise _lost_or_raise(decode_id, decoder, first_token is not None, exc, WorkerUnavailableError) from exc
        tail = detok.flush()  # a held-back tail that turned out not to start a stop string
        if tail and on_delta is not None:
            on_delta(Delta(tail, 0))
        await _await_acks(acks)  # the router holds this request's blocks before it counts as finished
        now = time.monotonic()
        if reason == "error":
            raise RequestFailedError(f"{decode_id}: request {rid} failed on the worker: {error or 'no reason given'}")
        hops: dict[str, float] = {}
        if first_token is not None and first_hops is not None:
            retry_s = started - request.submitted if request.attempt else 0.0
            route_s = sent - (started if request.attempt else request.submitted)
            if prefill is not None and "since_handle" in first_hops:
                hops = pd_breakdown(route_s, prefill_call_s, first_token - sent - prefill_call_s, prefill.hops,
                                    first_hops, retry_s)  # fmt: skip
            elif "since_arrival" in first_hops:
                hops = whole_breakdown(route_s, first_token - sent, first_hops, retry_s)
            log.debug("hops %s (%s -> %s): %s", rid, prefill_id, decode_id,
                      " ".join(f"{k}={1e3 * v:.1f}ms" for k, v in hops.items()))  # fmt: skip
        return ClusterCompletion(
            request.prompt,
            detok.text,
            list(detok.token_ids),
            reason,
            request_id=request.request_id,
            prompt_token_ids=tuple(ids),
            prefill_worker=prefill_id,
            decode_worker=decode_id,
            route_reason=decision.reason,
            predicted_hit=decision.predicted_hit,
            cached_tokens=max(cached, 0),
            ttft_s=(first_token or now) - request.submitted,
            latency_s=now - request.submitted,
            hops=hops,
        )

    async def _prefill(self, request: _Request, prefiller: Any, prefill_id: str, decoder: Any) -> Any:
        """The prefill worker's result for ``request``; sends its handle to the decode worker told
        of the request (which, whenever no handle comes, is aborted here so it frees its blocks)."""
        from ray.exceptions import RayActorError, RayTaskError

        from actors.worker import WorkerUnavailableError

        rid = request.engine_id
        handed = False
        try:
            try:
                result = await prefiller.prefill.remote(rid, request.token_ids)
            except (RayActorError, RayTaskError) as exc:
                raise _lost_or_raise(prefill_id, prefiller, False, exc, WorkerUnavailableError) from exc
            if result.kv_handle is None:
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

    def _worker(self, worker_id: str) -> Any:
        handle = self.workers.get(worker_id)
        if handle is None:  # removed after the router chose it
            raise _WorkerLost(worker_id, False, self.lost.get(worker_id, "removed from the router"))
        return handle


async def _await_acks(acks: list[Any]) -> None:
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


class _WorkerLost(Exception):
    """A worker died, stopped or hung during a request (``streamed``: it had already sent
    tokens, so the request cannot run again elsewhere without repeating them)."""

    def __init__(self, worker_id: str, streamed: bool, why: str = "its actor died", handle: Any = None):
        super().__init__(worker_id)
        self.worker_id = worker_id
        self.streamed = streamed
        self.why = why
        self.handle = handle  # the actor that failed (None: it had already left this driver)


def _lost_or_raise(
    worker_id: str, handle: Any, streamed: bool, exc: Exception, unavailable: type[Exception]
) -> Exception:
    """A Ray error of a worker call as ``_WorkerLost`` when the worker is gone or unhealthy;
    any other task error stays what it is."""
    from ray.exceptions import RayActorError

    if isinstance(exc, RayActorError) or isinstance(getattr(exc, "cause", None), unavailable):
        return _WorkerLost(worker_id, streamed, describe_failure(exc), handle)
    return exc
