"""Chaos: shared-prefix requests at a steady rate on a 2P+2D cluster while a decode worker, a
prefill worker and the router are killed at seeded random moments. Used by
``tests/integration/test_chaos.py`` (bounded) and ``benchmarks/chaos_bench.py`` (larger).

Every request is checked as it streams: its text so far must be a prefix of the text of a single
engine that ran the prompt alone, and at its end its tokens must equal that engine's. A request
whose decode worker is killed mid-stream migrates to another one and must still give exactly
those tokens in one unbroken stream (``migrated`` counts them). A request may instead end with an
error, but only a ``RuntimeError`` naming a worker, and only if nothing it streamed was wrong. A
request that has not ended ``request_timeout_s`` after it was sent is lost (hung). After the run
the cluster is quiesced and every worker must have all its blocks free.

Recovery of one kill: from the kill until the cluster is whole again (the replacement joined, or
the driver re-registered the workers with the restarted router) and serves at its earlier rate
again: the first moment when the requests completed in the ``RATE_WINDOW_S`` seconds before it,
all after the kill, reach ``RATE_RECOVERED`` of the completion rate measured before the first
kill (the undisturbed baseline; requests arrive open loop at a constant rate).
"""

from __future__ import annotations

import asyncio
import logging
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from engine.sampling_params import SamplingParams
from kvfleet_testing.pd_harness import alone_tokens
from kvfleet_testing.presets import FAST_HEALTH, cluster_config
from kvfleet_testing.workloads import shared_prefix_prompts

log = logging.getLogger(__name__)

SAMPLING = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
KINDS = ("decode", "prefill", "router")
#: with split workers (``workers.tensor_parallel_size`` > 1, aggregated): a follower rank of a
#: decode worker (its worker goes down with it), a decode worker, the router
SPLIT_KINDS = ("rank", "decode", "router")
DISTINCT_PROMPTS = 120
RATE_WINDOW_S = 2.0
RATE_RECOVERED = 0.9


@dataclass
class ChaosResult:
    """The outcome of one chaos run (the benchmark's JSON line)."""

    requests: int = 0
    completed: int = 0
    migrated: int = 0  # completed after moving to another worker mid-stream
    wrong_tokens: int = 0
    wrong_stream: int = 0
    lost: int = 0
    errored: int = 0
    unclear_errors: int = 0
    kills: int = 0
    recovery_s: list[float] = field(default_factory=list)
    recovery_s_p90: float = 0.0
    blocks_leaked: int = 0
    latency_p50_before_kills_s: float = 0.0
    completions_per_s_before_kills: float = 0.0  # the undisturbed rate recovery is measured against
    seconds: float = 0.0
    errors: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class _Kill:
    kind: str
    victim: str
    at: float
    killed_actor: str = ""  # the worker actor killed (its replacement is another one)
    rejoins_before: int = 0  # the driver's router re-registrations before a router kill
    whole_at: float | None = None
    served_at: float | None = None

    @property
    def recovery_s(self) -> float | None:
        if self.whole_at is None or self.served_at is None:
            return None
        return max(self.whole_at, self.served_at) - self.at


