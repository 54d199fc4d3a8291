"""The batched Mamba2 forward equals the per-request loop it replaced (fp32, atol 1e-5).

Random steps mix decode (one-token) and prefill chunks of many lengths (across the 64-token
sub-chunk), fresh requests (no state) and continuing ones, read block == write block and not,
several chunks reading the same cached state. Both paths start from the same random state
memory; the outputs and the whole state memory afterwards must match. The mutation tests show the
comparison catches a broken state carry.
"""

from __future__ import annotations

import random

import pytest
import torch

from engine.model.arch.model_arch import MambaArch
from engine.model.batch import ChunkSpec, ForwardBatch, GroupIndex
from engine.model.layers import mamba2, recurrent
from engine.model.layers.mamba2 import Mamba2Mixer
from engine.model.layers.mamba2_reference import forward_per_request

ATOL = 1e-5
HIDDEN = 48
NUM_BLOCKS = 80
ARCHS = {
    "one_group": MambaArch(
        num_heads=8, head_dim=8, n_groups=1, d_state=16, d_conv=4, intermediate_size=64, conv_bias=True, proj_bias=False
    ),
    "two_groups_clamped": MambaArch(
        num_heads=6,
        head_dim=4,
        n_groups=2,
        d_state=8,
        d_conv=3,
        intermediate_size=24,
        conv_bias=False,
        proj_bias=True,
        time_step_min=0.01,
        time_step_max=0.5,
    ),
}


def _mixer(arch: MambaArch, seed: int) -> Mamba2Mixer:
    torch.manual_seed(seed)
    mixer = Mamba2Mixer(arch, HIDDEN, group=0, eps=1e-5)
    with torch.no_grad():
        for p in mixer.parameters():
            p.normal_(0.0, 0.3)
        mixer.A_log.uniform_(-1.0, 1.0)
        mixer.dt_bias.uniform_(-2.0, 0.5)
    return mixer.eval()


