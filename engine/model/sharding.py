"""One rank's shard of a model under tensor parallelism (attention and dense-MLP families).

``RankShard`` owns the rank's place in the group (rank, size) and turns the full architecture
and checkpoint into this rank's: ``local_arch`` keeps ``1/size`` of the query heads, of the
key/value heads (each rank keeps a copy of one when there are fewer of them than ranks) and of
the MLP's intermediate width, so the model classes build the rank's widths unchanged and the KV
layout sizes the rank's pages; ``shard_weights`` slices q/k/v and gate/up by output rows and o/down
by input columns; ``add_all_reduce`` sums each row-parallel output over the group. Embeddings,
norms and the logits stay whole on every rank (the logits need no gather).

Invariants: every rank runs the same steps in the same order (its collectives pair up); a
row-parallel bias is kept on rank 0 only so the sum adds it once.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import nn

from engine.model.arch.model_arch import ModelArch
from engine.model.tensor_parallel import TensorParallelError, shard_problems

SHARDED_FAMILIES = ("llama", "gemma3")  # dense attention + MLP; the recurrent and MoE mixers are not split yet


@dataclass(frozen=True)
class RankShard:
    """Rank ``rank`` of ``size`` (torch.distributed's default group). Invariant: 0 <= rank < size."""

    rank: int
    size: int

    @staticmethod
    def current() -> RankShard | None:
        """This process's shard when torch.distributed is initialised with more than one rank."""
        if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
            return None
        return RankShard(dist.get_rank(), dist.get_world_size())

    def check(self, arch: ModelArch, model: str) -> None:
        if arch.family not in SHARDED_FAMILIES or arch.moe is not None:
            raise TensorParallelError(
                f"tensor_parallel_size={self.size}: model {model} ({arch.family}) is not sharded yet"
                f" (sharded: {', '.join(SHARDED_FAMILIES)} without MoE)"
            )
        problems = shard_problems(arch, self.size)
        if problems:
            raise TensorParallelError(
                f"tensor_parallel_size={self.size} does not divide model {model}: {'; '.join(problems)}"
            )

    def local_arch(self, arch: ModelArch) -> ModelArch:
        return replace(
            arch,
            num_heads=arch.num_heads // self.size,
            num_kv_heads=max(1, arch.num_kv_heads // self.size),
            intermediate_size=arch.intermediate_size // self.size,
        )

    def _kv_rows(self, arch: ModelArch) -> slice:
        """The rank's key/value heads' rows (in heads): a block of them, or the one it replicates."""
        kv = arch.num_kv_heads
        if kv >= self.size:
            per = kv // self.size
            return slice(self.rank * per, (self.rank + 1) * per)
        head = self.rank // (self.size // kv)
        return slice(head, head + 1)

    def shard_weights(self, arch: ModelArch, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's slice of each weight of the full checkpoint (unsplit ones as they are)."""
        d, r, n = arch.head_dim, self.rank, self.size
        heads = arch.num_heads // n
        kv = self._kv_rows(arch)
        inter = arch.intermediate_size // n
        out: dict[str, torch.Tensor] = {}
        for name, tensor in weights.items():
            leaf = name.rsplit(".", 2)
            module, kind = (leaf[-2], leaf[-1]) if len(leaf) >= 2 else ("", name)
            if module == "q_proj":
                tensor = tensor[r * heads * d : (r + 1) * heads * d]
            elif module in ("k_proj", "v_proj"):
                tensor = tensor[kv.start * d : kv.stop * d]
            elif module in ("gate_proj", "up_proj"):
                tensor = tensor[r * inter : (r + 1) * inter]
            elif module == "o_proj":
                tensor = tensor[:, r * heads * d : (r + 1) * heads * d] if kind == "weight" else self._row_bias(tensor)
            elif module == "down_proj":
                tensor = tensor[:, r * inter : (r + 1) * inter] if kind == "weight" else self._row_bias(tensor)
            elif name.endswith("self_attn.sinks"):
                tensor = tensor[r * heads : (r + 1) * heads]
            out[name] = tensor.contiguous()
        return out

    def _row_bias(self, bias: torch.Tensor) -> torch.Tensor:
        return bias if self.rank == 0 else torch.zeros_like(bias)

    def add_all_reduce(self, model: nn.Module) -> int:
        """Sum every attention ``o_proj`` and MLP ``down_proj`` output over the group; returns how many."""
        count = 0
        for name, module in model.named_modules():
            if isinstance(module, nn.Linear) and name.endswith(("self_attn.o_proj", "mlp.down_proj")):
                module.register_forward_hook(_all_reduce_output)
                count += 1
        return count


def _all_reduce_output(module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(output)
    return output
