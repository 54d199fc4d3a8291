"""Bad requests on a real 1P+1D tiny cluster: every driver entry point (generate, agenerate,
stream, stream_completion) refuses them with a field-named ValueError before anything reaches a
worker, and the same workers keep serving. Issue 15's symptom: a NaN temperature used to pass
validation, fail in torch.multinomial inside the worker's step() and end its engine loop."""

from __future__ import annotations

import asyncio
import math
import re

import pytest

from engine.sampling_params import SamplingParams
from tests.integration.conftest import GREEDY, cluster_config, oracle_tokens, random_prompts, wait_for

BAD_SAMPLING = [
    ({"temperature": math.nan}, r"^temperature: must be a finite number \(got nan\)$"),
    ({"temperature": math.inf}, r"^temperature: must be a finite number \(got inf\)$"),
    ({"top_p": math.nan}, r"^top_p: must be a finite number \(got nan\)$"),
    ({"temperature": "abc"}, r"^temperature: must be a number \(got 'abc'\)$"),
    ({"max_tokens": "5"}, r"^max_tokens: must be an integer \(got '5'\)$"),
    ({"seed": 2**64}, r"^seed: must fit in 64 bits"),
    ([1, 2], r"^sampling: 2 sampling params for 1 prompts$"),
]
BAD_PROMPTS = [
    (None, r"^prompt: must be text or a list of token ids \(got None\)$"),
    (3.5, r"^prompt: must be text or a list of token ids \(got 3.5\)$"),
    ([1, "2"], r"^prompt: token id '2' is not an integer \(position 1 of 2\)$"),
    ([1, -2], r"^prompt: token id -2 is outside the vocabulary \[0, 256\) \(position 1 of 2\)$"),
]


@pytest.fixture(scope="module")
def cluster(ray_session):
    from cluster.api import Cluster

    with Cluster(cluster_config("tiny", 1, 1)) as c:
        yield c


def _idle(cluster) -> bool:
    workers = cluster.stats()["workers"].values()
    return all(w["free_blocks"] == w["num_blocks"] and w["running"] == 0 and w["queued"] == 0 for w in workers)


async def _drain(iterator) -> list:
    return [item async for item in iterator]


def _every_entry_point(cluster, prompt, sampling) -> list:
    """The same request through each driver call; what each raised (None if it did not)."""
    calls = [
        lambda: cluster.generate([prompt], sampling),
        lambda: asyncio.run(cluster.agenerate(prompt, sampling)),
        lambda: asyncio.run(_drain(cluster.stream(prompt, sampling))),
        lambda: asyncio.run(_drain(cluster.stream_completion(prompt, sampling))),
    ]
    raised = []
    for call in calls:
        try:
            call()
        except ValueError as exc:
            raised.append(exc)
        else:
            raised.append(None)
    return raised


@pytest.mark.parametrize("sampling,message", BAD_SAMPLING, ids=lambda v: repr(v)[:24])
def test_bad_sampling_is_named_by_every_entry_point(cluster, sampling, message: str) -> None:
    if isinstance(sampling, list):  # a per-prompt list only exists for generate
        with pytest.raises(ValueError, match=message):
            cluster.generate(["hello"], sampling)
        return
    for raised in _every_entry_point(cluster, "hello", sampling):
        assert raised is not None and re.match(message, str(raised)), str(raised)


@pytest.mark.parametrize("prompt,message", BAD_PROMPTS, ids=lambda v: repr(v)[:24])
def test_bad_prompts_are_named_by_every_entry_point(cluster, prompt, message: str) -> None:
    for raised in _every_entry_point(cluster, prompt, GREEDY):
        assert raised is not None and re.match(message, str(raised)), str(raised)


def test_bad_request_ids_are_named(cluster) -> None:
    with pytest.raises(ValueError, match=r"^request_ids: must be unique \(got 'same'\)$"):
        cluster.generate(["a", "b"], GREEDY, request_ids=["same", "same"])
    with pytest.raises(ValueError, match=r"^request_ids: must be a non-empty string \(got 7\)$"):
        cluster.generate(["a"], GREEDY, request_ids=[7])


def test_after_a_nan_temperature_the_same_workers_keep_serving(cluster) -> None:
    with pytest.raises(ValueError, match=r"^temperature: must be a finite number \(got nan\)$"):
        cluster.generate(["a", "b", "c"], {"temperature": math.nan, "max_tokens": 4})
    assert _idle(cluster)  # nothing reached a worker
    prompts = random_prompts(7, [9, 40])
    assert [r.token_ids for r in cluster.generate(prompts, GREEDY)] == oracle_tokens(cluster.config, prompts)
    sampled = SamplingParams(max_tokens=6, temperature=0.8, seed=5, ignore_eos=True)
    first, second = cluster.generate([prompts[0], prompts[0]], sampled)
    assert first.token_ids == second.token_ids and len(first.token_ids) == 6
    assert set(cluster.stats()["workers"]) == {"prefill-0", "decode-0"}
    wait_for(lambda: _idle(cluster), 15, "every block back in the pool")
