"""One worker's tensor-parallel ranks: rank 0 leads, the others follow its steps.

At ``workers.tensor_parallel_size`` N > 1 a worker is N processes joined in one torch.distributed
group (NCCL on CUDA, gloo on the CPU), each holding its shard of the weights, the KV pages and
the recurrent states (engine/model/layers/parallel.py). Only rank 0 has a scheduler and a
KV-cache coordinator that decide anything: its ``EngineCore`` is the one the worker actor drives,
unchanged. Block ids are per token, the same on every rank, so a step's inputs mean the same on
each: before each forward, rank 0's ``ModelRunner`` sends them (``ChunkInputs``: the tokens,
positions, block tables, sampled rows and scored prompt positions of each chunk) to every other
rank once, with the host tier's copies before them, through a ``RankLeader``; ``follow_leader``
runs on each other rank and replays each message on its own runner: the same forward (the model's
sums and the vocabulary gather meet rank 0's), no sampling. Control messages go over their own
gloo group (a CPU channel on CUDA as well).

P/D between split workers (same size on both sides): every rank has its own transfer agent over
its own KV pages; when the group forms, rank 0 gathers the other ranks' registrations and
publishes them with its own (``AgentInfo.ranks``). A read rank 0's hand-off starts (the plan made
once, on rank 0) goes to every other rank as a ``read`` message: rank r reads the same block pairs
from the prefill worker's rank r (``engine.transfer.ranked``). Rank 0 asks the other ranks how
their reads stand (``poll``, answered by a gather) once its own has ended, and the request waits
for KV until the read has ended on every rank.

Invariants: every rank runs the same forwards in the same order (the leader sends each step before
it runs it, and a follower runs nothing else); a follower's KV pages change only by those forwards
and the copies sent with them; a follower stops at the leader's ``stop`` (or when the group
breaks: a dead rank takes the worker down as one unit).
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch.distributed as dist

from engine.kv_cache.host_tier import TierCopy
from engine.transfer.ranked import FollowerReads, RankRead, RankReads, ReadPoll
from engine.transfer.records import AgentInfo, TransferStatus

log = logging.getLogger(__name__)

#: how long a rank waits for the next control message before the group counts as broken (an idle
#: leader sends a keep-alive every ``KEEPALIVE_S``, far inside it: a send to a rank that died
#: fails, so an idle worker finds a dead rank within seconds, as a busy one does at its next step)
CONTROL_TIMEOUT = datetime.timedelta(hours=24)
KEEPALIVE_S = 5.0


@dataclass(frozen=True, slots=True)
class ChunkInputs:
    """What one scheduled chunk means to the forward on any rank: its ``tokens`` at positions
    ``start ..``, the request's block table per KV group (block ids), whether its last position
    is sampled, and, for a request that scores its prompt, the prompt tokens its positions predict
    (``score_targets``) with the top-``score_k`` alternatives asked for."""

    tokens: list[int]
    start: int
    block_ids: list[list[int]]
    sample: bool
    score_targets: list[int] | None = None
    score_k: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)


#: a control message: ("step", a step's chunks, [], None), ("copies", [], host-tier copies, None),
#: ("read", [], [], the reads to start), ("poll", [], [], the reads to report: answered by a
#: gather), ("noop", [], [], None) (a keep-alive) or ("stop", [], [], None)
Message = tuple[str, list[ChunkInputs], list[TierCopy], list[RankRead] | ReadPoll | None]


class RankLeader:
    """Rank 0's end of the control channel: owns the gloo group the messages go over.

    Invariant: every message is sent to all other ranks, in the order the runner produces them;
    after ``stop`` nothing more is sent."""

    def __init__(self, group: dist.ProcessGroup, size: int):
        self.group = group
        self.size = size
        self.stopped = False
        self.steps_sent = 0
        self.last_sent = time.monotonic()

    def send_step(self, chunks: list[ChunkInputs]) -> None:
        self._send(("step", chunks, [], None))
        self.steps_sent += 1

    def send_copies(self, copies: list[TierCopy]) -> None:
        self._send(("copies", [], copies, None))

    def send_reads(self, reads: list[RankRead]) -> None:
        """Start ``reads`` on every other rank (each from its own rank of the peer)."""
        self._send(("read", [], [], reads))

    def poll_reads(self, poll: ReadPoll) -> list[dict[int, TransferStatus]]:
        """How the reads ``poll.keys`` stand on ranks 1 .. N - 1 (one dict per rank, in rank
        order); the ranks forget ``poll.settled`` first."""
        self._send(("poll", [], [], poll))
        answers: list[dict[int, TransferStatus] | None] = [None] * self.size
        dist.gather_object({}, answers, dst=0, group=self.group)
        return [answer or {} for answer in answers[1:]]

    def keepalive(self, now: float) -> None:
        """Send a no-op when nothing was sent for ``KEEPALIVE_S`` (an idle worker's followers
        wait on the channel; this keeps them inside ``CONTROL_TIMEOUT`` and finds a dead rank)."""
        if not self.stopped and now - self.last_sent >= KEEPALIVE_S:
            self._send(("noop", [], [], None))

    def stop(self) -> None:
        """Release the followers (their ``follow_leader`` returns). Idempotent."""
        if not self.stopped:
            self._send(("stop", [], [], None))
            self.stopped = True

    def _send(self, message: Message) -> None:
        if self.stopped:
            raise RuntimeError("the tensor-parallel followers were stopped: no step can run")
        dist.broadcast_object_list([message], src=0, group=self.group)
        self.last_sent = time.monotonic()


class RankRunner(Protocol):
    """What leading and following need of a rank's ``engine.runner.ModelRunner``."""

    leader: RankLeader | None

    @property
    def decode(self) -> object | None: ...
    def follow_step(self, chunks: list[ChunkInputs]) -> None: ...
    def copy_tiers(self, copies: list[TierCopy], wait: bool = False) -> None: ...


