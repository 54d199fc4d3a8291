"""Tensor parallelism inside one worker: which part of the model each rank holds, and the one
collective the sharded layers need.

A worker of ``workers.tensor_parallel_size`` = N ranks gives each rank the same model with a
rank-local ``ModelArch`` (``shard_arch``): 1/N of the query heads, of the KV heads (each KV head
replicated on N / kv ranks when there are fewer KV heads than ranks, as vLLM does) and of the MLP
width. The checkpoint's tensors are cut to that shape by ``shard_weights``: q/k/v and gate/up
column-parallel (rows by head or by MLP unit), o and down row-parallel (their columns; their bias
kept by rank 0 only, so the sum adds it once); the token embedding and the LM head
vocabulary-parallel (1/N of the vocabulary's rows each: ``VocabParallelEmbedding`` looks up the ids
in its range and the ranks' rows are summed, ``gather_vocab`` joins the ranks' logits once per
step, so every rank samples from the full logits); norms replicated. The attention output and the
MLP output are summed over the ranks (``all_reduce``, torch.distributed: gloo on the CPU, NCCL on
CUDA); every other operation is rank-local. Block ids are per token and the same on every rank:
each rank holds its heads' share of every KV page, so a rank's page is 1/N of a TP=1 page.

Sharded so far: the decoder families without a sparse MoE (Llama, Qwen2/3, Mistral, Gemma3). The
recurrent (Mamba2, Gated DeltaNet) and MoE families are refused by ``check_tensor_parallel`` with
the reason, before anything is loaded.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from engine.model.arch.model_arch import ModelArch

FIELD = "workers.tensor_parallel_size"
SHARDED_FAMILIES = ("llama", "gemma3")


class TensorParallelError(ValueError):
    """A tensor-parallel size the model cannot be split by; the message names the field, the
    model and the number."""


def check_tensor_parallel(arch: ModelArch, size: int) -> None:
    """Raise TensorParallelError unless ``arch`` splits into ``size`` ranks."""
    if size < 1:
        raise TensorParallelError(f"{FIELD}: must be >= 1 (got {size})")
    if size == 1:
        return
    model = arch.architecture
    if arch.family not in SHARDED_FAMILIES or arch.moe is not None:
        kind = "sparse MoE" if arch.moe is not None else f"the {arch.family} family's recurrent"
        raise TensorParallelError(
            f"{FIELD}: {model}'s {kind} layers are not sharded across ranks yet; "
            f"tensor parallelism serves {', '.join(SHARDED_FAMILIES)} models without MoE (got {size})"
        )
    if arch.num_heads % size:
        raise TensorParallelError(f"{FIELD}: must divide {model}'s {arch.num_heads} attention heads (got {size})")
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


def shard_arch(arch: ModelArch, size: int, rank: int) -> ModelArch:
    """The rank-local architecture of rank ``rank`` of ``size`` (checked first)."""
    check_tensor_parallel(arch, size)
    if not 0 <= rank < size:
        raise TensorParallelError(f"tensor_parallel_rank: must be in [0, {size}) (got {rank})")
    if size == 1:
        return arch
    return dataclasses.replace(
        arch,
        num_heads=arch.num_heads // size,
        num_kv_heads=max(1, arch.num_kv_heads // size),
        intermediate_size=arch.intermediate_size // size,
        tp_size=size,
        tp_rank=rank,
    )


def _rows(tensor: torch.Tensor, start: int, count: int, dim: int = 0) -> torch.Tensor:
    return tensor.narrow(dim, start, count).contiguous()


def shard_weights(weights: dict[str, torch.Tensor], local: ModelArch, full_kv_heads: int) -> dict[str, torch.Tensor]:
    """Each checkpoint tensor cut to rank ``local.tp_rank``'s part (module docstring); tensors
    of replicated modules are passed through. ``full_kv_heads``: the checkpoint's KV heads."""
    size, rank = local.tp_size, local.tp_rank
    if size == 1:
        return weights
    head_dim = local.head_dim
    q_rows = local.num_heads * head_dim
    kv_rows = local.num_kv_heads * head_dim
    # with fewer KV heads than ranks, rank r holds KV head r * kv // size (the one its queries read)
    kv_first = rank * kv_rows if full_kv_heads >= size else (rank * full_kv_heads // size) * head_dim
    mlp = local.intermediate_size
    out: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        module, _, kind = name.rpartition(".")
        leaf = module.rpartition(".")[2]
        if leaf == "q_proj":
            tensor = _rows(tensor, rank * q_rows, q_rows)
        elif leaf in ("k_proj", "v_proj"):
            tensor = _rows(tensor, kv_first, kv_rows)
        elif leaf in ("gate_proj", "up_proj"):
            tensor = _rows(tensor, rank * mlp, mlp)
        elif leaf in ("o_proj", "down_proj"):
            if kind == "weight":
                width = q_rows if leaf == "o_proj" else mlp
                tensor = _rows(tensor, rank * width, width, dim=1)
            elif rank:  # a row-parallel bias is added once, by rank 0, before the sum
                tensor = torch.zeros_like(tensor)
        elif leaf in ("embed_tokens", "lm_head"):
            rows = tensor.shape[0] // size
            tensor = _rows(tensor, rank * rows, rows)
        elif leaf == "self_attn" and kind == "sinks":
            tensor = _rows(tensor, rank * local.num_heads, local.num_heads)
        out[name] = tensor
    return out


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
