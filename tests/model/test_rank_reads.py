"""Rank 0's bookkeeping of a split worker's reads (engine/transfer/ranked.py), without processes:
a read counts ended only once every rank ended it, failed if any rank failed, and the other
ranks are told which reads were settled; a handle from a worker of another size is refused by
name. The four-process run is tests/model/test_tp_pd.py."""

from __future__ import annotations

import numpy as np
import pytest

from engine.transfer.ranked import RankRead, RankReads, ReadPoll
from engine.transfer.records import DONE, FAILED, PENDING, AgentInfo, TransferStatus


class Leader:
    """A ``RankLeader`` stand-in: records what it sends, answers polls from ``answers``."""

    def __init__(self, size: int):
        self.size = size
        self.sent: list[RankRead] = []
        self.polls: list[ReadPoll] = []
        self.answers: list[dict[int, TransferStatus]] = [{} for _ in range(size - 1)]

    def send_reads(self, reads: list[RankRead]) -> None:
        self.sent += reads

    def poll_reads(self, poll: ReadPoll) -> list[dict[int, TransferStatus]]:
        self.polls.append(poll)
        return [{k: answer[k] for k in poll.keys if k in answer} for answer in self.answers]


def agent(name: str, ranks: int) -> AgentInfo:
    info = AgentInfo("local", name, 8, (64,), "host", 1)
    return AgentInfo("local", name, 8, (64,), "host", 1, ranks=tuple(info for _ in range(ranks - 1)))


def test_a_read_ends_when_every_rank_ended_it() -> None:
    leader = Leader(3)
    reads = RankReads(leader)  # type: ignore[arg-type]
    peer = agent("prefill", 3)
    reads.start(7, peer, np.array([[0, 1, 2]]), b"r7")
    reads.start(8, peer, np.array([[0, 3, 4]]), b"r8")
    assert [r.key for r in leader.sent] == [7, 8] and leader.sent[0].peer is peer
    leader.answers = [{7: DONE, 8: DONE}, {7: PENDING, 8: FAILED}]
    assert reads.settle({7: DONE, 8: DONE, 99: FAILED}) == {8: FAILED, 99: FAILED}  # 99: not split
    assert reads.take(8) == (peer, b"r8") and set(reads.pending) == {7}
    leader.answers = [{7: DONE}, {7: DONE}]
    assert reads.settle({7: DONE}) == {7: DONE}
    assert leader.polls[-1] == ReadPoll([7], [8]), "the ranks forget what was settled"
    assert reads.settle({}) == {} and len(leader.polls) == 2, "no read ended on rank 0: nothing asked"


def test_a_rank_that_lost_a_read_fails_it_and_a_peer_of_another_size_is_refused() -> None:
    leader = Leader(2)
    reads = RankReads(leader)  # type: ignore[arg-type]
    reads.start(1, agent("prefill", 2), np.zeros((0, 3), np.int64), b"r1")
    assert reads.settle({1: DONE}) == {1: FAILED}  # rank 1 never heard of it
    reads.check(agent("prefill", 2))
    with pytest.raises(ValueError, match=r"workers\.tensor_parallel_size: .* runs 1 ranks, this decode worker 2"):
        reads.check(agent("prefill", 1))
