"""An MoE learner's routers in a train step: the engine's routes compared with the
learner's and, with `correction.routing_replay`, replayed in every forward of the policy;
the load-balancing loss added at `optim.router_aux_coef`; and the moe/* metrics (routing
mismatch, replayed tokens, the loss, the experts' load over every rank). docs/moe.md"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from asyncfp8.moe import ExpertLoad, RouterTap, load_balancing_loss, moe_layout
from asyncfp8.moe.routes import batch_routes
from asyncfp8.run import distributed
from asyncfp8.train.batches import TrainBatch
from asyncfp8.train.sums import StepTotals, UpdateSums


class MoERouting:
    """The router terms of `model`'s train steps (`of`: None for a dense model)."""

    def __init__(self, model: torch.nn.Module, coef: float, replay: bool):
        self.tap = RouterTap(model)
        self.coef, self.replay = coef, replay
        # the last batch's routes, laid out once for its forward, backward and π_prox
        self._laid_out: tuple[TrainBatch, torch.Tensor] | None = None
        self.start_step()

    @classmethod
    def of(cls, model: torch.nn.Module, coef: float, replay: bool) -> MoERouting | None:
        return cls(model, coef, replay) if moe_layout(getattr(model, "config", None)) else None

    def start_step(self) -> None:
        layout = self.tap.layout
        self.load = ExpertLoad(len(layout.layers), layout.experts)
        self.tap.take_counts()
        self._laid_out = None

    @contextlib.contextmanager
    def reading(self) -> Iterator[RouterTap]:
        """Around a micro-batch's forward: its routers recorded."""
        with self.tap.reading() as routes:
            yield routes

    def routed(self, batch: TrainBatch) -> contextlib.AbstractContextManager:
        """Around a forward (and its backward) of `batch`: its engine routes compared
        and, replaying, used."""
        if batch.routes is None:
            return contextlib.nullcontext()
        if self._laid_out is None or self._laid_out[0] is not batch:
            lengths = batch.attention_mask.sum(1).tolist()
            width = batch.input_ids.shape[1]
            routes = batch_routes(batch.routes, lengths, width, self.tap.layout)
            self._laid_out = (batch, routes)
        return self.tap.routed(self._laid_out[1], self.replay)

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
        """moe/*: the load-balancing loss (a mean over the step's updates), the experts'
        load, and the routing mismatch and replayed tokens over every rank's micro-batches
        (a collective: every rank calls it)."""
        compared, mismatched, replayed = self.tap.take_counts()
        counts = {"compared": compared, "mismatched": mismatched, "replayed": replayed}
        summed = distributed.sum_over_ranks(self.load.as_floats() | counts)
        self.load.load_floats(summed)
        out = self.load.metrics() | {
            "moe/router_aux_loss": totals.router_aux / max(totals.passes, 1)
        }
        if summed["compared"] > 0:
            out["moe/routing_mismatch"] = summed["mismatched"] / summed["compared"]
            out["moe/replayed_tokens"] = summed["replayed"]
        return out