def _states(arch: MambaArch, seed: int) -> torch.Tensor:
    """Random state memory with a few trailing floats a layer must never touch."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(NUM_BLOCKS, arch.state_floats + 3, generator=generator)


def _batch(lengths: list[int], starts: list[int], reads: list[int], writes: list[int]) -> ForwardBatch:
    chunks, offset = [], 0
    for n, start in zip(lengths, starts, strict=True):
        chunks.append(ChunkSpec(offset, start, n))
        offset += n
    empty = torch.empty(0, dtype=torch.long)
    return ForwardBatch(
        input_ids=torch.zeros(offset, dtype=torch.long),
        positions=torch.zeros(offset, dtype=torch.long),
        chunks=chunks,
        prefill_chunks=[i for i, n in enumerate(lengths) if n > 1],
        decode_chunks=[i for i, n in enumerate(lengths) if n == 1],
        groups=[GroupIndex(empty, empty, state_read=reads, state_write=writes)],
        sample_indices=empty,
    )


def _random_step(rng: random.Random) -> ForwardBatch:
    """Up to 9 chunks: decode or prefill lengths, fresh or continuing, shared reads, in place or not."""
    count = rng.randint(1, 9)
    blocks = rng.sample(range(NUM_BLOCKS), NUM_BLOCKS)
    writes = blocks[:count]
    cached = blocks[count : count + 3]  # read-only states several chunks may share
    lengths, starts, reads = [], [], []
    for i in range(count):
        n = 1 if rng.random() < 0.5 else rng.choice([2, 3, 7, 16, 63, 64, 65, 100, 150])
        kind = rng.choice(["fresh", "in_place", "moved", "cached"])
        read = {"fresh": -1, "in_place": writes[i], "moved": blocks[count + 3 + i], "cached": rng.choice(cached)}[kind]
        lengths.append(n)
        starts.append(0 if read < 0 else rng.randint(1, 500))
        reads.append(read)
    return _batch(lengths, starts, reads, writes)


def _run(mixer: Mamba2Mixer, states: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch, per_request: bool):
    states = states.clone()
    mixer.bind_state(states)
    with torch.inference_mode():
        out = forward_per_request(mixer, hidden, batch) if per_request else mixer(hidden, batch)
    return out, states


def _max_diffs(mixer: Mamba2Mixer, states: torch.Tensor, batch: ForwardBatch, seed: int) -> tuple[float, float]:
    rows = batch.chunks[-1].offset + batch.chunks[-1].num_tokens
    hidden = torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(seed))
    ref_out, ref_states = _run(mixer, states, hidden, batch, per_request=True)
    out, new_states = _run(mixer, states, hidden, batch, per_request=False)
    return (out - ref_out).abs().max().item(), (new_states - ref_states).abs().max().item()


@pytest.fixture(params=["one_tile", "one_head_per_tile"])
def decode_tile(request, monkeypatch) -> None:
    """The decode update in one tile of heads (these shapes' default) or one head per tile."""
    if request.param == "one_head_per_tile":
        monkeypatch.setattr(mamba2, "DECODE_TILE_BYTES", 1)


@pytest.mark.parametrize("name", sorted(ARCHS))
def test_random_steps_equal_the_per_request_loop(name: str, decode_tile: None) -> None:
    arch = ARCHS[name]
    mixer, rng = _mixer(arch, seed=1), random.Random(name)
    for trial in range(25):
        batch = _random_step(rng)
        out_diff, state_diff = _max_diffs(mixer, _states(arch, trial), batch, seed=trial)
        shape = [(c.num_tokens, r) for c, r in zip(batch.chunks, batch.groups[0].state_read, strict=True)]
        assert out_diff < ATOL, f"trial {trial} {shape}: output |diff| {out_diff:.2e}"
        assert state_diff < ATOL, f"trial {trial} {shape}: state |diff| {state_diff:.2e}"


@pytest.mark.parametrize("lengths", [[1] * 32, [1, 1, 1], [5], [150, 1, 2, 1, 64], [65, 64, 63]])
def test_pure_decode_pure_prefill_and_mixed_steps(lengths: list[int], decode_tile: None) -> None:
    arch = ARCHS["one_group"]
    count = len(lengths)
    reads = [-1 if i % 3 == 0 else i for i in range(count)]
    writes = [i if i % 2 == 0 else count + i for i in range(count)]  # in place for even chunks
    batch = _batch(lengths, [0 if r < 0 else 10 + i for i, r in enumerate(reads)], reads, writes)
    assert max(_max_diffs(_mixer(arch, seed=2), _states(arch, 7), batch, seed=3)) < ATOL


def test_a_sequence_gives_the_same_state_token_by_token_and_in_chunks() -> None:
    """Carry across steps: one request fed as prefill chunks then decode steps (moving between
    blocks) ends where the per-request loop over one whole chunk ends."""
    arch = ARCHS["two_groups_clamped"]
    mixer = _mixer(arch, seed=4)
    hidden = torch.randn(90, HIDDEN, generator=torch.Generator().manual_seed(5))
    zero = torch.zeros(NUM_BLOCKS, arch.state_floats + 3)
    whole_out, whole_states = _run(mixer, zero, hidden, _batch([90], [0], [-1], [0]), per_request=True)
    states, outs, start, read = zero.clone(), [], 0, -1
    plan = [70, 3] + [1] * 17
    for step, n in enumerate(plan):
        write = step % 4  # moves to a new block every step, in place never
        mixer.bind_state(states)
        with torch.inference_mode():
            outs.append(mixer(hidden[start : start + n], _batch([n], [start], [read], [write])))
        start, read = start + n, write
    assert (torch.cat(outs) - whole_out).abs().max().item() < ATOL
    assert (states[read] - whole_states[0]).abs().max().item() < ATOL


@pytest.mark.parametrize("broken", ["reads_zeros", "drops_writes"])
def test_the_comparison_catches_a_broken_state_carry(broken: str, decode_tile: None, monkeypatch) -> None:
    arch = ARCHS["one_group"]
    batch = _batch([1, 1, 40, 1], [9, 4, 30, 12], [3, 4, 5, 6], [3, 10, 11, 6])
    mixer, states = _mixer(arch, seed=6), _states(arch, 8)
    assert max(_max_diffs(mixer, states, batch, seed=9)) < ATOL
    for index in batch.groups:  # a new step: the layers' shared index tensors are built again
        index.derived.clear()
    if broken == "reads_zeros":  # every chunk starts from zeros, as if fresh

        def read_blocks(reads, device):
            return torch.zeros(len(reads), dtype=torch.long), torch.ones(len(reads), dtype=torch.bool)

        monkeypatch.setattr(recurrent, "read_blocks", read_blocks)
    else:  # new states land in a block nobody reads
        monkeypatch.setattr(recurrent, "write_blocks", lambda writes, device: torch.full((len(writes),), 79))
    assert max(_max_diffs(mixer, states, batch, seed=9)) > 1e-2
