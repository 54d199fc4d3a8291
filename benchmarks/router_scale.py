"""The router at fleet scale: decisions per second, their latency, events absorbed and index size
for W = 64 / 256 / 1,024 / 4,096 workers, with each worker's cache and load held constant (the
workload grows with the fleet).

What runs: the router's own code (``engine.routing.RoutingPolicy`` and its ``PrefixIndex``) fed
by a simulated fleet (``benchmarks.support.scale_fleet``): every worker's cache sends the event
stream a real worker sends (stored, evicted, pinned, per group, fresh hash objects, consecutive
sequence numbers). Groups: full attention plus sliding windows of 128 and 512 tokens, block 16.
Side by side on the same trace runs the same router on its Python reference core
(``KVFLEET_ROUTING_CORE=python``: the pure-Python holder maps, load book and in-flight prefixes
the compiled parts are tested against), the baseline ``python_core``.

Per W: ``prefixes_per_worker * W`` shared prefixes (``--prefix-min``..``--prefix-max`` tokens,
Zipf ``--alpha`` popularity) and a unique suffix per request. Warm-up: every prefix runs once
on worker ``rank % W`` (events applied to the router, timed as absorption), then
``--decisions`` requests are routed one by one; each decision is timed alone (the thread's CPU
clock, so other tenants of a shared machine stay out; the wall clock's p99 is printed too), the
chosen worker runs the request and its events reach the router before the next decision. Per
decision ``--reports`` workers (round robin) report their load (queued tokens draining at
``--drain-tps``, block usage); arrivals come at ``--rate`` requests per second per worker. A
request's hashes reach ``route`` as the router actor receives them: unpickled right before the
call (``scale_fleet.received``), new objects. The simulated caches keep each block as one
``bytes`` key, so the router's garbage collector does not traverse them (it did, as tuples: 220
young-generation collections in one routing phase at W = 256, 44 ms; now about 25, 11 ms).

Each W and router runs ``--repeats`` times on the same trace and the fastest run counts (every
run's decisions/s is printed as ``runs_decisions_per_s``: the other tenants of a shared machine
move one run by 30-50 %). kvfleet's router is also replayed alone: a second run records what
the router is fed and replays it ``--replays`` times into a fresh router (the least decision
time counts); ``alone_*`` are its decisions/s and p50/p99 without the simulated fleet's own work
between two decisions (its caches, the exact oracle), which in the interleaved run evicts the
router's index and books from the CPU cache (a router actor runs in its own process).

Host tiers (``--host-tier N``, default 4; 0: off): each W and router runs once more on the same
trace with every worker's host tier holding N times its device cache (``scale_fleet``: the
device's evicted blocks offloaded there, the oldest dropped, promoted back on a hit, each with
its event; the oracle reads both tiers) and a reported promote cost, so that decisions predict
over both tiers (``HolderMaps.tiered``); reported per W as ``decisions_per_s_host_tier``,
``p50_us_host_tier``, ``p99_us_host_tier``, ``wall_p99_us_host_tier``, ``hit_rate_host_tier``
and ``accuracy_host_tier`` (the fastest of ``--repeats`` runs), and kvfleet's host-tier router
replayed alone like the tier-less one (``alone_decisions_per_s_host_tier``,
``alone_p50_us_host_tier``, ``alone_p99_us_host_tier``; ``alone_replay_mismatches*``: decisions
a replay made otherwise, 0). Measured 2026-11-29 on the shared 2-core machine (other tenants
busy), W = 256, 4,000 decisions, 2 repeats: tier-less 39,445 decisions/s, p99 65.8 us; host tier
16,627 decisions/s, p50 48.9 us, p99 195.6 us, hit rate 0.8829 (tier-less 0.8704), equal to the
Python core's (5,395 decisions/s), accuracy 1.0. The tiered walk itself
(``PrefixIndex._predict_tiered``) costs about 13 us at p50 of that (it read the host map at
every block before: 24 us, 9,955 decisions/s); the rest of the gap to the tier-less decision is
the policy's pricing of host hits outside the walk. Since then the tiered walk reads the first
group's host map only at the positions the device walk recorded as value changes (it read every
position's device entry to find them): its own work after a walk about 0.3 us instead of 1.1
(warm, W = 256). 2026-11-29 08:42-08:45, the machine's load average 10-12, W = 256, 4,000
decisions, 3 repeats, before / after: host tier 13,341 / 16,249 decisions/s, p99 251.8 / 214.7
us (tier-less 22,145 / 20,635 in the same runs), hit rate 0.8829 both, equal to the Python
core's. Each decision replayed alone six times, its least time (2026-11-29 08:36): host tier
21.2-21.5 us mean (46.6-47.2k decisions/s), tier-less 16.1-17.7 us (56-62k). Since then a
decision with host tiers makes one call into the maps (``HolderMaps.predict_tiered``: the walk,
then the walk over both tiers, the failing workers with a host tier picked in C, no
``_predict_tiered`` frame), and the host tiers live in holder maps of the device maps' kind
(``HostMaps``: in the compiled table, hashes inline; the index with host tiers 6.4 MB, was
11.3). 2026-11-29 12:23-12:32, load average 20-29 (other tenants' tests), W = 256, 4,000
decisions, 2 repeats, before / after, two interleaved runs each: host tier 14,881 / 14,305 and
14,816 / 17,584 decisions/s, p99 219.4 / 205.2 and 218.4 / 186.7 us (tier-less 26,189 / 24,039
and 28,272 / 19,882 in the same runs), hit rate 0.8829 in all, equal to the Python core's,
accuracy 1.0: within the machine's noise. The host-tier decision's own CPU work is small: warm
(each of 200 requests run 30 times, the least time), W = 256, the walk alone
(``HolderMaps.predict``) 2.5 us at p50, with the walk over both tiers in the same call 3.1 us,
``predict_partial`` 4.0 us; per decision the first group's holder value changes at about 2
positions (so 2 host lookups), and the walk over both tiers meets a worker in 2.5 % of
decisions. The rest of the live time is cache misses: between two decisions the simulated
fleet's work and the events absorbed evict the router's table and objects, and the host tiers'
events add to what is touched (runs whose router ignores them, same trace, at load 10-14:
between the two, inconclusive at that noise). Since then the family rule reads the deepest
full-attention depth from the walk (``HolderMaps.predict``'s reach, no pass over the depths)
and counts reuses in C (``_reuse.c``): 2026-11-29 18:37-18:41, W = 256, 4,000 decisions, 2
repeats, runs main / branch / branch / main back to back: tier-less 23,817 / 27,879 / 24,558 /
22,180 decisions/s, host tier 14,819 / 20,000 / 20,607 / 14,916 (p99 197.5 / 156.2 / 152.6 /
164.7 us), hit rates 0.8705 and 0.8828 in all, accuracy 1.0, replay mismatches 0.

Router replicas (``--replicas``, at ``--replica-workers``): N copies of kvfleet's policy, each
fed every event and load report, each request routed by the copy its first block's hash picks (one
prefix's decisions stay on one copy; a copy does not see the others' assignments and in-flight
prefixes except through the workers' later reports). Speedup: one router's busy CPU time over the
routing phase (decisions plus events absorbed) over the busiest copy's; hit ratio: the copies'
hit rate over one router's (the one router: the recording run of that W, or one made for it).
Each copy's busy time is measured as a replica runs, alone in its own process: what it was fed
is recorded and replayed into a fresh copy (``--replays`` times, the least time counts; the one
router the same way), each replay on its own hash objects (a replica deserialises its own).
Interleaved on one thread, the copies would evict each other's index from the CPU cache, and
copies after the first would find the hashes of shared ``bytes`` already computed. A replayed
decision that differs from the live one is counted (``replay mismatches``; 0 in every run).

Why 4 replicas give about 1.2-1.9x, not 3.5x (W = 256, 4,000 decisions): every replica keeps
the full index, so every replica absorbs every event (E), which does not shrink with N; only the
decisions (D) are split. The split by first block follows the prefixes: per replica the decision
shares are 0.283 / 0.261 / 0.261 / 0.196 (Zipf(1) over 768 prefixes; the hottest prefix alone is
1/H(768), about 14 % of requests, and all of it goes to one replica), so the busiest replica takes
E + 0.28 D. As decisions got cheaper E became the larger part: 2026-11-28 15:50-15:57, one
router 94-118 ms busy, 40-50 ms of it events (about 10 us of absorption per routed request,
200-250 ns per stored hash: the table's cache misses); replicas 47-81 ms, events 32-52 ms. The
speedup is (D + E) / (0.283 D + E); 3.5x at N = 4 needs E below 0.4 % of D with this split, and
below 5 % of D even with a perfect one (0.25 D per replica): absorbing a request's events in under
half a microsecond, each stored hash in a few nanoseconds. No router that applies every event to
its own full index gets there; the ways that would are outside this design: one index shared by
the replicas of a node (one absorber, N readers), or each replica fed only the events of the
prefixes it routes (giving up the full index that lets any replica take over a dead one's
prefixes with their hits).

Metrics: decisions/s (decisions / their CPU time), p50 / p99 us, events/s and block hashes/s
absorbed (events / the CPU time of ``apply_events``), index bytes (a sizing walk over every
object the index holds except its constant hit rules, each object counted once), bytes per
cached block per holder (index bytes / the (group, block, worker) triples the fleet caches),
hit rate (tokens the chosen worker's coordinator finds cached by its own fixed point, the exact
oracle, over prompt tokens, after the first ``--warmup`` share of decisions) and prediction
accuracy (decisions whose predicted hit equals that oracle).

Measured 2026-11-28 15:55-15:57 on the shared 2-core machine, 4,000 decisions per W, the fastest
of 3 runs each, the last of three full runs in a row; holder-set router / the baseline of that
day, in the same run (benchmarks/results/router_scale-cpu-2026-11-28.json; that baseline was the
router before its index kept holder sets, a W-bit worker mask per key, since deleted: the
baseline is now the Python reference core):

    W      decisions/s     p50 us         p99 us          index MB      bytes/block-holder  hit rate
    64     56,306/11,866   15.4/77.0      59.8/184.4      1.5/9.5       38.7/249.5          0.8571/0.8571
    256    57,093/8,612    15.7/99.3      38.6/507.7      5.0/31.1      34.5/215.6          0.8704/0.8698
    1024   54,328/5,145    17.2/160.5     34.9/624.3      17.0/107.6    37.2/235.5          0.8833/0.8830
    4096   39,648/2,374    20.9/348.6     75.0/1,785.3    64.4/731.6    38.8/440.7          0.8625/0.8589

Prediction accuracy against the exact oracle 1.0 for both; alone at W = 256: 54,609 decisions/s,
p99 37.4 us (W = 4,096: 53,810, 46.9 us); 4 replicas at W = 256: speedup 1.17, hit ratio 0.9989.
The machine's speed drifts over minutes: at W = 256 the three full runs' fastest runs were
46,930 / 42,881 / 57,093 decisions/s (their single runs 37,842-57,093; p99 38.6-52.5 us), alone
55,588 / 93,359 / 54,609; three runs at 15:15-15:18 (before ``--repeats``) gave 53,963 / 48,725 /
51,033 (p99 40.7 / 43.0 / 42.6 us), alone 90,749 / 100,325 / 59,421. The router before the
compiled pick gave 13-17k at W = 256, the mask router 6-11k; the Python reference core gives about
6k (``--quick``, 2026-11-28 21:44).
Where a decision's time goes (W = 256, interleaved run; timers between the statements of
``route``, 48-58k decisions/s): ``predict_partial`` 6.8-8.2 us, of which the compiled walk about
5-6k cycles at 2.1 GHz (69 lookups of the full-attention group, bound by memory latency; the
sliding windows' checks read the entries that walk met, about 1k cycles more); ``LoadBook.place``
4.0-5.0 us (the candidates' dicts, the load copy and the ``Decision`` are cold Python objects,
and a young-generation collection lands there now and then); the in-flight announcement 1.6-1.9
us; the rest of ``route`` about 1.5 us.

    python -m benchmarks.router_scale            # W = 64 .. 4,096 (several minutes)
    python -m benchmarks.router_scale --quick    # W = 64, 256, a few hundred decisions

Last line: ``{"decisions_per_s": {W: n}, "runs_decisions_per_s": {W: [n, ...]}, "p50_us", "p99_us",
"alone_decisions_per_s", "alone_p50_us", "alone_p99_us", "events_per_s", "index_mb",
"bytes_per_block_holder" (the largest over W), "hit_rate_vs_single_policy" (the lowest over W of
the hit rate over the baseline's), "accuracy", the ``*_host_tier`` figures per W,
"hit_rate_vs_single_policy_host_tier", "baseline": {the same for the Python core},
"replica_speedup": {N: x}, "replica_hit_ratio": {N: r}}``.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import random
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from benchmarks.support.scale_fleet import (
    GROUPS,
    FleetWorker,
    exact_hit,
    make_prefixes,
    make_requests,
    received,
    refreshed,
    warm_requests,
)
from configs.schema import RouterConfig
from engine.routing import RoutingPolicy
from engine.routing.hit_rules import HitRules
from engine.routing.holder_maps import CORE_ENV
from engine.routing.types import RouteRequest, WorkerLoad

LOG = logging.getLogger("router_scale")
ROUTERS = ("kvfleet", "python_core")
#: what the host-tier scenario reports per W (suffixed ``_host_tier``)
HOST_TIER_KEYS = ("decisions_per_s", "p50_us", "p99_us", "wall_p99_us", "hit_rate", "accuracy")
#: the host-tier scenario's reported promote cost: 128 KiB of KV per token at 25 GB/s
PROMOTE_S_PER_TOKEN = 128 * 1024 / 25e9


@contextmanager
def routing_core(core: str) -> Iterator[None]:
    """Policies made inside pick their compiled parts by ``core`` (``KVFLEET_ROUTING_CORE``)."""
    before = os.environ.get(CORE_ENV)
    os.environ[CORE_ENV] = core
    try:
        yield
    finally:
        if before is None:
            del os.environ[CORE_ENV]
        else:
            os.environ[CORE_ENV] = before


@dataclass
class Result:
    """One router at one fleet size."""

    workers: int
    decision_ns: list[int] = field(default_factory=list)
    decision_wall_ns: list[int] = field(default_factory=list)
    event_ns: int = 0
    events: int = 0
    event_hashes: int = 0
    hit_tokens: int = 0
    prompt_tokens: int = 0
    accurate: int = 0
    measured: int = 0
    index_bytes: int = 0
    block_holders: int = 0
    busy_ns: list[int] = field(default_factory=list)  # per replica: CPU time of its routing phase
    absorb_ns: list[int] = field(default_factory=list)  # per replica: the part of busy_ns spent on events
    routed: list[int] = field(default_factory=list)  # per replica: decisions it made
    replay_mismatches: int = 0  # decisions a replica replayed alone made differently (see replay_alone)
    alone_decision_ns: list[int] = field(default_factory=list)  # one router replayed alone: its best replay

    def summary(self) -> dict[str, float]:
        cpu = sorted(self.decision_ns)
        wall = sorted(self.decision_wall_ns)
        alone = sorted(self.alone_decision_ns)
        return {
            "decisions_per_s": round(len(cpu) / (sum(cpu) / 1e9)),
            "p50_us": round(statistics.median(cpu) / 1e3, 1),
            "p99_us": round(cpu[int(0.99 * (len(cpu) - 1))] / 1e3, 1),
            "wall_p99_us": round(wall[int(0.99 * (len(wall) - 1))] / 1e3, 1),
            **(
                {
                    "alone_decisions_per_s": round(len(alone) / (sum(alone) / 1e9)),
                    "alone_p50_us": round(statistics.median(alone) / 1e3, 1),
                    "alone_p99_us": round(alone[int(0.99 * (len(alone) - 1))] / 1e3, 1),
                    # decisions the replays made otherwise than the live run (0: the same router)
                    "alone_replay_mismatches": self.replay_mismatches,
                }
                if alone
                else {}
            ),
            "events_per_s": round(self.events / max(1e-9, self.event_ns / 1e9)),
            "hashes_per_s": round(self.event_hashes / max(1e-9, self.event_ns / 1e9)),
            "index_mb": round(self.index_bytes / 2**20, 1),
            "bytes_per_block_holder": round(self.index_bytes / max(1, self.block_holders), 1),
            "hit_rate": round(self.hit_tokens / max(1, self.prompt_tokens), 4),
            "accuracy": round(self.accurate / max(1, self.measured), 4),
        }


def sized(root: object, skip: set[int]) -> int:
    """Bytes of every object reachable from ``root`` through containers and instance slots or
    dicts, each counted once (``skip``: ids already counted or left out)."""
    total = 0
    stack = [root]
    while stack:
        obj = stack.pop()
        if id(obj) in skip:
            continue
        skip.add(id(obj))
        total += sys.getsizeof(obj)
        if isinstance(obj, dict):
            stack.extend(obj.keys())
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        elif not isinstance(obj, (int, float, bytes, str, bool, type(None))):
            stack.extend(_fields(obj))
    return total


def _fields(obj: object) -> Iterator[object]:
    if hasattr(obj, "__dict__"):
        yield obj.__dict__
    for cls in type(obj).__mro__:
        for name in getattr(cls, "__slots__", ()):
            if hasattr(obj, name):
                yield getattr(obj, name)


def index_bytes(index: object) -> int:
    """The index's memory less its hit rules (a constant shadow coordinator) and the worker ids."""
    rules = index.rules
    skip = {id(rules)}
    sized(rules, skip)  # everything the rules reach is theirs
    return sized(index, skip) - sys.getsizeof(index)


