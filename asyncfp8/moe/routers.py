"""The learner's routers during a forward. `RouterTap` hooks each MoE layer's router
(`mlp.gate`): inside `reading()` it keeps each layer's logits (with their graph, for the
load-balancing loss) and the experts used; inside `routed(routes, replay)` it compares its
picks with the engine's (`moe/routing_mismatch`) and, replaying, routes each token to the
engine's experts, weighted by its own router's probabilities of them (R3)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch
from torch import nn

from .architectures import moe_layout
from .routes import NO_ROUTE, routers_of


class RouterTap:
    """Reads (and may replay) the routers of `model` (a supported MoE: `moe_layout`)."""

    def __init__(self, model: nn.Module):
        layout = moe_layout(getattr(model, "config", None))
        if layout is None:
            raise ValueError(f"{type(model).__name__} has no routed experts to tap")
        self.layout = layout
        self.routers = routers_of(model)
        if len(self.routers) != len(layout.layers):
            raise ValueError(
                f"found {len(self.routers)} routers (mlp.gate) in a model of "
                f"{len(layout.layers)} MoE layers"
            )
        self.logits: list[torch.Tensor] = []  # per layer, [tokens, experts]
        self.chosen: list[torch.Tensor] = []  # per layer, [tokens, top_k]
        self._armed = False
        self._routes: torch.Tensor | None = None  # [tokens, layers, top_k], the engine's
        self._replay = False
        # token × layer pairs with an engine route read inside reading(), those whose set
        # the learner picks otherwise, and the tokens replayed: device counts (no sync per
        # layer), read by take_counts
        self._counts: torch.Tensor | None = None
        for layer, router in enumerate(self.routers):
            router.register_forward_hook(functools.partial(self._on_router, layer))

    def _on_router(self, layer: int, module: nn.Module, args, output):
        logits, scores, indices = output
        if self._routes is not None:
            engine = self._routes[:, layer].to(device=indices.device, dtype=torch.long)
            has = (engine != NO_ROUTE).all(-1)
            if self._armed:
                own, theirs = indices.sort(-1).values, engine.sort(-1).values
                differ = ((own != theirs).any(-1) & has).sum()
                replayed = has.sum() if self._replay and layer == 0 else torch.zeros_like(differ)
                counts = torch.stack([has.sum(), differ, replayed])
                self._counts = counts if self._counts is None else self._counts + counts
            if self._replay:
                indices = torch.where(has[:, None], engine, indices)
                weights = torch.softmax(logits, dim=-1, dtype=torch.float).gather(-1, indices)
                if getattr(module, "norm_topk_prob", False):
                    weights = weights / weights.sum(-1, keepdim=True)
                scores = torch.where(has[:, None], weights.to(scores.dtype), scores)
        if self._armed:
            self.logits.append(logits)
            self.chosen.append(indices)
        return logits, scores, indices

    @contextlib.contextmanager
    def reading(self) -> Iterator[RouterTap]:
        """Inside: the forwards' routers are recorded (the previous record dropped)."""
        self.logits, self.chosen = [], []
        self._armed = True
        try:
            yield self
        finally:
            self._armed = False

    @contextlib.contextmanager
    def routed(self, routes: torch.Tensor | None, replay: bool) -> Iterator[None]:
        """Inside: the engine's `routes` ([B, T, layers, top_k], NO_ROUTE where none ran;
        None: no effect) compared with the learner's picks and, with `replay`, used in
        their place. Around a forward and its backward (a checkpointed layer's recompute
        must route as its forward did)."""
        before = self._routes, self._replay
        if routes is not None:
            self._routes = routes.reshape(-1, *routes.shape[2:])
            self._replay = replay
        try:
            yield
        finally:
            self._routes, self._replay = before

    def take_counts(self) -> tuple[int, int, int]:
        """(compared, mismatched, replayed) since the last take."""
        counts, self._counts = self._counts, None
        return (0, 0, 0) if counts is None else tuple(int(c) for c in counts.tolist())
