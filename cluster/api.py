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
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self, TypeVar

from cluster.request_path import (
    ClusterCompletion,
    ClusterRequests,
    Delta,
    RequestFailedError,
    _Request,
)

from cluster.admin import ClusterAdmin
from cluster.supervision import ClusterSupervision
from configs import ClusterConfig, load_config
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
DEFAULT_START_TIMEOUT_S = 900.0  # the first use of Gemma-3-270M converts its GGUF (minutes)


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


class Cluster(ClusterRequests, ClusterSupervision, ClusterAdmin):
    """Owns a set of prefill/decode worker actors and a router actor on a Ray cluster (embedded
    or attached), the driver-side tokenizer, and the requests in flight.

    One request's path (route, prefill, decode, retry) is ``ClusterRequests``'s
    (cluster/request_path.py).

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


__all__ = ["Cluster", "ClusterCompletion", "ClusterHandles", "Delta", "RequestFailedError"]
