"""Cluster-level P/D stress: shared-prefix requests in concurrent waves on a local Ray cluster
while other processes keep every core busy; every request's greedy tokens against a single
engine that ran the prompt alone on an empty cache (``pd_harness.alone_tokens``). Used by
``tests/integration/test_pd_stress.py`` (bounded) and ``benchmarks/pd_stress.py`` (longer runs).

The workload reuses a few prefixes with different suffixes and exact repeats, so prefill
workers hit held (not yet read) blocks, decode workers hit blocks other requests pulled, and
the router keeps sending a prefix to the same pair of workers. The default token budget (65)
leaves 1-token remainders after a 64-token chunk, which load alone produces only rarely.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

from engine.sampling_params import SamplingParams
from kvfleet_testing.pd_harness import SAMPLING
from kvfleet_testing.presets import cluster_config
from kvfleet_testing.workloads import shared_prefix_prompts


def _spin(stop_at: float) -> None:  # pragma: no cover - runs in a child process
    x = 0
    while time.monotonic() < stop_at:
        x = (x * 1103515245 + 12345) & 0xFFFFFFFF


@contextlib.contextmanager
def busy_cpu(processes: int, max_s: float = 3600.0) -> Iterator[None]:
    """``processes`` child processes spinning on a core each (they also stop by themselves after
    ``max_s``); every one started here is killed by its pid on exit."""
    ctx = mp.get_context("spawn")
    children = [ctx.Process(target=_spin, args=(time.monotonic() + max_s,), daemon=True) for _ in range(processes)]
    for child in children:
        child.start()
    try:
        yield
    finally:
        for child in children:
            if child.pid is not None and child.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child.pid, signal.SIGKILL)
            child.join(5)


@dataclass
class StressResult:
    config: str
    requests: int = 0
    wrong_tokens: int = 0
    disaggregated: int = 0
    seconds: float = 0.0
    transfer: dict[str, int] = field(default_factory=dict)
    mismatches: list[dict[str, Any]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def run_cluster_stress(
    preset: str,
    backend: str,
    num_prefill: int,
    num_decode: int,
    *,
    requests: int,
    wave: int = 12,
    seed: int = 0,
    overrides: tuple[str, ...] = ("scheduler.max_num_batched_tokens=65",),
    sampling: SamplingParams = SAMPLING,
) -> StressResult:
    """Start a cluster (on the Ray this process is attached to, else an embedded one), run
    ``requests`` shared-prefix requests in concurrent waves of ``wave``, compare every one with
    the single engine; the cluster's transfer counters summed over its workers."""
    from cluster.api import Cluster
    from configs import load_config
    from kvfleet_testing.pd_harness import alone_tokens

    config = cluster_config(
        preset,
        num_prefill,
        num_decode,
        f"transfer.backend={backend}",
        "router.decode_only_threshold_tokens=16",
        *overrides,
    )
    prompts = shared_prefix_prompts(seed, requests)
    expected = alone_tokens(load_config(preset), prompts, sampling)
    result = StressResult(f"{preset}/{backend}/{num_prefill}P{num_decode}D")
    start = time.monotonic()
    with Cluster(config) as cluster:
        for lo in range(0, len(prompts), wave):
            for done in cluster.generate(prompts[lo : lo + wave], sampling):
                result.requests += 1
                result.disaggregated += done.disaggregated
                want = expected[tuple(done.prompt_token_ids)]
                if done.token_ids != want:
                    result.wrong_tokens += 1
                    at = next(
                        (i for i, (a, b) in enumerate(zip(done.token_ids, want, strict=False)) if a != b), len(want)
                    )
                    result.mismatches.append(
                        {
                            "prompt_tokens": len(done.prompt_token_ids),
                            "diverged_at": at,
                            "prefill": done.prefill_worker,
                            "decode": done.decode_worker,
                            "cached_tokens": done.cached_tokens,
                            "predicted_hit": done.predicted_hit,
                        }
                    )
        totals: dict[str, int] = {}
        for worker in cluster.stats()["workers"].values():
            for key, value in worker.get("transfer", {}).items():
                if isinstance(value, int):
                    totals[key] = totals.get(key, 0) + value
        result.transfer = totals
    result.seconds = round(time.monotonic() - start, 1)
    return result
