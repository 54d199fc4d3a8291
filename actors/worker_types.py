"""Plain data the worker actors exchange with drivers and with their own engine thread."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Literal

from engine.kv_cache.spec import KVCacheGroup
from engine.routing import PinOn

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


@dataclass(frozen=True)
class TokenChunk:
    """Tokens one request gained on a worker since the last chunk, and whether it finished."""

    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    num_cached_tokens: int = -1
    error: str | None = None  # why it finished with "error"
    worker_failed: bool = False  # the error is the worker's, not the request's: run it elsewhere


@dataclass(frozen=True)
class PrefillResult:
    """A prefill-only request's outcome: the handle the decode worker pulls from (None if it was
    aborted or failed) and the prefill worker's prefix hit at admission."""

    kv_handle: Any
    num_cached_tokens: int
    finish_reason: str
    error: str | None = None
    worker_failed: bool = False


@dataclass
class _Tracked:
    """Per-request bookkeeping of the engine thread (for streams, prefills, pins, metrics)."""

    loop: asyncio.AbstractEventLoop | None
    sink: asyncio.Queue[TokenChunk] | asyncio.Future[PrefillResult] | None
    prompt_tokens: int
    arrival: float = field(default_factory=time.monotonic)
    first_token: float | None = None
    output_tokens: int = 0
    cached_tokens: int = 0
    pin: PinOn | None = None
