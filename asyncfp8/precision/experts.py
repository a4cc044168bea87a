"""An MoE's experts under a weight format: each expert is its checkpoint's three linears
(`mlp.experts.{e}.gate_proj.weight`, `up_proj`, `down_proj`), quantized one by one as a
dense layer's are; the router stays 16-bit. `split_experts` gives an engine (or the probe's
reference) nn.Linears to swap; `FakeQuantExperts` is the learner's quantized forward over
its fused parameters. docs/moe.md, "Experts in 8 bits"."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn

from asyncfp8.moe.checkpoint_names import expert_parts

from .modules import QuantizingPolicy, straight_through

NamedTensors = Iterable[tuple[str, torch.Tensor]]


def _is_fused_experts(module: nn.Module) -> bool:
    """transformers' fused experts (Qwen3-MoE's `Qwen3MoeExperts`): 3-D `gate_up_proj`
    [experts, 2·I, H] and `down_proj` [experts, H, I]."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return (
        isinstance(gate_up, nn.Parameter)
        and isinstance(down, nn.Parameter)
        and gate_up.dim() == 3
        and down.dim() == 3
    )


def fused_experts(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every fused experts module in `model`."""
    return [(name, m) for name, m in model.named_modules() if _is_fused_experts(m)]


def split_named(named: NamedTensors) -> Iterator[tuple[str, torch.Tensor]]:
    """`named` with each fused expert tensor replaced by its experts' linear weights under
    checkpoint names (views); every other tensor as it is."""
    for name, tensor in named:
        parts = expert_parts(name, tensor)
        yield from parts if parts is not None else ((name, tensor),)


def _linear(weight: torch.Tensor) -> nn.Linear:
    linear = nn.Linear(
        weight.shape[1], weight.shape[0], bias=False, device=weight.device, dtype=weight.dtype
    )
    with torch.no_grad():
        linear.weight.copy_(weight)
    return linear


class ExpertMLP(nn.Module):
    """One expert: act(gate_proj(x)) · up_proj(x), then down_proj."""

    def __init__(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, act_fn):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = _linear(gate), _linear(up), _linear(down)
        self.act_fn = act_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def routed_sum(
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    expert: Callable[[int, torch.Tensor], torch.Tensor],
    count: int,
) -> torch.Tensor:
    """Σ over each token's routed experts of weight · expert(e, its rows), as transformers'
    Qwen3MoeExperts sums it (experts in index order, index_add into the token's row)."""
    out = torch.zeros_like(hidden_states)
    with torch.no_grad():
        hit = torch.zeros(count + 1, dtype=torch.long, device=top_k_index.device)
        hit.index_add_(0, top_k_index.reshape(-1), torch.ones_like(top_k_index.reshape(-1)))
        experts = (hit[:count] > 0).nonzero().flatten().tolist()
    for e in experts:
        token_idx, top_k_pos = torch.where(top_k_index == e)
        rows = expert(e, hidden_states[token_idx])
        rows = rows * top_k_weights[token_idx, top_k_pos, None]
        out.index_add_(0, token_idx, rows.to(out.dtype))
    return out


class ExpertLinears(nn.ModuleList):
    """A fused experts module as one ExpertMLP per expert (children `0` .. `E-1`, so
    that parameters carry checkpoint names), with transformers' forward signature."""

    def __init__(self, fused: nn.Module):
        gate_up, down = fused.gate_up_proj.detach(), fused.down_proj.detach()
        half = gate_up.shape[1] // 2
        super().__init__(
            ExpertMLP(gate_up[e, :half], gate_up[e, half:], down[e], fused.act_fn)
            for e in range(gate_up.shape[0])
        )
        #: the experts as grouped GEMMs over stacked weights, where the engine's device and
        #: format allow (grouped_experts.py); None: the loop over the experts
        self.grouped = None

    def forward(self, hidden_states, top_k_index, top_k_weights):
        if self.grouped is not None:
            return self.grouped(hidden_states, top_k_index, top_k_weights)
        return routed_sum(
            hidden_states, top_k_index, top_k_weights, lambda e, x: self[e](x), len(self)
        )


def split_experts(model: nn.Module) -> nn.Module:
    """Replaces, in place, every fused experts module of `model` by its ExpertLinears.
    Returns the model."""
    for name, module in fused_experts(model):
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, ExpertLinears(module))
    return model


class FakeQuantExperts(nn.Module):
    """The learner's experts as the engine computes them: the same fused parameters
    (names, optimizer state and FSDP shards unchanged), each expert linear's weight and
    input quantize-dequantized by the policy, straight-through gradients."""

    def __init__(self, fused: nn.Module, name: str, policy: QuantizingPolicy):
        super().__init__()
        self.gate_up_proj, self.down_proj = fused.gate_up_proj, fused.down_proj
        self.act_fn, self.quantized_name, self.policy = fused.act_fn, name, policy

    def _fake_weight(self, kind: str, fused: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            parts = expert_parts(f"{self.quantized_name}.{kind}", fused.detach())
            rounded = [
                self.policy.fake_quantize_weight(n, w).to(w.dtype)
                if self.policy.quantizes(n, w)
                else w
                for n, w in parts
            ]
            per_expert = 2 if kind == "gate_up_proj" else 1
            experts = [
                torch.cat(rounded[e : e + per_expert]) for e in range(0, len(rounded), per_expert)
            ]
        return straight_through(fused, torch.stack(experts))

    def _input(self, name: str, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            rounded = self.policy.fake_quantize_input(name, x.detach())
        return straight_through(x, rounded)

    def _expert(self, e: int, x, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
        prefix = f"{self.quantized_name}.{e}"
        half = gate_up.shape[1] // 2
        gate = nn.functional.linear(self._input(f"{prefix}.gate_proj.weight", x), gate_up[e, :half])
        up = nn.functional.linear(self._input(f"{prefix}.up_proj.weight", x), gate_up[e, half:])
        hidden = self.act_fn(gate) * up
        return nn.functional.linear(self._input(f"{prefix}.down_proj.weight", hidden), down[e])

    def forward(self, hidden_states, top_k_index, top_k_weights):
        gate_up = self._fake_weight("gate_up_proj", self.gate_up_proj)
        down = self._fake_weight("down_proj", self.down_proj)
        return routed_sum(
            hidden_states,
            top_k_index,
            top_k_weights,
            lambda e, x: self._expert(e, x, gate_up, down),
            gate_up.shape[0],
        )


def use_fake_quant_experts(model: nn.Module, policy: QuantizingPolicy) -> nn.Module:
    """Swaps every fused experts module for a FakeQuantExperts, in place."""
    for name, module in fused_experts(model):
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, FakeQuantExperts(module, name, policy))
    return model
