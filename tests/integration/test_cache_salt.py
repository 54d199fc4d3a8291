"""``cache_salt`` through the driver API on a 1P+1D tiny cluster: the driver hashes a prompt's
blocks with its salt (the router predicts with the salted hashes) and both workers hash with it,
so requests share cached blocks only with requests of the same salt; a split request with a salt
decodes the tokens it decodes without one."""

from __future__ import annotations

import pytest

from tests.integration.conftest import GREEDY, cluster_config, oracle_tokens, random_prompts, wait_for


@pytest.fixture(scope="module")
def cluster(ray_session):
    from cluster.api import Cluster

    with Cluster(cluster_config("tiny", 1, 1, "router.work_imbalance_ratio=0")) as c:
        yield c


def _idle(cluster) -> bool:
    workers = cluster.stats()["workers"].values()
    return all(w["free_blocks"] == w["num_blocks"] and w["running"] == 0 and w["queued"] == 0 for w in workers)


@pytest.mark.parametrize("length", [40, 160], ids=["decode-only", "split"])
def test_the_same_salt_shares_cached_blocks_and_another_salt_does_not(cluster, length: int) -> None:
    prompt = random_prompts(900 + length, [length])[0]
    first = cluster.generate([prompt], GREEDY, cache_salt="tenant-a")[0]
    assert first.cached_tokens == 0
    again = cluster.generate([prompt], GREEDY, cache_salt="tenant-a")[0]
    assert again.cached_tokens > 0
    assert again.predicted_hit == again.cached_tokens, (again.route_reason, again.predicted_hit)
    other = cluster.generate([prompt], GREEDY, cache_salt="tenant-b")[0]
    assert other.cached_tokens == 0 and other.predicted_hit == 0, (other.route_reason, other.cached_tokens)
    unsalted = cluster.generate([prompt], GREEDY)[0]
    assert unsalted.cached_tokens == 0 and unsalted.predicted_hit == 0
    assert first.token_ids == again.token_ids == other.token_ids == unsalted.token_ids
    wait_for(lambda: _idle(cluster), 15, "every block back in the pool")


def test_a_split_request_with_a_salt_decodes_the_same_tokens(cluster) -> None:
    prompt = random_prompts(31, [200])[0]
    salted = cluster.generate([prompt], GREEDY, cache_salt="split-salt")[0]
    plain = cluster.generate([prompt], GREEDY)[0]
    assert salted.disaggregated, salted.route_reason
    assert salted.token_ids == plain.token_ids == oracle_tokens(cluster.config, [prompt])[0]


async def _stream(cluster, prompt, salt: str) -> list:
    return [item async for item in cluster.stream_completion(prompt, GREEDY, cache_salt=salt)]


def test_a_checked_prompt_keeps_its_salt_and_stream_takes_one(cluster) -> None:
    import asyncio

    prompt = random_prompts(47, [50])[0]
    checked = cluster.check_prompt(prompt, "checked-salt")
    assert checked.cache_salt == "checked-salt" and checked.text is None
    first = cluster.generate([checked], GREEDY)[0]
    streamed = asyncio.run(_stream(cluster, prompt, "checked-salt"))[-1]
    assert streamed.cached_tokens > 0 and streamed.token_ids == first.token_ids


@pytest.mark.parametrize("salt", ["", 7])
def test_a_bad_salt_is_named(cluster, salt) -> None:
    with pytest.raises(ValueError, match=r"^cache_salt: must be a non-empty string \(got "):
        cluster.generate(["hello"], GREEDY, cache_salt=salt)
    assert _idle(cluster)
