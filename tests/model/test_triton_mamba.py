"""The Triton Mamba2 decode kernels (engine/model/kernels/triton_mamba.py) equal the torch decode path.

Each case runs ``Mamba2Mixer._decode`` twice on the same random state memory and step inputs
(conv inputs, raw dt, both read in place from an in-projection-like output whose other columns
are the gate), once with ``KVFLEET_MAMBA_KERNEL=torch`` (the tile loop) and once with
``=triton`` (the conv kernel, then the SSM kernel): the new conv windows must be equal (they are
copies), the layer output rows and the new SSM states must agree within 1e-5 (fp32; relative to
the values' size where the raw dt spans softplus's whole range), and every float of state memory
outside the written blocks' states, and every output row of no decode chunk, must be left exactly
as it was. Steps mix fresh requests, updates in place (read
block == write block), moves to a new block and several requests reading one cached state; shapes
cover 1 and 2 groups, head_dim 64 and 48 (not a power of two), d_state 16 and 128. On a CUDA
machine the kernels run compiled; elsewhere under Triton's interpreter. The end-to-end cases drive
tiny Bamba, Granite-4.0-H and Nemotron-H engines on the kernels against Hugging Face's logits.
"""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("triton", reason="the Triton Mamba2 kernel needs triton")

from engine.model.arch.model_arch import MambaArch
from engine.model.batch import ChunkSpec, ForwardBatch, GroupIndex
from engine.model.kernels import triton_mamba as tm
from engine.model.layers.mamba2 import Mamba2Mixer
from tests.model import logits_harness as harness
from tests.model.triton_interpreter import kernel_test_device

DEVICE = kernel_test_device()

ATOL = 1e-5
NUM_BLOCKS = 24
EXTRA = 3  # floats after each block's state that no layer may touch
ARCHS = {
    "g1-p64-n16": MambaArch(
        num_heads=4,
        head_dim=64,
        n_groups=1,
        d_state=16,
        d_conv=4,
        intermediate_size=256,
        conv_bias=True,
        proj_bias=False,
    ),
    "g2-p48-n128-clamped": MambaArch(
        num_heads=4,
        head_dim=48,
        n_groups=2,
        d_state=128,
        d_conv=3,
        intermediate_size=192,
        conv_bias=False,
        proj_bias=False,
        time_step_min=0.01,
        time_step_max=0.5,
    ),
    "g2-p64-n128": MambaArch(
        num_heads=6,
        head_dim=64,
        n_groups=2,
        d_state=128,
        d_conv=4,
        intermediate_size=384,
        conv_bias=True,
        proj_bias=False,
    ),
    "g1-p48-n16": MambaArch(
        num_heads=2,
        head_dim=48,
        n_groups=1,
        d_state=16,
        d_conv=4,
        intermediate_size=96,
        conv_bias=True,
        proj_bias=False,
    ),
}


def _mixer(arch: MambaArch, seed: int) -> Mamba2Mixer:
    torch.manual_seed(seed)
    mixer = Mamba2Mixer(arch, 32, group=0, eps=1e-5)
    with torch.no_grad():
        for p in mixer.parameters():
            p.normal_(0.0, 0.3)
        mixer.A_log.uniform_(-1.0, 1.0)
        mixer.dt_bias.uniform_(-2.0, 0.5)
    return mixer.eval().to(DEVICE)


def _decode_step(rng: random.Random, kinds: list[str]) -> tuple[ForwardBatch, list[int]]:
    """Decode chunks of the given kinds (fresh, in_place, moved, cached) at scattered rows of a
    step twice as long (the other rows belong to no decode chunk); returns the batch and the
    blocks written."""
    count = len(kinds)
    blocks = rng.sample(range(NUM_BLOCKS), NUM_BLOCKS)
    writes, cached, moved = blocks[:count], blocks[count : count + 2], blocks[count + 2 :]
    reads = []
    for i, kind in enumerate(kinds):
        reads.append({"fresh": -1, "in_place": writes[i], "moved": moved[i], "cached": rng.choice(cached)}[kind])
    offsets = sorted(rng.sample(range(2 * count), count))
    chunks = [
        ChunkSpec(offset, 0 if read < 0 else rng.randint(1, 300), 1)
        for offset, read in zip(offsets, reads, strict=True)
    ]
    empty = torch.empty(0, dtype=torch.long)
    index = GroupIndex(empty, empty, state_read=reads, state_write=writes)
    batch = ForwardBatch(empty, empty, chunks, [], list(range(count)), [index], empty)
    return batch, writes


