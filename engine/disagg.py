"""Prefill/decode disaggregation inside one engine: the handle that crosses workers, the read
plan, and the bookkeeping of held (prefill side) and in-flight (decode side) KV.

Token-count convention (one for every architecture, set by what a recurrent state allows):
for a prompt of N tokens the prefill engine computes the KV/state of the first N - 1 tokens and
samples nothing; the decode engine receives those N - 1 tokens' KV, computes token N - 1 itself
(getting the first logits and, for Mamba groups, h(N) from h(N - 1)) and decodes. Recurrent
state cannot be rolled back, so this is the only convention under which a Mamba state block can
travel; using it for attention-only models too keeps one code path.

What travels, per group (the coordinator decides by what it allocates on the decode side):
full attention: the blocks the decode side did not hit locally; sliding window: only blocks
inside the window at N - 1; Mamba: the single state block after N - 1 tokens. Null blocks never
travel. ``plan_read`` pairs each fresh decode block with the prefill block at the same table
index of the same group.

Lifetime: the prefill engine frees a handle's blocks on the reader's notification, or
``transfer.release_timeout_s`` after the export if none comes (the reader may be gone). Nothing
bounds the time a handle spends between the two engines (a busy driver, a worker thread waiting
on the router), so the handle carries the owner's release time (``expires_at``, wall clock) and
a reader starts a read only if it ends, even timed out, ``expiry_margin`` before then; otherwise
it recomputes (``handle_usable``). A read of blocks the owner already freed and reused would
give wrong tokens with no error.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from engine.transfer import AgentInfo

log = logging.getLogger(__name__)

NULL_BLOCK = -1
"""Marks a table slot the prefill engine no longer holds (out of window, older Mamba states)."""


def token_digest(token_ids: Sequence[int]) -> str:
    """A short fingerprint of the tokens whose KV a handle carries (catches mismatched prompts)."""
    return hashlib.sha256(np.asarray(token_ids, dtype=np.int64).tobytes()).hexdigest()[:32]


@dataclass(frozen=True)
class KVHandle:
    """Everything a decode engine needs to pull one prefilled request's KV. Plain data only, so it
    pickles and travels through Ray.

    ``block_ids[g][i]`` is the prefill engine's block at table index ``i`` of group ``g``, or
    ``NULL_BLOCK``; the KV covers the prompt's first ``num_tokens`` tokens (``prompt_len - 1``).
    ``layout_key`` must equal the reader's (same model, dtype, block size and grouping).
    """

    request_id: str
    num_tokens: int
    token_digest: str
    block_ids: tuple[tuple[int, ...], ...]
    agent: AgentInfo
    layout_key: str
    expires_at: float = 0.0  # ``time.time()`` when the owner frees the blocks unread (0: never)

    @property
    def notify_key(self) -> bytes:
        """The notification the owner receives when the read is done (its request id)."""
        return self.request_id.encode()


def check_handle(handle: KVHandle, layout_key: str, prompt_token_ids: Sequence[int]) -> None:
    """Raise ValueError (naming the field) unless ``handle`` fits this engine and this prompt."""
    if handle.layout_key != layout_key:
        raise ValueError(
            f"kv_handle.layout_key: prefill engine layout {handle.layout_key!r} differs from this "
            f"engine's {layout_key!r}; prefill and decode workers must run the same model and KV config"
        )
    if handle.num_tokens != len(prompt_token_ids) - 1:
        raise ValueError(
            f"kv_handle.num_tokens: {handle.num_tokens} does not fit a prompt of {len(prompt_token_ids)} "
            f"tokens (expected prompt length - 1)"
        )
    if handle.token_digest != token_digest(prompt_token_ids[:-1]):
        raise ValueError(f"kv_handle.token_digest: request {handle.request_id!r} was prefilled for a different prompt")


def expiry_margin(release_timeout_s: float) -> float:
    """Slack kept between a read's end and its owner's release: clock skew between hosts and the
    owner's step granularity (1 s, or a tenth of the release timeout when that is shorter)."""
    return min(1.0, 0.1 * release_timeout_s)


