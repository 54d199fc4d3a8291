"""A pin re-established by copying its blocks from a surviving holder over the transfer backend,
and computed again only when no holder has it.

Engine level (two ``EngineCore`` in this process, local transfer): the copied pin's KV pages
(every block a hit at the pin's end needs, in every group, Mamba state included) equal the
holder's byte for byte; the holder's hold is released once the reader is done; a holder that
evicted the prefix exports nothing. Cluster level (3 prefill + 1 decode workers): a holder that
loses the pin is replaced by a worker that copies it from the other holder (its pin log says
``copy`` from that holder); a pin whose only holder loses it is computed on the new one.
"""

from __future__ import annotations

import random

import pytest
import torch

from configs import load_config
from engine.kv_cache.hashing import block_hashes
from engine.sampling_params import SamplingParams
from tests.integration.conftest import cluster_config, random_prompts, wait_for

PIN_TOKENS = 48
ONE = SamplingParams(max_tokens=1, ignore_eos=True)


def _run(engine, request_id: str, tokens: list[int], **kwargs) -> object:
    engine.add_request(request_id, tokens, ONE, **kwargs)
    for _ in range(1000):
        for result in engine.step():
            if result.request_id == request_id and result.finished:
                return result
    raise AssertionError(f"{request_id} did not finish")


def _needed_pages(engine, hashes: list[bytes], length: int) -> list[tuple[int, int, int]]:
    """(group, table index, block id) of every block a hit at ``length`` needs, per group."""
    hit = engine.coordinator.find_longest_cache_hit(hashes, length)
    assert hit.num_tokens == length
    return [
        (g, i, hit.blocks[g][i].block_id)
        for g, manager in enumerate(engine.coordinator.managers)
        for i in manager.blocks_needed_at(length)
    ]


@pytest.mark.parametrize("preset", ["tiny", "tiny-hybrid"])
def test_copied_pin_has_the_holders_bytes_and_the_hold_is_released(preset):
    from engine.core import EngineCore

    config = load_config(preset, ["transfer.backend=local"])
    holder = EngineCore(config, threads=1, name=f"holder-{preset}", kv_role="both")
    target = EngineCore(config, threads=1, name=f"target-{preset}", kv_role="both")
    try:
        prefix = [random.Random(5).randrange(3, 250) for _ in range(PIN_TOKENS)]
        hashes = block_hashes(prefix, holder.coordinator.hash_block_size)
        _run(holder, "warm", [*prefix, 9])
        assert holder.worker_view.pin_prefix(hashes, PIN_TOKENS) == PIN_TOKENS

        handle = holder.export_prefix("copy-1", prefix)
        assert handle is not None and handle.num_tokens == PIN_TOKENS
        assert len(holder.worker_view.held) == 1, "the holder holds the prefix's blocks for the copy"
        _run(target, "copy-1", [*prefix, 0], kv_handle=handle)
        assert target.worker_view.transfer_stats.reads == 1 and target.worker_view.transfer_stats.failures == 0
        assert target.worker_view.transfer_stats.blocks > 0
        for _ in range(50):  # the holder sees the reader's notification and releases its hold
            holder.step()
            if not holder.worker_view.held:
                break
        assert not holder.worker_view.held and not holder.scheduler.held
        assert holder.worker_view.transfer_stats.released_by_notification == 1
        assert target.worker_view.pin_prefix(hashes, PIN_TOKENS) == PIN_TOKENS

        theirs = _needed_pages(holder, hashes, PIN_TOKENS)
        ours = _needed_pages(target, hashes, PIN_TOKENS)
        assert [(g, i) for g, i, _ in theirs] == [(g, i) for g, i, _ in ours]
        groups = holder.layout.groups
        compared = 0
        for (g, _, a), (_, _, b) in zip(theirs, ours, strict=False):
            for s, tensor in enumerate(holder.runner.slots):
                if holder.layout.slot_pool[s] != groups[g].pool:
                    continue
                assert torch.equal(tensor[a], target.runner.slots[s][b]), f"group {g} block {a}->{b} slot {s}"
                assert tensor[a].abs().sum() > 0, "a page of a computed prefix is not all zeros"
                compared += 1
        assert compared >= len(theirs)

        # A holder that no longer caches the prefix exports nothing (the reader computes it).
        other = [random.Random(6).randrange(3, 250) for _ in range(PIN_TOKENS)]
        assert holder.export_prefix("copy-2", other) is None
        assert not holder.worker_view.held
        holder.coordinator.check_invariants()
        target.coordinator.check_invariants()
    finally:
        holder.close()
        target.close()