def _run(mixer: Mamba2Mixer, states: torch.Tensor, inputs: tuple, batch: ForwardBatch, kernel: str, monkeypatch):
    """(output rows, state memory) after ``_decode`` on copies of ``states`` and ``inputs``
    (the in-projection's output and the layer's output)."""
    monkeypatch.setenv(tm.ENV, kernel)
    states = states.clone()
    mixer.bind_state(states)
    projected, out = (t.clone() for t in inputs)
    arch = mixer.arch
    _, xbc, dt = projected.split([arch.intermediate_size, arch.conv_dim, arch.num_heads], dim=-1)
    batch.groups[0].derived.clear()  # the index tensors are rebuilt per run, as per step
    with torch.inference_mode():
        mixer._decode(xbc, dt, out, batch, batch.groups[0])
    return out.cpu(), states.cpu()


STEPS = {  # kinds of the decode chunks in a step
    "mixed": ["fresh", "in_place", "moved", "cached", "cached", "in_place", "moved", "fresh"],
    "no-fresh": ["in_place", "moved", "cached", "in_place", "cached"],
    "one-fresh": ["fresh"],
}


@pytest.mark.parametrize("step", sorted(STEPS))
@pytest.mark.parametrize("name", sorted(ARCHS))
def test_kernel_matches_the_torch_decode_path(name: str, step: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _check_against_torch(ARCHS[name], f"{name}-{step}", STEPS[step], 2.0, monkeypatch)


@pytest.mark.parametrize("name", ["g1-p64-n16", "g2-p48-n128-clamped"])
def test_kernel_matches_over_the_whole_softplus_range(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Raw dt from about -60 to 60: softplus's linear branch above 20 and its log1p branch far
    below 0, and (in the clamped arch) both clamps."""
    _check_against_torch(ARCHS[name], f"{name}-wide-dt", STEPS["mixed"], 20.0, monkeypatch)


def _check_against_torch(arch: MambaArch, seed: str, kinds: list[str], dt_scale: float, monkeypatch) -> None:
    rng = random.Random(seed)
    kinds = list(kinds)
    rng.shuffle(kinds)
    batch, writes = _decode_step(rng, kinds)
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    states = torch.randn(NUM_BLOCKS, arch.state_floats + EXTRA, generator=gen).to(DEVICE)
    rows = 2 * len(kinds)
    # one in-projection output: gate | xBC | dt, so xbc and dt are strided views as in forward
    projected = torch.randn(rows, arch.intermediate_size + arch.conv_dim + arch.num_heads, generator=gen)
    projected[:, -arch.num_heads :] *= dt_scale
    out = torch.randn(rows, arch.intermediate_size, generator=gen)  # rows of no decode chunk must stay
    inputs = tuple(t.to(DEVICE) for t in (projected, out))
    mixer = _mixer(arch, seed=len(kinds))
    ref_out, ref_states = _run(mixer, states, inputs, batch, "torch", monkeypatch)
    calls: list = []
    monkeypatch.setattr(tm, "ssm_decode_update", _spy(tm.ssm_decode_update, calls))
    monkeypatch.setattr(tm, "conv_decode_update", _spy(tm.conv_decode_update, calls))
    new_out, new_states = _run(mixer, states, inputs, batch, "triton", monkeypatch)
    assert len(calls) == 2

    conv = arch.conv_dim * arch.d_conv
    written = torch.zeros(NUM_BLOCKS, arch.state_floats + EXTRA, dtype=torch.bool)
    written[writes, :conv] = True
    assert torch.equal(new_states[:, :conv], ref_states[:, :conv]), "conv windows differ"
    written[writes, conv : arch.state_floats] = True
    assert torch.equal(new_states[~written], states.cpu()[~written]), "a float outside the new states changed"
    scale = max(1.0, ref_states.abs().max().item()) if dt_scale > 2.0 else 1.0
    state_diff = (new_states - ref_states).abs().max().item()
    assert state_diff < ATOL * scale, f"state |diff| {state_diff:.2e} (scale {scale:.1f})"
    decoded = [c.offset for c in batch.chunks]
    untouched = [r for r in range(rows) if r not in decoded]
    assert torch.equal(new_out[untouched], out[untouched])
    scale = max(1.0, ref_out.abs().max().item()) if dt_scale > 2.0 else 1.0
    out_diff = (new_out - ref_out).abs().max().item()
    assert out_diff < ATOL * scale, f"output |diff| {out_diff:.2e} (scale {scale:.1f})"


def _spy(function, calls: list):
    def spy(*args, **kwargs):
        calls.append(args)
        return function(*args, **kwargs)

    return spy


def test_enabled_follows_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.delenv(tm.ENV, raising=False)
    assert not tm.enabled(cpu) and tm.enabled(cuda)  # unset: CUDA runs the kernels (triton imports here)
    monkeypatch.setenv(tm.ENV, "torch")
    assert not tm.enabled(cuda)
    monkeypatch.setenv(tm.ENV, "triton")
    assert tm.enabled(cuda)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert tm.enabled(cpu)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match=f"{tm.ENV}=triton on cpu needs TRITON_INTERPRET=1"):
        tm.enabled(cpu)
    monkeypatch.setenv(tm.ENV, "cuda")
    with pytest.raises(ValueError, match=tm.ENV):
        tm.enabled(cpu)


def test_tiny_bamba_on_the_kernel_matches_hf(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunked prefill and decode sharing steps (two Mamba2 layers, 8 heads of 16, d_state 16)."""
    from engine.model.checkpoints.tiny import build_tiny_checkpoint

    directory = build_tiny_checkpoint("tiny-bamba", tmp_path / "bamba", seed=3)
    monkeypatch.setenv(tm.ENV, "triton")
    calls: list = []
    monkeypatch.setattr(tm, "ssm_decode_update", _spy(tm.ssm_decode_update, calls))
    overrides = ("scheduler.prefill_chunk_size=8", "scheduler.max_num_batched_tokens=16")
    harness.run_and_check(directory, DEVICE, harness.random_prompts(2, (5, 19, 27)), 4, *overrides)
    assert calls


@pytest.mark.parametrize("name", ["tiny-granite-h", "tiny-nemotron-h"])
def test_tiny_hybrids_on_the_kernels_match_hf(name: str, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Granite-4.0-H and Nemotron-H (their Mamba2 options: groups, conv bias, dt limits) with
    chunked prefill and decode sharing steps, the decode on both kernels."""
    from engine.model.checkpoints.hybrid_tiny import build_hybrid_checkpoint

    directory = build_hybrid_checkpoint(name, tmp_path / name, seed=3)
    monkeypatch.setenv(tm.ENV, "triton")
    calls: list = []
    monkeypatch.setattr(tm, "conv_decode_update", _spy(tm.conv_decode_update, calls))
    overrides = ("scheduler.prefill_chunk_size=8", "scheduler.max_num_batched_tokens=16")
    harness.run_and_check(directory, DEVICE, harness.random_prompts(2, (5, 19, 27)), 4, *overrides)
    assert calls


def test_tiny_bamba_on_every_kernel_matches_hf(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The path ``benchmarks/support/op_count.fused_path`` counts: paged attention with the KV store
    in the rotary kernel, the fused residual + norm launches, the gated output norm and the
    activation kernel beside the Mamba2 decode kernel, with chunked prefill sharing steps."""
    from engine.model.checkpoints.tiny import build_tiny_checkpoint
    from engine.model.kernels import triton_norm

    directory = build_tiny_checkpoint("tiny-bamba", tmp_path / "bamba", seed=3)
    for variable in ("KVFLEET_ATTENTION", "KVFLEET_NORM", "KVFLEET_ROPE", "KVFLEET_ACT", tm.ENV):
        monkeypatch.setenv(variable, "triton")
    calls: list = []
    monkeypatch.setattr(triton_norm, "gated_rms_norm", _spy(triton_norm.gated_rms_norm, calls))
    overrides = ("scheduler.prefill_chunk_size=8", "scheduler.max_num_batched_tokens=16")
    harness.run_and_check(directory, DEVICE, harness.random_prompts(2, (5, 19, 27)), 4, *overrides)
    assert calls
