"""What the slot loop (`slot_loop.SlotLoop`) and a step strategy say to each other. The
loop refills slots, harvests sequences and stops; each step it hands to its strategy
(`PlainStep`, or `speculative.slots.SlotSpeculation`), which sees the loop only through
`SlotSteps` and the decoder only through `RecordingDecoder`: nothing here imports either
side, so neither imports the other."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from .base import SamplingParams


@dataclass(frozen=True)
class RecordedSpan:
    """Some rows' recorded positions of a `RecordingDecoder`, from a start position per
    row, `width` columns each (the longest span): the target's last hidden states
    [rows, width, H], the tokens fed there [rows, width] and whether each column is a
    real position of the row's sequence (not prompt padding, not a rejected draft, not
    past the row's end) [rows, width]; `ends`: each row's length (host ints)."""

    hidden: torch.Tensor
    tokens: torch.Tensor
    real: torch.Tensor
    ends: list[int]


class RecordingDecoder(Protocol):
    """The slot decoder as a speculative strategy uses it: verify steps, and the hidden
    states it records at every position (a drafter's input)."""

    def length(self, slot: int) -> int:
        """Row `slot`'s positions so far (prompt, padding included, and kept tokens)."""

    def recorded(self, slots: Sequence[int], starts: Sequence[int]) -> RecordedSpan:
        """Rows `slots`' recorded positions from `starts` up to their lengths."""

    def verify(self, tokens: torch.Tensor) -> torch.Tensor:
        """Appends T tokens per row [slots, T] (uncommitted); the logits after each."""

    def sequence(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Row `slot`'s real positions: (hidden states [T, H], tokens [T])."""


@dataclass(frozen=True)
class Kept:
    """What the host learned from a verify step, in one read: the tokens each row kept,
    each row's liveness after the step, and the sum of a per-row count over the rows
    live before it (with how many there were)."""

    per_row: list[int]
    live: list[bool]
    counted: int
    rows: int


class SlotSteps(Protocol):
    """The loop's side of a step: what a strategy may read and what it may ask."""

    decoder: RecordingDecoder
    sampling: SamplingParams

    def occupied(self) -> list[bool]:
        """Per slot, whether it holds a sequence (finished or not)."""

    def active(self) -> int:
        """How many slots hold a sequence."""

    def fed(self) -> torch.Tensor:
        """The token each row feeds next [slots]: its newest sampled one while it is
        live, the pad token once it has finished or is idle."""

    def pending(self) -> torch.Tensor:
        """Each row's newest sampled token, not fed yet [slots]."""

    def uniforms(self, stream: int, offsets: torch.Tensor) -> torch.Tensor:
        """Per row, its request's `stream` (`request_sampling`) at token indices its
        count + `offsets` [T]: [slots, T] float64 uniforms."""

    def plain_step(self, current: int) -> None:
        """One token per row, sampled from one decode step's logits (version `current`)."""

    def keep(
        self,
        tokens: torch.Tensor,
        logprobs: torch.Tensor,
        emitted: torch.Tensor,
        current: int,
        counts: torch.Tensor,
    ) -> Kept:
        """After a verify step: row i proposes its first `emitted[i]` of `tokens[i]`
        (with `logprobs[i]`, [slots, T]); it keeps them up to its budget and its eos,
        records them under version `current`, and the decoder keeps their positions.
        `counts` [slots] is summed over the rows live before the step (`Kept.counted`)."""


class StepStrategy(Protocol):
    """How the loop's decode steps are made."""

    #: positions a step may write past a sequence's last token (a verify step's drafts)
    overshoot: int
    #: whether it reads the decoder's recorded hidden states
    needs_hidden: bool

    def started(self, slots: Sequence[int]) -> None:
        """Slots `slots` start new sequences."""

    def finished(self, slot: int, decoder: RecordingDecoder) -> None:
        """Slot `slot`'s sequence is done; its row is released after this."""

    def step(self, loop: SlotSteps, current: int) -> list[bool] | None:
        """One decode step under version `current`: each row's liveness after it when the
        host learned it anyway (a verify step), else None."""