def run_chaos(
    *,
    requests: int,
    rate: float,
    kills: int,
    seed: int = 0,
    preset: str = "tiny",
    backend: str = "local",
    request_timeout_s: float = 120.0,
    quiesce_timeout_s: float = 60.0,
    tensor_parallel_size: int = 1,
) -> ChaosResult:
    """Run the chaos workload on a fresh 2P+2D cluster (on the Ray this process is attached to,
    else an embedded one); ``kills`` kills cycle decode, prefill, router at seeded moments
    spread over the middle of the run. ``tensor_parallel_size`` > 1: two aggregated decode
    workers split over that many ranks each, and the kills cycle a follower rank, a decode
    worker and the router (``SPLIT_KINDS``)."""
    from cluster.api import Cluster
    from configs import load_config

    rng = random.Random(seed)
    pool = shared_prefix_prompts(seed, min(requests, DISTINCT_PROMPTS))  # the oracle runs each alone
    prompts = [pool[rng.randrange(len(pool))] for _ in range(requests)]
    if tensor_parallel_size > 1:
        split = f"workers.tensor_parallel_size={tensor_parallel_size}"
        config = cluster_config(preset, 0, 2, split, *FAST_HEALTH)
        kinds = SPLIT_KINDS
    else:
        config = cluster_config(preset, 2, 2, f"transfer.backend={backend}", *FAST_HEALTH)
        kinds = KINDS
    expected = alone_tokens(load_config(preset), prompts, SAMPLING)
    duration = requests / rate
    kill_times = sorted(rng.uniform(0.15, 0.6) * duration for _ in range(kills))  # room to recover after
    result = ChaosResult(requests=requests)
    started = time.monotonic()
    with Cluster(config) as cluster:
        texts = {key: cluster.tokenizer.decode(list(tokens)) for key, tokens in expected.items()}
        asyncio.run(
            _drive(
                cluster,
                prompts,
                expected,
                texts,
                rate,
                [(at, kinds[i % len(kinds)]) for i, at in enumerate(kill_times)],
                rng,
                request_timeout_s,
                result,
            )
        )
        result.blocks_leaked = _quiesce(cluster, quiesce_timeout_s)
    result.seconds = round(time.monotonic() - started, 1)
    done = sorted(result.recovery_s)
    result.recovery_s_p90 = round(done[min(len(done) - 1, int(0.9 * len(done)))], 2) if done else 0.0
    return result


async def _drive(
    cluster: Any,
    prompts: list[list[int]],
    expected: dict[tuple[int, ...], list[int]],
    texts: dict[tuple[int, ...], str],
    rate: float,
    kill_times: list[tuple[float, str]],
    rng: random.Random,
    request_timeout_s: float,
    result: ChaosResult,
) -> None:
    from cluster.api import ClusterCompletion, Delta

    t0 = time.monotonic()
    latencies_before: list[float] = []
    completed_at: list[float] = []
    kills: list[_Kill] = []

    async def one(prompt: list[int], sent: float) -> None:
        key = tuple(prompt)
        streamed = ""
        try:
            async with asyncio.timeout(request_timeout_s):
                async for item in cluster.stream_completion(prompt, SAMPLING):
                    if isinstance(item, Delta):
                        streamed += item.text
                        if not texts[key].startswith(streamed):
                            result.wrong_stream += 1
                            result.errors.append(f"streamed {streamed!r}, oracle {texts[key]!r}")
                            return
                    elif isinstance(item, ClusterCompletion):
                        finished = time.monotonic()
                        if list(item.token_ids) != expected[key]:
                            result.wrong_tokens += 1
                            result.errors.append(f"{item.request_id} on {item.decode_worker}: wrong tokens")
                            return
                        result.completed += 1
                        result.migrated += item.migrations > 0
                        completed_at.append(finished)
                        if not kills:
                            latencies_before.append(finished - sent)
        except TimeoutError:
            result.lost += 1
            result.errors.append(f"a request sent at {sent - t0:.1f} s hung")
        except RuntimeError as exc:
            result.errored += 1
            if "worker" not in str(exc) and "router" not in str(exc):
                result.unclear_errors += 1
                result.errors.append(f"unclear error: {exc}")
        except Exception as exc:  # noqa: BLE001 - anything else is not a clear error: counted
            result.errored += 1
            result.unclear_errors += 1
            result.errors.append(f"unexpected {type(exc).__name__}: {exc}")

    async def killer() -> None:
        for at, kind in kill_times:
            await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
            role = _victim_role(kind)
            while kind != "router" and len([w for w in cluster.workers if w.startswith(role)]) < 2:
                await asyncio.sleep(0.2)  # never the last live worker of a role
            kills.append(await asyncio.get_running_loop().run_in_executor(None, _kill, cluster, kind, rng))
            result.kills += 1

    async def watch_whole() -> None:
        while True:
            await asyncio.sleep(0.1)
            for kill in kills:
                if kill.whole_at is None and _whole_again(cluster, kill):
                    kill.whole_at = time.monotonic()

    watcher = asyncio.ensure_future(watch_whole())
    chaos = asyncio.ensure_future(killer())
    running = []
    for i, prompt in enumerate(prompts):
        await asyncio.sleep(max(0.0, t0 + i / rate - time.monotonic()))
        running.append(asyncio.ensure_future(one(prompt, time.monotonic())))
    await asyncio.gather(*running)
    await chaos
    deadline = time.monotonic() + 120
    while any(k.whole_at is None for k in kills) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    watcher.cancel()
    baseline = _rate_before(completed_at, t0 + 0.1 * len(prompts) / rate, kills[0].at if kills else time.monotonic())
    result.completions_per_s_before_kills = round(baseline, 2)
    for kill in kills:
        kill.served_at = _rate_recovered(completed_at, kill.at, baseline)
    result.recovery_s = [round(k.recovery_s, 2) for k in kills if k.recovery_s is not None]
    if latencies_before:
        result.latency_p50_before_kills_s = round(statistics.median(latencies_before), 3)
    for kill in kills:
        log.info("kill of %s (%s) at %.1f s: recovered in %s s", kill.victim, kill.kind, kill.at - t0, kill.recovery_s)
        if kill.recovery_s is None:
            result.errors.append(f"the cluster did not recover from killing {kill.victim}")


