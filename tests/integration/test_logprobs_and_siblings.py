"""Logprobs through the cluster: the driver API hands each ``Delta`` its tokens' ids and logprobs
and each ``ClusterCompletion`` one logprob per token and (when asked) the prompt's, equal to a
single engine's (a P/D split request's tokens come from its decode worker; a request that asks
for prompt logprobs runs whole on one worker, since a prefill worker samples nothing); the CLI's
JSONL records carry them. Requests that share a placement key (the ``n`` samples of one prompt)
run on one decode worker even where the router would spread them.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from engine.sampling_params import SamplingParams
from tests.integration.conftest import cluster_config, random_prompts

LOGPROBS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=3)
PROMPT_LOGPROBS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=0, prompt_logprobs=2)


def single_engine(config: Any, prompt: list[int], sampling: SamplingParams) -> tuple[list[int], list[Any], Any]:
    """Tokens, logprobs and prompt logprobs of one in-process engine running ``prompt`` alone."""
    from engine.core import EngineCore

    engine = EngineCore(config, threads=1)
    tokens: list[int] = []
    logprobs: list[Any] = []
    prompt_logprobs = None
    try:
        engine.add_request("oracle", prompt, sampling)
        while engine.has_work:
            for out in engine.step():
                tokens += out.new_token_ids
                logprobs += out.logprobs or []
                prompt_logprobs = prompt_logprobs or out.prompt_logprobs
        return tokens, logprobs, prompt_logprobs
    finally:
        engine.close()


def same_logprobs(got: list[Any], want: list[Any]) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        if b is None:
            assert a is None
            continue
        assert (a.token_id, a.rank, [t for t, _ in a.top]) == (b.token_id, b.rank, [t for t, _ in b.top])
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert [v for _, v in a.top] == pytest.approx([v for _, v in b.top], abs=1e-4)


def test_logprobs_reach_deltas_completions_and_jsonl_records(ray_session, tmp_path):
    from cluster.api import Cluster, ClusterCompletion, Delta
    from cluster.jsonl import read_prompts, result_record

    config = cluster_config("tiny", 1, 1, "router.policy=round_robin")  # round robin splits every request
    split_prompt, echo_prompt = random_prompts(61, [90, 70])
    want_tokens, want_logprobs, _ = single_engine(config, split_prompt, LOGPROBS)
    echo_tokens, echo_logprobs, echo_prompt_logprobs = single_engine(config, echo_prompt, PROMPT_LOGPROBS)
    assert len(want_logprobs) == len(want_tokens) and len(echo_prompt_logprobs or []) == len(echo_prompt)

    with Cluster(config) as cluster:

        async def stream(prompt: list[int], sampling: SamplingParams) -> tuple[list[Delta], ClusterCompletion]:
            deltas, final = [], None
            async for item in cluster.stream_completion(prompt, sampling):
                if isinstance(item, Delta):
                    deltas.append(item)
                else:
                    final = item
            assert final is not None
            return deltas, final

        deltas, split = asyncio.run(stream(split_prompt, LOGPROBS))
        assert split.disaggregated and list(split.token_ids) == want_tokens
        assert split.prompt_logprobs is None
        same_logprobs(split.logprobs or [], want_logprobs)
        assert [t for d in deltas for t in d.token_ids] == want_tokens
        assert [lp for d in deltas for lp in d.logprobs] == split.logprobs
        assert all(len(d.logprobs) == len(d.token_ids) for d in deltas)

        _, echo = asyncio.run(stream(echo_prompt, PROMPT_LOGPROBS))
        assert not echo.disaggregated  # the prompt's logprobs come from the worker that computes it
        assert list(echo.token_ids) == echo_tokens
        same_logprobs(echo.logprobs or [], echo_logprobs)
        assert echo.prompt_logprobs is not None and echo.prompt_logprobs[0] is None
        same_logprobs(echo.prompt_logprobs, echo_prompt_logprobs)

        plain = cluster.generate([split_prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
        assert plain[0].logprobs is None and plain[0].prompt_logprobs is None and plain[0].token_ids == want_tokens

        lines = tmp_path / "in.jsonl"
        lines.write_text(
            json.dumps(
                {
                    "id": "with",
                    "prompt": split_prompt,
                    "max_tokens": 12,
                    "temperature": 0,
                    "ignore_eos": True,
                    "logprobs": 3,
                }
            )
            + "\n"
            + json.dumps(
                {
                    "id": "echo",
                    "prompt": echo_prompt,
                    "max_tokens": 4,
                    "temperature": 0,
                    "ignore_eos": True,
                    "logprobs": 0,
                    "prompt_logprobs": 2,
                }
            )
            + "\n"
            + json.dumps(
                {"id": "without", "prompt": split_prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
            )
            + "\n"
        )
        items = read_prompts(lines, SamplingParams())
        completions = cluster.generate([i.prompt for i in items], [i.sampling for i in items])
        records = [json.loads(json.dumps(result_record(i.id, c))) for i, c in zip(items, completions, strict=True)]
        with_lp, echo_record, without = records
        assert [e["token_id"] for e in with_lp["logprobs"]] == with_lp["token_ids"] == want_tokens
        assert [e["logprob"] for e in with_lp["logprobs"]] == pytest.approx(
            [e.logprob for e in want_logprobs], abs=1e-4
        )
        assert all(len(e["top"]) == 3 and e["top"][0][0] == e["token_id"] for e in with_lp["logprobs"])  # greedy
        assert echo_record["prompt_logprobs"][0] is None and len(echo_record["prompt_logprobs"]) == len(echo_prompt)
        assert [e["token_id"] for e in echo_record["prompt_logprobs"][1:]] == echo_prompt[1:]
        assert "logprobs" not in without and "prompt_logprobs" not in without


def test_requests_sharing_a_placement_run_on_one_decode_worker(ray_session):
    """Four concurrent samples of one prompt: round robin spreads them over both decode workers;
    with one ``share_placement`` key they all run where the first was routed (and, greedy, give
    the same tokens). A bad key is refused naming the field."""
    from cluster.api import Cluster

    config = cluster_config("tiny", 1, 2, "router.policy=round_robin")
    (prompt,) = random_prompts(73, [40])
    sampling = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    with Cluster(config) as cluster:

        async def samples(n: int, key: str | None) -> list[Any]:
            runs = [cluster.agenerate(prompt, sampling, share_placement=key) for _ in range(n)]
            return await asyncio.wait_for(asyncio.gather(*runs), 120)

        spread = asyncio.run(samples(4, None))
        assert {r.decode_worker for r in spread} == {"decode-0", "decode-1"}
        for key in ("group-a", "group-b", "group-c"):
            together = asyncio.run(samples(4, key))
            assert len({(r.prefill_worker, r.decode_worker) for r in together}) == 1, key
            assert len({tuple(r.token_ids) for r in together}) == 1
        assert together[0].token_ids == spread[0].token_ids

        with pytest.raises(ValueError, match="share_placement: must be a non-empty string"):
            asyncio.run(cluster.agenerate(prompt, sampling, share_placement=""))


def test_a_request_scoring_its_prompt_is_predicted_no_hit_where_its_prompt_is_cached(ray_session):
    """A request asking for its prompt's logprobs computes every prompt position, so it takes no
    prefix hit; the router (kvfleet's policy, which predicts hits) is told so and predicts none."""
    from cluster.api import Cluster

    config = cluster_config("tiny", 0, 1)
    (prompt,) = random_prompts(62, [90])
    with Cluster(config) as cluster:
        first = cluster.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))[0]
        cached = cluster.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))[0]
        assert first.cached_tokens == 0 and cached.predicted_hit == cached.cached_tokens > 0
        scored = cluster.generate([prompt], PROMPT_LOGPROBS)[0]
        assert scored.prompt_logprobs is not None
        assert scored.cached_tokens == 0 and scored.predicted_hit == 0
