"""The discrete-event simulation of ``benchmarks/routing_sim.py``: one policy over one trace.

Owns ``Simulation``: the event heap (arrivals, completions, delayed KV events, ticks, a worker's
removal), routing each arrival with the loads of that instant, the engine's admission on the
chosen worker, the FIFO compute, the router's actions (snapshots, pins, unpins, warm-up
prefills) and the ``Result`` of the run.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import logging
import time
from collections import deque

from benchmarks.support.routing_results import Record, Result
from benchmarks.support.routing_trace import BLOCK, CHUNK, GROUPS, Trace
from benchmarks.support.routing_workers import Job, SimWorker
from configs.schema import AutoPinConfig, RouterConfig
from engine.kv_cache import CacheRequest, KVCacheGroup
from engine.kv_cache.hashing import extend_block_hashes
from engine.routing import (
    HitRules,
    LeastLoadedPolicy,
    PinOn,
    PlacementPolicy,
    PrefixTreePolicy,
    RequestSnapshot,
    RoundRobinPolicy,
    RouteRequest,
    RoutingPolicy,
    Unpin,
    build_router,
    snapshot_coordinator,
)
from engine.routing.types import Action

LOG = logging.getLogger("routing_sim")


# -- the simulation --------------------------------------------------------------------------------------------------
class Simulation:
    """One policy (``round_robin``, ``least_loaded``, ``prefix_tree`` or ``kvfleet``) routing one trace
    over W simulated workers; ``run`` replays it and returns the ``Result``."""

    ARRIVE, DONE, DELIVER, TICK, REMOVE = range(5)

    def __init__(
        self,
        args: argparse.Namespace,
        trace: Trace,
        policy: str,
        pinned: list[int] | None = None,
        remove_at: float | None = None,
        event_lag_s: float = 0.0,
        label: str = "",
        auto_pin: bool = True,
        diagnose: bool = False,
        groups: list[KVCacheGroup] | None = None,
        host_factor: int = 0,
    ):
        """``host_factor``: every worker's host tier holds that many times its device pool (0:
        none); a host-tier hit token costs ``args.promote_tps``' copy instead of a prefill."""
        self.args = args
        self.trace = trace
        self.label = label or policy
        self.groups = groups or GROUPS  # the workers' KV layout (default: the simulation's hybrid one)
        self.ratio = trace.ratio
        workers = trace.workers
        self.event_lag_s = event_lag_s
        self.num_blocks = trace.num_blocks
        self.host_blocks = host_factor * self.num_blocks if host_factor else None
        promote = 1.0 / getattr(args, "promote_tps", 0.0) if self.host_blocks else 0.0
        self.workers = {
            f"w{i}": SimWorker(f"w{i}", self.num_blocks, self.groups, self.host_blocks, promote) for i in range(workers)
        }
        self.pinned = pinned or []
        self.auto_pin = auto_pin and policy == "kvfleet"
        self.diagnose = diagnose
        self.router = self._make_router(policy)
        for name in self.workers:
            self.router.add_worker(name, num_blocks=self.num_blocks)
        self.records = [Record(a.time, a.prefix, len(trace.prefixes[a.prefix]) + len(a.suffix)) for a in trace.arrivals]
        self.heap: list[tuple[float, int, int, object]] = []
        self.order = itertools.count()
        self.now = 0.0
        self.remove_at = remove_at
        self.removed_at: float | None = None
        self.removed_pins: set[int] = set()
        self.pin_ranks: dict[int, int] = {}
        self.jobs = itertools.count()
        # steady state: the first --warmup of the arrivals fill the caches and are not measured
        self.warmup = int(args.warmup * len(trace.arrivals))
        self.warm_time = trace.arrivals[min(self.warmup, len(trace.arrivals) - 1)].time

    def _make_router(self, policy: str) -> PlacementPolicy:
        seed = self.args.seed
        if policy == "round_robin":
            return RoundRobinPolicy(self.groups, seed=seed)
        if policy == "least_loaded":
            return LeastLoadedPolicy(self.groups, seed=seed)
        if policy == "prefix_tree":
            # eviction budget: the full-attention share of the worker's cache, in tokens (all of it
            # when full attention is the only group; with a host tier, what both tiers hold)
            share = 1.0 if len(self.groups) == 1 else 0.6
            blocks = self.num_blocks + (self.host_blocks or 0)
            return PrefixTreePolicy(self.groups, seed=seed, capacity_tokens=int(blocks * BLOCK * share))
        capacity = None
        if self.pinned:
            capacity = (
                sum(
                    len(HitRules(self.groups).needed(self.trace.prefix_hashes[r], self._aligned(r)))
                    for r in self.pinned
                )
                * self.args.pin_replicas
            )
        # kvfleet: RouterConfig defaults, automatic pinning on unless the run says otherwise
        config = RouterConfig(seed=seed, pin_capacity_blocks=capacity, auto_pin=AutoPinConfig(enabled=self.auto_pin))
        return build_router(config, self.groups)

    def _aligned(self, rank: int) -> int:
        n = len(self.trace.prefixes[rank])
        return n - n % BLOCK

    def push(self, t: float, kind: int, payload: object) -> None:
        heapq.heappush(self.heap, (t, next(self.order), kind, payload))

    # -- main loop -----------------------------------------------------------------------------------------------
    def run(self) -> Result:
        start = time.perf_counter()
        for arrival in self.trace.arrivals:
            self.push(arrival.time, self.ARRIVE, arrival.index)
        self.push(1.0, self.TICK, None)
        if self.pinned:
            router = self.router
            assert isinstance(router, RoutingPolicy)
            for rank in self.pinned:
                pin_id, actions = router.pin(self.trace.prefixes[rank], replicas=self.args.pin_replicas, now=0.0)
                self.pin_ranks[pin_id] = rank
                self.execute(actions)
        if self.remove_at is not None:
            self.push(self.remove_at, self.REMOVE, None)
        last_arrival = self.trace.arrivals[-1].time
        total = len(self.trace.arrivals)
        next_log = 0.25
        while self.heap:
            t, _, kind, payload = heapq.heappop(self.heap)
            self.now = t
            if kind == self.ARRIVE:
                self.arrive(payload)  # type: ignore[arg-type]
                if payload / total >= next_log:  # type: ignore[operator]
                    LOG.info("  %s: %d%% of arrivals, %.1f s", self.label, 100 * next_log, time.perf_counter() - start)
                    next_log += 0.25
            elif kind == self.DONE:
                self.done(*payload)  # type: ignore[misc]
            elif kind == self.DELIVER:
                worker, events = payload  # type: ignore[misc]
                if worker in self.router.roles:
                    self.execute(self.router.apply_events(worker, events, t))
            elif kind == self.TICK:
                self.execute(self.router.tick(t))
                if t < last_arrival or any(w.current or w.queue for w in self.workers.values()):
                    self.push(t + 1.0, self.TICK, None)
            elif kind == self.REMOVE:
                self.remove_worker()
        duration = max(self.now, last_arrival)
        result = Result(
            self.label,
            len(self.workers),
            self.ratio,
            self.records,
            [w.busy for w in self.workers.values()],
            duration,
            self.warmup,
            [w.busy_measured for w in self.workers.values()],
            self.warm_time,
            set(self.pinned),
            {r: self._aligned(r) for r in range(len(self.trace.prefixes))},
            wall_s=time.perf_counter() - start,
            num_blocks=self.num_blocks,
        )
        if self.removed_at is not None and isinstance(self.router, RoutingPolicy):
            # Per pin that lost a holder with the worker: the first time it is fully replicated again.
            recovered: dict[int, float] = {}
            for pin_id, _, t1 in self.router.pins.recoveries:
                if pin_id in self.removed_pins and t1 >= self.removed_at:
                    recovered[pin_id] = min(recovered.get(pin_id, t1), t1)
            if self.removed_pins and set(recovered) == self.removed_pins:
                result.recovery_s = max(recovered.values()) - self.removed_at
        return result

    # -- requests -------------------------------------------------------------------------------------------------
    def arrive(self, index: int) -> None:
        arrival = self.trace.arrivals[index]
        tokens = self.trace.prefixes[arrival.prefix] + list(arrival.suffix)
        hashes = extend_block_hashes(list(self.trace.prefix_hashes[arrival.prefix]), tokens, BLOCK)
        router = self.router
        for name, worker in self.workers.items():
            if worker.alive:
                router.update_load(name, worker.load(self.now, self.args.prefill_tps))
        request = RouteRequest(f"r{index}", hashes, len(tokens))
        if self.diagnose:  # pure lookups on every worker, outside the timed decision
            found = [w.coord.find_longest_cache_hit(hashes, len(tokens) - 1) for w in self.workers.values() if w.alive]
            self.records[index].best_hit = max(h.num_tokens for h in found)
            self.records[index].best_shared = max(h.shared_prefix_tokens for h in found)
        c0 = time.thread_time_ns()
        t0 = time.perf_counter_ns()
        decision = router.route(request, self.now)
        elapsed = time.perf_counter_ns() - t0
        cpu = time.thread_time_ns() - c0
        record = self.records[index]
        record.decision_ns = elapsed
        record.decision_cpu_ns = cpu
        record.predicted = decision.predicted_hit if router.name in ("kvfleet", "prefix_tree") else -1
        record.worker = str(decision.prefill_worker)
        chosen = self.workers[record.worker].coord
        record.hit_at_route = chosen.find_longest_cache_hit(hashes, len(tokens) - 1).num_tokens
        job = Job(
            f"r{index}-{next(self.jobs)}",
            CacheRequest(f"r{index}", tokens, BLOCK, block_hashes=hashes),
            arrival.time,
            arrival.output,
            index,
            decision.predicted_hit,
        )
        self.submit(self.workers[str(decision.prefill_worker)], job)

    def submit(self, worker: SimWorker, job: Job, front: bool = False) -> None:
        if worker.pending or not self.room(worker) or not self.admit(worker, job):
            worker.pending.append(job)
            if job.trace_index is not None:
                self.records[job.trace_index].delayed = True
        else:
            self.enqueue(worker, job, front)
        self.flush(worker)
        self.start(worker)

    def room(self, worker: SimWorker) -> bool:
        """The engine admits at most ``--max-num-seqs`` requests; later ones wait without KV."""
        return len(worker.queue) + (worker.current is not None) < self.args.max_num_seqs

    def admit(self, worker: SimWorker, job: Job) -> bool:
        """The engine's admission: local hit, then the prompt's KV built chunk by chunk."""
        coord = worker.coord
        request = job.request
        rid = request.request_id
        request.num_computed_tokens = 0
        hit = coord.get_computed_blocks(request)
        n = request.num_tokens
        done = hit.num_tokens
        first = min(CHUNK, n - done)
        if coord.allocate_slots(request, first, hit) is None:
            return False
        host_tokens = coord.host_hit_tokens(hit) if self.host_blocks else 0
        coord.take_tier_copies()  # the runner would run the promotes before the forward
        done += first
        request.num_computed_tokens = done
        coord.remove_skipped_blocks(rid, done)
        while done < n:
            step = min(CHUNK, n - done)
            if coord.allocate_slots(request, step) is None:
                coord.free(rid)
                request.num_computed_tokens = 0
                return False
            done += step
            request.num_computed_tokens = done
            coord.remove_skipped_blocks(rid, done)
        job.hit = hit.num_tokens
        job.uncached = n - hit.num_tokens
        job.promoted = host_tokens
        job.work = job.uncached + job.output * self.args.prefill_tps / self.args.decode_tps
        if host_tokens:
            job.work += host_tokens * self.args.prefill_tps / self.args.promote_tps
        if job.trace_index is not None:
            record = self.records[job.trace_index]
            record.hit = job.hit
        return True

    def enqueue(self, worker: SimWorker, job: Job, front: bool = False) -> None:
        if front:
            worker.queue.appendleft(job)
        else:
            worker.queue.append(job)
        worker.queued_work += job.work

    def start(self, worker: SimWorker) -> None:
        if worker.current is not None or not worker.queue or not worker.alive:
            return
        job = worker.queue.popleft()
        worker.queued_work -= job.work
        prefill = job.uncached / self.args.prefill_tps + (job.promoted / self.args.promote_tps if job.promoted else 0.0)
        service = prefill + job.output / self.args.decode_tps
        worker.current = job
        worker.current_end = self.now + service
        worker.busy += service
        worker.busy_measured += max(0.0, worker.current_end - max(self.now, self.warm_time))
        if job.trace_index is not None:
            self.records[job.trace_index].ttft = self.now + prefill - job.arrival
        self.push(self.now + service, self.DONE, (worker.name, job))

    def done(self, name: str, job: Job) -> None:
        worker = self.workers[name]
        if not worker.alive or worker.current is not job:
            return
        worker.current = None
        coord = worker.coord
        if job.pin is not None:
            pin = job.pin
            pinned = coord.pin_prefix(pin.block_hashes, pin.num_tokens)
            seq = coord.event_seq
            coord.free(job.request.request_id)
            self.flush(worker)
            assert isinstance(self.router, RoutingPolicy)
            self.execute(self.router.pin_result(name, pin.pin_id, pinned, self.now, seq))
        else:
            coord.free(job.request.request_id)
            self.flush(worker)
        while worker.pending and self.room(worker) and self.admit(worker, worker.pending[0]):
            self.enqueue(worker, worker.pending.popleft())
        self.flush(worker)
        self.start(worker)

    def flush(self, worker: SimWorker) -> None:
        """Hand the worker's new KV events to the router (now, or after the event lag)."""
        events = worker.coord.take_events()
        if not events:
            return
        if self.event_lag_s > 0:
            self.push(self.now + self.event_lag_s, self.DELIVER, (worker.name, events))
        elif worker.name in self.router.roles:
            self.execute(self.router.apply_events(worker.name, events, self.now))

    # -- router actions -------------------------------------------------------------------------------------------
    def execute(self, actions: list[Action]) -> None:
        queue = deque(actions)
        router = self.router
        while queue:
            action = queue.popleft()
            worker = self.workers.get(str(action.worker))
            if worker is None or not worker.alive:
                continue
            if isinstance(action, RequestSnapshot):
                queue.extend(router.apply_snapshot(action.worker, snapshot_coordinator(worker.coord), self.now))
            elif isinstance(action, Unpin):
                worker.coord.unpin_prefix(action.block_hashes, action.num_tokens)
                self.flush(worker)
            elif isinstance(action, PinOn):
                self.pin_on(worker, action)

    def pin_on(self, worker: SimWorker, action: PinOn) -> None:
        coord = worker.coord
        held = coord.find_longest_cache_hit(action.block_hashes, action.num_tokens).num_tokens
        if held >= action.num_tokens or not action.token_ids:  # automatic pins keep what is held
            pinned = coord.pin_prefix(action.block_hashes, action.num_tokens)
            self.flush(worker)
            assert isinstance(self.router, RoutingPolicy)
            self.execute(self.router.pin_result(worker.name, action.pin_id, pinned, self.now, coord.event_seq))
            return
        # Warm-up prefill of the prefix (+1 token: the hit search stops at N - 1), then pin.
        tokens = [*list(action.token_ids), 0]
        rid = f"pin{action.pin_id}-{next(self.jobs)}"
        job = Job(rid, CacheRequest(rid, tokens, BLOCK), self.now, 1, None, pin=action)
        self.submit(worker, job, front=True)

    def remove_worker(self) -> None:
        """Take away the worker holding the most pins; re-route what it had queued."""
        router = self.router
        assert isinstance(router, RoutingPolicy)
        explicit = [info for info in router.pin_info() if not info.auto]  # the user's pins (automatic
        # ones keep what a worker holds resident and go with it)
        counts = {name: 0 for name in self.workers}
        for info in explicit:
            for w in info.active:
                counts[str(w)] += 1
        name = max(sorted(counts), key=lambda n: counts[n])
        worker = self.workers[name]
        self.removed_at = self.now
        self.removed_pins = {info.pin_id for info in explicit if name in info.active}
        LOG.info("  removing %s at t=%.1f s (holder of %d pins)", name, self.now, len(self.removed_pins))
        worker.alive = False
        jobs = ([worker.current] if worker.current else []) + list(worker.queue) + list(worker.pending)
        worker.current, worker.queue, worker.pending = None, deque(), deque()
        self.execute(router.remove_worker(name, self.now))
        for job in jobs:
            if job.trace_index is not None:
                self.push(self.now, self.ARRIVE, job.trace_index)
