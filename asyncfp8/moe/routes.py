"""The experts an engine routed each token to, as a trajectory carries them: uint8
[tokens, layers, top_k] row-major bytes over the prompt and the completion, NO_ROUTE where
the engine ran none (the last completion token is never fed). `RouteRecorder` reads them
from an engine's own routers, forward by forward; `routes_of` checks a trajectory's against
the model; `batch_routes` lays a batch's out as the learner's forward reads them."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from .architectures import MoELayout, moe_layout

NO_ROUTE = 255  # no route ran for this token (uint8: at most 255 experts)


def routers_of(model: nn.Module) -> list[nn.Module]:
    """The MoE routers (`mlp.gate` with a top-k), in layer order."""
    return [
        module
        for name, module in model.named_modules()
        if name.endswith("mlp.gate") and hasattr(module, "top_k")
    ]


class RouteRecorder:
    """The experts each forward of `model` picked, per layer, while `recording()`: what an
    engine ran; `take()` gives the last forward's [rows, layers, top_k] uint8. A decode step
    of `step_rows` rows run while `stepping` is copied into a static buffer (`take_step()`),
    in place: torch.compile traces it, a CUDA graph replays it. Hooks stay on from
    `attach()` to `detach()`, so a compiled step is traced with them."""

    def __init__(self, model: nn.Module, step_rows: int | None = None):
        self.layout = moe_layout(model.config)
        if self.layout is None:
            raise ValueError(f"{type(model).__name__} has no routed experts to record")
        if self.layout.experts >= NO_ROUTE:
            raise ValueError(
                f"{self.layout.experts} experts: routes are recorded as uint8 below {NO_ROUTE}"
            )
        self.model = model
        self.picks: list[torch.Tensor] = []
        self.active = self.stepping = False
        self.step_picks = None
        if step_rows is not None:
            device = model.get_input_embeddings().weight.device
            shape = (len(self.layout.layers), step_rows, self.layout.top_k)
            self.step_picks = torch.full(shape, NO_ROUTE, dtype=torch.uint8, device=device)
        self.handles: list = []

    def attach(self) -> None:
        """Hooks on the routers until `detach()` (they record only while `recording()`)."""
        if not self.handles:
            self.handles = [
                router.register_forward_hook(functools.partial(self._record, layer))
                for layer, router in enumerate(routers_of(self.model))
            ]

    def detach(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    @contextlib.contextmanager
    def recording(self) -> Iterator[RouteRecorder]:
        """Records for the duration; hooks attached here are removed after it (none left
        behind for a compiled or captured step outside to trip on)."""
        temporary = not self.handles
        self.attach()
        self.active = True
        try:
            yield self
        finally:
            self.active = self.stepping = False
            self.picks = []
            if temporary:
                self.detach()

    def _record(self, layer: int, module: nn.Module, args, output) -> None:
        if not self.active:
            return
        if self.stepping:
            self.step_picks[layer].copy_(output[2])
        else:
            self.picks.append(output[2].detach())

    def take(self) -> torch.Tensor:
        """The experts of the forward since the last take: [rows, layers, top_k] uint8."""
        picks, self.picks = self.picks, []
        layers = len(self.layout.layers)
        if len(picks) != layers:
            raise RuntimeError(f"recorded {len(picks)} router outputs in a forward of {layers}")
        return torch.stack(picks, 1).to(torch.uint8)

    def take_step(self) -> torch.Tensor:
        """The last decode step's experts: [step_rows, layers, top_k] uint8."""
        return self.step_picks.transpose(0, 1).clone()


def pack_routes(routes: torch.Tensor) -> bytes:
    """[tokens, layers, top_k] uint8 → the trajectory's bytes."""
    return routes.to(torch.uint8).cpu().contiguous().numpy().tobytes()


def routes_of(routes: bytes, tokens: int, layout: MoELayout, sample: str) -> torch.Tensor:
    """A trajectory's routes as [tokens, layers, top_k] uint8; ValueError naming `sample`
    where they do not fit its tokens and the model's layers and top-k, or name an expert
    the model has not."""
    width = len(layout.layers) * layout.top_k
    if len(routes) != tokens * width:
        raise ValueError(
            f"{sample}: {len(routes)} bytes of routes for {tokens} tokens, but the model's "
            f"{len(layout.layers)} MoE layers × top-{layout.top_k} need {tokens * width}"
        )
    flat = torch.frombuffer(bytearray(routes), dtype=torch.uint8)
    picked = flat[flat != NO_ROUTE]
    if picked.numel() and int(picked.max()) >= layout.experts:
        raise ValueError(
            f"{sample}: routes name expert {int(picked.max())} of a model of {layout.experts}"
        )
    return flat.reshape(tokens, len(layout.layers), layout.top_k)


def batch_routes(
    rows: Sequence[bytes | None], lengths: Sequence[int], width: int, layout: MoELayout
) -> torch.Tensor | None:
    """Each row's routes at its positions of a right-padded batch `width` wide:
    [rows, width, layers, top_k] uint8, NO_ROUTE at padding and for rows without any;
    None when no row has routes."""
    if all(r is None for r in rows):
        return None
    out = torch.full(
        (len(rows), width, len(layout.layers), layout.top_k), NO_ROUTE, dtype=torch.uint8
    )
    for row, (routes, length) in enumerate(zip(rows, lengths, strict=True)):
        if routes is not None:
            out[row, :length] = routes_of(routes, length, layout, f"row {row}")
    return out
