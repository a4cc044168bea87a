"""One training step, pure of sockets and processes: a model, an optimizer and the settings
in, the step's sums out. `plan_shares` turns GRPO groups into every rank's share (advantages,
mini- and micro-batches, the next version's calibration rows); `TrainStep` trains one share:
per update, log-probs micro-batch by micro-batch, the correction, the loss, AdamW, with the
guard (train/rollback.py) and FP16 loss scaling (train/loss_scale.py) (docs/running.md)."""

from __future__ import annotations

import contextlib
import itertools
import math
import time
from dataclasses import dataclass
from typing import Any

import torch
from omegaconf import DictConfig

from asyncfp8.correction.calibration import (
    BoundCalibration,
    Starved,
    calibration_values,
    starved_scale,
)
from asyncfp8.correction.registry import Correction, make_batch
from asyncfp8.run import distributed
from asyncfp8.run.failpoints import failpoint
from asyncfp8.sync import Trajectory
from asyncfp8.train.batches import Group, TrainBatch, batch_tensors, plan_step
from asyncfp8.train.evidence import add_reward_evidence, add_token_evidence, oldest_over_ranks
from asyncfp8.train.logprobs import completion_logprobs
from asyncfp8.train.loss_scale import LossScaler
from asyncfp8.train.losses import (
    PolicyLoss,
    aggregate_parts,
    group_advantages,
    kl_penalty,
    policy_loss_terms,
)
from asyncfp8.train.moe_routing import MoERouting
from asyncfp8.train.phases import PhaseClock
from asyncfp8.train.proximal_thread import ProximalThread, ahead_scored, merged
from asyncfp8.train.rollback import StepGuard
from asyncfp8.train.sums import StepSums, StepTotals, UpdateSums
from asyncfp8.train.versions import VersionWeights

Row = tuple[int, Trajectory, float]  # (sample index in the batch, trajectory, advantage)


@dataclass
class Share:
    """What one rank trains in a step: per mini-batch, its micro-batches of rows; and the
    calibration rows of the next version, the same on every rank."""

    mini_batches: list[list[list[Row]]]
    calibration: list[Trajectory]


@dataclass
class Prepared:
    """A share's tensors per mini-batch and micro-batch, and the π_prox each reads: the
    recompute before the first update (several updates) and, with correction.proximal=version,
    the log-probs of older versions' tokens under their own weights, and where they are."""

    batches: list[list[TrainBatch]]
    proximal: list[list[torch.Tensor]] | None
    stale: list[list[tuple[torch.Tensor, torch.Tensor] | None]] | None


def lr_lambda(optim: DictConfig, steps: int):
    """The learning-rate factor of `optim.schedule` at each step: a linear warm-up over
    `optim.warmup_steps`, then constant or cosine down to 0.1 (the config's schema allows
    no other `optim.schedule`)."""

    def factor(step: int) -> float:
        if step < optim.warmup_steps:
            return (step + 1) / optim.warmup_steps
        if optim.schedule == "cosine":
            progress = min(1.0, (step - optim.warmup_steps) / max(1, steps - optim.warmup_steps))
            return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))
        return 1.0

    return factor


def plan_shares(groups: list[Group], optim: DictConfig, world: int) -> list[Share]:
    """GRPO advantages over the whole batch, then every rank's part of every mini-batch,
    cut into micro-batches; the calibration rows are the batch's first samples that fit
    one micro-batch."""
    trajectories = [t for group in groups for t in group.trajectories]
    rewards = torch.tensor([t.reward for t in trajectories])
    group_index = torch.tensor([i for i, g in enumerate(groups) for _ in g.trajectories])
    advantages = group_advantages(rewards, group_index, scale=optim.advantage_scale).tolist()
    lengths = [len(t.prompt_ids) + len(t.token_ids) for t in trajectories]
    plan = plan_step(lengths, optim.mini_batches, world, optim.micro_batch_tokens)
    calibration = trajectories[:1]
    budget = optim.micro_batch_tokens or math.inf
    for t in trajectories[1:]:
        width = max(len(c.prompt_ids) + len(c.token_ids) for c in [*calibration, t])
        if (len(calibration) + 1) * width > budget:
            break
        calibration.append(t)
    return [
        Share(
            [
                [[(i, trajectories[i], advantages[i]) for i in micro] for micro in mini[rank]]
                for mini in plan
            ],
            calibration,
        )
        for rank in range(world)
    ]


