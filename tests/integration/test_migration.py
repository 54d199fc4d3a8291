"""A request whose decode worker dies after it streamed tokens migrates: it is routed again and
goes on on another worker from its prompt and the tokens it sent, and its client sees one
unbroken stream with the tokens, text and logprobs of an uninterrupted run (greedy, and seeded
sampling, whose draws are indexed by (seed, output position)); ``serve.migration_limit`` bounds
the moves; every block comes back.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from typing import Any

import pytest
import ray

from engine.sampling_params import SamplingParams
from tests.integration.conftest import FAST_HEALTH, cluster_config, random_prompts, wait_for

GREEDY_LOGPROBS = SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True, logprobs=2)
SEEDED = SamplingParams(max_tokens=300, temperature=0.9, top_k=0, seed=7, ignore_eos=True)
REPLACE_TIMEOUT_S = 180


def _idle_with_every_block(cluster: Any) -> bool:
    workers = cluster.stats()["workers"]
    return set(workers) == set(cluster.infos) and all(
        w["free_blocks"] == w["num_blocks"] and w["running"] == 0 and w["queued"] == 0 for w in workers.values()
    )


async def _running_on(cluster: Any) -> str:
    """The decode worker that runs the one request in flight now."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for worker_id, handle in sorted(cluster.workers.items()):
            if worker_id.startswith("decode") and (await handle.stats.remote())["requests"] > 0:
                return worker_id
        await asyncio.sleep(0.01)
    raise AssertionError("no decode worker runs the request")


async def _stream_killing_its_worker(cluster: Any, prompt: list[int], sampling: SamplingParams) -> tuple[Any, ...]:
    """Stream one request; after its first tokens, kill the decode worker that runs it. Returns
    the deltas, the completion (or the exception the stream raised) and the killed worker."""
    from cluster.api import ClusterCompletion, Delta

    deltas: list[Delta] = []
    completion: ClusterCompletion | BaseException | None = None
    killed = ""
    try:
        async for item in cluster.stream_completion(prompt, sampling):
            if isinstance(item, Delta):
                deltas.append(item)
                if not killed and item.token_ids:
                    killed = await _running_on(cluster)
                    ray.kill(cluster.workers[killed], no_restart=True)
            else:
                completion = item
    except RuntimeError as exc:
        completion = exc
    assert killed, "the request streamed no token"
    return deltas, completion, killed


def _check_one_unbroken_stream(deltas: list[Any], completion: Any) -> None:
    assert "".join(d.text for d in deltas) == completion.text
    assert [t for d in deltas for t in d.token_ids] == list(completion.token_ids)
    assert sum(d.num_tokens for d in deltas) == len(completion.token_ids)
    if completion.logprobs is not None:
        assert [lp for d in deltas for lp in d.logprobs] == completion.logprobs


def _same_logprobs(got: list[Any] | None, want: list[Any] | None) -> None:
    assert got is not None and want is not None and len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert a.token_id == b.token_id and a.rank == b.rank
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
        assert [v for _, v in a.top] == pytest.approx([v for _, v in b.top], abs=1e-4)


def test_a_stream_whose_decode_worker_dies_goes_on_elsewhere_unbroken(ray_session):
    """Greedy (with logprobs) and seeded streams each lose their decode worker after their first
    tokens: each completes on another worker with exactly the uninterrupted run's tokens, text
    (and logprobs), one migration. With ``serve.migration_limit=0`` (an attached driver) the same
    loss ends the request with an error naming the worker. Every worker is replaced and every
    block comes back."""
    from cluster.api import Cluster

    config = cluster_config("tiny", 1, 3, *FAST_HEALTH)
    greedy_prompt, seeded_prompt, last_prompt = random_prompts(27, [30, 34, 38])
    with Cluster(config) as cluster:
        reference = cluster.generate([greedy_prompt, seeded_prompt], [GREEDY_LOGPROBS, SEEDED])
        assert [r.migrations for r in reference] == [0, 0]
        assert len(reference[0].logprobs or []) == len(reference[0].token_ids) == 300

        for prompt, sampling, want in (
            (greedy_prompt, GREEDY_LOGPROBS, reference[0]),
            (seeded_prompt, SEEDED, reference[1]),
        ):
            deltas, completion, killed = asyncio.run(_stream_killing_its_worker(cluster, prompt, sampling))
            assert not isinstance(completion, BaseException), completion
            assert completion.migrations == 1, (killed, completion.decode_worker)
            assert completion.decode_worker != killed
            assert list(completion.token_ids) == list(want.token_ids)
            assert completion.text == want.text
            assert completion.finish_reason == want.finish_reason == "length"
            _check_one_unbroken_stream(deltas, completion)
            if sampling.logprobs is not None:
                _same_logprobs(completion.logprobs, want.logprobs)

        strict = Cluster.attach(
            replace(
                cluster.handles(),
                config=config.model_copy(update={"serve": config.serve.model_copy(update={"migration_limit": 0})}),
            )
        )
        try:
            _, outcome, killed = asyncio.run(_stream_killing_its_worker(strict, last_prompt, GREEDY_LOGPROBS))
        finally:
            strict.shutdown()
        assert isinstance(outcome, RuntimeError), outcome
        assert killed in str(outcome) and "after streaming output" in str(outcome), str(outcome)
        assert "serve.migration_limit=0" in str(outcome), str(outcome)

        wait_for(lambda: cluster.replacements >= 3 and not cluster.lost, REPLACE_TIMEOUT_S, "3 workers replaced")
        wait_for(lambda: _idle_with_every_block(cluster), 60, "every block back")
        again = cluster.generate([greedy_prompt, seeded_prompt], [GREEDY_LOGPROBS, SEEDED])
        assert [r.token_ids for r in again] == [r.token_ids for r in reference]
