"""Plain data the worker actors exchange with drivers and with their own engine thread.

Timings that cross processes are durations measured on one process's monotonic clock each
(``hops``), never timestamps: the driver combines durations, it never subtracts two clocks."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Literal

from engine.kv_cache.spec import KVCacheGroup
from engine.logprobs import TokenLogprob
from engine.routing import PinOn

if TYPE_CHECKING:
    import ray

    from engine.disagg import KVHandle
    from engine.request import Request
    from engine.transfer import AgentInfo

WorkerRole = Literal["prefill", "decode"]


class WorkerUnavailableError(RuntimeError):
    """The worker's engine stopped (or the worker is shut down): it serves nothing more, and a
    driver should treat it as dead (route elsewhere, replace it)."""


@dataclass(frozen=True)
class WorkerInfo:
    """What the driver and the router need to know of a started worker (plain data)."""

    worker_id: str
    role: WorkerRole
    router_role: Literal["prefill", "decode", "both"]
    num_blocks: int
    block_size: int
    max_model_len: int
    vocab_size: int
    groups: tuple[KVCacheGroup, ...]
    model_directory: str
    node_ip: str
    pid: int
    agent: AgentInfo | None = None  # the transfer AgentInfo (P/D workers): decode workers warm a connection to it
    eos_token_id: int | None = None  # the model's end-of-sequence token (the engine's stop rule, ``stop_status``)


#: ``finish_reason`` of a request a worker sent back unrun: the hit the router predicted there was
#: evicted before the request arrived (the router had not heard of it yet); route it again
STALE_PREDICTION = "stale_prediction"


@dataclass(frozen=True)
class ExpectedHit:
    """The hit the router predicted where a request's prompt is computed: the prompt's block
    hashes and the tokens predicted cached. The worker holds those blocks from the request's
    arrival to its admission (``WorkerView.lease_prefix``). ``strict``: when fewer are still
    cached on arrival, the worker answers ``STALE_PREDICTION`` at once (with the ``router_ack``
    of the report carrying its evictions) instead of running the request on a hit it lost."""

    block_hashes: list[bytes]
    num_tokens: int
    strict: bool = True


@dataclass(frozen=True)
class TokenChunk:
    """Tokens one request gained on a worker since the last chunk, and whether it finished."""

    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    num_cached_tokens: int = -1
    error: str | None = None  # why it finished with "error"
    worker_failed: bool = False  # the error is the worker's, not the request's: run it elsewhere
    hops: dict[str, float] | None = None  # on the first tokens' chunk: this worker's hop durations (s)
    #: on the last chunk: the refs (one per router replica) of the report carrying its blocks
    router_ack: tuple[ray.ObjectRef[None], ...] = ()
    logprobs: list[TokenLogprob] | None = None  # one per token of ``token_ids`` when the sampling asks for them
    prompt_logprobs: list[TokenLogprob | None] | None = None  # on the first chunk, with ``prompt_logprobs``

    def followed_by(self, more: TokenChunk) -> TokenChunk:
        """This chunk and the one that came after it as one (a stream coalesces chunks that piled
        up): ``more``'s status with both chunks' tokens, logprobs and the first hops."""
        logprobs = None
        if self.logprobs is not None or more.logprobs is not None:
            logprobs = (self.logprobs or []) + (more.logprobs or [])
        return replace(
            more,
            token_ids=self.token_ids + more.token_ids,
            hops=self.hops or more.hops,
            logprobs=logprobs,
            prompt_logprobs=self.prompt_logprobs or more.prompt_logprobs,
        )


@dataclass(frozen=True)
class PrefillResult:
    """A prefill-only request's outcome: the handle the decode worker pulls from (None if it was
    aborted or failed) and the prefill worker's prefix hit at admission."""

    kv_handle: KVHandle | None
    num_cached_tokens: int
    finish_reason: str
    error: str | None = None
    worker_failed: bool = False
    hops: dict[str, float] = field(default_factory=dict)  # prefill_queue, prefill (s, this worker's clock)
    #: the refs (one per router replica) of the report carrying the prefilled blocks
    router_ack: tuple[ray.ObjectRef[None], ...] = ()


@dataclass
class TrackedRequest:
    """Per-request bookkeeping of a worker's engine thread (for streams, prefills, pins, metrics):
    where its result goes (``sink`` on the actor's event loop ``loop``; both None for a pin's
    request) and the times its hops are measured from."""

    loop: asyncio.AbstractEventLoop | None
    sink: asyncio.Queue[TokenChunk] | asyncio.Future[PrefillResult] | None
    prompt_tokens: int
    arrival: float = field(default_factory=time.monotonic)
    first_token: float | None = None
    output_tokens: int = 0
    cached_tokens: int = 0
    pin: PinOn | None = None
    request: Request | None = None  # the engine's Request (its scheduled_at / kv_loaded_at time the hops)
    reserved_at: float | None = None  # announced remote prefill: its blocks were reserved then
    handle_at: float | None = None  # ... its handle reached this worker (the actor call) then
    handle_taken_at: float | None = None  # ... and the engine thread took it then