def handle_usable(handle: KVHandle, read_timeout_s: float, release_timeout_s: float, now: float | None = None) -> bool:
    """Whether a read started now ends (done, or failed at ``read_timeout_s``) before the owner
    may free the handle's blocks, with ``expiry_margin`` to spare."""
    if not handle.expires_at:
        return True
    now = time.time() if now is None else now
    return now + read_timeout_s + expiry_margin(release_timeout_s) <= handle.expires_at


def plan_read(
    handle: KVHandle,
    local_tables: Sequence[Sequence[int]],
    fresh: Sequence[set[int]],
    group_pool: Sequence[int] | None = None,
) -> np.ndarray:
    """``(pool, remote, local)`` block triples filling every fresh local block (``fresh[g]``: the
    fresh block ids of group ``g``) from the same table slot; block ids are ids in the group's
    pool (``group_pool[g]``, all 0 when None).

    Raises ValueError if the prefill engine no longer holds a block the decode side needs (a
    layout or window mismatch): the caller treats it as a failed transfer.
    """
    triples: list[tuple[int, int, int]] = []
    if len(local_tables) != len(handle.block_ids):
        raise ValueError(f"kv_handle.block_ids: {len(handle.block_ids)} groups, this engine has {len(local_tables)}")
    for g, (remote, local) in enumerate(zip(handle.block_ids, local_tables, strict=True)):
        pool = group_pool[g] if group_pool is not None else 0
        for i, block in enumerate(local):
            if block not in fresh[g]:
                continue
            source = remote[i] if i < len(remote) else NULL_BLOCK
            if source == NULL_BLOCK:
                raise ValueError(f"kv_handle.block_ids: group {g} slot {i} is not held by the prefill engine")
            triples.append((pool, source, block))
    return np.asarray(triples, dtype=np.int64).reshape(-1, 3)


class HeldBlocks:
    """Prefill side: requests whose blocks wait for a reader, each with a release deadline.

    Invariant: a request id is here exactly while the scheduler holds its blocks for a reader.
    """

    def __init__(self, release_timeout_s: float):
        self.release_timeout_s = release_timeout_s
        self.deadlines: dict[str, float] = {}

    def hold(self, request_id: str, now: float | None = None) -> float:
        """Start holding; returns the release time on the wall clock (for the handle)."""
        self.deadlines[request_id] = (time.monotonic() if now is None else now) + self.release_timeout_s
        return time.time() + self.release_timeout_s

    def due(self, notifications: Iterable[bytes], now: float | None = None) -> tuple[list[str], list[str]]:
        """``(notified, expired)`` request ids to release now; both leave the ledger."""
        notified = []
        for note in notifications:
            request_id = note.decode(errors="replace")
            if self.deadlines.pop(request_id, None) is not None:
                notified.append(request_id)
        now = time.monotonic() if now is None else now
        expired = [rid for rid, deadline in self.deadlines.items() if deadline <= now]
        for request_id in expired:
            del self.deadlines[request_id]
        return notified, expired

    def forget(self, request_id: str) -> None:
        self.deadlines.pop(request_id, None)

    def __len__(self) -> int:
        return len(self.deadlines)


@dataclass
class TransferStats:
    """Decode-side counters: reads started, blocks and bytes moved, failures, read seconds,
    handles refused because their owner could free the blocks before a read would end."""

    reads: int = 0
    notify_only: int = 0
    expired_handles: int = 0
    blocks: int = 0
    bytes: int = 0
    failures: int = 0
    seconds: float = 0.0
    released_by_notification: int = 0
    released_by_timeout: int = 0
    warm_ups: int = 0  # connections opened to a peer before its first read
    cold_reads: int = 0  # reads that opened the connection to their peer themselves


class CompletedRead(NamedTuple):
    """One read that brought a request's KV in: its bytes and its seconds (handle taken -> done)."""

    nbytes: int
    seconds: float


@dataclass
class PendingLoads:
    """Decode side: in-flight reads (transfer id -> request id) and reads that only notify.

    ``aborted`` requests keep their blocks until their read ends, so a late write can never land
    in a block that was handed to another request.
    """

    reads: dict[int, str] = field(default_factory=dict)
    notify_only: set[int] = field(default_factory=set)
    aborted: set[str] = field(default_factory=set)

    def __len__(self) -> int:
        return len(self.reads) + len(self.notify_only)
