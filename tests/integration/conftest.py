"""One local Ray for the whole integration suite (loopback, no dashboard, enough logical CPUs)
and helpers shared by the cluster tests: config building, oracle tokens, waiting.

The Ray fixture is scoped to this package: it starts before the first integration test and stops
after the last one, so the unit tests that run later in the same session see no Ray."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator

import pytest

from configs import ClusterConfig, load_config
from engine.sampling_params import SamplingParams

# Logical CPUs: the largest cluster here (2 prefill + 2 decode workers at 0.5 CPU each) fits many
# times over; Ray's num_cpus is a count, not cores, so this never leaves an actor pending.
RAY_NUM_CPUS = 8
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="package")
def ray_session() -> Iterator[None]:
    import ray

    ray.init(
        address="local",  # never attach to another cluster on this machine
        num_cpus=RAY_NUM_CPUS,
        resources={"prefill": 4, "decode": 4},
        include_dashboard=False,
        object_store_memory=256 * 1024**2,
        _node_ip_address="127.0.0.1",
        namespace="kvfleet-tests",
        log_to_driver=False,
    )
    yield
    ray.shutdown()


def cluster_config(preset: str, num_prefill: int, num_decode: int, *overrides: str) -> ClusterConfig:
    return load_config(preset, [f"workers.num_prefill={num_prefill}", f"workers.num_decode={num_decode}", *overrides])


def random_prompts(seed: int, lengths: list[int], low: int = 3, high: int = 250) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(low, high) for _ in range(n)] for n in lengths]


def oracle_tokens(
    config: ClusterConfig, prompts: list[list[int]], sampling: SamplingParams = GREEDY
) -> list[list[int]]:
    """Greedy tokens of one in-process engine running every prompt whole (same config)."""
    from engine.core import EngineCore

    engine = EngineCore(config, threads=1)
    try:
        out: dict[str, list[int]] = {}
        for i, prompt in enumerate(prompts):
            engine.add_request(f"o{i}", prompt, sampling)
            out[f"o{i}"] = []
        while engine.has_work:
            for result in engine.step():
                out[result.request_id] += result.new_token_ids
        return [out[f"o{i}"] for i in range(len(prompts))]
    finally:
        engine.close()


def wait_for(predicate: Callable[[], bool], timeout_s: float, what: str, interval_s: float = 0.05) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(interval_s)
