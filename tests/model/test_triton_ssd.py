"""The Triton SSD scan (engine/model/kernels/triton_ssd.py) equals the torch scan it replaces
(``engine.model.layers.ssd.ssd_scan_packed``).

Each case packs random chunks as ``Mamba2Mixer._prefill`` does (``pack_chunks``, longest first),
with x, dt, B and C strided views of one buffer as the mixer's are, and runs both scans on the
same inputs: y and the final states must agree within ``RTOL`` of their largest value (fp32).
Lengths cover one chunk of several sub-chunks and a mix with 65, 64 (exactly one sub-chunk), 1
and a length no multiple of 64, from zero states (``h`` None) and from given ones; shapes cover
1 to 3 groups of 1 to 3 heads, head_dim / d_state no power of two, and state tiles smaller
than a head's state. Two deliberately wrong
inputs (a perturbed initial state, a packing whose carry between sub-chunks is cut) must fail the
same comparison, and one launch must be three kernels. On a CUDA machine the kernels run
compiled; elsewhere under Triton's interpreter. The end-to-end case drives a tiny Bamba engine
with the kernel on against Hugging Face's logits.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("triton", reason="the Triton SSD scan needs triton")

from engine.model.kernels import triton_ssd as ts
from engine.model.layers.ssd import PackedChunks, pack_chunks, ssd_scan_packed
from tests.model import logits_harness as harness
from tests.model.triton_interpreter import kernel_test_device

DEVICE = kernel_test_device()

RTOL = 1e-4
Inputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
SHAPES = {  # (groups G, heads per group E, head_dim P, d_state N)
    "g1-e2-p16-n16": (1, 2, 16, 16),
    "g2-e3-p24-n12": (2, 3, 24, 12),
    "g3-e1-p16-n32": (3, 1, 16, 32),
}
LENGTHS = {
    "one-chunk": [150],
    "mixed": [129, 65, 64, 1],
}


def _inputs(shape: tuple[int, int, int, int], tokens: int, seed: int) -> Inputs:
    """x, dt, a, b, c for ``tokens`` packed tokens; x, b and c are column views of one
    ``[tokens, x | B | C]`` buffer and dt a column view of another, as in the mixer."""
    groups, heads_per_group, head_dim, d_state = shape
    gen = torch.Generator().manual_seed(seed)
    width = groups * (heads_per_group * head_dim + 2 * d_state)
    conv = torch.randn(tokens, width, generator=gen)
    x, b, c = conv.split([groups * heads_per_group * head_dim, groups * d_state, groups * d_state], dim=-1)
    x = x.view(tokens, groups, heads_per_group, head_dim)
    steps = torch.rand(tokens, groups * heads_per_group + 3, generator=gen) * 0.3 + 0.01
    dt = steps[:, 3:].view(tokens, groups, heads_per_group)
    a = -(torch.rand(groups, heads_per_group, generator=gen) * 2.0 + 0.2)
    b, c = (t.view(tokens, groups, d_state) for t in (b, c))
    return x.to(DEVICE), dt.to(DEVICE), a.to(DEVICE), b.to(DEVICE), c.to(DEVICE)


def _initial(shape: tuple[int, int, int, int], count: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed + 1)
    return torch.randn(count, *shape, generator=gen).to(DEVICE)


def _relative_error(
    inputs: Inputs, h: torch.Tensor | None, packed: PackedChunks, wrong: PackedChunks | None = None
) -> tuple[float, float]:
    """Largest |triton - torch| of y and of the final states, each over its largest |value|
    (the Triton scan on the ``wrong`` packing where given)."""
    ref_y, ref_h = ssd_scan_packed(*inputs, None if h is None else h.clone(), packed)
    new_y, new_h = ts.ssd_scan_packed(*inputs, None if h is None else h.clone(), wrong or packed)
    y_err = ((new_y - ref_y).abs().max() / ref_y.abs().max()).item()
    h_err = ((new_h - ref_h).abs().max() / ref_h.abs().max()).item()
    return y_err, h_err


CASES = [  # (shape, lengths, from given states)
    ("g1-e2-p16-n16", "one-chunk", False),
    ("g1-e2-p16-n16", "mixed", True),
    ("g2-e3-p24-n12", "one-chunk", True),
    ("g2-e3-p24-n12", "mixed", False),
    ("g2-e3-p24-n12", "mixed", True),
    ("g3-e1-p16-n32", "mixed", True),
]


@pytest.mark.parametrize(("name", "lengths", "initial"), CASES)
def test_kernel_matches_the_torch_scan(name: str, lengths: str, initial: bool) -> None:
    shape, sizes = SHAPES[name], LENGTHS[lengths]
    packed = pack_chunks(sizes, 4, torch.device(DEVICE))
    inputs = _inputs(shape, sum(sizes), seed=len(sizes) + 7 * shape[0])
    h = _initial(shape, len(sizes), seed=3) if initial else None
    y_err, h_err = _relative_error(inputs, h, packed)
    assert y_err < RTOL and h_err < RTOL, f"relative |diff|: y {y_err:.2e}, states {h_err:.2e}"


def test_state_tiles_smaller_than_the_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """16 x 16 state tiles: head_dim 24 and d_state 32 split into 2 x 2 tiles (the second row
    tile partly masked), and the output kernel sums d_state over two column tiles."""
    monkeypatch.setattr(ts, "MAX_BLOCK_P", 16)
    monkeypatch.setattr(ts, "MAX_BLOCK_N", 16)
    shape, sizes = (2, 1, 24, 32), [129, 64, 1]
    packed = pack_chunks(sizes, 4, torch.device(DEVICE))
    y_err, h_err = _relative_error(_inputs(shape, sum(sizes), seed=9), _initial(shape, len(sizes), seed=9), packed)
    assert y_err < RTOL and h_err < RTOL, f"relative |diff|: y {y_err:.2e}, states {h_err:.2e}"


def test_the_given_states_are_updated_in_place_as_the_reference_does() -> None:
    shape, sizes = SHAPES["g1-e2-p16-n16"], [70, 3]
    h = _initial(shape, len(sizes), seed=5)
    _, final = ts.ssd_scan_packed(*_inputs(shape, sum(sizes), seed=5), h, pack_chunks(sizes, 4, torch.device(DEVICE)))
    assert final is h


def test_the_comparison_catches_a_wrong_initial_state_or_a_cut_carry() -> None:
    """The reference's comparison fails for a one-in-a-thousand change of one chunk's initial
    state, and for a packing that gives the first chunk only its first sub-chunk in the state
    pass (the carry into its later sub-chunks cut)."""
    shape, sizes = SHAPES["g1-e2-p16-n16"], [140, 65, 30]
    packed = pack_chunks(sizes, 4, torch.device(DEVICE))
    inputs = _inputs(shape, sum(sizes), seed=11)
    h = _initial(shape, len(sizes), seed=11)
    nudged = h.clone()
    nudged[2] *= 1.001
    ref_y, _ = ssd_scan_packed(*inputs, h.clone(), packed)
    new_y, _ = ts.ssd_scan_packed(*inputs, nudged, packed)
    assert ((new_y - ref_y).abs().max() / ref_y.abs().max()).item() > RTOL
    spans = packed.chunk_spans.clone()
    spans[0, 1] = 1
    y_err, _ = _relative_error(inputs, h, packed, dataclasses.replace(packed, chunk_spans=spans))
    assert y_err > RTOL


def test_one_scan_is_three_launches(monkeypatch: pytest.MonkeyPatch) -> None:
    launches: list[tuple[int, ...]] = []

    class Counted:
        def __init__(self, kernel) -> None:
            self.kernel = kernel

        def __getitem__(self, grid: tuple[int, ...]):
            launches.append(grid)
            return self.kernel[grid]

    kernels = tuple(Counted(k) for k in ts._kernels())
    monkeypatch.setattr(ts, "_kernels", lambda: kernels)
    shape, sizes = SHAPES["g1-e2-p16-n16"], [200, 64, 1]
    ts.ssd_scan_packed(*_inputs(shape, sum(sizes), seed=2), None, pack_chunks(sizes, 4, torch.device(DEVICE)))
    assert launches == [(6, 2, 1), (3, 2, 1), (6, 2, 1)]  # 4 + 1 + 1 sub-chunks, 3 chunks, 2 heads


def test_bfloat16_inputs_are_close_to_the_fp32_scan() -> None:
    shape, sizes = SHAPES["g2-e3-p24-n12"], [90, 20]
    packed = pack_chunks(sizes, 4, torch.device(DEVICE))
    inputs = _inputs(shape, sum(sizes), seed=4)
    rounded = tuple(t.to(torch.bfloat16) for t in inputs)
    ref_y, ref_h = ssd_scan_packed(*(t.float() for t in rounded), None, packed)
    new_y, new_h = ts.ssd_scan_packed(*rounded, None, packed)
    assert new_y.dtype == torch.bfloat16 and new_h.dtype == torch.bfloat16
    assert ((new_y.float() - ref_y).abs().max() / ref_y.abs().max()).item() < 1e-2
    assert ((new_h.float() - ref_h).abs().max() / ref_h.abs().max()).item() < 1e-2


def test_enabled_is_opt_in_everywhere(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.delenv(ts.ENV, raising=False)
    assert not ts.enabled(cpu) and not ts.enabled(cuda)  # unset: off until a GPU run checks it compiled
    monkeypatch.setenv(ts.ENV, "triton")
    assert ts.enabled(cuda)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert ts.enabled(cpu)
    monkeypatch.setenv(ts.ENV, "torch")
    assert not ts.enabled(cuda)


def test_tiny_bamba_prefill_on_the_kernel_matches_hf(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks of up to 80 tokens (two sub-chunks; the second chunk of the long prompt starts from
    the first's state) beside a short prompt, then decode on the torch path."""
    from engine.model.checkpoints.tiny import build_tiny_checkpoint

    directory = build_tiny_checkpoint("tiny-bamba", tmp_path / "bamba", seed=3)
    monkeypatch.setenv(ts.ENV, "triton")
    calls: list[int] = []
    scan = ts.ssd_scan_packed

    def spy(*args):
        calls.append(args[0].shape[0])
        return scan(*args)

    monkeypatch.setattr(ts, "ssd_scan_packed", spy)
    overrides = ("scheduler.prefill_chunk_size=80", "scheduler.max_num_batched_tokens=100")
    harness.run_and_check(directory, DEVICE, harness.random_prompts(6, (150, 19)), 2, *overrides)
    assert max(calls) > 64
