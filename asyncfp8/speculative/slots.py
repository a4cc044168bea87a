"""Speculative decoding inside the torch engine's slot loop (`engines.slots.run_slots`).

`SlotSpeculation` is what the loop asks and tells: per step, how many tokens to draft
(`choose`: a fixed k, or TLT's adaptive control: none while the active batch is large, a
bandit's k per batch-size bucket when it is small); the drafts (`draft`), drawn from the
per-request streams so that a sample does not depend on its slot; the target's features
after every forward (`add`), fed to the drafter's cache lazily, in one batched call when
a draft needs them (a plain step costs no drafter forward); acceptance counts per
version; and every finished sequence's hidden states and tokens (`observe`) for the
online trainer, which trains between generations (`train`).

The drafter's cache has one row per slot. A refilled slot's row is emptied and extended
with the new prompt's (hidden state, next token) pairs, the first sampled token last.
Rows that hold no sequence draft tokens nobody reads.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from asyncfp8.engines.base import SamplingParams

from .adaptive import SpeculationController
from .drafter import Drafter
from .training import DrafterTrainer

#: Forwards whose features may wait for the drafter: a plain-decoding stretch longer
#: than this feeds them in batches of it.
MAX_PENDING = 64


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
        # Rows that never held a sequence draft from a zero feature: nobody reads them.
        self.cache.started.fill_(True)
        self.pending: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
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
        self, k: int, sampling: SamplingParams, uniforms: Callable[[int], torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.flush()
        return self.drafter.draft(self.cache, k, sampling, uniforms=uniforms)

    # -- what the loop tells ------------------------------------------------------------------

    def start_rows(
        self,
        rows: torch.Tensor,
        hidden: torch.Tensor,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        first: torch.Tensor,
    ) -> None:
        """Slots `rows` [n] start new prompts: hidden [n, W, H] and prompt_ids / prompt_mask
        [n, W] (left padded), first [n] the token sampled after each prompt."""
        for _, _, mask in self.pending:  # the rows' previous sequences are done
            mask[rows] = False
        lengths = self.cache.lengths.clone()
        lengths[rows] = 0
        self.cache.truncate(lengths)
        self.cache.started[rows] = False
        slots, width = self.cache.batch, prompt_ids.shape[1]
        full = hidden.new_zeros(slots, width, hidden.shape[-1])
        full[rows] = hidden
        following = torch.zeros(slots, width, dtype=torch.long, device=hidden.device)
        following[rows] = torch.cat([prompt_ids[:, 1:], first[:, None]], 1)
        mask = torch.zeros(slots, width, dtype=torch.bool, device=hidden.device)
        mask[rows] = prompt_mask
        self.pending.append((full, following, mask))

    def add(self, hidden: torch.Tensor, following: torch.Tensor, mask: torch.Tensor) -> None:
        """A forward's features hidden [slots, T, H], the token after each position
        [slots, T], and the pairs that are real [slots, T] (kept as they are now)."""
        self.pending.append((hidden, following.clone(), mask.clone()))
        if len(self.pending) >= MAX_PENDING:  # bounded memory while nothing drafts
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        hidden, following, mask = (torch.cat(parts, 1) for parts in zip(*self.pending, strict=True))
        self.pending = []
        self.drafter.extend(self.cache, hidden, following, mask)

    def record(self, num_accepted: torch.Tensor, k: int, live: torch.Tensor) -> None:
        accepted = int(num_accepted[live].sum())
        rows = int(live.sum())
        self.verify_rows += rows
        self.drafted += k * rows
        self.accepted += accepted
        if self.trainer is not None:
            self.trainer.record_acceptance(num_accepted, k, live)

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