@pytest.fixture(scope="module")
def cluster(ray_session):
    from cluster.api import Cluster

    config = cluster_config("tiny", 3, 1, "kv_cache.pinning.budget_blocks=32")
    with Cluster(config) as c:
        yield c


def _pin(cluster, pin_id: int) -> dict:
    return next(p for p in cluster.pins() if p["pin_id"] == pin_id)


def _log(cluster, worker_id: str, pin_id: int) -> list[dict]:
    import ray

    return [r for r in ray.get(cluster.workers[worker_id].pin_log.remote()) if r["pin_id"] == pin_id]


def _lose(cluster, worker_id: str, prefix: list[int]) -> None:
    """Take the pin away on ``worker_id`` (as memory pressure would): the router sees it go."""
    from engine.kv_cache.spec import hash_block_size

    size = hash_block_size(list(next(iter(cluster.infos.values())).groups))
    cluster.workers[worker_id].unpin.remote(block_hashes(prefix, size), len(prefix))


def test_lost_holder_is_replaced_by_a_copy_from_the_survivor(cluster):
    prefix = random_prompts(81, [PIN_TOKENS])[0]
    pin_id = cluster.pin_prefix(prefix, replicas=2)
    wait_for(lambda: len(_pin(cluster, pin_id)["active"]) == 2, 60, "both holders")
    first = sorted(_pin(cluster, pin_id)["active"])
    for worker in first:
        assert [r["method"] for r in _log(cluster, worker, pin_id)] == ["compute"]
    lost, survivor = first
    _lose(cluster, lost, prefix)
    wait_for(
        lambda: lost not in _pin(cluster, pin_id)["active"] and len(_pin(cluster, pin_id)["active"]) == 2,
        60,
        "a new holder",
    )
    (new,) = set(_pin(cluster, pin_id)["active"]) - {survivor}
    (record,) = _log(cluster, new, pin_id)
    assert record["method"] == "copy" and record["source"] == survivor, record
    assert record["pinned"] == PIN_TOKENS
    stats = cluster.stats()["workers"]
    assert stats[new]["transfer"]["reads"] >= 1 and stats[new]["transfer"]["failures"] == 0
    # The pinned prefix serves a request (past the decode-only threshold, so a prefill worker
    # holding the pin prefills it) with the hit the router predicted.
    tail = random_prompts(82, [40])[0]
    done = cluster.generate([prefix + tail], SamplingParams(max_tokens=4, ignore_eos=True))[0]
    assert done.prefill_worker in (new, survivor), done
    assert done.cached_tokens == done.predicted_hit == PIN_TOKENS
    assert cluster.unpin(pin_id)


def test_pin_without_a_surviving_holder_is_computed_again(cluster):
    prefix = random_prompts(83, [PIN_TOKENS])[0]
    pin_id = cluster.pin_prefix(prefix, replicas=1)
    wait_for(lambda: len(_pin(cluster, pin_id)["active"]) == 1, 60, "the holder")
    (only,) = _pin(cluster, pin_id)["active"]
    _lose(cluster, only, prefix)
    wait_for(lambda: _pin(cluster, pin_id)["active"] not in ([], [only]), 60, "a new holder")
    (new,) = _pin(cluster, pin_id)["active"]
    (record,) = _log(cluster, new, pin_id)
    assert record["method"] == "compute" and record["source"] is None, record
    assert record["pinned"] == PIN_TOKENS
    assert cluster.unpin(pin_id)
