"""Baseline placement policies, for the simulator and for ``router.policy`` in the config.

- ``RoundRobinPolicy``: workers in turn.
- ``LeastLoadedPolicy``: the fewest queued tokens, ties at random.
- ``PrefixTreePolicy``: an *approximate* prefix tree built from the router's own routing history,
  in the manner of Ray Serve's ``PrefixCacheAffinityRouter`` and SGLang's ``cache_aware`` policy
  (CLUSTER_REFERENCE.md b1, b2), over block hashes instead of characters: each routed prompt is
  inserted under the chosen worker, each worker's entries are evicted LRU beyond a token budget.
  It sees neither KV events nor hybrid hit rules: it believes a worker holds every block it was
  sent, which is what produces false hits for sliding-window and Mamba groups.

  Rule (Ray's, with SGLang's least-loaded fallback): when the queue lengths differ by more than
  ``imbalance_threshold`` requests, the least-loaded worker; otherwise, if the deepest match
  covers at least ``match_rate_threshold`` of the prompt, the least-loaded worker among those with
  that match; otherwise the least-loaded worker.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol

from engine.kv_cache.spec import KVCacheGroup, alignment_tokens, hash_block_size
from engine.routing.index import WorkerSnapshot
from engine.routing.placement_policy import PlacementPolicy
from engine.routing.types import (
    Action,
    Decision,
    Role,
    RouteRequest,
    WorkerId,
    WorkerLoad,
)


class RoundRobinPolicy(PlacementPolicy):
    name = "round_robin"

    def __init__(self, groups: Sequence[KVCacheGroup] = (), seed: int = 0):
        super().__init__(seed)
        self._turn = {"prefill": 0, "decode": 0}

    def _next(self, role: Role) -> WorkerId:
        workers = self._candidates(role)
        self._require(workers, role)
        turn = self._turn[role]
        self._turn[role] = turn + 1
        return workers[turn % len(workers)]

    def route(self, request: RouteRequest, now: float = 0.0) -> Decision:
        prefill = self._next("prefill")
        pd = any(r == "prefill" for r in self.roles.values())
        decode = self._next("decode") if pd else prefill
        decision = Decision(prefill, decode, 0, request.num_tokens, "round_robin")
        self._record(decision)
        return decision


class LeastLoadedPolicy(PlacementPolicy):
    name = "least_loaded"

    def __init__(self, groups: Sequence[KVCacheGroup] = (), seed: int = 0):
        super().__init__(seed)

    def _least(self, role: Role, key: str) -> WorkerId:
        workers = self._candidates(role)
        self._require(workers, role)
        loads = self.loads
        best = min(getattr(loads[w], key) for w in workers)
        ties = [w for w in workers if getattr(loads[w], key) == best]
        return ties[0] if len(ties) == 1 else ties[self.rng.randrange(len(ties))]

    def route(self, request: RouteRequest, now: float = 0.0) -> Decision:
        prefill = self._least("prefill", "queued_tokens")
        pd = any(r == "prefill" for r in self.roles.values())
        decode = self._least("decode", "running_requests") if pd else prefill
        decision = Decision(prefill, decode, 0, request.num_tokens, "least_loaded")
        self._record(decision)
        return decision


class PrefixTreePolicy(PlacementPolicy):
    name = "prefix_tree"

    def __init__(
        self,
        groups: Sequence[KVCacheGroup] = (),
        seed: int = 0,
        capacity_tokens: int = 400_000,
        match_rate_threshold: float = 0.1,
        imbalance_threshold: int = 10,
    ):
        super().__init__(seed)
        groups = list(groups)
        self.hash_block_size = hash_block_size(groups) if groups else 16
        self.alignment = alignment_tokens(groups) if groups else self.hash_block_size
        self.capacity_blocks = max(1, capacity_tokens // self.hash_block_size)
        self.match_rate_threshold = match_rate_threshold
        self.imbalance_threshold = imbalance_threshold
        self._lru: dict[WorkerId, OrderedDict[bytes, None]] = {}
        self._bit: dict[WorkerId, int] = {}
        self._owners: dict[bytes, int] = {}
        self._by_bit: dict[int, WorkerId] = {}
        self._next_slot = 0

    def _added(self, worker: WorkerId, snapshot: WorkerSnapshot | None, now: float) -> list[Action]:
        bit = 1 << self._next_slot
        self._next_slot += 1
        self._bit[worker] = bit
        self._by_bit[bit] = worker
        self._lru[worker] = OrderedDict()
        return []

    def _removed(self, worker: WorkerId, load: WorkerLoad, now: float) -> list[Action]:
        bit = self._bit.pop(worker, 0)
        self._by_bit.pop(bit, None)
        for block_hash in self._lru.pop(worker, OrderedDict()):
            self._drop(block_hash, bit)
        return []

    def _drop(self, block_hash: bytes, bit: int) -> None:
        rest = self._owners.get(block_hash, 0) & ~bit
        if rest:
            self._owners[block_hash] = rest
        else:
            self._owners.pop(block_hash, None)

    def match(self, hashes: Sequence[bytes], workers: list[WorkerId]) -> tuple[int, list[WorkerId]]:
        """Deepest number of leading blocks some candidate was sent, and those candidates."""
        alive = 0
        for worker in workers:
            alive |= self._bit[worker]
        depth = 0
        get = self._owners.get
        for block_hash in hashes:
            here = alive & get(block_hash, 0)
            if not here:
                break
            alive = here
            depth += 1
        if depth == 0:
            return 0, []
        out = []
        while alive:
            low = alive & -alive
            out.append(self._by_bit[low])
            alive ^= low
        return depth, out

    def _least_running(self, workers: list[WorkerId]) -> WorkerId:
        loads = self.loads
        best = min(loads[w].running_requests for w in workers)
        ties = [w for w in workers if loads[w].running_requests == best]
        return ties[0] if len(ties) == 1 else ties[self.rng.randrange(len(ties))]

    def _insert(self, worker: WorkerId, hashes: Sequence[bytes]) -> None:
        lru = self._lru[worker]
        bit = self._bit[worker]
        owners = self._owners
        for block_hash in hashes:
            if block_hash in lru:
                lru.move_to_end(block_hash)
            else:
                lru[block_hash] = None
                owners[block_hash] = owners.get(block_hash, 0) | bit
        while len(lru) > self.capacity_blocks:
            old, _ = lru.popitem(last=False)
            self._drop(old, bit)

    def route(self, request: RouteRequest, now: float = 0.0) -> Decision:
        workers = self._candidates("prefill")
        self._require(workers, "prefill")
        hashes = request.block_hashes
        queues = [self.loads[w].running_requests for w in workers]
        depth, matched = self.match(hashes, workers)
        reason = "least_loaded"
        if max(queues) - min(queues) > self.imbalance_threshold:
            worker = self._least_running(workers)
            reason = "imbalanced"
        elif matched and depth * self.hash_block_size >= self.match_rate_threshold * request.num_tokens:
            worker = self._least_running(matched)
            reason = "prefix"
        else:
            worker = self._least_running(workers)
        believed = 0
        if worker in matched:
            believed = min(depth * self.hash_block_size, request.num_tokens - 1)
            believed -= believed % self.alignment
        self._insert(worker, hashes)
        pd = any(r == "prefill" for r in self.roles.values())
        decode = self._least_running(self._candidates("decode")) if pd else worker
        decision = Decision(worker, decode, believed, request.num_tokens, reason)
        self._record(decision)
        return decision


class BaselineFactory(Protocol):
    """How ``engine.routing.factory`` builds a baseline router: the KV-cache groups and a seed."""

    def __call__(self, groups: Sequence[KVCacheGroup] = (), seed: int = 0) -> PlacementPolicy: ...


BASELINES: dict[str, BaselineFactory] = {
    "round_robin": RoundRobinPolicy,
    "least_loaded": LeastLoadedPolicy,
    "prefix_tree": PrefixTreePolicy,
}
