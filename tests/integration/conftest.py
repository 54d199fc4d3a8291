"""One local Ray for the whole integration suite (loopback, no dashboard, enough logical CPUs)
and helpers shared by the cluster tests: config building, oracle tokens, waiting.

The Ray fixture is scoped to this package: it starts before the first integration test and stops
after the last one, so the unit tests that run later in the same session see no Ray."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest

from configs import ClusterConfig
from engine.sampling_params import SamplingParams
from kvfleet_testing.presets import FAST_HEALTH, cluster_config  # noqa: F401  (re-exported)
from tests.support import init_local_ray, wait_for  # noqa: F401  (re-exported)

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="package")
def ray_session() -> Iterator[None]:
    import ray

    init_local_ray("kvfleet-tests")
    yield
    ray.shutdown()


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
