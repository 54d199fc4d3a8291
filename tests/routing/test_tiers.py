"""Prediction per tier: workers with a host tier (``kv_cache.offload``), driven through evictions
(offloads), host LRU drops and promotes, feed the router only their KV events; the index's
predicted (hit tokens, host tokens) must equal what each worker's coordinator then serves, for
every group mix (sliding windows, Mamba, chunked local), the remote-prefill rule included.

Oracles: the worker's real ``HybridCoordinator`` (``get_computed_blocks`` and its hit's host
blocks, ``host_hit_tokens``), what an admission then actually took, and the coordinator's own
device and host maps (the index's per-tier tables must equal them after every sync).
"""

from __future__ import annotations

import random

import pytest

from engine.kv_cache.events import BlockDropped, BlockOffloaded, BlockPromoted, BlockRemoved, BlockStored
from engine.kv_cache.hashing import block_hashes
from engine.kv_cache.spec import FullAttentionSpec
from engine.routing import PrefixIndex, RouteRequest, RoutingPolicy, WorkerLoad, snapshot_coordinator
from engine.routing.index import WorkerId
from engine.routing.types import RequestSnapshot
from tests.routing.helpers import CONFIGS, Worker, execute, groups_of, router_config, sync, tokens


def predict_tiers(
    index: PrefixIndex, hashes: list[bytes], max_length: int, remote: bool = False
) -> tuple[dict[WorkerId, int], dict[WorkerId, int]]:
    host: dict[WorkerId, int] = {}
    hits, pending, _ = index.predict_partial(hashes, max_length, remote, host=host)
    if pending is not None:
        index.resolve(pending, hits)
    return hits, host


def coordinator_tables(worker: Worker) -> tuple[list[set[bytes]], list[set[bytes]]]:
    coord = worker.coord
    device = [set(m.cached) for m in coord.managers]
    host = coord.host
    hosted = [set(host.pools[coord.group_pool[g]].cached[g]) if host else set() for g in range(len(device))]
    return device, hosted


def check_tables(index: PrefixIndex, workers: dict[str, Worker]) -> None:
    for name, worker in workers.items():
        device, hosted = coordinator_tables(worker)
        assert [set(t) for t in index.tables(name)] == device, name
        assert [set(t) for t in index.host_tables(name)] == hosted, name


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("seed", [0, 1])
def test_predicted_hit_per_tier_equals_what_the_worker_serves(name: str, seed: int) -> None:
    specs = CONFIGS[name]
    rng = random.Random(seed)
    workers = {
        f"t{i}": Worker(f"t{i}", specs, rng.choice([20, 28, 40]), host_blocks=rng.choice([24, 48, 96]))
        for i in range(3)
    }
    workers["plain"] = Worker("plain", specs, 40)
    policy = RoutingPolicy(groups_of(specs), router_config(seed=seed))
    for w in workers:
        policy.add_worker(w)
    index = policy.index
    prefixes = [tokens(rng, rng.randrange(4, 48), vocab=6) for _ in range(8)]
    hbs = policy.rules.hash_block_size
    checked = host_hits = beyond_device = served = served_host = 0
    for _ in range(220):
        name_ = rng.choice(sorted(workers))
        worker = workers[name_]
        op = rng.random()
        if op < 0.55:
            query = rng.choice(prefixes) + tokens(rng, rng.randrange(1, 12), vocab=6)
            hits, host = predict_tiers(index, block_hashes(query, hbs), len(query) - 1)
            if worker.run(query) is not None:  # what the admission took: predicted exactly
                assert worker.last_hit == (hits.get(name_, 0), host.get(name_, 0)), (name_, query)
                served += 1
                served_host += worker.last_hit[1] > 0
        elif op < 0.85:
            worker.finish(rng=rng)
        elif op < 0.93:
            prefix = rng.choice(prefixes)
            worker.coord.pin_prefix(block_hashes(prefix, hbs), len(prefix))
        else:
            prefix = rng.choice(prefixes)
            worker.coord.unpin_prefix(block_hashes(prefix, hbs), len(prefix))
        assert sync(policy, workers) == []
        check_tables(index, workers)
        query = rng.choice(prefixes) + tokens(rng, rng.randrange(0, 6), vocab=6)
        hashes = block_hashes(query, hbs)
        for remote in (False, True):
            hits, host = predict_tiers(index, hashes, len(query) - 1, remote)
            for n, w in workers.items():
                actual = w.actual_tiers(query, remote)
                assert (hits.get(n, 0), host.get(n, 0)) == actual, (n, remote, query)
                reference = index.tiered_hit(n, hashes, len(query) - 1, remote)
                assert (reference.tokens, reference.host_tokens) == actual
                assert index.hit(n, hashes, len(query) - 1, remote) == actual[0]
                checked += 1
                host_hits += actual[1] > 0
                device_only = w.coord.find_longest_cache_hit(hashes, len(query) - 1, remote, include_host=False)
                beyond_device += actual[0] > device_only.num_tokens
    assert host_hits > checked // 20  # the workload does hit in the host tier
    assert beyond_device > 0  # and there the device maps alone would under-predict
    assert served > 30 and served_host > 0


