"""Tensor parallelism inside one worker: which part of the model each rank holds, and the one
collective the sharded layers need.

A worker of ``workers.tensor_parallel_size`` = N ranks gives each rank the same model with a
rank-local ``ModelArch`` (``shard_arch``): 1/N of the query heads, of the KV heads (each KV head
replicated on N / kv ranks when there are fewer KV heads than ranks, as vLLM does), of the MLP
width, of every expert's width (each rank holds every expert, narrowed; the router is replicated),
of the Mamba2 heads and groups, and of the Gated DeltaNet key and value heads. The checkpoint's
tensors are cut to that shape by ``weight_cut`` (one ``Cut`` per tensor, applied to a loaded
tensor by ``shard_weights`` or to a safetensors slice by the loader, which then reads only the
rank's bytes):

- column-parallel (rows by head or by MLP unit): q/k/v, gate/up (dense MLPs, experts, shared
  experts), GraniteMoeHybrid's ``input_linear`` (its gate half and its up half each), gpt-oss's
  interleaved ``gate_up_proj``; Mamba2's ``in_proj`` by its z / x / B / C / dt parts, its conv
  channels by x / B / C, its per-head ``dt_bias`` / ``A_log`` / ``D`` and its gated norm's
  channels (with fewer groups than ranks, each group's B and C are replicated on the ranks that
  share it, and its norm's mean square is summed over them); Gated DeltaNet's ``in_proj_qkvz`` /
  ``in_proj_ba`` (grouped per key head), its conv channels by q / k / v, its per-head
  ``dt_bias`` / ``A_log``;
- row-parallel (their input columns): o, down, ``output_linear``, the recurrent mixers'
  ``out_proj``; a row-parallel bias is kept by rank 0 only (the others hold zeros), so the sum
  adds it once (Nemotron-H's ``fc2_latent_proj`` likewise: it is applied to a partial sum);
- vocabulary-parallel: the token embedding and the LM head (1/N of the vocabulary's rows each:
  ``VocabParallelEmbedding`` looks up the ids in its range and the ranks' rows are summed,
  ``gather_vocab`` joins the ranks' logits once per step, so every rank samples from the full
  logits);
- replicated: norms (but the Mamba2 gated norm, whose groups are split), routers, Gated
  DeltaNet's per-head output norm, Nemotron-H's latent projections' weights.

Every token mixer's and every MLP's output is summed over the ranks (``all_reduce``,
torch.distributed: gloo on the CPU, NCCL on CUDA); every other operation is rank-local. Block ids
are per token and the same on every rank: each rank holds its heads' share of every KV page and
of every recurrent state (a Mamba2 rank its heads' SSM states and its channels' conv windows),
so a rank's page is 1/N of a TP=1 page.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from engine.model.arch.model_arch import ModelArch

FIELD = "workers.tensor_parallel_size"


class TensorParallelError(ValueError):
    """A tensor-parallel size the model cannot be split by; the message names the field, the
    model and the number."""


def _must_divide(model: str, what: str, count: int, size: int) -> None:
    if count % size:
        raise TensorParallelError(f"{FIELD}: must divide {model}'s {count} {what} (got {size})")


def check_tensor_parallel(arch: ModelArch, size: int) -> None:
    """Raise TensorParallelError unless ``arch`` splits into ``size`` ranks."""
    if size < 1:
        raise TensorParallelError(f"{FIELD}: must be >= 1 (got {size})")
    if size == 1:
        return
    model = arch.architecture
    _must_divide(model, "attention heads", arch.num_heads, size)
    kv = arch.num_kv_heads
    if (kv >= size and kv % size) or (kv < size and size % kv):
        raise TensorParallelError(
            f"{FIELD}: {model}'s {kv} KV heads must split evenly over the ranks or each be replicated "
            f"on a whole number of them (got {size})"
        )
    if arch.vocab_size % size:
        raise TensorParallelError(f"{FIELD}: must divide {model}'s vocabulary of {arch.vocab_size} (got {size})")
    if arch.intermediate_size % size:
        raise TensorParallelError(f"{FIELD}: must divide {model}'s MLP width {arch.intermediate_size} (got {size})")
    if arch.mamba is not None:
        _must_divide(model, "Mamba2 heads", arch.mamba.num_heads, size)
        groups = arch.mamba.n_groups
        if (groups >= size and groups % size) or (groups < size and size % groups):
            raise TensorParallelError(
                f"{FIELD}: {model}'s {groups} Mamba2 groups (mamba n_groups) must split evenly over the ranks "
                f"or each be shared by a whole number of them (got {size})"
            )
    if arch.gated_deltanet is not None:
        _must_divide(model, "Gated DeltaNet key heads", arch.gated_deltanet.num_k_heads, size)
    if arch.moe is not None:
        if arch.moe.intermediate_size % size:
            raise TensorParallelError(
                f"{FIELD}: must divide {model}'s expert width {arch.moe.intermediate_size} (got {size})"
            )
        if arch.moe.shared_intermediate_size % size:
            raise TensorParallelError(
                f"{FIELD}: must divide {model}'s shared expert width {arch.moe.shared_intermediate_size} (got {size})"
            )


def shard_arch(arch: ModelArch, size: int, rank: int) -> ModelArch:
    """The rank-local architecture of rank ``rank`` of ``size`` (checked first)."""
    check_tensor_parallel(arch, size)
    if not 0 <= rank < size:
        raise TensorParallelError(f"tensor_parallel_rank: must be in [0, {size}) (got {rank})")
    if size == 1:
        return arch
    mamba, deltanet, moe = arch.mamba, arch.gated_deltanet, arch.moe
    return dataclasses.replace(
        arch,
        num_heads=arch.num_heads // size,
        num_kv_heads=max(1, arch.num_kv_heads // size),
        intermediate_size=arch.intermediate_size // size,
        mamba=None
        if mamba is None
        else dataclasses.replace(
            mamba,
            num_heads=mamba.num_heads // size,
            n_groups=max(1, mamba.n_groups // size),
            intermediate_size=mamba.intermediate_size // size,
            group_ranks=max(1, size // mamba.n_groups),
            group=rank * mamba.n_groups // size if mamba.n_groups < size else 0,
        ),
        gated_deltanet=None
        if deltanet is None
        else dataclasses.replace(
            deltanet, num_k_heads=deltanet.num_k_heads // size, num_v_heads=deltanet.num_v_heads // size
        ),
        moe=None
        if moe is None
        else dataclasses.replace(
            moe,
            intermediate_size=moe.intermediate_size // size,
            shared_intermediate_size=moe.shared_intermediate_size // size,
        ),
        tp_size=size,
        tp_rank=rank,
    )


@dataclass(frozen=True)
class Cut:
    """One rank's part of a checkpoint tensor: along ``dim``, the ``(start, count)`` ranges joined
    in order; ``zero``: zeros of the whole tensor's shape (a row-parallel bias rank 0 alone adds)."""

    dim: int = 0
    ranges: tuple[tuple[int, int], ...] = ()
    zero: bool = False

    def shape(self, full: Sequence[int]) -> tuple[int, ...]:
        """The rank's tensor shape, from the whole tensor's."""
        if self.zero:
            return tuple(full)
        out = list(full)
        out[self.dim] = sum(count for _, count in self.ranges)
        return tuple(out)

    def apply(self, tensor: torch.Tensor) -> torch.Tensor:
        """The rank's part of the whole ``tensor`` (a new, contiguous tensor)."""
        if self.zero:
            return torch.zeros_like(tensor)
        parts = [tensor.narrow(self.dim, start, count) for start, count in self.ranges]
        return torch.cat(parts, self.dim) if len(parts) > 1 else parts[0].contiguous()


