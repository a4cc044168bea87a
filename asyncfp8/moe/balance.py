"""How evenly the experts are used: the load-balancing loss (`optim.router_aux_coef`) and
the per-expert token shares behind the `moe/expert_load_*` metrics."""

from __future__ import annotations

import torch


def load_balancing_loss(
    logits: list[torch.Tensor], mask: torch.Tensor, experts: int, top_k: int
) -> torch.Tensor:
    """Switch Transformer's auxiliary loss as Qwen3-MoE trains with it (transformers'
    `load_balancing_loss_func`): experts · Σ_e f_e · P_e, with f_e expert e's top-k picks
    per token and P_e its mean router probability, over the real tokens (`mask`, [B, T]) of
    every layer's logits ([B·T, experts] each). top_k when the load is even; up to
    `experts` when the same experts take every token, with certainty."""
    # Imported here: asyncfp8.precision names experts through this package, and must not
    # load transformers' models on import (a bench's own `kernels` module shadows theirs).
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    return load_balancing_loss_func(tuple(logits), experts, top_k, mask)


class ExpertLoad:
    """Top-k picks per layer and expert, added up over real tokens (summed over ranks by
    the caller); `metrics` reads them as shares × experts (1: an even load)."""

    def __init__(self, layers: int, experts: int):
        self.counts = torch.zeros(layers, experts, dtype=torch.float64)

    def add(self, chosen: list[torch.Tensor], mask: torch.Tensor) -> None:
        real = mask.reshape(-1).bool().cpu()
        for layer, picks in enumerate(chosen):
            picks = picks.detach().cpu()[real].reshape(-1)
            self.counts[layer] += torch.bincount(picks, minlength=self.counts.shape[1]).double()

    def as_floats(self) -> dict[str, float]:
        return {f"{i}": float(v) for i, v in enumerate(self.counts.reshape(-1).tolist())}

    def load_floats(self, values: dict[str, float]) -> None:
        flat = torch.tensor([values[f"{i}"] for i in range(self.counts.numel())])
        self.counts = flat.reshape(self.counts.shape).double()

    def metrics(self) -> dict[str, float]:
        """moe/expert_load_max and _min: over layers, the busiest and the idlest expert's
        share of the picks times the expert count (1 each when even; 0 min: a starved
        expert). Empty before any pick."""
        totals = self.counts.sum(-1, keepdim=True)
        if not bool((totals > 0).all()):
            return {}
        load = self.counts / totals * self.counts.shape[1]
        return {"moe/expert_load_max": load.max().item(), "moe/expert_load_min": load.min().item()}
