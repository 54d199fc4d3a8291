"""P/D reads of a worker split over tensor-parallel ranks (engine/rank_group.py): each rank holds
its own shard of every KV page and recurrent state (its heads), in its own slot tensors under its
own transfer agent, so a request's KV moves as one read per rank: the decode worker's rank r
reads from the prefill worker's rank r (``AgentInfo.ranks``), both sides at the same size.

Which blocks travel is decided once, on rank 0 (its hand-off's ``plan_read``: block ids are per
token, the same on every rank), and every rank moves exactly those pairs. Rank 0's side
(``RankReads``) sends each read to the other ranks over the control channel, asks them how it
stands once its own part has ended, and counts it ended only when it ended on every rank, failed
if it failed on any. The prefill worker's notification (its blocks may be freed) is sent after
that, by rank 0 only: the other ranks read with none, so no rank's blocks are freed while another
rank still reads them. The other ranks' side (``FollowerReads``) starts and polls its reads on
that rank's transfer object and counts what it moved.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np

from engine.transfer.records import DONE, FAILED, PENDING, AgentInfo, TransferStatus

if TYPE_CHECKING:
    from engine.transfer.base import KVTransfer

log = logging.getLogger(__name__)


class ReadLeader(Protocol):
    """What rank 0's reads need of the control channel (engine.rank_group.RankLeader): the group's
    size, sending reads to every other rank, and asking each which of them ended."""

    size: int

    def send_reads(self, reads: list[RankRead]) -> None: ...
    def poll_reads(self, poll: ReadPoll) -> list[dict[int, TransferStatus]]: ...


@dataclass(frozen=True)
class RankRead:
    """One read every other rank makes: ``pairs`` (``(pool, remote, local)`` triples, rank 0's
    plan) from its own rank of ``peer`` (the prefill worker's published info), under ``key``
    (rank 0's transfer id of the same read)."""

    key: int
    peer: AgentInfo
    pairs: np.ndarray


@dataclass(frozen=True)
class ReadPoll:
    """Rank 0 asks how the reads ``keys`` stand; ``settled``: reads it counted ended (the ranks
    forget them)."""

    keys: list[int]
    settled: list[int] = field(default_factory=list)


class RankReads:
    """Rank 0's side of a split worker's reads: owns the reads started on every rank and not yet
    ended on all (``pending``: rank 0's transfer id -> the peer and the notification to send when
    they end) and the reads ended since the other ranks were last told (``settled``).

    Invariant: a read leaves ``pending`` only when every rank reported it ended, so the blocks
    it writes stay the request's until no rank writes them any more."""

    def __init__(self, leader: ReadLeader):
        self.leader = leader
        self.size = leader.size
        self.pending: dict[int, tuple[AgentInfo, bytes]] = {}
        self.settled: list[int] = []

    def check(self, peer: AgentInfo) -> None:
        """ValueError naming the field unless ``peer`` is split over as many ranks as this worker."""
        if peer.tensor_parallel_size != self.size:
            raise ValueError(
                f"workers.tensor_parallel_size: the prefill worker {peer.name!r} runs "
                f"{peer.tensor_parallel_size} ranks, this decode worker {self.size}; a P/D transfer needs the "
                "same size on both sides"
            )

    def start(self, tid: int, peer: AgentInfo, pairs: np.ndarray, notify: bytes) -> None:
        """Rank 0 started read ``tid`` of ``pairs`` from ``peer`` (with no notification): start
        it on every other rank; ``notify`` goes to the peer once it ended everywhere."""
        self.leader.send_reads([RankRead(tid, peer, np.asarray(pairs, dtype=np.int64))])
        self.pending[tid] = (peer, notify)

    def settle(self, ended: dict[int, TransferStatus]) -> dict[int, TransferStatus]:
        """Of the reads that ended on rank 0 (``ended``), those that ended on every rank, each
        DONE only if it is done on every rank; the others stay pending here."""
        asked = [tid for tid in ended if tid in self.pending]
        if not asked:
            return ended
        settled, self.settled = self.settled, []
        answers = self.leader.poll_reads(ReadPoll(asked, settled))
        out: dict[int, TransferStatus] = {}
        for tid, status in ended.items():
            if tid not in self.pending:
                out[tid] = status
                continue
            statuses = [status, *(answer.get(tid, FAILED) for answer in answers)]
            if PENDING in statuses:
                continue
            out[tid] = DONE if all(s == DONE for s in statuses) else FAILED
            self.settled.append(tid)
        return out

    def take(self, tid: int) -> tuple[AgentInfo, bytes]:
        """The peer and notification of a read that ended on every rank (it leaves ``pending``)."""
        return self.pending.pop(tid)


class FollowerReads:
    """One rank's (above 0) reads of a split decode worker: owns the reads rank 0 sent and this
    rank's transfer object runs (``reads``: key -> this rank's transfer id), the statuses of those
    that ended until rank 0 settles them (``ended``), and what this rank moved (``reads_done``,
    ``blocks``, ``bytes``: reads that ended well).

    Invariant: a key is in at most one of ``reads`` (in flight) and ``ended``; a transfer id is
    released as soon as its read ended."""

    def __init__(self, transfer: KVTransfer, rank: int):
        self.transfer = transfer
        self.rank = rank
        self.reads: dict[int, int] = {}
        self.ended: dict[int, TransferStatus] = {}
        self.reads_done = 0
        self.blocks = 0
        self.bytes = 0

    @property
    def agent_info(self) -> AgentInfo:
        return self.transfer.agent_info

    def start(self, read: RankRead) -> None:
        """Start ``read`` from this rank of its peer (a peer with fewer ranks: it fails)."""
        if read.peer.tensor_parallel_size <= self.rank:
            log.error("rank %d: the prefill worker %s has no rank %d", self.rank, read.peer.name, self.rank)
            self.ended[read.key] = FAILED
            return
        self.reads[read.key] = self.transfer.start_read(read.peer.ranks[self.rank - 1], read.pairs)

    def poll(self, poll: ReadPoll) -> dict[int, TransferStatus]:
        """How the reads ``poll.keys`` stand here (an unknown key: failed); those that ended are
        released and counted."""
        for key in poll.settled:
            self.ended.pop(key, None)
        out: dict[int, TransferStatus] = {}
        for key in poll.keys:
            tid = self.reads.get(key)
            if tid is None:
                out[key] = self.ended.get(key, FAILED)
                continue
            status = self.transfer.poll([tid])[tid]
            if status != PENDING:
                record = self.transfer.read_record(tid)
                if status == DONE:
                    self.reads_done += 1
                    self.blocks += record.num_blocks
                    self.bytes += record.nbytes
                else:
                    log.warning("rank %d: KV read from %s failed (%s)", self.rank, record.peer, record.error)
                self.transfer.release(tid)
                del self.reads[key]
                self.ended[key] = status
            out[key] = status
        return out
