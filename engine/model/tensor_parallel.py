"""What tensor parallelism asks of a model: the checks made before any worker starts.

A worker of ``T`` ranks splits every attention layer's query heads ``T`` ways (key/value heads
too, or each rank keeps a copy of one when there are fewer of them than ranks), every dense
MLP's and every expert's intermediate width, a Mamba2 mixer's heads and its gated norm's
groups (a single group is replicated, its norm's sum all-reduced), and a Gated DeltaNet
mixer's key and value heads. Embeddings and the logits stay whole on every rank.
``shard_problems`` lists each width that does not divide; ``check_tensor_parallel`` turns them
into one error naming the config field, the model and the number, and refuses more ranks than
one node has devices (the ranks of a worker share a node).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from configs.schema import ClusterConfig
from engine.model.arch.model_arch import ModelArch


class TensorParallelError(ValueError):
    """A ``tensor_parallel_size`` this model or node cannot run; the message names the field."""


def _divides(problems: list[str], what: str, width: int, size: int) -> None:
    if width % size:
        problems.append(f"{what} = {width}, not divisible by {size}")


def shard_problems(arch: ModelArch, size: int) -> list[str]:
    """Each width of ``arch`` that ``size`` ranks cannot split (empty: the model shards)."""
    problems: list[str] = []
    if size == 1:
        return problems
    kinds = {layer.kind for layer in arch.layers}
    if kinds & {"full_attention", "sliding_attention"}:
        _divides(problems, "attention heads", arch.num_heads, size)
        kv = arch.num_kv_heads
        if kv >= size and kv % size:
            problems.append(f"key/value heads = {kv}, not divisible by {size}")
        elif kv < size and size % kv:
            problems.append(
                f"key/value heads = {kv}, fewer than {size} ranks and not a divisor of it (cannot be replicated)"
            )
    dense = (
        arch.moe is None
        or bool(arch.dense_mlp_layers)
        or any(layer.kind == "mlp" and not layer.moe for layer in arch.layers)
    )
    if dense and arch.intermediate_size:
        _divides(problems, "MLP intermediate size", arch.intermediate_size, size)
    if arch.moe is not None:
        _divides(problems, "expert intermediate size", arch.moe.intermediate_size, size)
        if arch.moe.shared_intermediate_size:
            _divides(problems, "shared expert intermediate size", arch.moe.shared_intermediate_size, size)
    if arch.mamba is not None and "mamba" in kinds:
        _divides(problems, "Mamba2 heads", arch.mamba.num_heads, size)
        groups = arch.mamba.n_groups
        if groups != 1 and groups % size:
            problems.append(f"Mamba2 groups = {groups}, not divisible by {size} (only a single group is replicated)")
    if arch.gated_deltanet is not None:
        _divides(problems, "Gated DeltaNet key heads", arch.gated_deltanet.num_k_heads, size)
        _divides(problems, "Gated DeltaNet value heads", arch.gated_deltanet.num_v_heads, size)
    return problems


def check_tensor_parallel(
    arch: ModelArch, size: int, *, field: str, model: str, devices_per_node: int | None = None, device: str = "cpu"
) -> None:
    """Raise TensorParallelError unless ``size`` ranks can split ``arch`` and fit on one node
    that has ``devices_per_node`` devices of kind ``device`` (None: not checked)."""
    if size < 1:
        raise TensorParallelError(f"{field}: must be >= 1 (got {size})")
    problems = shard_problems(arch, size)
    if problems:
        raise TensorParallelError(f"{field}={size} does not divide model {model}: " + "; ".join(problems))
    if devices_per_node is not None and size > devices_per_node:
        unit = "GPUs" if device == "cuda" else "CPUs"
        raise TensorParallelError(
            f"{field}={size}: a worker's ranks share one node, but the largest node has {devices_per_node} {unit}"
            f" (model {model})"
        )


def largest_node_devices(nodes: list[dict[str, object]], device: str) -> int:
    """The most devices of kind ``device`` on one alive node, from Ray's ``ray.nodes()`` list."""
    key = "GPU" if device == "cuda" else "CPU"
    counts = [0]
    for node in nodes:
        resources = node.get("Resources")
        if node.get("Alive", True) and isinstance(resources, dict):
            counts.append(int(float(resources.get(key, 0.0))))
    return max(counts)


def check_workers_tensor_parallel(config: ClusterConfig, arch: ModelArch, devices_per_node: int | None) -> None:
    """Check each role's ``tensor_parallel_size`` against the model and the largest node.

    Workers run one rank each today, so a size above 1 that passes the model checks is refused
    too (named as not yet served) rather than silently run on one rank."""
    workers = config.workers
    roles: tuple[tuple[Literal["prefill", "decode"], int], ...] = (
        ("prefill", workers.num_prefill),
        ("decode", workers.num_decode),
    )
    for role, count in roles:
        if count == 0:
            continue
        field, size = workers.tensor_parallel(role)
        check_tensor_parallel(
            arch,
            size,
            field=field,
            model=config.model.source,
            devices_per_node=devices_per_node,
            device=config.model.device,
        )
        if size > 1:
            raise TensorParallelError(
                f"{field}={size}: model {config.model.source} shards {size} ways, but workers of more than one"
                " rank are not served yet (set it to 1)"
            )


def check_tensor_parallel_at_edge(config: ClusterConfig, model_directory: Path, nodes: list[dict[str, object]]) -> None:
    """``check_workers_tensor_parallel`` for the model in ``model_directory`` on the nodes Ray lists."""
    from engine.model.arch.hf_config import arch_from_hf_config
    from engine.model.checkpoints.loader import read_hf_config

    arch = arch_from_hf_config(read_hf_config(model_directory), config.model.sliding_window_override)
    check_workers_tensor_parallel(config, arch, largest_node_devices(nodes, config.model.device))
