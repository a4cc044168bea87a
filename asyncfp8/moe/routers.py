"""The routers' decisions during a forward: `RouterTap` hooks each MoE layer's router
(`mlp.gate`) and keeps, per layer, its logits over the experts (with their graph, for the
load-balancing loss) and the experts it picked, for the forwards run inside it only (an
activation-checkpointed layer's recompute in the backward adds nothing)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from .architectures import moe_layout


class RouterTap:
    """Reads the routers of `model` (a supported MoE: `moe_layout`)."""

    def __init__(self, model: nn.Module):
        layout = moe_layout(model.config)
        if layout is None:
            raise ValueError(f"{type(model).__name__} has no routed experts to tap")
        self.layout = layout
        self.routers = [
            module
            for name, module in model.named_modules()
            if name.endswith("mlp.gate") and hasattr(module, "top_k")
        ]
        if len(self.routers) != len(layout.layers):
            raise ValueError(
                f"found {len(self.routers)} routers (mlp.gate) in a model of "
                f"{len(layout.layers)} MoE layers"
            )
        self.logits: list[torch.Tensor] = []  # per layer, [tokens, experts]
        self.chosen: list[torch.Tensor] = []  # per layer, [tokens, top_k]
        self._armed = False
        for router in self.routers:
            router.register_forward_hook(self._record)

    def _record(self, module: nn.Module, args, output) -> None:
        if self._armed:
            logits, _, indices = output
            self.logits.append(logits)
            self.chosen.append(indices)

    @contextlib.contextmanager
    def reading(self) -> Iterator[RouterTap]:
        """Inside: the forwards' routers are recorded (the previous record dropped)."""
        self.logits, self.chosen = [], []
        self._armed = True
        try:
            yield self
        finally:
            self._armed = False
