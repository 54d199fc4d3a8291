"""The cluster end to end on a local Ray: 1P+1D and 2P+2D, tiny Gemma3 (sliding window + full)
and tiny Bamba (Mamba2 hybrid), the in-process transfer backend.

Oracles: the greedy tokens of one in-process engine on the same config; the router's predicted
hit against the hit the worker's coordinator reports; every worker's free-block count at rest.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from configs import ConfigError
from engine.sampling_params import SamplingParams
from tests.integration.conftest import GREEDY, cluster_config, oracle_tokens, random_prompts, wait_for

SHAPES = [("tiny", 1, 1), ("tiny-hybrid", 1, 1), ("tiny", 2, 2), ("tiny-hybrid", 2, 2)]
# 1 token (cannot be split), short (prefilled on the decode worker), long (prefill -> transfer -> decode)
LENGTHS = [1, 7, 30, 65, 90, 133, 47, 200]


@pytest.fixture(scope="module", params=SHAPES, ids=lambda s: f"{s[0]}-{s[1]}P{s[2]}D")
def cluster(request, ray_session):
    from cluster.api import Cluster

    preset, num_prefill, num_decode = request.param
    # the work guard (spread a prefix whose holder took more than its share of recent work) has its
    # own tests; here it would make placement depend on which tests ran before
    with Cluster(cluster_config(preset, num_prefill, num_decode, "router.work_imbalance_ratio=0")) as c:
        yield c


def all_free(cluster) -> bool:
    stats = cluster.stats()["workers"]
    return all(w["free_blocks"] == w["num_blocks"] and w["running"] == 0 and w["queued"] == 0 for w in stats.values())


def test_greedy_tokens_equal_a_single_engine(cluster):
    prompts = random_prompts(11, LENGTHS)
    expected = oracle_tokens(cluster.config, prompts)
    results = cluster.generate(prompts, GREEDY)
    assert [r.token_ids for r in results] == expected
    assert all(r.finish_reason == "length" for r in results)
    split = [r for r in results if r.disaggregated]
    assert {len(r.prompt_token_ids) for r in split} >= {90, 133, 200}, "long prompts go through a prefill worker"
    assert all(len(r.prompt_token_ids) >= 2 for r in split), "a 1-token prompt cannot be split"
    assert all(r.prefill_worker.startswith("prefill") for r in split)
    assert all(r.decode_worker.startswith("decode") for r in results)
    wait_for(lambda: all_free(cluster), 15, "every block back in the pool")


def test_prefix_request_lands_on_its_holder_with_the_predicted_hit(cluster):
    base = random_prompts(21, [120])[0]
    first = cluster.generate([base], GREEDY)[0]
    holders = {first.prefill_worker, first.decode_worker}
    # short new tail: the decode worker that pulled the prefix may serve it without a transfer, if
    # what it pulled serves that hit (a sliding window or Mamba state at token 100 it may lack)
    short = cluster.generate([base[:100] + random_prompts(22, [12])[0]], GREEDY)[0]
    # long new tail: a prefill worker is needed; the one holding the prefix gets it
    long = cluster.generate([base[:100] + random_prompts(23, [80])[0]], GREEDY)[0]
    for result in (short, long):
        assert result.prefill_worker in holders, (result.prefill_worker, holders)
        assert result.predicted_hit == result.cached_tokens, (result.route_reason, result.predicted_hit)
        # 100 shared tokens: 100 where every group serves it; a Mamba group has states only at
        # its checkpoints (prefill chunk ends, every 64 tokens here), so 64 on tiny Bamba
        assert result.cached_tokens >= 64, result.cached_tokens
    assert short.disaggregated or short.decode_worker == first.decode_worker
    assert long.disaggregated and long.prefill_worker == first.prefill_worker
    expected = oracle_tokens(cluster.config, [list(short.prompt_token_ids), list(long.prompt_token_ids)])
    assert [short.token_ids, long.token_ids] == expected
    # the whole prompt again, predicted exactly wherever it runs
    same = cluster.generate([base], GREEDY)[0]
    assert same.predicted_hit == same.cached_tokens, (same.route_reason, same.predicted_hit, same.cached_tokens)
    assert same.token_ids == first.token_ids


@pytest.mark.parametrize("preset", ["tiny", "tiny-hybrid"])
def test_a_fully_cached_prompt_split_anyway_is_predicted_exactly(ray_session, preset):
    """Every request through the prefill worker (threshold 0): a prompt it computed before is
    fully cached there, and its prefill-only lookup stops two tokens short of the prompt (it
    computes N - 1 tokens); the router must predict that bound, not the N - 1 one."""
    from cluster.api import Cluster

    prompts = random_prompts(51, [64, 97, 128, 145])
    config = cluster_config(preset, 1, 1, "router.decode_only_threshold_tokens=0")
    with Cluster(config) as c:
        first = c.generate(prompts, GREEDY)
        again = c.generate(prompts, GREEDY)
        assert all(r.disaggregated for r in first + again)
        for r in again:
            assert r.predicted_hit == r.cached_tokens, (len(r.prompt_token_ids), r.predicted_hit, r.cached_tokens)
            assert r.cached_tokens <= len(r.prompt_token_ids) - 2
        assert max(r.cached_tokens for r in again) >= 64
        assert [r.token_ids for r in again] == [r.token_ids for r in first] == oracle_tokens(config, prompts)
        wait_for(lambda: all_free(c), 15, "every block back in the pool")


def test_stream_yields_the_same_text_as_generate(cluster):
    prompt = random_prompts(31, [70])[0]
    sampling = SamplingParams(max_tokens=12, ignore_eos=True)

    async def collect() -> list[str]:
        return [delta async for delta in cluster.stream(prompt, sampling)]

    deltas = asyncio.run(collect())
    whole = cluster.generate([prompt], sampling)[0]
    assert "".join(deltas) == whole.text


def test_aborts_free_every_block(cluster):
    prompts = random_prompts(41, [5, 20, 80, 150])
    sampling = SamplingParams(max_tokens=300, ignore_eos=True)
    ids = [f"abort-{i}" for i in range(len(prompts))]
    results: list = []
    runner = threading.Thread(target=lambda: results.extend(cluster.generate(prompts, sampling, request_ids=ids)))
    runner.start()
    wait_for(lambda: all(rid in cluster._in_flight for rid in ids), 10, "requests in flight")

    def decoding() -> bool:
        return sum(w["running"] for w in cluster.stats()["workers"].values()) > 0

    wait_for(decoding, 10, "some requests decoding (others may still be in prefill or transfer)", 0.005)
    for rid in ids:
        assert cluster.abort(rid)
    runner.join(30)
    assert not runner.is_alive()
    assert [r.finish_reason for r in results] == ["abort"] * len(prompts)
    assert all(len(r.token_ids) < 300 for r in results)
    assert not cluster.abort("no-such-request")
    # an abort that overtakes its request (it reaches the workers first) still ends it
    import ray

    ray.get([w.abort.remote("overtaken") for w in cluster.workers.values()])
    (late,) = cluster.generate([prompts[3]], GREEDY, request_ids=["overtaken"])
    assert late.finish_reason == "abort" and late.token_ids == []
    wait_for(lambda: all_free(cluster), 15, "free blocks back to baseline on every worker")
    # and it keeps serving
    again = cluster.generate(prompts[:2], GREEDY)
    assert [r.token_ids for r in again] == oracle_tokens(cluster.config, prompts[:2])


def test_bad_inputs_get_clear_errors_and_the_cluster_keeps_serving(cluster):
    too_long = [5] * cluster.max_model_len
    with pytest.raises(ValueError, match=r"prompt: must not be empty"):
        cluster.generate([""], GREEDY)
    with pytest.raises(ValueError, match=r"prompt: must not be empty"):
        cluster.generate([[]], GREEDY)
    with pytest.raises(ValueError, match=rf"prompt: {len(too_long)} tokens .*max_model_len={cluster.max_model_len}"):
        cluster.generate([too_long], GREEDY)
    with pytest.raises(ValueError, match=r"max_tokens: must be >= 1 \(got 0\)"):
        cluster.generate(["hello"], {"max_tokens": 0})
    with pytest.raises(ValueError, match=r"max_tokens: must be >= 1 \(got -3\)"):
        cluster.generate(["hello"], {"max_tokens": -3})
    with pytest.raises(ValueError, match=r"prompt: token id 999 is outside the vocabulary \[0, 256\)"):
        cluster.generate([[1, 2, 999]], GREEDY)
    with pytest.raises(ValueError, match=r"prompt: must not be empty"):  # one bad prompt: nothing runs
        cluster.generate(["fine", ""], GREEDY)
    prompt = random_prompts(51, [70])[0]
    assert cluster.generate([prompt], GREEDY)[0].token_ids == oracle_tokens(cluster.config, [prompt])[0]
    assert all_free(cluster) or wait_for(lambda: all_free(cluster), 15, "idle") is None


def test_stats_report_every_worker(cluster):
    stats = cluster.stats()
    config = cluster.config.workers
    assert len(stats["workers"]) == config.num_prefill + config.num_decode
    for worker in stats["workers"].values():
        assert set(worker) >= {"running", "queued", "free_blocks", "num_blocks", "hit_rate", "pinned_blocks"}
        assert 0.0 <= worker["hit_rate"] <= 1.0
        assert worker["capacity_tokens"] > 0 and worker["kv_pools"][0]["kind"] == "attention"
    totals = stats["totals"]
    assert totals["capacity_tokens"] == sum(w["capacity_tokens"] for w in stats["workers"].values())
    assert totals["num_blocks"] == sum(w["num_blocks"] for w in stats["workers"].values())
    assert stats["router"]["routed"] > 0


def test_unknown_preset_and_bad_override_are_config_errors(ray_session):
    from cluster.api import Cluster

    with pytest.raises(ConfigError, match=r"config: unknown preset 'no-such-preset'"):
        Cluster("no-such-preset")
    with pytest.raises(ConfigError, match=r"workers.num_decode: must be >= 1 \(got 0\)"):
        Cluster("tiny", ["workers.num_decode=0"])
    with pytest.raises(ConfigError, match=r"expected dotted.key=value"):
        Cluster("tiny", ["workers.num_decode"])
