"""The sparse mixture-of-experts MLP, written once for every MoE architecture kvfleet serves.

Interface::

    block = SparseMoE(moe: MoEArch, hidden_size: int)
    y = block(x)                       # x, y: [T, hidden]; T = the step's flattened tokens
    weights, experts = block.route(x)  # [T, top_k] routing weights (x.dtype), expert ids (long)

Parameter names follow the checkpoint convention that ``moe.layout`` names (see ``MoEArch``), so
``load_state_dict`` maps Hugging Face weights by name:

=========  =======================================  ==============================================
layout     router                                   experts (E experts, I = moe.intermediate_size)
=========  =======================================  ==============================================
qwen       ``gate.weight`` [E, H] (+ ``gate.bias``  ``experts.{e}.gate_proj/up_proj.weight`` [I, H],
           if ``router_bias``)                      ``experts.{e}.down_proj.weight`` [H, I]
gpt_oss    ``router.weight`` [E, H], ``router.bias``  ``experts.gate_up_proj`` [E, H, 2I] (gate/up
                                                    interleaved), ``experts.gate_up_proj_bias``
                                                    [E, 2I], ``experts.down_proj`` [E, I, H],
                                                    ``experts.down_proj_bias`` [E, H]
granite    ``router.layer.weight`` [E, H]           ``input_linear.weight`` [E, 2I, H] (gate half
                                                    then up half), ``output_linear.weight`` [E, H, I]
=========  =======================================  ==============================================

With ``moe.shared_intermediate_size > 0`` (qwen layout) the block also owns ``shared_expert``
(``gate_proj/up_proj/down_proj``) added to every token's output, scaled by
``sigmoid(shared_expert_gate(x))`` when ``moe.shared_expert_gate`` (Qwen3-Next, Qwen2-MoE).
GraniteMoeHybrid keeps its shared MLP beside the block (``shared_mlp.input_linear`` /
``output_linear``): build it with ``FusedGatedMLP`` and add its output yourself.

Routing: ``softmax_topk`` takes softmax over all experts in fp32, then the top k (renormalised to
sum 1 when ``norm_topk_prob``); ``topk_softmax`` takes the top k logits and a softmax over them.
Dispatch is batched: the T x k (token, expert) pairs are sorted by expert once, each expert that
received tokens runs one matmul over its contiguous slice (a loop over experts with tokens, never
over tokens), and the weighted rows are summed back per token with one ``index_add_``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.arch.model_arch import MoEArch
from engine.model.layers.blocks import GatedMLP, activation
from engine.model.layers.parallel import all_reduce


class FusedGatedMLP(nn.Module):
    """A gated MLP whose gate and up projections are one matrix: ``input_linear`` [2I, H] (gate rows
    first), ``output_linear`` [H, I]. GraniteMoeHybrid's ``shared_mlp``."""

    def __init__(self, hidden: int, intermediate: int, act: str):
        super().__init__()
        self.input_linear = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.output_linear = nn.Linear(intermediate, hidden, bias=False)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.input_linear(x).chunk(2, dim=-1)
        return self.output_linear(self.act(gate) * up)


class ExpertBank(nn.Module):
    """One weight matrix per expert, stored stacked: ``weight`` [E, out, in] (granite's
    ``input_linear`` / ``output_linear``)."""

    def __init__(self, num_experts: int, out_features: int, in_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, out_features, in_features))

    def apply_expert(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight[expert])


