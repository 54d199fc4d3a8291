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
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from cluster.admin import ClusterAdmin
from cluster.lifecycle import ClusterHandles, ClusterLifecycle
from cluster.request_path import (
    ClusterCompletion,
    ClusterRequests,
    Delta,
    RequestFailedError,
    _Request,
)
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

Prompt = str | Sequence[int]
DEFAULT_START_TIMEOUT_S = 900.0  # the first use of Gemma-3-270M converts its GGUF (minutes)


class Cluster(ClusterLifecycle, ClusterRequests, ClusterSupervision, ClusterAdmin):
    """Owns a set of prefill/decode worker actors and a router actor on a Ray cluster (embedded
    or attached), the driver-side tokenizer, and the requests in flight.

    Starting, attaching and stopping (Ray, the actors, the driver's event loop) are
    ``ClusterLifecycle``'s (cluster/lifecycle.py); one request's path (route, prefill, decode,
    retry) is ``ClusterRequests``'s (cluster/request_path.py).

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

    # -- lifecycle: ClusterLifecycle (cluster/lifecycle.py) ----------------------------------------

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