def join_rank_group(address: str, rank: int, size: int, device: str, timeout_s: float) -> None:
    """Join this worker's torch.distributed group of ``size`` ranks at ``address``
    (``tcp://host:port`` on rank 0's node): NCCL on CUDA, gloo otherwise; a collective that waits
    longer than ``timeout_s`` fails (a hung rank breaks the worker, as the health check sees)."""
    backend = "nccl" if device == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(backend, init_method=address, rank=rank, world_size=size, timeout=timeout)
    log.info("tensor-parallel rank %d of %d joined at %s (%s)", rank, size, address, backend)


def control_group() -> dist.ProcessGroup:
    """The control channel's group over every rank (gloo, whatever the tensors' backend). Every
    rank must call it, in the same order relative to its other group creations."""
    group = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    assert group is not None, "every rank is a member of the control group"
    return group


def _gather_agents(group: dist.ProcessGroup, info: AgentInfo | None) -> list[AgentInfo | None]:
    """Every rank's transfer registration (None: it has none), in rank order, on rank 0 (one
    collective every rank makes right after the control group forms)."""
    size = dist.get_world_size()
    infos: list[AgentInfo | None] | None = [None] * size if dist.get_rank() == 0 else None
    dist.gather_object(info, infos, dst=0, group=group)
    return infos or []


class RankedHandoff(Protocol):
    """What leading needs of rank 0's P/D hand-off (engine.pd_handoff.PDHandoff): its agent's
    registration, published with every rank's, and the reads of the other ranks it drives."""

    agent_info: AgentInfo
    ranks: RankReads | None


def lead_ranks(runner: RankRunner, handoff: RankedHandoff | None = None) -> RankLeader:
    """Make ``runner`` (rank 0's) send each step's inputs to the other ranks from now on; they run
    ``follow_leader``. With the engine's P/D ``handoff`` (a ``kv_role``; every other rank then
    follows with its ``FollowerReads``), its registration is published with the other ranks'
    (``AgentInfo.ranks``) and each read it starts runs on every rank. Call after the process
    group is initialised, on rank 0 only."""
    if dist.get_rank() != 0:
        raise ValueError(f"tensor_parallel_rank: only rank 0 leads (this is rank {dist.get_rank()})")
    if runner.decode is not None:
        raise ValueError("tensor_parallel_size > 1: the static decode step is not split over ranks yet")
    group = control_group()
    leader = RankLeader(group, dist.get_world_size())
    infos = _gather_agents(group, handoff.agent_info if handoff is not None else None)
    if handoff is not None:
        missing = [rank for rank, info in enumerate(infos) if info is None]
        if missing:
            raise ValueError(
                f"kv_role: ranks {missing} of this worker have no transfer registration; every rank of a "
                "prefill / decode worker reads or serves its own shard of the KV"
            )
        others = tuple(info for info in infos[1:] if info is not None)
        handoff.agent_info = dataclasses.replace(handoff.agent_info, ranks=others)
        handoff.ranks = RankReads(leader)
    runner.leader = leader
    return leader


def follow_leader(
    runner: RankRunner, on_step: Callable[[], None] | None = None, reads: FollowerReads | None = None
) -> int:
    """On a rank other than 0: run every step rank 0's runner sends, on this rank's ``runner``,
    until the leader stops (``on_step`` called after each), and the P/D reads it sends with this
    rank's ``reads`` (its transfer agent; None: the worker has no ``kv_role``); returns the
    number of steps run."""
    rank = dist.get_rank()
    if rank == 0:
        raise ValueError("tensor_parallel_rank: rank 0 leads, it does not follow")
    group = control_group()
    _gather_agents(group, reads.agent_info if reads is not None else None)
    steps = 0
    log.info("tensor-parallel rank %d follows rank 0", rank)
    while True:
        box: list[Message | None] = [None]
        dist.broadcast_object_list(box, src=0, group=group)
        message = box[0]
        assert message is not None, "a broadcast fills the box"
        kind, chunks, copies, payload = message
        if kind == "stop":
            log.info("tensor-parallel rank %d stops after %d steps", rank, steps)
            return steps
        if kind == "copies":
            runner.copy_tiers(copies, wait=True)
        elif kind == "step":
            runner.follow_step(chunks)
            steps += 1
            if on_step is not None:
                on_step()
        elif kind == "read":
            assert isinstance(payload, list), "a read message carries its reads"
            for read in payload:
                if reads is None:
                    log.error("tensor-parallel rank %d: a P/D read came to a rank without a transfer agent", rank)
                else:
                    reads.start(read)
        elif kind == "poll":
            assert isinstance(payload, ReadPoll), "a poll message carries the reads it asks about"
            answer = reads.poll(payload) if reads is not None else {}
            dist.gather_object(answer, None, dst=0, group=group)
        elif kind != "noop":
            raise RuntimeError(f"tensor-parallel rank {rank}: unknown control message {kind!r}")