def _even(shape: Sequence[int], dim: int, rank: int, size: int, parts: int = 1) -> Cut:
    """Rank ``rank``'s 1/size of each of ``parts`` equal consecutive parts of ``dim``."""
    part = shape[dim] // parts
    width = part // size
    return Cut(dim, tuple((p * part + rank * width, width) for p in range(parts)))


def _parts(sizes: Sequence[int], rank: int, size: int) -> Cut:
    """Rank ``rank``'s 1/size of each of the consecutive rows of ``sizes`` (whole-model sizes)."""
    ranges, start = [], 0
    for n in sizes:
        ranges.append((start + rank * (n // size), n // size))
        start += n
    return Cut(0, tuple(ranges))


_ROW_PARALLEL = ("o_proj", "down_proj", "out_proj")
_RECURRENT_OWNERS = ("mamba", "mixer", "linear_attn")


def weight_cut(name: str, shape: Sequence[int], local: ModelArch, full_kv_heads: int) -> Cut | None:
    """The part of checkpoint tensor ``name`` (of whole shape ``shape``) that rank
    ``local.tp_rank`` holds (module docstring); None: the rank holds it whole."""
    size, rank = local.tp_size, local.tp_rank
    if size == 1:
        return None
    module, _, kind = name.rpartition(".")
    parent, _, leaf = module.rpartition(".")
    owner = parent.rpartition(".")[2]
    bias = kind == "bias"
    if leaf in _ROW_PARALLEL or leaf == "output_linear":
        if bias:
            return Cut(zero=True) if rank else None
        return _even(shape, len(shape) - 1, rank, size)
    if leaf == "fc2_latent_proj":
        return Cut(zero=True) if bias and rank else None
    if leaf in ("q_proj", "gate_proj", "up_proj", "embed_tokens", "embeddings", "lm_head"):
        return _even(shape, 0, rank, size)
    if leaf in ("k_proj", "v_proj"):
        head_dim = local.head_dim
        rows = local.num_kv_heads * head_dim
        # with fewer KV heads than ranks, rank r holds KV head r * kv // size (the one its queries read)
        first = rank * rows if full_kv_heads >= size else (rank * full_kv_heads // size) * head_dim
        return Cut(0, ((first, rows),))
    if leaf == "input_linear":  # gate half then up half, [2I, H] or an expert bank's [E, 2I, H]
        return _even(shape, len(shape) - 2, rank, size, parts=2)
    if leaf == "experts":  # gpt-oss's stacked experts (parameters of the ``experts`` module)
        if kind == "gate_up_proj":  # [E, H, 2I], gate/up interleaved per unit: units stay whole
            return _even(shape, 2, rank, size)
        if kind == "gate_up_proj_bias":
            return _even(shape, 1, rank, size)
        if kind == "down_proj":  # [E, I, H]
            return _even(shape, 1, rank, size)
        return Cut(zero=True) if kind == "down_proj_bias" and rank else None
    if leaf == "self_attn" and kind == "sinks":
        return _even(shape, 0, rank, size)
    return _recurrent_cut(leaf, owner, kind, shape, local)


def _shift(ranges: tuple[tuple[int, int], ...], offset: int) -> tuple[tuple[int, int], ...]:
    return tuple((start + offset, count) for start, count in ranges)


def _recurrent_cut(leaf: str, owner: str, kind: str, shape: Sequence[int], local: ModelArch) -> Cut | None:
    """The cuts of a Mamba2 or Gated DeltaNet mixer's tensors (their row-parallel ``out_proj`` is
    cut by ``weight_cut``); None for everything else."""
    size, rank = local.tp_size, local.tp_rank
    per_head = kind in ("dt_bias", "A_log", "D") and leaf in _RECURRENT_OWNERS
    if local.mamba is not None:
        m = local.mamba
        inner, heads = m.intermediate_size * size, m.num_heads * size
        groups = m.n_groups * size // m.group_ranks * m.d_state  # the model's B (or C) rows
        # B and C: the rank's groups, or the one group it shares with group_ranks - 1 others
        b_c = ((m.group * m.d_state, m.d_state),) if m.group_ranks > 1 else _parts((groups,), rank, size).ranges
        if leaf == "in_proj":  # z, x, B, C, dt
            z_x = _parts((inner, inner), rank, size).ranges
            dt = _parts((heads,), rank, size).ranges[0]
            return Cut(
                0,
                (
                    *z_x,
                    *_shift(b_c, 2 * inner),
                    *_shift(b_c, 2 * inner + groups),
                    (dt[0] + 2 * inner + 2 * groups, dt[1]),
                ),
            )
        if leaf == "conv1d":  # x, B, C channels
            x = _parts((inner,), rank, size).ranges
            return Cut(0, (*x, *_shift(b_c, inner), *_shift(b_c, inner + groups)))
        if per_head or (leaf == "norm" and owner in _RECURRENT_OWNERS):  # heads; the gated norm's groups
            return _even(shape, 0, rank, size)
    if local.gated_deltanet is not None:
        d = local.gated_deltanet
        if leaf in ("in_proj_qkvz", "in_proj_ba"):  # grouped per key head
            return _even(shape, 0, rank, size)
        if leaf == "conv1d":  # q, k, v channels
            key, value = d.key_dim * size, d.value_dim * size
            return _parts((key, key, value), rank, size)
        if per_head:
            return _even(shape, 0, rank, size)
    return None


def shard_weights(weights: dict[str, torch.Tensor], local: ModelArch, full_kv_heads: int) -> dict[str, torch.Tensor]:
    """Each checkpoint tensor cut to rank ``local.tp_rank``'s part (``weight_cut``); tensors the
    rank holds whole are passed through. ``full_kv_heads``: the checkpoint's KV heads."""
    if local.tp_size == 1:
        return weights
    out: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        cut = weight_cut(name, tensor.shape, local, full_kv_heads)
        out[name] = tensor if cut is None else cut.apply(tensor)
    return out


def token_embedding(arch: ModelArch) -> nn.Embedding:
    """The family's token embedding: vocabulary-parallel under tensor parallelism, else plain."""
    if arch.tp_size > 1:
        return VocabParallelEmbedding(arch.vocab_size, arch.hidden_size, arch.tp_size, arch.tp_rank)
    # the checkpoint's table replaces this one, so it is left uninitialised: ``normal_`` on the
    # meta device (engine/model/checkpoints/loader.py builds there) would import torch._dynamo,
    # seconds of every worker's start
    return nn.Embedding(arch.vocab_size, arch.hidden_size, _weight=torch.empty(arch.vocab_size, arch.hidden_size))


def all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """Sum ``tensor`` over the worker's ranks, in place (the default process group)."""
    dist.all_reduce(tensor)
    return tensor


def gather_vocab(logits: torch.Tensor) -> torch.Tensor:
    """Every rank's slice of the vocabulary's logits (``[rows, vocab / N]``), joined in rank order."""
    parts = [torch.empty_like(logits) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, logits.contiguous())
    return torch.cat(parts, dim=-1)


class VocabParallelEmbedding(nn.Embedding):
    """The token embedding of one rank: rows ``[first, first + num_embeddings)`` of the
    vocabulary. Ids outside the range look up zeros; the ranks' lookups are summed, so each id
    gets its one row. Invariant: ``first = rank * num_embeddings``."""

    def __init__(self, vocab_size: int, hidden_size: int, size: int, rank: int) -> None:
        super().__init__(vocab_size // size, hidden_size)
        self.first = rank * (vocab_size // size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.first
        outside = (local < 0) | (local >= self.num_embeddings)
        rows = F.embedding(local.masked_fill(outside, 0), self.weight)
        return all_reduce(rows.masked_fill(outside.unsqueeze(-1), 0.0))
