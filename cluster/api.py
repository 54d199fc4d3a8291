"""The driver API: ``Cluster(config)`` starts (or attaches to) Ray, starts the workers and the
router, and serves ``generate`` / ``stream`` / ``pin_prefix`` / ``unpin`` / ``stats`` / ``abort``.

One request (see docs/architecture.md): the entry point (this API, the HTTP ingress, the CLI)
checks and tokenizes the prompt once (``engine.validation``); the driver hashes its blocks (with
its cache salt, if any) and asks the router actor where it runs; when the router splits it, the
driver tells the decode worker at once (it reserves the prompt's blocks and warms its connection
to the prefill worker while the prefill runs), the prefill worker computes the prompt's KV and
returns a handle, the driver relays it and the decode worker pulls that KV and decodes; otherwise
the decode (or aggregated) worker runs it whole. Tokens stream back from the decode worker; the driver detokenizes and
applies stop strings (aborting the request on the worker when one matches). A request counts as
finished once the router applied the reports holding its blocks (the workers send them without
waiting; the driver awaits them). ``ClusterCompletion.hops`` breaks its TTFT down per hop. A
request whose worker is lost is routed again: from its prompt before it streamed a token, else
from its prompt and the tokens it streamed, on one worker (a migration, at most
``serve.migration_limit`` times; ``ClusterCompletion.migrations`` counts them).

``Cluster`` is a facade over the objects it owns: the ``RequestRunner`` (cluster/request_runner.py:
admission, routing, streaming, retries), the ``Supervisor`` (cluster/supervisor.py: the actors,
their health and replacement), and the ``DriverLoop`` (cluster/driver_loop.py) that its blocking
calls wait on.

    with Cluster("tiny") as cluster:
        print(cluster.generate(["Hello"], SamplingParams(max_tokens=8))[0].text)
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Self

from cluster.driver_loop import NOT_STARTED, DriverLoop
from cluster.handles import RouterHandle, WorkerHandle
from cluster.in_flight import InFlight
from cluster.request_runner import RequestFailedError, RequestRunner
from cluster.results import ClusterCompletion, Delta
from cluster.served_model import ServedModel
from cluster.supervisor import Supervisor
from configs import ClusterConfig, load_config
from engine.kv_cache.coordinator_types import PIN_TIERS
from engine.sampling_params import SamplingParams
from engine.validation import ValidatedPrompt

if TYPE_CHECKING:
    from actors.worker_types import WorkerInfo
    from engine.routing import Decision
    from engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)

Prompt = str | Sequence[int] | ValidatedPrompt  # a ValidatedPrompt was checked by its entry point
DEFAULT_START_TIMEOUT_S = 900.0  # the first use of Gemma-3-270M converts its GGUF (minutes)


@dataclass(frozen=True)
class ClusterHandles:
    """Everything another process needs to drive a started cluster (picklable): the config, the
    worker and router actor handles (one per router replica), what each worker reported at
    start, the model directory.
    The process that started the actors owns them; ``Cluster.attach`` only drives them."""

    config: ClusterConfig
    workers: dict[str, WorkerHandle]
    infos: dict[str, WorkerInfo]
    routers: list[RouterHandle]
    model_directory: str


class Cluster:
    """Owns a set of prefill/decode worker actors and a router actor on a Ray cluster (embedded
    or attached) through its ``Supervisor``, the requests in flight through its
    ``RequestRunner`` (which also holds the served model: tokenizer, vocabulary, context length),
    and the driver's event loop. Every public method checks its arguments here or in the runner,
    then delegates.

    Invariants: between ``start`` and ``shutdown`` every worker is registered with the router
    and reports to it, the driver loop runs and the runner admits requests (the cluster is
    *started* exactly when the runner accepts); an embedded Ray started here is shut down here
    (an attached one is left running); ``shutdown`` is idempotent.
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
        self._owns_ray = False
        self._loop = DriverLoop()
        self._in_flight = InFlight()
        self._supervisor = Supervisor(self.config, self._loop, self._in_flight)
        self._runner = RequestRunner(self.config, self._supervisor, self._in_flight)

    # -- what the cluster holds (read-only views of its owned objects) ----------------------------
    @property
    def workers(self) -> dict[str, WorkerHandle]:
        """The live worker actors by id (a lost worker leaves until its replacement joins)."""
        return self._supervisor.workers

    @property
    def infos(self) -> dict[str, WorkerInfo]:
        """What each worker reported when it (or its replacement) started, by id."""
        return self._supervisor.infos

    @property
    def router(self) -> RouterHandle:
        """Router replica 0 (the router, unless ``router.replicas`` > 1)."""
        return self._supervisor.router

    @property
    def routers(self) -> list[RouterHandle]:
        """Every router replica, in replica order."""
        return list(self._supervisor.routers)

    @property
    def lost(self) -> dict[str, str]:
        """Workers taken out and not (yet) replaced: id -> why."""
        return self._supervisor.lost

    @property
    def replacements(self) -> int:
        return self._supervisor.replacements

    @property
    def router_incarnation(self) -> str | None:
        return self._supervisor.router_incarnation

    @property
    def router_incarnations(self) -> list[str | None]:
        """The incarnation last seen of each router replica (None: not seen yet)."""
        return list(self._supervisor.router_incarnations)

    @property
    def router_rejoins(self) -> int:
        return self._supervisor.router_rejoins

    @property
    def model(self) -> ServedModel:
        """The model this started cluster serves (tokenizer, vocabulary, context length);
        RuntimeError when not started."""
        return self._runner.served()

    @property
    def tokenizer(self) -> Tokenizer | None:
        model = self._runner.model
        return model.tokenizer if model is not None else None

    @property
    def max_model_len(self) -> int:
        model = self._runner.model
        return model.max_model_len if model is not None else 0

    @property
    def vocab_size(self) -> int:
        model = self._runner.model
        return model.vocab_size if model is not None else 0

    @property
    def model_directory(self) -> str:
        model = self._runner.model
        return model.directory if model is not None else ""

    # -- lifecycle ---------------------------------------------------------------------------------
    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def start(self) -> Self:
        """Connect to Ray (or start it), start the workers and the router; wait until ready.

        Either leaves a started cluster or shuts down what it began and raises."""
        if self._runner.accepting:
            return self
        import ray

        from cluster.placement import check_capacity, check_tensor_parallel, embedded_init_kwargs, loopback_environment
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
            check_tensor_parallel(config, model_directory, ray.nodes())
            infos = self._supervisor.start_workers(resources, self.start_timeout_s)
            model = ServedModel.from_workers(infos, str(model_directory))
            self._supervisor.start_router()
            self._loop.start()
            self._runner.start(model)
            self._supervisor.start()
            for pin in config.router.pins:
                self.pin_prefix(
                    pin.text if pin.text is not None else list(pin.token_ids or []), pin.replicas, pin.ttl_s, wait=False
                )
        except BaseException:
            self.shutdown()
            raise
        log.info(
            "cluster ready: %d prefill + %d decode workers, router policy %s, %s",
            config.workers.num_prefill,
            config.workers.num_decode,
            config.router.policy,
            config.model.source,
        )
        return self

    def handles(self) -> ClusterHandles:
        """What ``Cluster.attach`` needs to drive this cluster from another process."""
        self._require_started()
        supervisor = self._supervisor
        return ClusterHandles(
            self.config,
            dict(supervisor.workers),
            dict(supervisor.infos),
            list(supervisor.routers),
            self.model_directory,
        )

    @classmethod
    def attach(cls, handles: ClusterHandles) -> Cluster:
        """Drive a cluster another process started (its actors stay that process's: ``shutdown``
        here stops only this driver, never the actors or Ray)."""
        cluster = cls(handles.config)
        cluster._supervisor.attach(handles.workers, handles.infos, handles.routers)
        model = ServedModel.from_workers(handles.infos, handles.model_directory)
        cluster._loop.start()
        cluster._runner.start(model)
        cluster._supervisor.start()
        return cluster

    def shutdown(self) -> None:
        """Stop the workers and the router (and the embedded Ray, if started here). Idempotent."""
        import ray

        if self._runner.accepting:
            self._runner.report_finished()  # the router's metrics get the last requests' ends
        self._supervisor.stop()
        self._supervisor.stop_actors()
        self._loop.stop()
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()
        self._owns_ray = False
        self._runner.stop()

    def _require_started(self) -> None:
        if not self._runner.accepting:
            raise RuntimeError(NOT_STARTED)

    # -- requests ----------------------------------------------------------------------------------
    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling: SamplingParams | dict[str, Any] | Sequence[SamplingParams] | None = None,
        *,
        request_ids: Sequence[str] | None = None,
        on_completion: Callable[[ClusterCompletion], None] | None = None,
        return_exceptions: bool = False,
        cache_salt: str | None = None,
    ) -> list[ClusterCompletion]:
        """Run every prompt (text, or a list of token ids) to completion; results in input order.

        ``sampling``: one for all prompts, or one per prompt. Every prompt is checked before any
        runs: an empty prompt, one of max_model_len tokens or more, a token id outside the
        vocabulary or bad sampling values raise ValueError naming the field and the value.
        ``on_completion`` is called (on the driver's event-loop thread) as each request finishes.
        ``return_exceptions``: a request that fails (e.g. on a worker) gives its exception in its
        place and the others run on; by default the first failure raises. ``cache_salt``: a
        non-empty string every prompt's block hashes depend on, so requests reuse cached blocks
        only of requests with the same salt (a ``ValidatedPrompt`` carries its own).
        """
        requests = self._runner.admit_batch(prompts, sampling, request_ids, cache_salt)
        return self._loop.run(self._runner.run_batch(requests, on_completion, return_exceptions))

    async def agenerate(
        self,
        prompt: Prompt,
        sampling: SamplingParams | dict[str, Any] | None = None,
        *,
        request_id: str | None = None,
        cache_salt: str | None = None,
        on_delta: Callable[[Delta], None] | None = None,
        share_placement: str | None = None,
    ) -> ClusterCompletion:
        """One request, awaited in the caller's event loop (the same checks as ``generate``).
        ``on_delta`` is called with each ``Delta`` as output tokens arrive (no queue between the
        workers' stream and the caller). Cancelling the awaiting task aborts the request on its
        workers and frees its blocks.

        ``share_placement``: a non-empty key; requests in flight with the same key run where the
        first of them was routed (its prefill and decode workers), so the ``n`` samples of one
        prompt, run as ``n`` concurrent calls with one key, share the prompt's KV on one decode
        worker through its prefix cache. A request that loses its worker is routed on its own.
        Use a key unique to the group (e.g. the HTTP request's id): a later group with the same
        key, started while one of the earlier group is still in flight, follows it too."""
        request = self._runner.admit(prompt, sampling, request_id, cache_salt, share_placement)
        return await self._runner.run(request, on_delta)

    async def stream(
        self,
        prompt: Prompt,
        sampling: SamplingParams | dict[str, Any] | None = None,
        *,
        request_id: str | None = None,
        cache_salt: str | None = None,
    ) -> AsyncIterator[str]:
        """Text deltas of one request as its tokens arrive (an async iterator in the caller's
        loop). Leaving the iteration early aborts the request."""
        async for item in self.stream_completion(prompt, sampling, request_id=request_id, cache_salt=cache_salt):
            if isinstance(item, Delta) and item.text:
                yield item.text

    def stream_completion(
        self,
        prompt: Prompt,
        sampling: SamplingParams | dict[str, Any] | None = None,
        *,
        request_id: str | None = None,
        cache_salt: str | None = None,
        share_placement: str | None = None,
    ) -> AsyncIterator[Delta | ClusterCompletion]:
        """One request as it runs (an async iterator in the caller's loop; the request is checked
        when iteration starts): a ``Delta`` whenever output tokens arrive, then its
        ``ClusterCompletion`` last. Leaving the iteration early (or cancelling the task that
        iterates) aborts the request on its workers and frees its blocks. ``share_placement``:
        as for ``agenerate``."""
        return self._runner.stream(prompt, sampling, request_id, cache_salt, share_placement)

    def abort(self, request_id: str) -> bool:
        """Stop a request in flight and free its blocks everywhere; False if it is unknown."""
        return self._runner.abort(request_id)

    def check_prompt(self, prompt: object, cache_salt: object = None) -> ValidatedPrompt:
        """A prompt (text, or a list of token ids) and its cache salt after every check a request
        gets before it runs, for ``generate`` / ``stream`` to take as it is; raises ValueError
        naming the field and the value for an empty prompt, a wrong type, a token id outside the
        vocabulary, a prompt of max_model_len tokens or more, or an empty cache salt."""
        return self._runner.check_prompt(prompt, cache_salt)

    # -- pins --------------------------------------------------------------------------------------
    def pin_prefix(
        self,
        prefix: str | Sequence[int],
        replicas: int = 1,
        ttl: float | None = None,
        *,
        tier: str = "device",
        wait: bool = True,
        timeout_s: float = 120.0,
    ) -> int:
        """Keep ``prefix`` (text or token ids) resident on ``replicas`` workers, for ``ttl``
        seconds or until ``unpin``; returns the pin id. ``tier``: "device" (in device memory,
        moved to the host tier pinned under pressure) or "host" (in the host tier only, promoted
        on a hit; needs ``kv_cache.offload``). ``wait``: until every replica holds it."""
        return self._loop.run(self.apin_prefix(prefix, replicas, ttl, tier=tier, wait=wait, timeout_s=timeout_s))

    async def apin_prefix(
        self,
        prefix: str | Sequence[int],
        replicas: int = 1,
        ttl: float | None = None,
        *,
        tier: str = "device",
        wait: bool = True,
        timeout_s: float = 120.0,
    ) -> int:
        """``pin_prefix`` awaited in the caller's event loop."""
        from ray.exceptions import RayTaskError

        model = self._runner.served()
        if isinstance(prefix, str):
            if not prefix:
                raise ValueError("prefix: must not be empty (got '')")
            token_ids = list(model.tokenizer.encode(prefix))
        else:
            token_ids = model.check_ids("prefix", prefix)
        if not token_ids:
            raise ValueError(f"prefix: encodes to no tokens (got {prefix!r})")
        if isinstance(replicas, bool) or not isinstance(replicas, int):
            raise ValueError(f"replicas: must be an integer (got {replicas!r})")  # noqa: TRY004  (API errors are ValueError)
        if replicas < 1:
            raise ValueError(f"replicas: must be >= 1 (got {replicas})")
        if ttl is not None:
            if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or math.isnan(ttl):
                raise ValueError(f"ttl: must be a number of seconds (got {ttl!r})")
            if ttl <= 0:
                raise ValueError(f"ttl: must be > 0 seconds (got {ttl})")
            if math.isinf(ttl):
                raise ValueError(f"ttl: must be finite (got {ttl}); leave it out for a pin without expiry")
        if tier not in PIN_TIERS:
            raise ValueError(f"tier: must be one of {', '.join(PIN_TIERS)} (got {tier!r})")
        cache = self.config.kv_cache
        if tier == "host" and not (cache.offload.enabled and cache.prefix_caching):
            raise ValueError(
                "tier: 'host' needs the host tier (kv_cache.offload.enabled=true with prefix caching; got tier='host')"
            )
        supervisor = self._supervisor
        try:
            pin_id = int(await supervisor.on_pin_router("pin", token_ids, replicas, ttl, tier))
        except RayTaskError as exc:  # the policy's own check (e.g. more replicas than holders)
            if isinstance(exc.cause, ValueError):
                raise ValueError(str(exc.cause)) from None  # noqa: TRY004  (the policy's ValueError, unwrapped)
            raise
        if wait:
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                pin = {p["pin_id"]: p for p in await supervisor.on_pin_router("pins")}.get(pin_id)
                if pin is None or len(pin["active"]) >= pin["replicas"]:
                    break
                await asyncio.sleep(0.05)
            else:
                log.warning("pin %d: not on %d replicas after %.0f s", pin_id, replicas, timeout_s)
        return pin_id

    def unpin(self, pin_id: int) -> bool:
        """Remove a pin everywhere; False if no such pin."""
        return self._loop.run(self.aunpin(pin_id))

    async def aunpin(self, pin_id: int) -> bool:
        self._require_started()
        return bool(await self._supervisor.on_pin_router("unpin", pin_id))

    def pins(self) -> list[dict[str, Any]]:
        """Every cluster pin: id, tokens, replicas, ``tier``, active and pending holders, and per
        active holder the tier it keeps the pin in (``holder_tiers``: worker id -> tier)."""
        return self._loop.run(self.apins())

    async def apins(self) -> list[dict[str, Any]]:
        self._require_started()
        return list(await self._supervisor.on_pin_router("pins"))

    # -- stats and health --------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Per worker: running, queued, free / total / pinned blocks, hit rate; totals; router."""
        return self._loop.run(self.astats())

    async def astats(self, timeout_s: float = 60.0) -> dict[str, Any]:
        """``stats`` awaited in the caller's event loop."""
        self._require_started()
        return await self._supervisor.stats(timeout_s)

    def health(self, timeout_s: float = 5.0) -> dict[str, str]:
        """Every worker this cluster started: "ok", or why it is not healthy."""
        return self._loop.run(self.ahealth(timeout_s))

    async def ahealth(self, timeout_s: float = 5.0) -> dict[str, str]:
        """Every worker this cluster started, with "ok" or why it is not healthy (an engine
        thread that stopped, an actor that died or did not answer within ``timeout_s``)."""
        self._require_started()
        return await self._supervisor.health(timeout_s)

    async def check_workers(self) -> dict[str, str]:
        """One round of the health loop now: every worker's health (renewing this driver's
        leases on it); a worker that fails is lost. Returns ``{worker id: "ok" or why not}``."""
        return await self._supervisor.check_workers()

    def fallback_decision(self, request_id: str, num_tokens: int) -> Decision:
        """Where a request runs while the router cannot be asked (see ``Supervisor``)."""
        return self._supervisor.fallback_decision(request_id, num_tokens)


__all__ = ["Cluster", "ClusterCompletion", "ClusterHandles", "Delta", "RequestFailedError"]