def run(
    args: argparse.Namespace, workers: int, router: str, replicas: int = 1, replays: int = 0, host: int = 0
) -> Result:
    """One router (``replicas`` copies of kvfleet's, each fed every event and load report, each
    request routed by the replica its first block's hash picks) over one fleet size; with
    ``replays``, each copy's busy time is the least of that many replays alone (``replay_alone``);
    with ``host``, every worker has a host tier of ``host * capacity`` blocks."""
    rng = random.Random(args.seed * 7919 + workers)
    prefixes = make_prefixes(args.prefixes_per_worker * workers, rng, args.prefix_min, args.prefix_max)
    suffix = (args.suffix_min, args.suffix_max)
    warm = warm_requests(prefixes, rng, suffix)
    requests = make_requests(prefixes, args.decisions, args.alpha, rng, suffix)
    config = RouterConfig(seed=args.seed)
    with routing_core("auto" if router == "kvfleet" else "python"):
        copies = [RoutingPolicy(GROUPS, config) for _ in range(replicas)]
    policy = copies[0]
    rules = HitRules(GROUPS)
    fleet = [FleetWorker(f"w{k}", args.capacity, host * args.capacity) for k in range(workers)]
    promote = PROMOTE_S_PER_TOKEN if host else 0.0
    by_name = {w.name: w for w in fleet}
    for w in fleet:
        for copy in copies:
            copy.add_worker(w.name, "both", args.capacity)
    result = Result(workers, busy_ns=[0] * len(copies), absorb_ns=[0] * len(copies), routed=[0] * len(copies))
    routing = False
    calls: list[Call] = []  # with replicas: what each copy was fed, replayed alone afterwards

    def absorb(worker: FleetWorker, events: list, now: float) -> None:  # type: ignore[type-arg]
        for k, copy in enumerate(copies):
            # each replica deserialises its own copy of a report: its own hash objects, whose
            # hashes it computes itself (shared objects would hand later copies cached hashes)
            mine = events if k == 0 else [refreshed(e) for e in events]
            if k == 0 and replays:
                calls.append(("events", worker.name, events, now, routing))
            start = time.thread_time_ns()
            copy.apply_events(worker.name, mine, now)
            spent = time.thread_time_ns() - start
            result.event_ns += spent
            if routing:
                result.busy_ns[k] += spent
                result.absorb_ns[k] += spent
        result.events += len(events)
        result.event_hashes += sum(len(getattr(e, "block_hashes", ())) for e in events)

    for request in warm:
        worker = fleet[request.prefix % workers]
        absorb(worker, worker.run(request, len(prefixes[request.prefix])), 0.0)
    LOG.info("W=%d %s: warm (%d prefixes), routing %d requests", workers, router, len(prefixes), len(requests))
    rate = args.rate * workers
    now = 0.0
    report = 0
    warmup = int(args.warmup * len(requests))
    gc.collect()
    gc.freeze()
    routing = True
    for i, request in enumerate(requests):
        now += 1.0 / rate
        for _ in range(args.reports):
            w = fleet[report % workers]
            report += 1
            load = WorkerLoad(w.load(now, args.drain_tps), 0, len(w.refs) / w.capacity, promote)
            for copy in copies:
                copy.update_load(w.name, load)
            if replays:
                calls.append(("load", w.name, load))
        route = RouteRequest(f"r{i}", received(request.block_hashes), request.num_tokens)
        k = int.from_bytes(request.block_hashes[0][:8], "big") % len(copies)  # by prefix
        wall = time.perf_counter_ns()
        start = time.thread_time_ns()
        decision = copies[k].route(route, now)
        spent = time.thread_time_ns() - start
        result.decision_ns.append(spent)
        result.busy_ns[k] += spent
        result.routed[k] += 1
        result.decision_wall_ns.append(time.perf_counter_ns() - wall)
        if replays:
            calls.append(("route", k, route, now, decision.prefill_worker))
        worker = by_name[decision.prefill_worker]
        truth = exact_hit(rules, worker, request)
        if i >= warmup:
            result.measured += 1
            result.accurate += decision.predicted_hit == truth
            result.hit_tokens += truth
            result.prompt_tokens += request.num_tokens
        worker.load(now, args.drain_tps)
        worker.queued += request.num_tokens - truth
        absorb(worker, worker.run(request, len(prefixes[request.prefix])), now)
    gc.unfreeze()
    for k in range(len(copies) if replays else 0):
        timed = [replay_alone(k, calls, [w.name for w in fleet], args.capacity, config, result) for _ in range(replays)]
        best = min(timed, key=lambda replay: replay.busy_ns)
        result.busy_ns[k], result.absorb_ns[k] = best.busy_ns, best.absorb_ns
        if len(copies) == 1:
            result.alone_decision_ns = min(timed, key=lambda replay: sum(replay.decision_ns)).decision_ns
    result.block_holders = sum(len(w.refs) for w in fleet)
    result.index_bytes = index_bytes(policy.index)
    LOG.info("W=%d %s: %s", workers, router, result.summary())
    return result


