"""Predicted hit == the worker coordinator's actual hit, for every hybrid group mix.

Workers run real ``HybridCoordinator``s driven like the engine drives them (admission with the
local hit, aligned prefill chunks, window drops, frees, retention pins, explicit pins, eviction
under a small pool); their KV events are the index's only input.
"""

from __future__ import annotations

import random

import pytest

import engine.routing.index as index_module
from engine.kv_cache.hashing import block_hashes
from engine.kv_cache.spec import FullAttentionSpec, MambaSpec, SlidingWindowSpec
from engine.routing import PrefixTreePolicy, RouteRequest, RoutingPolicy
from tests.routing.helpers import (
    CONFIGS,
    Worker,
    groups_of,
    router_config,
    sync,
    tokens,
)


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("seed", [0, 1])
def test_prediction_equals_coordinator_hit(name: str, seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Holders below their full-attention depth are resolved by the coordinator's fixed point on
    the index's view of their cache (``PrefixIndex.hit``); that path must be exercised and exact."""
    resolved = []
    real_hit = index_module.PrefixIndex.hit
    monkeypatch.setattr(index_module.PrefixIndex, "hit", lambda self, *a: resolved.append(1) or real_hit(self, *a))
    specs = CONFIGS[name]
    rng = random.Random(seed)
    workers = {f"w{i}": Worker(f"w{i}", specs, rng.choice([24, 40, 64])) for i in range(4)}
    policy = RoutingPolicy(groups_of(specs), router_config(seed=seed))
    for w in workers:
        policy.add_worker(w)
    prefixes = [tokens(rng, rng.randrange(4, 48), vocab=6) for _ in range(6)]
    hbs = policy.rules.hash_block_size
    checked = nonzero = 0
    for _ in range(250):
        worker = workers[rng.choice(sorted(workers))]
        op = rng.random()
        if op < 0.55:
            worker.run(rng.choice(prefixes) + tokens(rng, rng.randrange(1, 12), vocab=6))
        elif op < 0.85:
            worker.finish(rng=rng)
        elif op < 0.93:
            prefix = rng.choice(prefixes)
            worker.coord.pin_prefix(block_hashes(prefix, hbs), len(prefix))
        else:
            prefix = rng.choice(prefixes)
            worker.coord.unpin_prefix(block_hashes(prefix, hbs), len(prefix))
        assert sync(policy, workers) == []
        query = rng.choice(prefixes) + tokens(rng, rng.randrange(0, 6), vocab=6)
        hashes = block_hashes(query, hbs)
        for remote in (False, True):
            predicted = policy.index.predict(hashes, len(query) - 1, skip_mamba=remote)
            for n, w in workers.items():
                actual = w.actual_hit(query, remote)
                assert predicted.get(n, 0) == actual, (n, remote, query)
                assert policy.index.hit(n, hashes, len(query) - 1, remote) == actual  # reference path
                checked += 1
                nonzero += actual > 0
    assert nonzero > checked // 10  # the workload does produce hits
    assert len(resolved) > checked  # step 3 ran besides the reference calls (one per check)


def test_sliding_window_evicted_lowers_the_prediction() -> None:
    """The full-attention prefix is cached but the window at its end was evicted: no false hit."""
    specs = [FullAttentionSpec(4), SlidingWindowSpec(4, window=9)]
    worker = Worker("w", specs, 64, retention=False)
    policy = RoutingPolicy(groups_of(specs))
    policy.add_worker("w")
    prefix = list(range(40))
    worker.run([*prefix, 99])
    worker.finish_all()
    sync(policy, {"w": worker})
    query = [*prefix, 7, 7]
    hashes = block_hashes(query, 4)
    assert policy.index.predict(hashes, len(query) - 1) == {"w": 40}
    # Evict the window blocks ending at 40 (indices 8, 9), keep all full-attention blocks.
    pool = worker.coord.pool
    window = [pool.cached[1][hashes[i]] for i in (8, 9)]
    pool.evict(window)
    sync(policy, {"w": worker})
    assert worker.actual_hit(query) == 32
    assert policy.index.predict(hashes, len(query) - 1) == {"w": 32}


def test_missing_mamba_state_lowers_the_prediction_but_not_for_remote_prefill() -> None:
    specs = [FullAttentionSpec(4), MambaSpec(4)]
    worker = Worker("w", specs, 64, retention=False)
    policy = RoutingPolicy(groups_of(specs))
    policy.add_worker("w")
    prefix = list(range(24))
    worker.run([*prefix, 5])
    worker.finish_all()
    sync(policy, {"w": worker})
    query = [*prefix, 1, 2, 3]
    hashes = block_hashes(query, 4)
    pool = worker.coord.pool
    pool.evict([pool.cached[1][hashes[5]]])  # the state after 24 tokens
    sync(policy, {"w": worker})
    full, remote = worker.actual_hit(query), worker.actual_hit(query, remote=True)
    assert (full, remote) == (0, 24)  # only the checkpoint at 24 was cached (aligned chunking)
    assert policy.index.predict(hashes, len(query) - 1).get("w", 0) == full
    assert policy.index.predict(hashes, len(query) - 1, skip_mamba=True).get("w", 0) == remote


def test_approximate_tree_believes_hits_the_worker_does_not_have() -> None:
    """The history-based baseline predicts the full prefix where the window was never kept."""
    specs = [FullAttentionSpec(4), SlidingWindowSpec(4, window=9)]
    worker = Worker("w", specs, 20, retention=False)
    tree = PrefixTreePolicy(groups_of(specs))
    tree.add_worker("w")
    policy = RoutingPolicy(groups_of(specs))
    policy.add_worker("w")
    rng = random.Random(0)
    prefix = list(range(40))
    first = [*prefix, 1]
    tree.route(RouteRequest("a", block_hashes(first, 4), len(first)))
    worker.run(first)
    worker.finish_all()
    for _ in range(3):  # other traffic reuses the freed window blocks first
        worker.run([*tokens(rng, 12, vocab=1000), 1])
        worker.finish_all()
    sync(policy, {"w": worker})
    query = [*prefix, 2, 3]
    request = RouteRequest("b", block_hashes(query, 4), len(query))
    actual = worker.actual_hit(query)
    assert tree.route(request).predicted_hit == 40 != actual
    assert policy.route(request).predicted_hit == actual


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_disaggregated_prediction_equals_the_prefill_only_lookup(name: str) -> None:
    """A prefill-only request carries the prompt's first N - 1 tokens, so the prefill engine looks
    up at most N - 2 of them; the router's predicted prefill hit must be that lookup, also when
    the whole prompt is cached there (where the N - 1 bound would over-predict)."""
    specs = CONFIGS[name]
    rng = random.Random(5)
    workers = {"p0": Worker("p0", specs, 96), "d0": Worker("d0", specs, 96)}
    policy = RoutingPolicy(groups_of(specs), router_config(decode_only_threshold_tokens=1))
    policy.add_worker("p0", role="prefill")
    policy.add_worker("d0", role="decode")
    hbs = policy.rules.hash_block_size
    over = 0
    for n in (17, 24, 25, 33, 40, 49):  # aligned and unaligned N - 1
        prompt = tokens(rng, n, vocab=50)
        assert workers["p0"].run([*prompt, 1]) is not None  # the whole prompt is cached on p0
        workers["p0"].finish_all()
        sync(policy, workers)
        decision = policy.route(RouteRequest(f"r{n}", block_hashes(prompt, hbs), n))
        assert decision.prefill_worker == "p0"
        actual = workers["p0"].actual_hit(prompt[:-1])  # what the prefill-only request finds
        assert decision.predicted_hit == actual, (n, decision.predicted_hit, actual)
        over += policy.index.hit("p0", block_hashes(prompt, hbs), n - 1) > actual
    assert over > 0  # the case the N - 1 bound gets wrong does occur