def _rate_before(completed_at: list[float], start: float, end: float) -> float:
    """Completions per second between ``start`` (past the warm-up) and ``end`` (the first kill)."""
    count = sum(start <= t < end for t in completed_at)
    return count / (end - start) if end > start else 0.0


def _rate_recovered(completed_at: list[float], kill_at: float, baseline: float) -> float | None:
    """The first completion time after which the last ``RATE_WINDOW_S`` seconds, all after the
    kill, held ``RATE_RECOVERED`` x ``baseline`` x ``RATE_WINDOW_S`` completions; None if never."""
    need = RATE_RECOVERED * baseline * RATE_WINDOW_S
    after = sorted(t for t in completed_at if t > kill_at)
    lo = 0
    for hi, t in enumerate(after):
        while after[lo] <= t - RATE_WINDOW_S:
            lo += 1
        if t - RATE_WINDOW_S >= kill_at and hi - lo + 1 >= need:
            return t
    return None


def _victim_role(kind: str) -> str:
    """The worker role a kill of ``kind`` picks its victim among: a "rank" kill takes one follower
    rank of a split decode worker."""
    return "decode" if kind == "rank" else kind


def _kill(cluster: Any, kind: str, rng: random.Random) -> _Kill:
    import ray

    if kind == "router":
        kill = _Kill(kind, "router", time.monotonic(), rejoins_before=cluster.router_rejoins)
        ray.kill(cluster.router, no_restart=False)
        return kill
    victim = rng.choice(sorted(w for w in cluster.workers if w.startswith(_victim_role(kind))))
    handle = cluster.workers[victim]
    kill = _Kill(kind, victim, time.monotonic(), killed_actor=handle._actor_id.hex())
    if kind == "rank":  # one follower rank: the worker must go down with it and be replaced
        followers = cluster._supervisor.ranks.followers.get(victim, [])
        ray.kill(followers[rng.randrange(len(followers))], no_restart=True)
    else:
        ray.kill(handle, no_restart=True)
    log.warning("chaos: killed %s", victim)
    return kill


def _whole_again(cluster: Any, kill: _Kill) -> bool:
    if kill.kind == "router":
        return cluster.router_rejoins > kill.rejoins_before
    handle = cluster.workers.get(kill.victim)
    return handle is not None and handle._actor_id.hex() != kill.killed_actor


def _quiesce(cluster: Any, timeout_s: float) -> int:
    """Wait until every worker is idle with every block free; the blocks still in use then."""
    deadline = time.monotonic() + timeout_s
    while True:
        workers = cluster.stats()["workers"]
        leaked = sum(w["num_blocks"] - w["free_blocks"] for w in workers.values())
        idle = all(w["running"] == 0 and w["queued"] == 0 for w in workers.values())
        if (leaked == 0 and idle and len(workers) == len(cluster.infos)) or time.monotonic() > deadline:
            return leaked
        time.sleep(0.2)