class TrainStep:
    """The policy update of one batch share (see the module's docstring): the share
    prepared, then each update's gradients accumulated over its micro-batches and applied."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        correction: Correction,
        optim: DictConfig,
        correction_mode: str,
        temperature: float,
        pad_token_id: int,
        device: torch.device,
        reference: torch.nn.Module | None = None,
        world: int = 1,
        guard: StepGuard | None = None,
        versions: VersionWeights | None = None,
        loss_scaler: LossScaler | None = None,
        calibration: BoundCalibration | None = None,
        min_kept: float = 0.0,
        starved: str = Starved.scale,
        proximal_thread: ProximalThread | None = None,
        routing_replay: bool = False,
        clock: PhaseClock | None = None,
    ):
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.correction, self.optim = correction, optim
        self.loss = PolicyLoss.from_config(optim, correction_mode)  # checked here
        self.temperature, self.pad_token_id, self.device = temperature, pad_token_id, device
        self.reference, self.world, self.guard = reference, world, guard
        self.versions = versions  # correction.proximal=version: π_prox of each token's own
        self.proximal_thread = proximal_thread  # ... scored ahead, as the groups arrived
        self.loss_scaler = loss_scaler  # run.compute_dtype=float16: FP16 gradients, scaled
        # correction.target_rejected: the bounds set on the first step (correction/calibration.py)
        self.calibration = calibration
        self.min_kept, self.starved = min_kept, starved  # the starved-update rule
        self.starved_updates = 0  # since the learner started
        # An MoE: its routers read in every forward (balance loss, replay, moe/* metrics)
        self.routing = MoERouting.of(model, optim.router_aux_coef, routing_replay)
        self.clock = clock or PhaseClock("false", device)  # run.phase_times (train/phases.py)

    def __call__(self, share: Share, step: int, version: int) -> StepSums:
        started = time.perf_counter()
        totals = StepTotals()
        if self.routing is not None:
            self.routing.start_step()
        with self.clock("prepare"):
            prepared = self._prepare(share, totals)
        rejection = {}
        if self.calibration is not None and not self.calibration.done:
            rejection = self._calibrate(prepared.batches, version)
        seen: dict[int, torch.Tensor] = {}  # per sample: the log-probs the correction saw
        rolled_back = False
        for epoch, m in itertools.product(
            range(self.optim.ppo_epochs), range(len(share.mini_batches))
        ):
            judged = self.guard is not None and epoch == 0 and m == 0
            sums, factor = self._accumulate(
                prepared, m, version, judged, seen if epoch == 0 else None
            )
            oldest = None
            if judged:  # the whole share's rewards: they are known before any update
                rows = [t for mini in share.mini_batches for micro in mini for _, t, _ in micro]
                oldest = add_reward_evidence(rows, self.guard.ignored_versions, sums.evidence)
            sums = sums.over_ranks()
            with self.clock("guard"):
                failed = judged and self._guard_fails(sums, oldest, step, version)
            if failed:
                self.optimizer.zero_grad(set_to_none=True)
                rolled_back = True
                break
            with self.clock("optimizer"):
                self._apply(sums, factor, step, totals)
        self.scheduler.step()  # a skipped step too: the schedule follows the step count
        failpoint("learner.mid_step")  # weights changed; nothing recorded or published yet
        return StepSums(
            distributed.gather(seen),
            totals,
            time.perf_counter() - started,
            rolled_back,
            self.guard.metrics if self.guard is not None else {},
            self._loss_scale_metrics(totals.loss_scale_skipped),
            rejection | {"correction/starved_steps": self.starved_updates},
            self.routing.metrics(totals) if self.routing is not None else {},
        )

    def _prepare(self, share: Share, totals: StepTotals) -> Prepared:
        """The share's tensors, and π_prox where it is not each micro-batch's own forward:
        with one update it is; with several, the policy before the first update is
        recomputed here."""
        optim = self.optim
        if self.proximal_thread is not None:  # π_prox scored ahead lands on the trajectories
            rows = [t for mini in share.mini_batches for micro in mini for _, t, _ in micro]
            with self.clock("proximal"):
                self.proximal_thread.wait(rows)
        batches = [[self._tensors(rows) for rows in mini] for mini in share.mini_batches]
        proximal = None
        if self.loss.mode == "decoupled" and optim.mini_batches * optim.ppo_epochs > 1:
            advice = distributed.memory_advice("the recompute", self.memory())
            with torch.no_grad(), advice, self.clock("proximal"):
                proximal = [[self.logprobs(self.model, b)[0] for b in mini] for mini in batches]
        stale = None
        if self.versions is not None:
            with self.clock("proximal"):
                stale = self._stale_proximal(batches, totals)
        return Prepared(batches, proximal, stale)

    def _accumulate(
        self,
        prepared: Prepared,
        m: int,
        version: int,
        judged: bool,
        seen: dict[int, torch.Tensor] | None,
    ) -> tuple[UpdateSums, float]:
        """Forward and backward of mini-batch `m`'s micro-batches, gradients accumulated;
        its sums on this rank, and the factor its backwards ran with (`_gradient_factor`).
        `judged`: the guard's evidence measured too. `seen` gets each sample's log-probs
        the correction saw."""
        self.optimizer.zero_grad(set_to_none=True)
        sums = UpdateSums()
        mini = prepared.batches[m]
        factor = self._gradient_factor(mini)
        for j, micro in enumerate(mini):
            with distributed.memory_advice("a train step", self.memory(micro)):
                learner_logp = self._micro_batch(
                    micro,
                    prepared.proximal[m][j] if prepared.proximal else None,
                    version,
                    sums,
                    judged,
                    prepared.stale[m][j] if prepared.stale else None,
                    factor,
                )
            if seen is not None:
                for row, index in enumerate(micro.index):
                    seen[index] = learner_logp[row][micro.mask[row]].cpu()
        return sums, factor

    def _apply(self, sums: UpdateSums, factor: float, step: int, totals: StepTotals) -> None:
        """The accumulated gradients divided into a mean, then the update: applied, shrunk
        (starved), or skipped (an FP16 overflow, or too little kept evidence)."""
        # the mean over the whole mini-batch; the loss scale (FP16) comes off in the same
        # division, in FP32
        distributed.scale_gradients(self.model, 1.0 / (max(sums.denominator, 1.0) * factor))
        parameters = [p for p in self.model.parameters() if p.grad is not None]
        total_norm = torch.nn.utils.get_total_norm([p.grad for p in parameters])
        grad_norm = total_norm
        if hasattr(grad_norm, "full_tensor"):  # a sharded (FSDP2) model's norm is a DTensor
            grad_norm = grad_norm.full_tensor()
        totals.add(sums)
        # Non-finite first: a starved update must not hide a NaN gradient.
        if not torch.isfinite(grad_norm):
            if self.loss_scaler is None:
                raise FloatingPointError(f"step {step}: gradient norm is {grad_norm.item()}")
            # An FP16 overflow: skipped, the scale halved. Not clipped first: clipping by a
            # NaN norm would make every gradient NaN, and hide where it started.
            self.loss_scaler.overflowed(self.model, step)
            self.optimizer.zero_grad(set_to_none=True)
            totals.loss_scale_skipped += 1
            return
        if self.loss_scaler is not None:  # finite: the overflow streak ends, growth counts
            self.loss_scaler.stepped()
        # Too little kept evidence: the update shrunk or skipped (correction/calibration.py)
        lr_scale = starved_scale(sums.kept, sums.real_tokens, self.min_kept, str(self.starved))
        totals.update_scale += lr_scale
        if lr_scale < 1.0:
            totals.starved += 1
            self.starved_updates += 1
        if lr_scale == 0.0:
            self.optimizer.zero_grad(set_to_none=True)
            totals.starved_skipped += 1
            return
        torch.nn.utils.clip_grads_with_norm_(parameters, self.optim.grad_clip, total_norm)
        if self.guard is not None:  # after a rollback, smaller steps for a while
            lr_scale *= self.guard.update_scale(step)
            self.guard.updated()
        self._optimizer_step(lr_scale)
        totals.grad_norm += grad_norm.item()
        totals.updates += 1

    def _guard_fails(self, sums: UpdateSums, oldest: int | None, step: int, version: int) -> bool:
        """Judges the step's first mini-batch (`sums` over every rank) with the weights the
        previous step left; True when the guard rolled them back. Which versions sampled
        the batch matters only to a dead one (one collective; the sums are the same on
        every rank, and so is the answer)."""
        dead = self.guard.rules.dead(sums.evidence)
        sampled_from = oldest_over_ranks(oldest) if dead else None
        return self.guard.check(sums.evidence, step, version, sampled_from) is not None

    def _gradient_factor(self, mini: list[TrainBatch]) -> float:
        """What each micro-batch's loss numerator is multiplied by before its backward: 1,
        or with FP16 gradients the loss scale over the mini-batch's tokens (on every rank),
        so that the scale applies to a per-token mean, as loss scales usually do, whatever
        the batch's size."""
        if self.loss_scaler is None:
            return 1.0
        tokens = float(sum(int(micro.mask.sum()) for micro in mini))
        tokens = distributed.sum_over_ranks({"tokens": tokens})["tokens"]
        return self.loss_scaler.scale / max(tokens, 1.0)

    def _loss_scale_metrics(self, skipped: int) -> dict[str, float]:
        return {} if self.loss_scaler is None else self.loss_scaler.metrics(skipped)

    def _optimizer_step(self, lr_scale: float = 1.0) -> None:
        """AdamW's step at the learning rate times `lr_scale` (a starved update: Adam's step
        barely depends on the gradient's size, so the rate is what must shrink)."""
        rates = [group["lr"] for group in self.optimizer.param_groups]
        for group in self.optimizer.param_groups:
            group["lr"] *= lr_scale
        try:
            self.optimizer.step()
        finally:
            for group, rate in zip(self.optimizer.param_groups, rates, strict=True):
                group["lr"] = rate

    @torch.no_grad()
    def _calibrate(self, batches: list[list[TrainBatch]], version: int) -> dict[str, float]:
        """Sets the correction's unset bounds from this batch (correction/calibration.py):
        one forward without gradient of every micro-batch; the sequences whose tokens are
        all of `version` (staleness 0: the ratio is the precision's alone), or every
        sequence when none is (counted: `correction/calibration_fresh` 0)."""
        micros = [b for mini in batches for b in mini]

        def fresh_rows(b: TrainBatch) -> torch.Tensor:
            mask = b.mask.bool()
            return (~mask | (b.versions == version)).all(-1) & mask.any(-1)

        fresh = sum(int(fresh_rows(b).sum()) for b in micros)
        any_fresh = distributed.sum_over_ranks({"fresh": float(fresh)})["fresh"] > 0
        values = []
        for b in micros:
            mask = b.mask.bool()
            if any_fresh:
                mask = mask & fresh_rows(b)[:, None]
            logp = self.logprobs(self.model, b)[0]
            batch = make_batch(logp, b.rollout_logp, mask)
            values.append(calibration_values(self.correction.name, batch))
        # on the CPU: rank 0 concatenates what every rank's GPU measured
        gathered = distributed.gather(torch.cat(values).cpu())
        measured = None
        if gathered is not None:
            measured = self.calibration.measure(torch.cat(gathered))
        measured = distributed.broadcast(measured)
        self.calibration.apply(measured)
        return measured | {"correction/calibration_fresh": float(any_fresh)}

    def _micro_batch(
        self,
        micro: TrainBatch,
        proximal: torch.Tensor | None,
        version: int,
        sums: UpdateSums,
        judged: bool = False,
        stale: tuple[torch.Tensor, torch.Tensor] | None = None,
        factor: float = 1.0,
    ) -> torch.Tensor:
        """Forward and backward of one micro-batch; adds its loss numerator, denominator
        and counts to `sums` (and, `judged`, the guard's evidence). `stale`: π_prox of its
        older versions' tokens and where they are (correction.proximal=version). The
        backward runs on the numerator times `factor` (`_gradient_factor`). Returns the
        log-probs the correction saw."""
        optim = self.optim
        with self.clock("forward"):
            with self.routing.reading() if self.routing else contextlib.nullcontext() as routes:
                logp, entropy = self.logprobs(self.model, micro)
            if judged:
                bound = self.guard.settings.log_ratio_bound
                ignored = self.guard.ignored_versions
                add_token_evidence(logp, micro, bound, ignored, sums.evidence, own_version=stale)
            if proximal is None:
                proximal = logp.detach()
            if stale is not None:
                proximal = torch.where(stale[1], stale[0], proximal)
            terms = policy_loss_terms(self.loss, self.correction, logp, micro, proximal, version)
            kept = terms.mask.to(logp.dtype)
            per_token = terms.per_token - optim.entropy_coef * entropy
            if self.reference is not None:
                with torch.no_grad():
                    reference_logp, _ = self.logprobs(self.reference, micro)
                kl = kl_penalty(logp, reference_logp, optim.kl_estimator)
                per_token = per_token + optim.kl_coef * kl
                sums.kl += (kl.detach() * kept).sum().item()
            numerator, denominator = aggregate_parts(per_token, terms.mask, self.loss.aggregation)
            if routes is not None:
                numerator = numerator + self.routing.term(
                    routes, micro.attention_mask, denominator, sums
                )
        # FP16 gradients: the loss scaled up, so that small gradients do not flush to
        # zero; routed as the forward was, for an activation-checkpointed recompute
        with self._routed(self.model, micro), self.clock("backward"):
            (numerator * factor if factor != 1.0 else numerator).backward()
        sums.total += numerator.item()
        policy = aggregate_parts(terms.per_token.detach(), terms.mask, self.loss.aggregation)[0]
        sums.policy += policy.item()
        sums.denominator += denominator
        sums.entropy += (entropy.detach() * kept).sum().item()
        sums.kept += kept.sum().item()
        sums.real_tokens += micro.mask.sum().item()
        sums.clipped += terms.clipped.sum().item()
        return proximal if self.loss.mode == "decoupled" else logp.detach()

    @torch.no_grad()
    def _stale_proximal(
        self, batches: list[list[TrainBatch]], totals: StepTotals
    ) -> list[list[tuple[torch.Tensor, torch.Tensor] | None]]:
        """Per micro-batch, the log-probs of its tokens of versions other than the model's
        own under the weights of their version, and where those tokens are (None: it has
        none). A version the learner no longer (or never) kept is left to the current
        weights and counted (`proximal/fallback_tokens`)."""
        out: list[list[tuple[torch.Tensor, torch.Tensor] | None]] = [
            [None] * len(mini) for mini in batches
        ]
        totals.proximal_version_tokens = totals.proximal_fallback_tokens = 0
        totals.proximal_ahead_tokens = 0
        micros = [(m, j, b) for m, mini in enumerate(batches) for j, b in enumerate(mini)]
        present = {int(v) for _, _, b in micros for v in b.versions[b.mask].unique()}
        for v in sorted(present - {self.versions.live}):
            tokens = sum(int((b.mask & (b.versions == v)).sum()) for _, _, b in micros)
            scored = [(m, j, b, b.mask & (b.versions == v)) for m, j, b in micros]
            scored = [(m, j, b, where) for m, j, b, where in scored if where.any()]
            left = []  # what the thread did not score: this step's forward, swapped in
            ahead_tokens = 0
            for m, j, b, where in scored:
                if ahead_scored(b, where):  # scored ahead (proximal_thread): no forward here
                    out[m][j] = merged(out[m][j], b.proximal_logp.to(where.device), where)
                    ahead_tokens += int(where.sum())
                else:
                    left.append((m, j, b, where))
            totals.proximal_ahead_tokens += ahead_tokens
            if left and not self.versions.has(v):
                totals.proximal_version_tokens += ahead_tokens
                totals.proximal_fallback_tokens += tokens - ahead_tokens
                continue
            totals.proximal_version_tokens += tokens
            if not left:
                continue
            with self.versions.swapped_in(v):
                for m, j, b, where in left:
                    out[m][j] = merged(out[m][j], self.logprobs(self.model, b)[0], where)
        return out

    def _tensors(self, rows: list[Row]) -> TrainBatch:
        batch = batch_tensors([t for _, t, _ in rows], self.pad_token_id)
        batch.advantages = torch.tensor([advantage for _, _, advantage in rows])
        batch.index = [index for index, _, _ in rows]
        return batch.to(self.device)

    def logprobs(
        self, model: torch.nn.Module, batch: TrainBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        with self._routed(model, batch):
            chunk = self.optim.logprob_chunk_tokens
            return completion_logprobs(model, batch, self.temperature, chunk)

    def _routed(self, model: torch.nn.Module, batch: TrainBatch):
        """The policy's forwards of an MoE batch routed with its engine routes."""
        if self.routing is None or model is not self.model:
            return contextlib.nullcontext()
        return self.routing.routed(batch)

    def memory(self, micro: TrainBatch | None = None) -> dict[str, Any]:
        """What bounds a step's memory, for an out-of-memory message."""
        optim = self.optim
        shape = {"micro-batch": "{} × {} tokens".format(*micro.shape)} if micro else {}
        return shape | {
            "optim.micro_batch_tokens": optim.micro_batch_tokens,
            "optim.activation_checkpointing": optim.activation_checkpointing,
            "optim.logprob_chunk_tokens": optim.logprob_chunk_tokens,
            "ranks": self.world,
        }


def all_rewards_equal(group: Group) -> bool:
    """No reward spread: GRPO gives every sample advantage 0 (DAPO skips such groups)."""
    return len({t.reward for t in group.trajectories}) == 1