def test_events_say_offloaded_promoted_and_dropped_and_a_resync_is_exact() -> None:
    specs = [FullAttentionSpec(4)]
    worker = Worker("w", specs, 12, retention=False, host_blocks=12)
    policy = RoutingPolicy(groups_of(specs))
    policy.add_worker("w")
    rng = random.Random(2)
    prompts = [tokens(rng, 21, vocab=1000) for _ in range(5)]
    for prompt in prompts:  # each evicts the one before it from the device, then from the host
        worker.run(prompt)
        worker.finish_all()
    events = worker.coord.take_events()
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    kinds = {type(e) for e in events}
    assert {BlockStored, BlockRemoved, BlockOffloaded, BlockDropped} <= kinds
    policy.apply_events("w", events)
    check_tables(policy.index, {"w": worker})
    # a prompt in the host tier comes back: a promote, the host keeps its copy
    back = next(p for p in prompts if worker.actual_tiers(p)[1] > 0)
    worker.run(back)
    promoted = [e for e in worker.coord.take_events() if isinstance(e, BlockPromoted)]
    assert promoted and all(isinstance(e, BlockStored) for e in promoted)
    worker.finish_all()
    # a gap: the router misses these events and resyncs from a snapshot that has both tiers
    worker.run(prompts[0])
    worker.finish_all()
    worker.coord.take_events()
    worker.run(prompts[1])
    actions = sync(policy, {"w": worker})
    assert actions == [RequestSnapshot("w")]
    execute(policy, {"w": worker}, actions)
    assert snapshot_coordinator(worker.coord).host[0]
    check_tables(policy.index, {"w": worker})
    worker.finish_all()
    assert sync(policy, {"w": worker}) == []
    check_tables(policy.index, {"w": worker})


def test_a_host_tier_hit_is_priced_as_load_time() -> None:
    """A device hit beats the same hit in the host tier, which beats a miss; the host hit costs
    the worker's reported promote time, at most a miss."""
    specs = [FullAttentionSpec(4)]
    rng = random.Random(4)
    prefix = tokens(rng, 32, vocab=1000)
    device = Worker("device", specs, 40, host_blocks=40)
    hosted = Worker("hosted", specs, 12, host_blocks=40)
    workers = {"device": device, "hosted": hosted, "none": Worker("none", specs, 40)}
    for worker in (device, hosted):
        worker.run([*prefix, 1])
        worker.finish_all()
    for _ in range(2):  # other prompts push the prefix out of hosted's device into its host tier
        hosted.run(tokens(rng, 33, vocab=1000))
        hosted.finish_all()
    policy = RoutingPolicy(groups_of(specs), router_config(work_imbalance_ratio=0))
    for name in workers:
        policy.add_worker(name)
    sync(policy, workers)
    query = [*prefix, 7, 7]
    request = RouteRequest("q", block_hashes(query, 4), len(query))
    assert hosted.actual_tiers(query) == (32, 32) and device.actual_tiers(query) == (32, 0)
    policy.update_load("hosted", WorkerLoad(promote_s_per_token=1e-5))
    assert policy.book.promote_load("hosted") == pytest.approx(20000 * 1e-5 / policy.w_miss)
    assert policy.route(request).prefill_worker == "device"
    policy.remove_worker("device")
    decision = policy.route(RouteRequest("q2", request.block_hashes, len(query)))
    assert (decision.prefill_worker, decision.predicted_hit, decision.predicted_host_hit) == ("hosted", 32, 32)
    hosted.run(query)
    assert hosted.last_hit == (32, 32)
    policy.update_load("hosted", WorkerLoad(promote_s_per_token=10.0))
    assert policy.book.promote_load("hosted") == 1.0  # never above a recompute
