"""P/D between two workers split over two tensor-parallel ranks each (engine/rank_group.py,
engine/transfer/ranked.py): a prefill group and a decode group, four processes over gloo on
loopback, KV moved by the local (same-host) transfer backend, rank r of the decode worker reading
its own shard from rank r of the prefill worker.

Oracles: the greedy tokens of one single-rank engine that runs each whole request; the block
count each read must move, from the per-group rule of tests/engine/test_pd.py (``expected_blocks``:
full attention the blocks the decode side did not hit, sliding window those inside the window,
Mamba one state block), on rank 0 per request and on rank 1 in total; with a prefix cached on the
decode side, fewer blocks move on every rank; the prefill worker frees every held block (its
rank 0 is notified only once both ranks read).
"""

from __future__ import annotations

import functools
import queue
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from configs import load_config
from engine.core import EngineCore
from engine.model.checkpoints.tiny import build_tiny_checkpoint
from engine.rank_group import follow_leader, lead_ranks
from engine.sampling_params import SamplingParams
from engine.transfer.ranked import FollowerReads
from kvfleet_testing.tp_ranks import run_groups
from tests.engine.test_pd import expected_blocks, prompts, reference_tokens, run_to_end

SIZE = 2
TIMEOUT_S = 120
PRESETS = {"tiny": "tiny-gemma3", "tiny-hybrid": "tiny-bamba"}
#: a handle must stay readable however slowly this loaded machine runs the other group
SETTINGS = ("transfer.backend=local", "transfer.release_timeout_s=300", "model.cuda_graphs=false")
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _requests() -> tuple[list[int], list[int], list[int]]:
    """A fresh prompt, a prefix of 32 tokens and a suffix that follows it."""
    fresh, shared, suffix = prompts(5, [37, 32, 13])
    return fresh, shared, suffix


def _engine(preset: str, directory: str, rank: int, role: str) -> EngineCore:
    overrides = [f"model.source={directory}", f"workers.tensor_parallel_size={SIZE}", *SETTINGS]
    config = load_config(preset, overrides)
    return EngineCore(config, threads=1, name=role, kv_role=role, tensor_parallel_rank=rank)  # type: ignore[arg-type]


def _follow(engine: EngineCore, rank: int) -> dict[str, int]:
    assert engine.transfer is not None
    reads = FollowerReads(engine.transfer, rank)
    try:
        follow_leader(engine.runner, reads=reads)
    finally:
        engine.close()
    return {"reads": reads.reads_done, "blocks": reads.blocks, "bytes": reads.bytes}


def _prefill(models: dict[str, str], commands: queue.Queue, handles: queue.Queue, rank: int, size: int) -> dict:
    """The prefill worker: prefill what the decode worker asks, until it says stop; rank 0 then
    waits until every held block was released."""
    out: dict[str, dict] = {}
    for preset, directory in models.items():
        engine = _engine(preset, directory, rank, "prefill")
        if rank:
            out[preset] = _follow(engine, rank)
            continue
        leader = lead_ranks(engine.runner, engine.handoff)
        try:
            baseline = engine.coordinator.num_free_blocks
            while (command := commands.get(timeout=TIMEOUT_S))[0] != "stop":
                _, request_id, prompt = command
                engine.add_request(request_id, prompt, SamplingParams(max_tokens=1), prefill_only=True)
                (result,) = [r for r in run_until_finished(engine, request_id) if r.request_id == request_id]
                handles.put(result.kv_handle)
            assert engine.handoff is not None
            while engine.handoff.held:  # the decode worker's notifications free them
                engine.step()
            out[preset] = {"free": engine.coordinator.num_free_blocks, "baseline": baseline}
        finally:
            leader.stop()
            engine.close()
    return out


def run_until_finished(engine: EngineCore, request_id: str) -> list:
    finished = []
    while not finished:
        finished = [r for r in engine.step() if r.request_id == request_id and r.finished]
    return finished