Call = tuple  # type: ignore[type-arg]  # ("events", worker, events, now, timed) | ("load", worker, load) | ("route", copy, request, now, worker)


@dataclass
class Replay:
    """One replica replayed alone: CPU time of its routing phase (all, the events' part) and of
    each of its decisions."""

    busy_ns: int
    absorb_ns: int
    decision_ns: list[int]


def replay_alone(
    k: int, calls: list[Call], workers: list[str], capacity: int, config: RouterConfig, result: Result
) -> Replay:
    """Replica ``k`` on its own: a fresh copy fed what copy ``k`` was fed (every event, with its
    own hash objects, and load report; its own requests), timed alone, as a replica runs in its
    own process; the N copies interleaved on one thread share one CPU cache and slow each other,
    and the simulated fleet's own work between two decisions (its caches, the exact oracle) evicts
    the router's. A decision that differs from the live run's is counted in ``replay_mismatches``
    (0: the replay is the same replica)."""
    copy = RoutingPolicy(GROUPS, config)
    for name in workers:
        copy.add_worker(name, "both", capacity)
    busy = absorbed = 0
    decisions: list[int] = []
    gc.collect()
    gc.freeze()
    for call in calls:
        if call[0] == "events":
            _, name, events, now, timed = call
            mine = [refreshed(e) for e in events]
            start = time.thread_time_ns()
            copy.apply_events(name, mine, now)
            spent = time.thread_time_ns() - start
            if timed:
                busy += spent
                absorbed += spent
        elif call[0] == "load":
            copy.update_load(call[1], call[2])
        elif call[1] == k:
            _, _, recorded, now, worker = call
            route = RouteRequest(recorded.request_id, received(recorded.block_hashes), recorded.num_tokens)
            start = time.thread_time_ns()
            decision = copy.route(route, now)
            spent = time.thread_time_ns() - start
            busy += spent
            decisions.append(spent)
            result.replay_mismatches += decision.prefill_worker != worker
    gc.unfreeze()
    return Replay(busy, absorbed, decisions)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, nargs="+", default=[64, 256, 1024, 4096])
    ap.add_argument("--routers", nargs="+", choices=ROUTERS, default=list(ROUTERS))
    ap.add_argument("--decisions", type=int, default=4000, help="routed requests per fleet size")
    ap.add_argument("--warmup", type=float, default=0.2, help="share of decisions left out of the hit rate")
    ap.add_argument("--prefixes-per-worker", type=int, default=3)
    ap.add_argument("--prefix-min", type=int, default=256)
    ap.add_argument("--prefix-max", type=int, default=2048)
    ap.add_argument("--suffix-min", type=int, default=32)
    ap.add_argument("--suffix-max", type=int, default=256)
    ap.add_argument("--alpha", type=float, default=1.0, help="Zipf exponent of prefix popularity")
    ap.add_argument("--capacity", type=int, default=640, help="cached (group, block) entries per worker")
    ap.add_argument("--rate", type=float, default=2.0, help="requests per second per worker")
    ap.add_argument("--drain-tps", type=float, default=4000.0, help="queued tokens a worker serves per second")
    ap.add_argument("--reports", type=int, default=2, help="load reports per decision")
    ap.add_argument(
        "--replicas",
        type=int,
        nargs="*",
        default=[4],
        help="router replica counts compared with one router (empty: none)",
    )
    ap.add_argument("--replica-workers", type=int, default=256, help="fleet size of the replica comparison")
    ap.add_argument("--replays", type=int, default=3, help="replays of each replica alone (the least time counts)")
    ap.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="runs of each fleet size and router (the fastest counts; every run's decisions/s is printed)",
    )
    ap.add_argument(
        "--host-tier",
        type=int,
        default=4,
        help="the host-tier scenario: every worker's host tier holds this many times --capacity (0: none)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="W = 64, 256 and 400 decisions")
    args = ap.parse_args(argv)
    if args.quick:
        args.workers, args.decisions = [64, 256], 400
    if args.host_tier < 0:
        ap.error(f"--host-tier: must be >= 0 (got {args.host_tier})")
    for name in ("decisions", "prefixes_per_worker", "capacity", "reports", "replays", "repeats"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')}: must be >= 1 (got {getattr(args, name)})")
    if any(n < 2 for n in args.replicas):
        ap.error(f"--replicas: every count must be >= 2 (got {args.replicas})")
    if any(w < 1 for w in args.workers):
        ap.error(f"--workers: every size must be >= 1 (got {args.workers})")
    return args


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    args = parse_args(argv)
    summaries: dict[str, dict[int, dict[str, float]]] = {r: {} for r in args.routers}
    recorded: dict[int, Result] = {}  # per W: kvfleet's recording run, replayed alone
    for workers in args.workers:
        for router in args.routers:
            runs = []
            for _ in range(args.repeats):  # the same trace each time: the fastest is the least disturbed
                runs.append(run(args, workers, router).summary())
                gc.collect()
            summary = max(runs, key=lambda r: r["decisions_per_s"])
            summary["runs_decisions_per_s"] = [r["decisions_per_s"] for r in runs]  # type: ignore[assignment]
            if router == "kvfleet":  # alone: a second run that records what it feeds the router
                # (not the first: what it keeps for the replays would stay alive through the
                # routing phase, and the router's allocations would pay for collecting it)
                recorded[workers] = run(args, workers, router, 1, args.replays)
                summary.update({k: v for k, v in recorded[workers].summary().items() if k.startswith("alone_")})
                gc.collect()
            if args.host_tier:  # the same trace, every worker with a host tier
                tiered = []
                for _ in range(args.repeats):
                    tiered.append(run(args, workers, router, host=args.host_tier).summary())
                    gc.collect()
                best = max(tiered, key=lambda r: r["decisions_per_s"])
                summary.update({f"{k}_host_tier": best[k] for k in HOST_TIER_KEYS})
                if router == "kvfleet":  # the host-tier router replayed alone, as above
                    alone = run(args, workers, router, 1, args.replays, host=args.host_tier).summary()
                    summary.update({f"{k}_host_tier": v for k, v in alone.items() if k.startswith("alone_")})
                    gc.collect()
            summaries[router][workers] = summary
    for router in args.routers:
        for workers, s in summaries[router].items():
            print(f"{router:<14} W={workers:<5} " + " ".join(f"{k}={v}" for k, v in s.items()))

    def per_w(router: str) -> dict[str, object]:
        rows = summaries[router]
        keys = (
            "decisions_per_s",
            "runs_decisions_per_s",
            "p50_us",
            "p99_us",
            "wall_p99_us",
            "alone_decisions_per_s",
            "alone_p50_us",
            "alone_p99_us",
            "alone_replay_mismatches",
            "events_per_s",
            "index_mb",
            "hit_rate",
            "accuracy",
            *(f"{k}_host_tier" for k in HOST_TIER_KEYS),
            *(f"alone_{k}_host_tier" for k in ("decisions_per_s", "p50_us", "p99_us", "replay_mismatches")),
        )
        out: dict[str, object] = {k: {str(w): s[k] for w, s in rows.items() if k in s} for k in keys}
        out = {k: v for k, v in out.items() if v}
        out["bytes_per_block_holder"] = max(s["bytes_per_block_holder"] for s in rows.values())
        return out

    report: dict[str, object] = per_w(args.routers[0])
    if len(args.routers) > 1:
        ours, base = summaries[args.routers[0]], summaries[args.routers[1]]
        report["hit_rate_vs_single_policy"] = round(
            min(ours[w]["hit_rate"] / max(1e-9, base[w]["hit_rate"]) for w in ours), 4
        )
        report["baseline"] = per_w(args.routers[1])
        if args.host_tier:
            report["hit_rate_vs_single_policy_host_tier"] = round(
                min(ours[w]["hit_rate_host_tier"] / max(1e-9, base[w]["hit_rate_host_tier"]) for w in ours), 4
            )
    if args.replicas:
        speedup: dict[str, float] = {}
        ratio: dict[str, float] = {}
        one = recorded.get(args.replica_workers) or run(args, args.replica_workers, "kvfleet", 1, args.replays)
        for n in args.replicas:
            many = run(args, args.replica_workers, "kvfleet", n, args.replays)
            # Replicas run in parallel: the fleet routes as fast as its busiest replica, and each
            # replica also absorbs every event.
            speedup[str(n)] = round(sum(one.busy_ns) / max(many.busy_ns), 3)
            ratio[str(n)] = round(many.summary()["hit_rate"] / max(1e-9, one.summary()["hit_rate"]), 4)
            print(
                f"replicas={n} W={args.replica_workers}: busy ms one {sum(one.busy_ns) / 1e6:.0f} (events "
                f"{sum(one.absorb_ns) / 1e6:.0f}), per replica {[round(b / 1e6) for b in many.busy_ns]} (events "
                f"{[round(b / 1e6) for b in many.absorb_ns]}, decision share "
                f"{[round(r / len(many.decision_ns), 3) for r in many.routed]}, replay mismatches "
                f"{many.replay_mismatches}); hit rate "
                f"{one.summary()['hit_rate']} vs {many.summary()['hit_rate']}"
            )
        report["replica_speedup"] = speedup
        report["replica_hit_ratio"] = ratio
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
