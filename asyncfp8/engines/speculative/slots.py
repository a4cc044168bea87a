"""Speculative decoding in the torch engine's slot loop: `SlotSpeculation`, a step strategy
that picks k (fixed, or TLT's adaptive control), drafts from per-request streams, verifies
in one target forward and accepts losslessly. The drafter's cache, a row per slot, takes in
a row's recorded positions only when it drafts; finished sequences go to the online trainer
(docs/engines.md, "Speculation in the slots")."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from asyncfp8.engines.base import SamplingParams
from asyncfp8.engines.decode import processed_logprobs
from asyncfp8.engines.request_sampling import COIN, DRAFT, FINAL
from asyncfp8.engines.speculative.acceptance import accept
from asyncfp8.engines.speculative.adaptive import SpeculationController
from asyncfp8.engines.speculative.drafter import Drafter
from asyncfp8.engines.speculative.settings import SpeculativeSettings, check_drafter_checkpoint
from asyncfp8.engines.speculative.training import DrafterTrainer
from asyncfp8.engines.stepping import Kept, RecordingDecoder, SlotSteps


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
        #: a verify step writes the last token and k drafts past a row's last position
        self.overshoot = self.max_k + 1
        self.needs_hidden = True
        self.cache = drafter.new_cache(slots)
        #: per row, the decoder cache positions its drafter row has taken in (host)
        self.synced = [0] * slots
        self.steps = 0  # forwards the loop asked about
        self.speculative_steps = 0
        self.verify_rows = 0  # live rows over speculative steps
        self.drafted = 0
        self.accepted = 0

    @classmethod
    def from_settings(
        cls,
        settings: SpeculativeSettings,
        target: torch.nn.Module,
        device: torch.device,
        slots: int | None,
    ) -> SlotSpeculation:
        """`engine.speculative`'s drafter for `target` (initialized from `settings.seed`),
        its trainer and, in adaptive mode, its controller; then `settings.init`'s state."""
        # Read once: checked for this model before anything is built, loaded at the end.
        state = (
            None
            if settings.init is None
            else check_drafter_checkpoint(settings.init, target.config)
        )
        with torch.random.fork_rng(devices=[]):  # its init: the seed's, not the global stream's
            torch.manual_seed(settings.seed)
            drafter = Drafter(target).to(device)
        trainer = DrafterTrainer(
            drafter, lr=settings.lr, batch_size=settings.batch_size, seed=settings.seed
        )
        controller = None
        if settings.mode == "adaptive":
            controller = SpeculationController(
                threshold=settings.threshold,
                patience=settings.patience,
                ks=settings.ks,
                seed=settings.seed,
            )
        speculation = cls(
            drafter,
            slots,
            k=settings.draft_tokens if controller is None else None,
            controller=controller,
            trainer=trainer,
        )
        if state is not None:
            speculation.load_state_dict(state)
        return speculation

    def state_dict(self) -> dict:
        """For a worker checkpoint: the trainer's state (drafter, optimizer, counters,
        acceptance per version) and the controller's."""
        controller = self.controller
        return {
            "trainer": self.trainer.state_dict(),
            "controller": None if controller is None else controller.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.trainer.load_state_dict(state["trainer"])
        if self.controller is not None and state.get("controller") is not None:
            self.controller.load_state_dict(state["controller"])

    # -- the step ---------------------------------------------------------------------------------

    def step(self, loop: SlotSteps, current: int) -> list[bool] | None:
        """A plain step or a draft-and-verify step, as `choose` says; the latter returns
        each row's liveness after it."""
        active = loop.active()
        k = self.choose(active)
        started = time.perf_counter()
        if not k:
            loop.plain_step(current)
            self.report(active, 0, active, time.perf_counter() - started)
            return None
        kept = self._verify_step(loop, k, current)
        self.report(active, k, sum(kept.per_row), time.perf_counter() - started)
        return kept.live

    def _verify_step(self, loop: SlotSteps, k: int, current: int) -> Kept:
        sampling = loop.sampling
        greedy = sampling.temperature == 0
        offsets = torch.arange(k + 1, device=loop.pending().device)
        # The k drafts' uniforms in one draw, as k draws at count + i would give them.
        draft_u = None if greedy else loop.uniforms(DRAFT, offsets[:k])
        drafts, draft_logp = self.draft(
            k, sampling, lambda i: draft_u[:, i], loop.decoder, loop.pending(), loop.occupied()
        )
        logits = loop.decoder.verify(torch.cat([loop.fed()[:, None], drafts], 1))
        result = accept(
            processed_logprobs(logits, sampling),
            draft_logp,
            drafts,
            greedy=greedy,
            uniforms=None
            if greedy
            else (loop.uniforms(COIN, offsets[:k]), loop.uniforms(FINAL, offsets)),
        )
        kept = loop.keep(
            result.tokens, result.logprobs, result.num_emitted, current, result.num_accepted
        )
        self.record(kept.counted, kept.rows, k)
        return kept

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
        decoder: RecordingDecoder,
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

    def started(self, rows: Sequence[int]) -> None:
        """Slots `rows` start new sequences: their drafter rows are emptied (the next
        draft feeds them from the decoder, prompt first)."""
        index = torch.tensor(list(rows), dtype=torch.long, device=self.cache.lengths.device)
        lengths = self.cache.lengths.clone()
        lengths[index] = 0
        self.cache.truncate(lengths)
        for row in rows:
            self.synced[row] = 0

    @torch.no_grad()
    def sync(self, decoder: RecordingDecoder, last: torch.Tensor, live: Sequence[bool]) -> None:
        """Feeds each live row the (hidden state, next token) pairs of the decoder's
        positions [synced, length): its real positions (not prompt padding), each paired
        with the token of the next real position, the last one with `last` (sampled
        after it, not fed yet). The positions below a row's length are final: rejected
        drafts only ever sit past it."""
        rows = [row for row, on in enumerate(live) if on and self.synced[row] < decoder.length(row)]
        if not rows:
            return
        span = decoder.recorded(rows, [self.synced[r] for r in rows])
        device = self.cache.lengths.device
        index = torch.tensor(rows, dtype=torch.long, device=device)
        starts = torch.tensor([self.synced[r] for r in rows], dtype=torch.long, device=device)
        ends = span.ends
        spans = torch.tensor(ends, dtype=torch.long, device=device) - starts
        width = span.tokens.shape[1]
        offsets = torch.arange(width + 1, device=device)
        # One column more than recorded, for the pending token of the longest span.
        after_end = torch.zeros_like(span.real[:, :1])
        valid = torch.cat([span.real, after_end], 1)
        # Column `span` of each row holds its pending token: the one after its last position.
        pending = offsets == spans[:, None]
        recorded = torch.cat([span.tokens, torch.zeros_like(span.tokens[:, :1])], 1)
        tokens = torch.where(pending, last[index][:, None], recorded)
        # following[p]: the token of the first column after p that is real or pending.
        beyond = width + 1
        present = torch.where(valid | pending, offsets, beyond)
        first_at_or_after = present.flip(-1).cummin(-1).values.flip(-1)
        after = torch.cat([first_at_or_after[:, 1:], torch.full_like(spans[:, None], beyond)], 1)
        following = tokens.gather(1, after.clamp_max(width))
        self.drafter.extend(
            self.cache,
            span.hidden,
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

    def finished(self, slot: int, decoder: RecordingDecoder) -> None:
        """Slot `slot`'s sequence is done: its hidden states and tokens (its real
        positions) go to the trainer."""
        if self.trainer is not None:
            hidden, tokens = decoder.sequence(slot)
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