def _decode(models: dict[str, str], commands: queue.Queue, handles: queue.Queue, rank: int, size: int) -> dict:
    """The decode worker: a fresh prompt pulled whole, then a prompt whose first 32 tokens it
    computed itself before (a local hit), each generated greedily on the pulled KV."""
    out: dict[str, dict] = {}
    for preset, directory in models.items():
        engine = _engine(preset, directory, rank, "decode")
        if rank:
            out[preset] = _follow(engine, rank)
            continue
        leader = lead_ranks(engine.runner, engine.handoff)
        handoff = engine.handoff
        assert handoff is not None
        found: dict[str, object] = {"tokens": {}, "blocks": {}}
        try:
            fresh, shared, suffix = _requests()
            engine.add_request("warm", [*shared, 7], SamplingParams(max_tokens=1))
            run_to_end(engine, {"warm"})
            for request_id, prompt in (("fresh", fresh), ("hit", shared + suffix)):
                commands.put(("prefill", f"{preset}-{request_id}", prompt))
                handle = handles.get(timeout=TIMEOUT_S)
                assert handle.agent.tensor_parallel_size == SIZE, "the handle names the prefill worker's ranks"
                blocks, hits = handoff.stats.blocks, engine.scheduler.hit_tokens
                engine.add_request(request_id, prompt, GREEDY, kv_handle=handle)
                found[f"hit_{request_id}"] = engine.scheduler.hit_tokens - hits
                found["tokens"][request_id] = run_to_end(engine, {request_id})[request_id][0]  # type: ignore[index]
                found["blocks"][request_id] = handoff.stats.blocks - blocks  # type: ignore[index]
            found.update(reads=handoff.stats.reads, total=handoff.stats.blocks, bytes=handoff.stats.bytes)
            found["failures"] = handoff.stats.failures
        finally:
            commands.put(("stop",))
            leader.stop()
            engine.close()
        out[preset] = found
    return out


@pytest.fixture(scope="module")
def split_pd(tmp_path_factory) -> tuple[dict[str, Path], list[list[dict]]]:
    """Per group (prefill, decode), per rank, per preset, what it saw; and the checkpoints."""
    root = tmp_path_factory.mktemp("tp-pd")
    directories = {preset: build_tiny_checkpoint(name, root / name, seed=3) for preset, name in PRESETS.items()}
    models = {preset: str(directory) for preset, directory in directories.items()}
    ctx = mp.get_context("spawn")
    commands, handles = ctx.Queue(), ctx.Queue()
    groups = [
        functools.partial(_prefill, models, commands, handles),
        functools.partial(_decode, models, commands, handles),
    ]
    return directories, run_groups(groups, SIZE, TIMEOUT_S)


@pytest.mark.parametrize("preset", list(PRESETS))
def test_split_pd_matches_one_rank_and_each_rank_moves_only_missing_blocks(preset: str, split_pd) -> None:
    directories, (prefill, decode) = split_pd
    config = load_config(preset, [f"model.source={directories[preset]}", *SETTINGS])
    single = EngineCore(config, threads=1)
    specs = [group.spec for group in single.coordinator.groups]
    fresh, shared, suffix = _requests()
    leader, follower = decode[0][preset], decode[1][preset]
    assert leader["tokens"] == {
        "fresh": reference_tokens(single, fresh, GREEDY),
        "hit": reference_tokens(single, shared + suffix, GREEDY),
    }
    assert leader["failures"] == 0 and leader["reads"] == 2
    assert leader["hit_fresh"] == 0 and leader["hit_hit"] == 32
    want = {
        "fresh": expected_blocks(specs, len(fresh) - 1, 0),
        "hit": expected_blocks(specs, len(shared + suffix) - 1, 32),
    }
    assert leader["blocks"] == want
    assert want["hit"] < expected_blocks(specs, len(shared + suffix) - 1, 0), "the cached prefix does not move"
    # rank 1 read its own shard of exactly those blocks from the prefill worker's rank 1
    assert follower == {"reads": 2, "blocks": sum(want.values()), "bytes": leader["bytes"]}
    assert leader["bytes"] > 0
    assert prefill[0][preset]["free"] == prefill[0][preset]["baseline"], "the prefill worker freed what it held"
    assert prefill[1][preset]["reads"] == 0, "nothing reads from the prefill worker's ranks but its peers"
