"""The routes an MoE model's forwards ran in the slot loop, per slot: its prompt's from the
fill, and each completion token's from the plain step that fed it (a token never fed, the
last, and any a speculative step kept, have none: NO_ROUTE). Read from the engine's own
routers (`asyncfp8.moe.routes.RouteRecorder`): the fill's as the hooks saw them, a step's
from the buffer the hooks copy into, eager, compiled or replayed as a CUDA graph alike."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from asyncfp8.moe.routes import NO_ROUTE, RouteRecorder, pack_routes


class SlotRoutes:
    def __init__(self, recorder: RouteRecorder, slots: int, room: int, device: torch.device):
        layout = recorder.layout
        self.recorder = recorder
        self.prompt: list[torch.Tensor | None] = [None] * slots
        self.out = torch.full(
            (slots, room, len(layout.layers), layout.top_k),
            NO_ROUTE,
            dtype=torch.uint8,
            device=device,
        )
        self.rows = torch.arange(slots, device=device)

    def before_forward(self) -> None:
        """Drops what forwards since the last one recorded (a probe between steps)."""
        self.recorder.picks = []

    def before_step(self) -> None:
        """The next forward is a decode step: its picks go to the step buffer."""
        self.recorder.picks = []
        self.recorder.stepping = True

    def filled(
        self, slots: Sequence[int], prompts: Sequence[Sequence[int]], rows: list[int], width: int
    ) -> None:
        """After the fill of `slots` with `prompts` (the fill's distinct left-padded
        `rows`, `width` wide): each slot's prompt routes, and no completion routes yet."""
        picks = self.recorder.take()
        picks = picks.reshape(-1, width, *picks.shape[1:])
        for slot, ids, row in zip(slots, prompts, rows, strict=True):
            self.prompt[slot] = picks[row, width - len(ids) :]
            self.out[slot] = NO_ROUTE

    def stepped(self, columns: torch.Tensor, fed: torch.Tensor) -> None:
        """After a plain step: each row `fed` a real token has its routes at its
        completion column (`columns`, [slots])."""
        self.recorder.stepping = False
        picks = self.recorder.take_step()
        here = self.out[self.rows, columns]
        self.out[self.rows, columns] = torch.where(fed[:, None, None], picks, here)

    def harvest(self, slots: Sequence[int], tokens: Sequence[int]) -> list[bytes]:
        """Each slot's routes: its prompt's, then its first `tokens` completion tokens',
        brought to the host in one copy (a GPU read waits for the device)."""
        parts = [
            torch.cat([self.prompt[slot], self.out[slot, :count]])
            for slot, count in zip(slots, tokens, strict=True)
        ]
        host = torch.cat(parts).cpu()
        sizes = [len(part) for part in parts]
        return [pack_routes(rows) for rows in host.split(sizes)]
