"""Undoing a fatal step, as a training step uses the guard (train/guard.py has the rules):
`StepGuard` keeps the last good states (`LastGood`), puts one back when a batch fails,
shrinks the updates after and stops the run after `guard.max_rollbacks` in a row;
`HeldOutGuard` is the last line, on the held-out evaluations. Why each rule is so:
docs/running.md#the-guard-undoing-a-fatal-step."""

from __future__ import annotations

import json
import logging
import time
from collections import deque
from pathlib import Path

import torch

from asyncfp8.run.distributed import local_shard, resharded
from asyncfp8.run.files import GUARD_STOP_FILE
from asyncfp8.train.guard import Evidence, GuardRules, GuardSettings, Verdict

log = logging.getLogger("asyncfp8.learner")


class LastGood:
    """A CPU copy of the model's parameters and the optimizer's per-parameter state."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer
        self.params: list[torch.Tensor] = []
        self.state: list[dict[str, torch.Tensor]] = []
        self.step: int | None = None  # steps trained before the copy; None: no copy yet
        self.version: int | None = None  # the newest version published when it was kept

    @property
    def nbytes(self) -> int:
        tensors = [*self.params, *(t for s in self.state for t in s.values())]
        return sum(t.numel() * t.element_size() for t in tensors)

    @torch.no_grad()
    def keep(self, step: int, version: int | None = None) -> None:
        parameters = list(resharded(self.model).parameters())
        if not self.params:
            self.params = [torch.empty_like(local_shard(p), device="cpu") for p in parameters]
        for buffer, p in zip(self.params, parameters, strict=True):
            buffer.copy_(local_shard(p.detach()))
        states = [self.optimizer.state.get(p, {}) for p in parameters]
        if len(self.state) != len(parameters) or any(
            s.keys() != saved.keys() for s, saved in zip(states, self.state, strict=True)
        ):  # the first step creates AdamW's state: buffers once more
            self.state = [
                {k: torch.empty_like(local_shard(v), device="cpu") for k, v in s.items()}
                for s in states
            ]
        for saved, state in zip(self.state, states, strict=True):
            for key, buffer in saved.items():
                buffer.copy_(local_shard(state[key]))
        self.step, self.version = step, version

    @torch.no_grad()
    def restore(self) -> None:
        parameters = list(resharded(self.model).parameters())
        for buffer, p in zip(self.params, parameters, strict=True):
            local_shard(p.data).copy_(buffer)
        for saved, p in zip(self.state, parameters, strict=True):
            if not saved:  # kept before AdamW's first step: it had no state
                self.optimizer.state.pop(p, None)
                continue
            state = self.optimizer.state[p]
            for key, buffer in saved.items():
                local_shard(state[key]).copy_(buffer)


class StepGuard:
    """The guard's state across steps: the rules' history, the last good copy, and the
    rollbacks counted."""

    def __init__(
        self, settings: GuardSettings, model: torch.nn.Module, optimizer: torch.optim.Optimizer
    ):
        self.settings = settings
        self.rules = GuardRules(settings)
        # the good states, oldest first; their buffers are reused once there are enough
        self.states: deque[LastGood] = deque()
        self.spare = [LastGood(model, optimizer) for _ in range(settings.keep_states)]
        self.rollbacks = 0
        self.in_row = 0
        self.rolled_back_at: deque[int] = deque()  # steps of the rollbacks of the last shrink_steps
        self.restored_step: int | None = None  # the step of the state last put back
        self.dead_from: int | None = None  # the oldest version that sampled the dead streak
        self.last_verdict: Verdict | None = None
        # (after, up to]: versions published from weights a rollback undid
        self.ignored_versions: tuple[int, int] | None = None
        self.metrics: dict[str, float] = {}  # of the latest check
        # the model holds the newest state as put back, no update applied since (a rollback
        # or a held-out restart): a batch that passes on it keeps no second copy, which would
        # push out the state a further rollback goes back to
        self.on_restored = False

    @property
    def good_step(self) -> int | None:
        """Steps trained before the newest good state (None: no state yet)."""
        return self.states[-1].step if self.states else None

    @property
    def exhausted(self) -> bool:
        return self.in_row >= self.settings.max_rollbacks

    def check(
        self,
        evidence: Evidence,
        step: int,
        version: int | None,
        sampled_from: int | None = None,
    ) -> Verdict | None:
        """Judges a batch (its `evidence`, summed over ranks) with
        the weights after `step` steps, `version` the newest published, `sampled_from` the
        oldest version that sampled its judged samples; keeps them, or restores the last
        good ones."""
        started = time.perf_counter()
        median = self.rules.reward_median()
        verdict = self.rules.judge(evidence)
        if sampled_from is not None and (verdict is not None or self.rules.pending):
            older = self.dead_from is not None and self.dead_from < sampled_from
            self.dead_from = self.dead_from if older else sampled_from
        if verdict is not None:
            self.rollbacks += 1
            self.in_row += 1
            self.rolled_back_at.append(step)
            self.last_verdict = verdict
            self._roll_back(verdict, step, self.dead_from)
            good = self.states[-1].version if self.states else None
            if good is not None and version is not None and version > good:
                self.ignored_versions = (good, version)
        # a batch of left-out samples only verifies nothing; a dead streak's waits
        elif evidence.samples > 0 and not self.rules.pending:
            if not self.on_restored:  # the restored weights are kept already: no second copy
                self._keep(step, version)
            if self.restored_step is None or self.states[0].step > self.restored_step:
                self.in_row = 0  # past the state last put back
        if not self.rules.pending:
            self.dead_from = None
        self.metrics = {
            "guard/rolled_back": int(verdict is not None),
            "guard/rollbacks": self.rollbacks,
            "guard/rollbacks_in_row": self.in_row,
            "guard/dead_streak": self.rules.dead_streak,
            "guard/far_tokens": evidence.far_tokens,
            "guard/far_fraction": evidence.far_fraction,
            "guard/k3": evidence.k3,
            "guard/reward_frac": evidence.reward_frac,
            "guard/reward_median": median,
            "guard/update_scale": self.update_scale(step),  # of this step's update, if any
            "guard/check_s": time.perf_counter() - started,
            "guard/ignored_tokens": evidence.ignored_tokens,
            # far from the rollout, not from their own version: rounding, not the update
            "guard/excused_tokens": evidence.excused_tokens,
            # the update took them far above their version: it sided with the engine
            "guard/raised_tokens": evidence.raised_tokens,
        }
        return verdict

    def updated(self) -> None:
        """An update was applied: the weights are no longer the state last put back."""
        self.on_restored = False

    def update_scale(self, step: int) -> float:
        """The factor on the learning rate of the update after `step` steps:
        `guard.shrink` per rollback in the last `guard.shrink_steps` steps. A state put
        back after a fatal step is often one update from breaking again, so the steps
        after a rollback are smaller, and grow back as the rollbacks age."""
        while self.rolled_back_at and step - self.rolled_back_at[0] > self.settings.shrink_steps:
            self.rolled_back_at.popleft()
        return self.settings.shrink ** len(self.rolled_back_at)

    def fall_back(self) -> int | None:
        """Puts back the oldest good state kept (the newer ones dropped) and returns its
        step (None: no state). What a run the guard stops saves: the newest may have
        passed only because its batch could not see the break (sync mode, above)."""
        if not self.states:
            return None
        while len(self.states) > 1:
            self.spare.append(self.states.pop())
        self.states[-1].restore()
        return self.states[-1].step

    def restart_from(self, step: int, version: int | None, newest: int | None) -> None:
        """After the held-out guard put back the weights after `step` (published as
        `version`): the states kept since are of the undone weights and go; the restored
        weights are the newest good state; versions up to `newest` leave the evidence."""
        while self.states:
            self.spare.append(self.states.pop())
        self._keep(step, version)
        self.in_row, self.restored_step, self.on_restored = 0, None, True
        if version is not None and newest is not None and newest > version:
            self.ignored_versions = (version, newest)

    def summary_line(self) -> str:
        """The guard's line in the learner's last message."""
        if not self.rollbacks:
            return "guard: 0 rollbacks"
        verdict = self.last_verdict
        return (
            f"guard: {self.rollbacks} rollback(s), the last on {verdict.signal} ({verdict.detail})"
        )

    def report_stop(
        self, step: int, good: int | None, folder: Path | None, run_dir: Path, write: bool
    ) -> None:
        """The stop after `guard.max_rollbacks` in a row, at `step`: the message naming the
        signal, its setting and the state the run stops with (`good`: the step of the
        fallen-back state, None without one; `folder`: its checkpoint, or the newest), and
        (`write`, rank 0) the record the launcher and the report read (GUARD_STOP_FILE)."""
        verdict = self.last_verdict
        if good is not None:
            state = f"the weights after step {good} (the oldest good state kept) in {folder}"
        else:
            state = (
                "no good state in memory (no batch passed since this process started); the "
                f"newest checkpoint is {folder}"
            )
        log.error(
            "guard: %d rollbacks in a row (guard.max_rollbacks=%d); the last at step %d on "
            "signal %s (%s; bounded by %s). The run stops with %s. Continue with "
            "run.resume=true run.dir=%s (raise %s or guard.max_rollbacks, or "
            "guard.enabled=false, to let such batches train)",
            self.in_row,
            self.settings.max_rollbacks,
            step,
            verdict.signal,
            verdict.detail,
            verdict.setting,
            state,
            run_dir,
            verdict.setting,
        )
        if write:
            record = {
                "step": step,
                "signal": verdict.signal,
                "detail": verdict.detail,
                "setting": verdict.setting,
                "good_step": good,
                "checkpoint": str(folder) if folder is not None else None,
            }
            (run_dir / GUARD_STOP_FILE).write_text(json.dumps(record, indent=2))

    def _drop_sampled_states(self, sampled_from: int) -> None:
        """A dead batch speaks of the weights that sampled it, not of the learner's: in
        overlapped async they are a version older, often the newest state kept, and
        putting them back fails again. So the states from version `sampled_from` on go,
        back to the newest older one; with none kept that old, the oldest stays
        (guard.keep_states bounds how far back the guard can go)."""
        while len(self.states) > 1 and (self.states[-1].version or 0) >= sampled_from:
            self.spare.append(self.states.pop())
        if self.states and (self.states[-1].version or 0) >= sampled_from:
            log.warning(
                "guard: the dead batch was sampled from version %d on, and no good state "
                "older than it is kept (the oldest is of version %s): that one is put "
                "back; raise guard.keep_states to keep more",
                sampled_from,
                self.states[-1].version,
            )

    def _keep(self, step: int, version: int | None) -> None:
        slot = self.spare.pop() if self.spare else self.states.popleft()
        slot.keep(step, version)
        self.states.append(slot)

    def _roll_back(self, verdict: Verdict, step: int, sampled_from: int | None) -> None:
        # the state put back failed again (no newer state kept since): one further back
        newest_restored = self.states and self.states[-1].step == self.restored_step
        if self.in_row > 1 and len(self.states) > 1 and newest_restored:
            self.spare.append(self.states.pop())
        if verdict.signal == "dead_reward" and sampled_from is not None:
            self._drop_sampled_states(sampled_from)
        good = self.good_step
        if good is None:
            log.warning(
                "guard: the batch of step %d fails (%s: %s), but there is no good state to "
                "roll back to yet (no batch has passed since this process started, step 0 "
                "of this process): the step is skipped, the weights left as they are",
                step + 1,
                verdict.signal,
                verdict.detail,
            )
            return
        self.states[-1].restore()
        self.restored_step, self.on_restored = good, True
        log.warning(
            "guard: the batch of step %d fails (%s: %s): rolled back to the weights and "
            "optimizer state after step %d and skipped the step (%d in a row of at most "
            "guard.max_rollbacks=%d)",
            step + 1,
            verdict.signal,
            verdict.detail,
            good,
            self.in_row,
            self.settings.max_rollbacks,
        )


class HeldOutGuard:
    """The held-out evaluation as the guard's last line (`guard.heldout_below`), for a slide
    no batch shows. An evaluation that passes keeps the weights and AdamW's state (a
    `LastGood`); one whose greedy pass@1 is below `below` times the best so far puts them
    back and the run goes on from there. The line, half the best, is far below the noise
    of 256 prompts, so the choice it makes selects only against a collapse."""

    def __init__(self, below: float, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        self.below = below
        self.kept = LastGood(model, optimizer)
        self.kept_score: float | None = None
        self.best: float | None = None
        self.rollbacks = 0

    def judge(self, score: float, step: int, version: int | None) -> str | None:
        """Keeps the weights after `step` steps (`version` the newest published) when
        `score` passes, else puts back the last kept ones and says why."""
        # a best implies a kept state: the first evaluation always passes
        if self.best is not None and score < self.below * self.best:
            self.kept.restore()
            self.rollbacks += 1
            return (
                f"held-out greedy pass@1 {score:.3f} after step {step} is below "
                f"guard.heldout_below={self.below:g} x the best {self.best:.3f}: put back the "
                f"weights and optimizer state after step {self.kept.step} (held-out "
                f"{self.kept_score:.3f} then)"
            )
        self.best = score if self.best is None else max(self.best, score)
        self.kept.keep(step, version)
        self.kept_score = score
        return None