class GptOssExperts(nn.Module):
    """gpt-oss experts: ``x @ gate_up_proj[e] + bias`` gives interleaved (gate, up) pairs; the
    output is ``((up.clamp(±limit) + 1) * g * sigmoid(alpha * g)) @ down_proj[e] + bias`` with
    ``g = gate.clamp(max=limit)``."""

    def __init__(self, moe: MoEArch, hidden: int):
        super().__init__()
        e, i = moe.num_experts, moe.intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, hidden, 2 * i))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(e, 2 * i))
        self.down_proj = nn.Parameter(torch.empty(e, i, hidden))
        self.down_proj_bias = nn.Parameter(torch.empty(e, hidden))
        self.alpha, self.limit = moe.swiglu_alpha, moe.swiglu_limit

    def apply_expert(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        gate_up = torch.addmm(self.gate_up_proj_bias[expert], x, self.gate_up_proj[expert])
        gate = gate_up[:, 0::2].clamp(max=self.limit)
        up = gate_up[:, 1::2].clamp(min=-self.limit, max=self.limit)
        hidden = (up + 1) * (gate * torch.sigmoid(gate * self.alpha))
        return torch.addmm(self.down_proj_bias[expert], hidden, self.down_proj[expert])


class _RouterHolder(nn.Module):
    """Granite nests its router one level deeper (``router.layer.weight``)."""

    def __init__(self, layer: nn.Linear):
        super().__init__()
        self.layer = layer


class SparseMoE(nn.Module):
    """Owns one layer's router, experts and optional shared expert (parameter names per
    ``moe.layout``, see the module docstring). Invariants: every token gets exactly ``top_k``
    distinct experts; an expert's output is weighted by its routing weight and summed per token;
    the shared expert (if any) sees every token. ``reduce``: ``moe`` is one tensor-parallel rank's
    slice of every expert's width (engine/model/layers/parallel.py), so the block's output (routed
    plus shared) is summed over the ranks once."""

    def __init__(self, moe: MoEArch, hidden_size: int, reduce: bool = False):
        super().__init__()
        self.reduce = reduce
        if moe.layout not in _EXPERT_FNS:
            raise ValueError(f"moe.layout: {moe.layout!r} is not supported ({', '.join(_EXPERT_FNS)})")
        if moe.scoring not in ("softmax_topk", "topk_softmax"):
            raise ValueError(f"moe.scoring: {moe.scoring!r} is not supported (softmax_topk, topk_softmax)")
        if not 0 < moe.top_k <= moe.num_experts:
            raise ValueError(f"moe.top_k: {moe.top_k} must be in [1, num_experts={moe.num_experts}]")
        self.moe = moe
        e, i, h = moe.num_experts, moe.intermediate_size, hidden_size
        self.experts: nn.ModuleList | GptOssExperts
        self.router: nn.Linear | _RouterHolder
        if moe.layout == "qwen":
            self.gate = nn.Linear(h, e, bias=moe.router_bias)
            self.experts = nn.ModuleList(GatedMLP(h, i, moe.hidden_act) for _ in range(e))
        elif moe.layout == "gpt_oss":
            self.router = nn.Linear(h, e, bias=moe.router_bias)
            self.experts = GptOssExperts(moe, h)
        else:  # granite
            self.router = _RouterHolder(nn.Linear(h, e, bias=moe.router_bias))
            self.input_linear = ExpertBank(e, 2 * i, h)
            self.output_linear = ExpertBank(e, h, i)
            self.act = activation(moe.hidden_act)
        if moe.shared_intermediate_size:
            if moe.layout != "qwen":
                raise ValueError(
                    f"moe.shared_intermediate_size: a shared expert inside the block needs layout 'qwen', "
                    f"not {moe.layout!r}"
                )
            self.shared_expert = GatedMLP(h, moe.shared_intermediate_size, moe.hidden_act)
            if moe.shared_expert_gate:
                self.shared_expert_gate = nn.Linear(h, 1, bias=False)

    def router_linear(self) -> nn.Linear:
        if self.moe.layout == "qwen":
            return self.gate
        router = self.router
        return router.layer if isinstance(router, _RouterHolder) else router

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per token: the ``top_k`` routing weights (``x.dtype``) and expert ids."""
        logits = self.router_linear()(x).float()
        k = self.moe.top_k
        if self.moe.scoring == "softmax_topk":
            weights, experts = torch.softmax(logits, dim=-1).topk(k, dim=-1)
            if self.moe.norm_topk_prob:
                weights = weights / weights.sum(dim=-1, keepdim=True)
        else:
            top, experts = logits.topk(k, dim=-1)
            weights = torch.softmax(top, dim=-1)
        return weights.to(x.dtype), experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.route(x)
        out = self._dispatch(x, weights, experts)
        if self.moe.shared_intermediate_size:
            shared = self.shared_expert(x)
            if self.moe.shared_expert_gate:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return all_reduce(out) if self.reduce else out

    def _dispatch(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        k = self.moe.top_k
        flat = experts.reshape(-1)  # pair p = token p // k, its (p % k)-th choice
        order = torch.argsort(flat, stable=True)
        tokens = order // k
        counts = torch.bincount(flat, minlength=self.moe.num_experts).tolist()  # one host sync per layer
        grouped = x.index_select(0, tokens)
        results = torch.empty_like(grouped)
        expert_fn = _EXPERT_FNS[self.moe.layout]
        start = 0
        for expert, n in enumerate(counts):
            if n:
                results[start : start + n] = expert_fn(self, expert, grouped[start : start + n])
                start += n
        results.mul_(weights.reshape(-1).index_select(0, order)[:, None])
        return torch.zeros_like(x).index_add_(0, tokens, results)


def _qwen_expert(block: SparseMoE, expert: int, x: torch.Tensor) -> torch.Tensor:
    return block.experts[expert](x)  # type: ignore[index]  # layout "qwen": a ModuleList


def _gpt_oss_expert(block: SparseMoE, expert: int, x: torch.Tensor) -> torch.Tensor:
    return block.experts.apply_expert(expert, x)  # type: ignore[operator]  # layout "gpt_oss": GptOssExperts


def _granite_expert(block: SparseMoE, expert: int, x: torch.Tensor) -> torch.Tensor:
    gate, up = block.input_linear.apply_expert(expert, x).chunk(2, dim=-1)
    return block.output_linear.apply_expert(expert, block.act(gate) * up)


# layout -> how one expert maps its tokens' hidden states (add a layout here and in SparseMoE.__init__)
_EXPERT_FNS: dict[str, Callable[[SparseMoE, int, torch.Tensor], torch.Tensor]] = {
    "qwen": _qwen_expert,
    "gpt_oss": _gpt_oss_expert,
    "granite": _granite_expert,
}
