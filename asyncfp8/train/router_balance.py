"""An MoE learner's router terms in a train step: the routers read during each micro-batch's
forward, the load-balancing loss added to its loss at `optim.router_aux_coef`, and the
moe/* metrics (the loss, and the experts' load over every rank). docs/moe.md"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from asyncfp8.moe import ExpertLoad, RouterTap, load_balancing_loss, moe_layout
from asyncfp8.run import distributed
from asyncfp8.train.sums import StepTotals, UpdateSums


class RouterBalance:
    """The router terms of `model`'s train steps (`of`: None for a dense model)."""

    def __init__(self, model: torch.nn.Module, coef: float):
        self.tap = RouterTap(model)
        self.coef = coef
        layout = self.tap.layout
        self.load = ExpertLoad(len(layout.layers), layout.experts)

    @classmethod
    def of(cls, model: torch.nn.Module, coef: float) -> RouterBalance | None:
        return cls(model, coef) if moe_layout(getattr(model, "config", None)) else None

    def start_step(self) -> None:
        layout = self.tap.layout
        self.load = ExpertLoad(len(layout.layers), layout.experts)

    @contextlib.contextmanager
    def reading(self) -> Iterator[RouterTap]:
        """Around a micro-batch's forward: its routers recorded."""
        with self.tap.reading() as routes:
            yield routes

    def term(
        self, routes: RouterTap, mask: torch.Tensor, denominator: float, sums: UpdateSums
    ) -> torch.Tensor | float:
        """The load-balancing term of a micro-batch's loss numerator: the weight times the
        loss over its real tokens (`mask`, [B, T]), times the micro-batch's denominator so
        that the update's Σ numerators / Σ denominators holds its mean. The loss and the
        experts' picks are recorded whatever the weight (0: no gradient)."""
        layout = routes.layout
        if len(routes.logits) != len(layout.layers):  # one forward, each router once
            raise RuntimeError(
                f"read {len(routes.logits)} router outputs in a micro-batch's forward of a "
                f"model of {len(layout.layers)} MoE layers"
            )
        with torch.set_grad_enabled(self.coef > 0 and torch.is_grad_enabled()):
            aux = load_balancing_loss(routes.logits, mask, layout.experts, layout.top_k)
        sums.router_aux += aux.item() * denominator
        self.load.add(routes.chosen, mask)
        return self.coef * denominator * aux if self.coef > 0 else 0.0

    def metrics(self, totals: StepTotals) -> dict[str, float]:
        """moe/*: the load-balancing loss (a mean over the step's updates) and the experts'
        load over every rank's real tokens (a collective: every rank calls it)."""
        self.load.load_floats(distributed.sum_over_ranks(self.load.as_floats()))
        aux = totals.router_aux / max(totals.passes, 1)
        return self.load.metrics() | {"moe/router_aux_loss": aux}
