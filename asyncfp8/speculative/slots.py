"""Speculative decoding inside the torch engine's slot loop (`engines.slots.run_slots`).

`SlotSpeculation` is what the loop asks and tells: per step, how many tokens to draft
(`choose`: a fixed k, or TLT's adaptive control: none while the active batch is large, a
bandit's k per batch-size bucket when it is small); the drafts (`draft`), drawn from the
per-request streams so that a sample does not depend on its slot; acceptance counts per
version; and every finished sequence's hidden states and tokens (`observe`) for the
online trainer, which trains between generations (`train`).

The drafter's cache has one row per slot, fed from what the slot decoder records anyway
(the target's last hidden state and the token at every position of every row): when a
draft is asked for, each live row takes in its positions since the last draft, each
paired with the token after it (the next real position's, or the token sampled last and
not fed yet). Nothing is fed while no row drafts, and a sequence that ends before the
next draft is never fed at all: plain steps (the adaptive mode at a large batch) cost no
drafter work, and a row refilled meanwhile is only emptied. Rows that hold no live
sequence draft tokens nobody reads.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from asyncfp8.engines.base import SamplingParams

from .adaptive import SpeculationController
from .drafter import Drafter
from .training import DrafterTrainer

if TYPE_CHECKING:
    from asyncfp8.engines.slots import SlotDecoder


class SlotSpeculation:
    """Speculation over `slots` slots with `drafter`: a fixed draft length `k`, or
    `controller` deciding per step (exactly one of them). `trainer` (optional) records
    acceptance per version and the rollouts it trains on."""

    def __init__(
        self,
        drafter: Drafter,
        slots: int,
        *,
        k: int | None = None,
        controller: SpeculationController | None = None,
        trainer: DrafterTrainer | None = None,
    ):
        if (k is None) == (controller is None):
            raise ValueError("give a fixed draft length k or an adaptive controller, not both")
        if k is not None and k < 1:
            raise ValueError(f"draft length k must be >= 1, got {k}")
        self.drafter, self.k, self.controller, self.trainer = drafter, k, controller, trainer
        self.max_k = k if controller is None else max(controller.ks)
        self.cache = drafter.new_cache(slots)
        #: per row, the decoder cache positions its drafter row has taken in (host)
        self.synced = [0] * slots
        self.steps = 0  # forwards the loop asked about
        self.speculative_steps = 0
        self.verify_rows = 0  # live rows over speculative steps
        self.drafted = 0
        self.accepted = 0

    # -- what the loop asks -------------------------------------------------------------------

    def choose(self, active: int) -> int:
        """The draft length for a step over `active` sequences; 0: a plain step."""
        self.steps += 1
        if self.controller is None:
            k = self.k
        elif self.controller.check(active):
            k = self.controller.choose_k(active)
        else:
            k = 0
        self.speculative_steps += k > 0
        return k

    def report(self, active: int, k: int, tokens: int, seconds: float) -> None:
        """What a step of draft length k over `active` sequences emitted, and how long it
        took: the controller's bandit learns tokens/s per bucket from it."""
        # A plain step is the bandit's arm k = 0 only when the controller chose it.
        chosen = self.controller is not None and self.controller.speculating
        if chosen and k in self.controller.ks and seconds > 0:
            self.controller.report(active, k, tokens, seconds)

    def draft(
        self,
        k: int,
        sampling: SamplingParams,
        uniforms: Callable[[int], torch.Tensor],
        decoder: SlotDecoder,
        last: torch.Tensor,
        live: Sequence[bool],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """k drafts per row [slots, k] and their processed log-probs, after the `live`
        rows have taken in `decoder`'s positions since their last draft (`last` [slots]:
        each row's sampled token not yet fed)."""
        self.sync(decoder, last, live)
        # Rows without a live sequence draft from whatever their row holds: unread.
        self.cache.started |= ~torch.tensor(live, device=self.cache.started.device)
        return self.drafter.draft(self.cache, k, sampling, uniforms=uniforms)

    # -- what the loop tells ------------------------------------------------------------------

    def start_rows(self, rows: Sequence[int]) -> None:
        """Slots `rows` start new sequences: their drafter rows are emptied (the next
        draft feeds them from the decoder, prompt first)."""
        index = torch.tensor(list(rows), dtype=torch.long, device=self.cache.lengths.device)
        lengths = self.cache.lengths.clone()
        lengths[index] = 0
        self.cache.truncate(lengths)
        for row in rows:
            self.synced[row] = 0

    @torch.no_grad()
    def sync(self, decoder: SlotDecoder, last: torch.Tensor, live: Sequence[bool]) -> None:
        """Feeds each live row the (hidden state, next token) pairs of the decoder's
        positions [synced, length): its real positions (not prompt padding), each paired
        with the token of the next real position, the last one with `last` (sampled
        after it, not fed yet). The positions below a row's length are final: rejected
        drafts only ever sit past it."""
        rows = [
            row for row, on in enumerate(live) if on and self.synced[row] < decoder.lengths[row]
        ]
        if not rows:
            return
        device = self.cache.lengths.device
        index = torch.tensor(rows, dtype=torch.long, device=device)
        starts = torch.tensor([self.synced[r] for r in rows], dtype=torch.long, device=device)
        ends = [decoder.lengths[r] for r in rows]
        spans = torch.tensor(ends, dtype=torch.long, device=device) - starts
        width = max(end - self.synced[r] for r, end in zip(rows, ends, strict=True))
        offsets = torch.arange(width + 1, device=device)
        columns = (starts[:, None] + offsets).clamp_max(decoder.max_tokens - 1)
        inside = offsets < spans[:, None]
        valid = decoder.kv_valid[index[:, None], columns] & inside
        # Column `span` of each row holds its pending token: the one after its last position.
        pending = offsets == spans[:, None]
        tokens = torch.where(
            pending, last[index][:, None], decoder.fed_tokens[index[:, None], columns]
        )
        # following[p]: the token of the first column after p that is real or pending.
        beyond = width + 1
        present = torch.where(valid | pending, offsets, beyond)
        first_at_or_after = present.flip(-1).cummin(-1).values.flip(-1)
        after = torch.cat([first_at_or_after[:, 1:], torch.full_like(spans[:, None], beyond)], 1)
        following = tokens.gather(1, after.clamp_max(width))
        hidden = decoder.hidden_states[index[:, None], columns[:, :width]]
        self.drafter.extend(
            self.cache,
            hidden,
            following[:, :width],
            valid[:, :width],
            rows=None if len(rows) == self.cache.batch else index,
        )
        for row, end in zip(rows, ends, strict=True):
            self.synced[row] = end

    def record(self, accepted: int, rows: int, k: int) -> None:
        """One verify step of `rows` live rows, k drafts each, `accepted` of them accepted
        (host numbers: the slot loop reads them with its own, in one sync)."""
        self.verify_rows += rows
        self.drafted += k * rows
        self.accepted += accepted
        if self.trainer is not None:
            self.trainer.record_accepted(accepted, rows, k)

    def observe(self, hidden: torch.Tensor, tokens: torch.Tensor) -> None:
        """A finished sequence's hidden states [T, H] and tokens [T] (its real positions)."""
        if self.trainer is not None:
            self.trainer.observe(hidden[None], tokens[None])

    # -- metrics ---------------------------------------------------------------------------------

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per verify forward per sequence: accepted drafts plus the target's own."""
        return (self.accepted + self.verify_rows) / self.verify_rows if self.verify_rows else 0.0

    def metrics(self) -> dict[str, float]:
        """Since this object was made: `spec/fraction_steps_speculating` and
        `spec/total/*`; the trainer's `spec/acceptance_rate` and
        `spec/mean_accepted_length` are the current version's, with its `drafter/*`."""
        out = {
            "spec/fraction_steps_speculating": self.speculative_steps / self.steps
            if self.steps
            else 0.0,
            "spec/total/acceptance_rate": self.accepted / self.drafted if self.drafted else 0.0,
            "spec/total/mean_accepted_length": self.mean_accepted_length,
        }
        if self.controller is not None:
            out |= self.controller.metrics()
        if self.trainer is not None:
            out |= self.trainer.metrics()
        return out
