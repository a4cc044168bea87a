"""The learner: trains the policy on the workers' trajectories and publishes versions.

    python -m asyncfp8.learner precision=fp8 correction=token_tis run.steps=100
    torchrun --nproc_per_node 4 -m asyncfp8.learner ...     # FSDP2 over 4 ranks (GPUs or CPUs)

One step, top to bottom (`Learner.train_step`): take `groups_per_step` complete GRPO
groups whose samples are at most `max_staleness` versions old (older ones are dropped
and counted; with `run.dynamic_sampling`, groups whose rewards are all equal are skipped
and more are leased), hand every rank its share, and for each of `optim.ppo_epochs` ×
`optim.mini_batches` optimizer steps: recompute the sampled tokens' log-probabilities
micro-batch by micro-batch (`optim.micro_batch_tokens`, gradients accumulated), let the
configured correction weigh them against the rollout engine's log-probabilities, take
the clipped policy loss (plus the KL-to-reference and entropy terms when set), and step
AdamW. Every `sync.every` steps the weights go out as a new version through the
precision policy (quantized, KV scales recalibrated); every `eval.every` steps the policy
is scored on held-out prompts. Receiving runs on its own thread
(`asyncfp8.inbox.Inbox`), so trajectories are acknowledged and work is leased out while
the learner computes. The distributed plumbing is `asyncfp8.distributed`: rank 0 alone
owns the sockets, the ledger and the metrics; every rank runs every forward.
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
import os
import random
import secrets
import shutil
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hydra
import numpy as np
import torch
import zmq
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

import asyncfp8.conf  # noqa: F401  (stores the config schemas before Hydra composes)
from asyncfp8 import distributed
from asyncfp8.batches import batch_tensors, check_split, plan_step
from asyncfp8.checks import check_config, max_staleness_of
from asyncfp8.correction.metrics import mismatch_metrics
from asyncfp8.correction.registry import make_batch
from asyncfp8.evaluation import HeldOut
from asyncfp8.export import MODEL_DIR, save_model
from asyncfp8.failpoints import failpoint
from asyncfp8.inbox import Group, Inbox
from asyncfp8.leases import LeaseBook
from asyncfp8.ledger import Ledger
from asyncfp8.logprobs import completion_logprobs, install_logprob_head, without_logits
from asyncfp8.losses import (
    aggregate_parts,
    group_advantages,
    kl_penalty,
    policy_loss_terms,
)
from asyncfp8.metrics import MetricsLog
from asyncfp8.models import load_model, load_tokenizer, run_model_dir
from asyncfp8.precision import calibrate_version, version_weights
from asyncfp8.process import (
    StopFlag,
    curve,
    endpoints,
    set_threads,
    setup_logging,
)
from asyncfp8.refit import ReferenceForward, probe_sequences, refit_summary
from asyncfp8.runconfig import CONFIG_FILE, log_resume, restore_on_resume
from asyncfp8.sync import (
    BackgroundPublisher,
    HandshakeWatch,
    Limits,
    Trajectory,
    VersionPublisher,
)

log = logging.getLogger("asyncfp8.learner")
CHECKPOINT_DIR = "checkpoints"
LEARNER_STATE = "learner.pt"  # in a checkpoint directory, beside the sharded model and optimizer
# The newest version number ever used in this run dir, written before the version goes
# out. A learner killed after its last checkpoint may have published beyond it (or died
# halfway through sending one), and workers ignore a version number they have passed: a
# resumed learner numbers its versions after this one.
LATEST_VERSION_FILE = "latest_version"
STOP = "stop"  # what rank 0 hands the others instead of a share when the run stops
# Warn when more than this share of groups had no reward spread over this many steps.
ZERO_SPREAD_WARN, ZERO_SPREAD_WINDOW = 0.5, 20


class Preempted(Exception):
    """SIGTERM / Ctrl-C while waiting for data."""


@dataclass
class Share:
    """What one rank trains in a step: per mini-batch, its micro-batches of (sample
    index, trajectory, advantage); and the calibration rows, the same on every rank."""

    mini_batches: list[list[list[tuple[int, Trajectory, float]]]]
    calibration: list[Trajectory]


def lr_lambda(optim: DictConfig, steps: int):
    if optim.schedule not in ("constant", "cosine"):
        raise ValueError(f"optim.schedule must be constant or cosine, got {optim.schedule!r}")

    def factor(step: int) -> float:
        if step < optim.warmup_steps:
            return (step + 1) / optim.warmup_steps
        if optim.schedule == "cosine":
            progress = min(1.0, (step - optim.warmup_steps) / max(1, steps - optim.warmup_steps))
            return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))
        return 1.0

    return factor


class Learner:
    def __init__(self, cfg: DictConfig):
        self.cfg, run, optim = cfg, cfg.run, cfg.optim
        self.stop = StopFlag()
        # The whole config, before a socket is bound or the model loaded.
        self.model_dir = model_dir = run_model_dir(cfg)
        checked = check_config(cfg, model_dir, "learner")
        self.task, self.policy, self.correction = checked.task, checked.policy, checked.correction
        self.max_staleness = max_staleness_of(run)
        self.ranks = distributed.start(run.device, run.dist_timeout)
        check_split(run.groups_per_step * run.group_size, optim.mini_batches, self.ranks.world)
        set_threads(run.threads, run.workers + self.ranks.world)
        torch.manual_seed(run.seed)
        random.seed(run.seed)
        np.random.seed(run.seed)
        self.dir = Path(run.dir)
        self.dir.mkdir(parents=True, exist_ok=True)

        self.dtype = distributed.compute_dtype(run.compute_dtype, self.ranks.device)
        self.model = self._load(model_dir, frozen=False)
        # KL-to-reference: a frozen copy of the starting policy, sharded like it.
        self.reference = self._load(model_dir, frozen=True) if optim.kl_coef > 0 else None
        self.tokenizer = load_tokenizer(model_dir)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=optim.lr,
            betas=tuple(optim.betas),
            eps=optim.eps,
            weight_decay=optim.weight_decay,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(optim, run.steps)
        )
        self.step, self.version = 0, None
        # Training time before this process (a resumed run), and the step it resumed at.
        self.elapsed_before, self.resumed_from = 0.0, None
        self.started = time.perf_counter()
        self.zero_spread: list[float] = []  # recent steps' share of groups without reward spread
        self.calibration_batch = self._prompt_batch()
        self.heldout = None
        if cfg.eval.every:
            self.heldout = HeldOut(
                self.task,
                self.tokenizer,
                cfg.eval.prompts,
                cfg.eval.samples,
                run.max_new_tokens,
                run.temperature,
                run.seed,
                self.ranks,
            )
        self.publisher = self.inbox = self.watch = self.ledger = self.metrics = None
        # The refit probe's reference (asyncfp8/refit.py): what an engine running each
        # version must compute on a few sequences, shipped with the version.
        probe = cfg.sync.get("probe")
        self.probe_reference = None
        if self.ranks.main and probe is not None and probe.enabled:
            self.probe_reference = ReferenceForward(model_dir, self.policy)
        if self.ranks.main:
            self._listen()
        if run.resume:
            self._restore()
        if self.ranks.main:
            self.ledger = Ledger(self.dir, resumed_step=self.step if run.resume else None)
            # run.loggers: JSONL, TensorBoard, W&B (a resumed run continues its W&B run)
            self.metrics = MetricsLog.for_run(cfg, resumed_step=self.step if run.resume else None)
            OmegaConf.save(cfg, self.dir / CONFIG_FILE, resolve=True)
            log.info(
                "model %s (%.2fM parameters), precision %s (learner forward: %s, quantized from: "
                "%s), correction %s (%s), %s mode, max staleness %d, %d rank(s) on %s computing in %s, listening on %s",
                model_dir,
                sum(p.numel() for p in self.model.parameters()) / 1e6,
                self.policy.spec,
                self.policy.learner_forward,
                self.policy.quantize_from,
                self.correction.name,
                cfg.correction.mode,
                run.mode,
                self.max_staleness,
                self.ranks.world,
                self.ranks.device.type,
                str(self.dtype).removeprefix("torch."),
                endpoints(cfg.sync, "bind").trajectories,
            )

    def _load(self, model_dir: Path, frozen: bool) -> torch.nn.Module:
        model = self.policy.prepare_learner(load_model(model_dir, dtype=torch.float32))
        install_logprob_head(model)
        if frozen:
            model.requires_grad_(False)
        return distributed.shard(
            model,
            self.ranks.device,
            self.dtype,
            frozen=frozen,
            activation_checkpointing=self.cfg.optim.activation_checkpointing and not frozen,
        )

    def _listen(self) -> None:
        """Rank 0's sockets: versions out, trajectories and lease requests in."""
        cfg, run = self.cfg, self.cfg.run
        addresses, secure = endpoints(cfg.sync, "bind"), curve(cfg.sync)
        self.watch = HandshakeWatch()
        book = LeaseBook(
            capacity=(self.max_staleness + 1) * run.groups_per_step * cfg.sync.every,
            timeout=run.lease_timeout,
        )
        sampling = {
            "n": run.group_size,
            "temperature": run.temperature,
            "max_new_tokens": run.max_new_tokens,
        }
        try:
            self.publisher = VersionPublisher(
                addresses.versions,
                addresses.snapshots,
                chunk_bytes=max(1, int(cfg.sync.chunk_mb * (1 << 20))),
                curve=secure,
                watch=self.watch,
                transport=cfg.sync.transport,
                zstd_level=cfg.sync.zstd_level,
            )
            self.background = BackgroundPublisher(self.publisher, background=cfg.sync.background)
            self.inbox = Inbox(
                addresses.trajectories,
                book,
                run.group_size,
                sampling,
                run.seed,
                secure,
                limits=Limits(max_message_bytes=int(cfg.sync.max_trajectory_mb * (1 << 20))),
                watch=self.watch,
            )
        except zmq.ZMQError as err:
            raise SystemExit(
                f"learner: cannot listen on {addresses}: {err}. Is another learner running? "
                "Pick other ports with sync.version_port=... sync.snapshot_port=... "
                "sync.trajectory_port=..."
            ) from None

    # -- the loop ----------------------------------------------------------------------------

    def run(self) -> int:
        run, main = self.cfg.run, self.ranks.main
        if main:
            self.inbox.start()
        published = self.publish()
        if main:
            self.inbox.trained(0, published["sync/version"])
        if self.step == 0:
            self.checkpoint()  # so that a learner killed before its first interval can resume
            baseline = self._evaluation()  # the policy before any step
            if main and baseline:
                self.metrics.write(0, baseline | {"version": self.version})
        last = self.started = time.perf_counter()
        samples_before = 0
        try:
            while self.step < run.steps:
                waited = time.perf_counter()
                share, groups = self._next_step()
                waited = time.perf_counter() - waited
                metrics = self.train_step(share, groups)
                self.step += 1
                if main:
                    skipped = self.inbox.take_skipped()
                    metrics["groups/skipped"] = len(skipped)
                    self.ledger.write(
                        self.step, self.version, groups, self.inbox.take_dropped(), skipped
                    )
                published = None
                if self.step % self.cfg.sync.every == 0 or self.step == run.steps:
                    sync_metrics = self.publish()
                    metrics |= sync_metrics
                    published = sync_metrics.get("sync/version")
                metrics |= self._evaluation()
                if main:
                    self.inbox.trained(len(groups), published)
                    now = time.perf_counter()
                    counts = self.inbox.snapshot_counts()
                    metrics |= self._throughput(counts, now - last, samples_before)
                    metrics["total/rejected/snapshot_request"] = self.publisher.rejected
                    metrics["total/failed_handshakes"] = self.watch.failures
                    samples_before = counts["counts"]["samples"]
                    metrics["time/wait_s"], metrics["time/step_total_s"] = waited, now - last
                    metrics["time/elapsed_s"] = self.elapsed_before + now - self.started
                    if self.resumed_from is not None:  # the first step after a resume says so
                        metrics["run/resumed_from_step"], self.resumed_from = (
                            self.resumed_from,
                            None,
                        )
                    self._warn_without_reward_spread(metrics)
                    last = now
                    self.metrics.write(self.step, metrics)
                if self.step % run.checkpoint_every == 0 and self.step < run.steps:
                    self.checkpoint()
                # .get: a run saved before run.export_every existed resumes without it
                export_every = run.get("export_every", 0)
                if export_every and self.step % export_every == 0 and self.step < run.steps:
                    self.export()
        except Preempted:
            path = self.checkpoint()
            if main:
                log.info(
                    "stopped by signal %s at step %d; checkpoint %s; continue with "
                    "run.resume=true run.dir=%s",
                    self.stop.signal,
                    self.step,
                    path,
                    self.dir,
                )
            self.close()
            return 128 + (self.stop.signal or 15)
        self.checkpoint()
        self.export()
        if main:
            self.inbox.finish(linger=15)
            log.info("finished %d steps; last version %d", self.step, self.version)
        self.close()
        return 0

    def _next_step(self) -> tuple[Share, list[Group] | None]:
        """Rank 0 waits for the step's groups and hands every rank its share; it hands
        them STOP instead when the run is stopped. (share, the groups on rank 0)."""
        if not self.ranks.main:
            share = distributed.scatter(None)
            if isinstance(share, tuple) and share[0] == STOP:
                if share[1] is None:
                    raise SystemExit(1)  # rank 0 failed and said why in its log
                self.stop.signal = share[1]
                raise Preempted
            return share, None
        try:
            if self.stop:
                raise Preempted
            groups = self._wait_for_groups()
        except Preempted:
            distributed.scatter([(STOP, self.stop.signal or 15)] * self.ranks.world)
            raise
        except SystemExit:
            distributed.scatter([(STOP, None)] * self.ranks.world)
            raise
        return distributed.scatter(self.shares(groups)), groups

    def _wait_for_groups(self) -> list[Group]:
        run = self.cfg.run
        skip = _all_rewards_equal if run.dynamic_sampling else None
        waited_since = time.monotonic()
        while True:
            groups = self.inbox.take(
                run.groups_per_step, self.version, self.max_staleness, 5.0, skip=skip
            )
            if groups is not None:
                return groups
            if self.stop:
                raise Preempted
            waited = time.monotonic() - waited_since
            counts = self.inbox.snapshot_counts()
            if waited > run.worker_wait_timeout:
                raise SystemExit(
                    f"learner: no {run.groups_per_step} groups after {waited:.0f} s "
                    f"(run.worker_wait_timeout); workers heard from: "
                    f"{sorted(counts['workers']) or 'none'}. Are workers running and "
                    f"connecting to {endpoints(self.cfg.sync, 'connect').trajectories}?"
                )
            log.info(
                "step %d: waiting for trajectories (%.0f s; %d groups ready, %d open; workers %s)",
                self.step,
                waited,
                counts["queue/ready_groups"],
                counts["queue/open_groups"],
                sorted(counts["workers"]) or "none yet",
            )

    def shares(self, groups: list[Group]) -> list[Share]:
        """GRPO advantages over the whole batch, then every rank's part of every mini-batch,
        cut into micro-batches (asyncfp8.batches)."""
        optim = self.cfg.optim
        trajectories = [t for group in groups for t in group.trajectories]
        rewards = torch.tensor([t.reward for t in trajectories])
        group_index = torch.tensor([i for i, g in enumerate(groups) for _ in g.trajectories])
        advantages = group_advantages(rewards, group_index, scale=optim.advantage_scale).tolist()
        lengths = [len(t.prompt_ids) + len(t.token_ids) for t in trajectories]
        plan = plan_step(lengths, optim.mini_batches, self.ranks.world, optim.micro_batch_tokens)
        # Calibration (KV scales) on the batch's first samples, within one micro-batch.
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
            for rank in range(self.ranks.world)
        ]

    def train_step(self, share: Share, groups: list[Group] | None) -> dict[str, Any]:
        """This rank's share of one batch (every rank calls it; rank 0 also passes the
        step's groups and gets the step's metrics back)."""
        optim = self.cfg.optim
        started = time.perf_counter()
        batches = [[self._tensors(rows) for rows in mini] for mini in share.mini_batches]
        # π_prox is the policy before this step's first update: with one update, each
        # micro-batch's own forward; with several, a recompute before the first.
        proximal = None
        if self.cfg.correction.mode == "decoupled" and optim.mini_batches * optim.ppo_epochs > 1:
            with torch.no_grad(), distributed.memory_advice("the recompute", self._memory()):
                proximal = [[self._logprobs(self.model, b)[0] for b in mini] for mini in batches]
        seen: dict[int, torch.Tensor] = {}  # per sample: the log-probs the correction saw
        totals: dict[str, float] = defaultdict(float)
        for epoch, (m, mini) in itertools.product(range(optim.ppo_epochs), enumerate(batches)):
            self.optimizer.zero_grad(set_to_none=True)
            sums: dict[str, float] = defaultdict(float)
            for j, micro in enumerate(mini):
                with distributed.memory_advice("a train step", self._memory(micro)):
                    learner_logp = self._micro_batch(
                        micro, proximal[m][j] if proximal else None, sums
                    )
                if epoch == 0:
                    for row, index in enumerate(micro["index"]):
                        seen[index] = learner_logp[row][micro["mask"][row]].cpu()
            # The loss is a mean over the whole mini-batch: its sums over micro-batches
            # and ranks, divided by the whole count.
            sums = distributed.sum_over_ranks(sums)
            distributed.scale_gradients(self.model, 1.0 / max(sums["denominator"], 1.0))
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), optim.grad_clip)
            grad_norm = grad_norm.full_tensor()  # a sharded model's norm is a DTensor
            if not torch.isfinite(grad_norm):
                raise FloatingPointError(f"step {self.step}: gradient norm is {grad_norm.item()}")
            self.optimizer.step()
            for key, value in sums.items():
                totals[key] += value
            for key in ("policy", "total"):
                totals[f"{key}_loss"] += sums[key] / max(sums["denominator"], 1.0)
            totals["grad_norm"] += grad_norm.item()
            totals["updates"] += 1
        self.scheduler.step()
        failpoint("learner.mid_step")  # weights changed; nothing recorded or published yet
        self.calibration_batch = self._calibration_batch(share.calibration)
        everyone_seen = distributed.gather(seen)
        if not self.ranks.main:
            return {}
        return self._step_metrics(groups, everyone_seen, totals, time.perf_counter() - started)

    def _micro_batch(self, micro: dict, proximal: torch.Tensor | None, sums: dict) -> torch.Tensor:
        """Forward and backward of one micro-batch; adds its loss numerator, denominator
        and counts to `sums`. Returns the log-probs the correction saw."""
        optim = self.cfg.optim
        logp, entropy = self._logprobs(self.model, micro)
        decoupled = self.cfg.correction.mode == "decoupled"
        if proximal is None:
            proximal = logp.detach()
        terms = policy_loss_terms(
            self.correction,
            logp,
            micro["rollout_logp"],
            micro["advantages"],
            micro["mask"],
            proximal_logp=proximal,
            versions=micro["versions"],
            current_version=self.version,
            mode=self.cfg.correction.mode,
            kind=optim.loss,
            clip_low=optim.clip_low,
            clip_high=optim.clip_high,
            clip_ratio_c=optim.clip_ratio_c,
        )
        kept = terms.mask.to(logp.dtype)
        per_token = terms.per_token - optim.entropy_coef * entropy
        if self.reference is not None:
            with torch.no_grad():
                reference_logp, _ = self._logprobs(self.reference, micro)
            kl = kl_penalty(logp, reference_logp, optim.kl_estimator)
            per_token = per_token + optim.kl_coef * kl
            sums["kl"] += (kl.detach() * kept).sum().item()
        numerator, denominator = aggregate_parts(per_token, terms.mask, optim.aggregation)
        numerator.backward()
        sums["total"] += numerator.item()
        sums["policy"] += aggregate_parts(terms.per_token.detach(), terms.mask, optim.aggregation)[
            0
        ].item()
        sums["denominator"] += denominator
        sums["entropy"] += (entropy.detach() * kept).sum().item()
        sums["kept"] += kept.sum().item()
        sums["clipped"] += terms.clipped.sum().item()
        return proximal if decoupled else logp.detach()

    def _step_metrics(
        self, groups: list[Group], seen: list[dict], totals: dict, seconds: float
    ) -> dict[str, Any]:
        """Rank 0: the step's metrics over the whole batch (every rank's samples)."""
        trajectories = [t for group in groups for t in group.trajectories]
        batch = batch_tensors(trajectories, self.tokenizer.pad_token_id)
        learner_logp = torch.zeros_like(batch["rollout_logp"])
        for rows in seen:
            for index, values in rows.items():
                learner_logp[index, : len(values)] = values.float()
        metrics = self.correction(
            learner_logp, batch["rollout_logp"], batch["mask"], batch["versions"], self.version
        ).metrics
        rewards = torch.tensor([t.reward for t in trajectories])
        lengths = batch["mask"].sum(-1).float()
        all_same = sum(_all_rewards_equal(g) for g in groups)
        updates, kept = totals["updates"], max(totals["kept"], 1.0)
        metrics |= {
            "version": self.version,
            "reward/mean": rewards.mean().item(),
            "reward/std": rewards.std().item(),
            "response/length_mean": lengths.mean().item(),
            "response/frac_stopped": sum(t.finish_reason == "stop" for t in trajectories)
            / len(trajectories),
            "groups/frac_zero_advantage": all_same / len(groups),
            "loss/policy": totals["policy_loss"] / updates,
            "loss/total": totals["total_loss"] / updates,
            "loss/ppo_clip_frac": totals["clipped"] / kept,
            "loss/entropy": totals["entropy"] / kept,
            "optim/grad_norm": totals["grad_norm"] / updates,
            "optim/updates": int(updates),
            "optim/lr": self.scheduler.get_last_lr()[0],
            "time/train_s": seconds,
        }
        if self.reference is not None:
            metrics["loss/kl_ref"] = totals["kl"] / kept
        return metrics | self._fresh_mismatch(learner_logp, batch)

    def _warn_without_reward_spread(self, metrics: dict[str, Any]) -> None:
        """A group whose samples all got the same reward has zero advantage and trains
        nothing; when most groups are like that for a while, say so (once per window)."""
        self.zero_spread.append(metrics["groups/frac_zero_advantage"])
        window = self.zero_spread[-ZERO_SPREAD_WINDOW:]
        if len(window) == ZERO_SPREAD_WINDOW and sum(window) / len(window) > ZERO_SPREAD_WARN:
            log.warning(
                "over the last %d steps %.0f%% of groups had no reward spread (every sample "
                "scored the same): those groups train nothing. The task may be too hard or "
                "too easy for this model, or the reward constant (check task.reward).",
                ZERO_SPREAD_WINDOW,
                100 * sum(window) / len(window),
            )
            self.zero_spread.clear()

    def _fresh_mismatch(self, learner_logp, batch) -> dict[str, float]:
        """The mismatch on tokens of the current version only: precision, without
        staleness (the correction's mismatch/ metrics mix both)."""
        fresh = batch["mask"] & (batch["versions"] == self.version)
        if not fresh.any():
            return {}
        measured = mismatch_metrics(make_batch(learner_logp, batch["rollout_logp"], fresh))
        return {
            "fresh/" + key.split("/", 1)[1]: value
            for key, value in measured.items()
            if key.startswith("mismatch/")
        } | {
            "fresh/frac_tokens": (fresh.sum() / batch["mask"].sum()).item(),
            "fresh/tokens": int(fresh.sum()),
        }

    def _tensors(self, rows: list[tuple[int, Trajectory, float]]) -> dict[str, Any]:
        batch = batch_tensors([t for _, t, _ in rows], self.tokenizer.pad_token_id)
        batch["advantages"] = torch.tensor([advantage for _, _, advantage in rows])
        batch = {key: value.to(self.ranks.device) for key, value in batch.items()}
        return batch | {"index": [index for index, _, _ in rows]}

    def _logprobs(self, model: torch.nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        return completion_logprobs(
            model, batch, self.cfg.run.temperature, self.cfg.optim.logprob_chunk_tokens
        )

    def _memory(self, micro: dict | None = None) -> dict[str, Any]:
        """What bounds a step's memory, for an out-of-memory message."""
        optim = self.cfg.optim
        shape = {"micro-batch": "{} × {} tokens".format(*micro["input_ids"].shape)} if micro else {}
        return shape | {
            "optim.micro_batch_tokens": optim.micro_batch_tokens,
            "optim.activation_checkpointing": optim.activation_checkpointing,
            "optim.logprob_chunk_tokens": optim.logprob_chunk_tokens,
            "ranks": self.ranks.world,
        }

    def _calibration_batch(self, trajectories: list[Trajectory]) -> dict[str, torch.Tensor]:
        batch = batch_tensors(trajectories, self.tokenizer.pad_token_id)
        return {key: batch[key].to(self.ranks.device) for key in ("input_ids", "attention_mask")}

    def _prompt_batch(self) -> dict[str, torch.Tensor]:
        """Calibration data before the first step: the task's first prompts."""
        texts = [self.task.prompt(i).text for i in range(32)]
        batch = self.tokenizer(texts, return_tensors="pt", padding=True)
        return {key: value.to(self.ranks.device) for key, value in batch.items()}

    def _evaluation(self) -> dict[str, Any]:
        """Held-out pass@1 when it is due: before the first step, every `eval.every`
        steps and after the last (collective)."""
        every = self.cfg.eval.every
        if self.heldout is None or (self.step % every and self.step != self.cfg.run.steps):
            return {}
        started = time.perf_counter()
        metrics = self.heldout.evaluate(self.model)
        metrics["time/eval_s"] = time.perf_counter() - started
        if self.ranks.main:
            log.info(
                "held-out pass@1 after %d steps: greedy %.3f, sampled %.3f (%d prompts, %.1f s)",
                self.step,
                metrics["eval/pass1_greedy"],
                metrics["eval/pass1_sampled"],
                metrics["eval/prompts"],
                metrics["time/eval_s"],
            )
        return metrics

    def _throughput(self, counts: dict, seconds: float, samples_before: int) -> dict[str, float]:
        metrics = {
            key: value for key, value in counts.items() if key.startswith(("queue/", "data/"))
        }
        metrics["throughput/samples_per_s"] = (counts["counts"]["samples"] - samples_before) / max(
            seconds, 1e-9
        )
        metrics |= {f"total/{key}": value for key, value in counts["counts"].items()}
        metrics["total/rejected_messages"] = counts["rejected"]
        metrics |= {
            f"total/rejected/{source.replace(' ', '_')}": n
            for source, n in counts["rejected_by_source"].items()
        }
        metrics["total/duplicate_messages"] = counts["duplicates"]
        tokens_per_s = []
        for worker, stats in counts["workers"].items():
            if stats.get("generate_s", 0) > 0:
                rate = stats["tokens"] / stats["generate_s"]
                tokens_per_s.append(rate)
                metrics[f"worker/{worker}/tokens_per_s"] = rate
                metrics[f"worker/{worker}/paused_s"] = stats.get("paused_s", 0.0)
                metrics[f"worker/{worker}/rejected_versions"] = stats.get("rejected_versions", 0.0)
                metrics |= {  # the online drafter's (engine.speculative), the refit probe's
                    f"worker/{worker}/{key}": value
                    for key, value in stats.items()
                    if key.startswith(("spec/", "drafter/", "refit/"))
                }
        if tokens_per_s:
            metrics["throughput/tokens_per_s"] = sum(tokens_per_s)
        return metrics | refit_summary(counts["workers"])

    # -- versions ----------------------------------------------------------------------------

    def publish(self) -> dict[str, float]:
        """The current weights as the precision policy wants them, streamed out as a
        new version (with freshly calibrated KV scales when the policy has them). Every
        rank gathers and calibrates (collectives); rank 0 sends."""
        self.version = 0 if self.version is None else self.version + 1
        started = time.perf_counter()
        if self.ranks.main:
            # Reserve the number before any chunk leaves: if this learner dies mid-send, the
            # one that resumes must not reuse a number workers may hold part of.
            latest = self.dir / LATEST_VERSION_FILE
            latest.with_suffix(".tmp").write_text(str(self.version))
            os.replace(latest.with_suffix(".tmp"), latest)
        with torch.no_grad():
            # Every rank takes part in the gather and in calibration (collectives).
            full = distributed.full_state_dict(self.model)  # on rank 0's CPU, in FP32
            with without_logits(self.model):
                extra = calibrate_version(self.model, self.policy, self.calibration_batch)
            if not self.ranks.main:
                return {}
            # By parameter name, so that tied weights are sent once. The snapshot is taken
            # (needed: with one rank on the CPU the gathered tensors are the parameters
            # themselves, which the next step updates in place) and this returns;
            # quantizing (by the policy), encoding and sending happen on a thread while
            # the next step trains. With precision.quantize_from=compute the policy gets
            # the masters rounded to the compute dtype, as the learner's forward sees them.
            masters = ((name, full[name]) for name, _ in self.model.named_parameters())
            waited = self.background.submit(
                self.version,
                masters,
                functools.partial(version_weights, self.policy),
                extra=extra,
                policy=self.policy.spec,
                engine_config=self.policy.engine_config(),
                dtype=self.dtype if self.policy.quantize_from == "compute" else None,
                annotate=self._refit_probe(),
            )
        last = self.background.last  # the latest publish that finished
        return {
            "sync/version": self.version,
            "sync/bytes": last.bytes if last else 0,
            "sync/publish_s": last.seconds if last else 0.0,
            "sync/publish_wait_s": waited,
            "sync/probe_s": self.background.annotate_s,
            "sync/seconds": time.perf_counter() - started,
        }

    def _refit_probe(self):
        """The refit probe of the version being published, made on the publishing thread
        from its snapshot: the first rows the version was calibrated on (this step's
        rollouts), cut to sync.probe.tokens, with the reference's log-probs."""
        if self.probe_reference is None:
            return None
        settings = self.cfg.sync.probe
        ids, lengths = probe_sequences(
            self.calibration_batch["input_ids"],
            self.calibration_batch["attention_mask"],
            settings.sequences,
            settings.tokens,
        )
        reference = self.probe_reference
        return lambda snapshot, extra: reference.probe(snapshot, extra, ids, lengths).to_extra()

    # -- checkpoints -------------------------------------------------------------------------

    def checkpoint(self) -> Path:
        """A directory per checkpoint: the sharded model and optimizer, written by every
        rank (torch.distributed.checkpoint: readable at another world size), and rank 0's
        `learner.pt` (schedule, step, version, data position and what was received but not
        trained on: the inbox, RNG states). Written beside its final name and renamed, so
        a directory with that name is complete; the oldest beyond `run.keep_checkpoints`
        are removed."""
        folder = self.dir / CHECKPOINT_DIR
        final = folder / f"step_{self.step:08d}"
        staging = folder / f".{final.name}.{distributed.broadcast(secrets.token_hex(4))}.tmp"
        has_optimizer = bool(self.optimizer.state)  # an optimizer yet to step has no state
        distributed.save_checkpoint(
            str(staging), self.model, self.optimizer if has_optimizer else None
        )
        if self.ranks.main:
            state = {
                "step": self.step,
                "version": self.version,
                "scheduler": self.scheduler.state_dict(),
                "inbox": self.inbox.state_dict(),
                "optimizer_saved": has_optimizer,
                "elapsed_s": self.elapsed_before + time.perf_counter() - self.started,
                "world_size": self.ranks.world,
                "rng": {
                    "torch": torch.get_rng_state(),
                    "python": random.getstate(),
                    "numpy": np.random.get_state(),
                },
            }
            torch.save(state, staging / LEARNER_STATE)
            if final.exists():  # reached again after a resume from an older checkpoint
                shutil.rmtree(final)
            os.replace(staging, final)
            saved = sorted(p for p in folder.glob("step_*") if p.is_dir())
            for old in saved[: -self.cfg.run.keep_checkpoints]:
                shutil.rmtree(old)
            for leftover in folder.glob(".step_*.tmp"):  # of a learner killed mid-checkpoint
                shutil.rmtree(leftover, ignore_errors=True)
        return final

    def export(self) -> Path:
        """The policy as a Hugging Face model in `<run.dir>/model/` (BF16, with the source
        model's tokenizer and generation config), replacing the previous export. Every rank
        takes part in the gather; rank 0 writes."""
        out = self.dir / MODEL_DIR
        with torch.no_grad():
            full = distributed.full_state_dict(self.model)
        if self.ranks.main:
            info = {
                "run": str(self.dir.resolve()),
                "step": self.step,
                "source_model": str(self.model_dir),
            }
            save_model(full, self.model_dir, out, info)
            log.info("exported the step-%d policy to %s", self.step, out)
        return out

    def _restore(self) -> None:
        """Every rank reads the newest checkpoint (run.dir must be on storage they all see)."""
        saved = sorted((self.dir / CHECKPOINT_DIR).glob(f"step_*/{LEARNER_STATE}"))
        if not saved and any((self.dir / CHECKPOINT_DIR).glob("step_*.pt")):
            raise SystemExit(
                f"learner: {self.dir / CHECKPOINT_DIR} holds only single-file checkpoints "
                "(step_N.pt) of an asyncfp8 from before the sharded learner; this one cannot "
                "resume them: start a new run.dir"
            )
        if not saved:
            raise SystemExit(
                f"learner: run.resume=true but {self.dir / CHECKPOINT_DIR} holds no checkpoint; "
                "point run.dir at the run to continue"
            )
        folder = saved[-1].parent
        state = torch.load(saved[-1], weights_only=False)
        distributed.load_checkpoint(
            str(folder), self.model, self.optimizer if state["optimizer_saved"] else None
        )
        self.scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
        np.random.set_state(state["rng"]["numpy"])
        self.step, self.version = state["step"], state["version"]
        self.elapsed_before, self.resumed_from = state.get("elapsed_s", 0.0), self.step
        latest = self.dir / LATEST_VERSION_FILE
        if latest.exists():
            self.version = max(self.version, int(latest.read_text()))
        if not self.ranks.main:
            return
        self.inbox.load_state_dict(state["inbox"])
        log.info(
            "resumed from %s: step %d, version %d (the next is %d), next prompt %d; saved by "
            "%d rank(s), resumed on %d",
            folder,
            self.step,
            self.version,
            self.version + 1,
            state["inbox"]["book"]["next_prompt"],
            state["world_size"],
            self.ranks.world,
        )

    def close(self) -> None:
        if self.ranks.main:
            self.inbox.close()
            self.publisher.close()
            self.watch.close()
            self.ledger.close()
            self.metrics.close()
        distributed.close()


def _all_rewards_equal(group: Group) -> bool:
    """No reward spread: GRPO gives every sample advantage 0 (DAPO skips such groups)."""
    return len({t.reward for t in group.trajectories}) == 1


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    rank = os.environ.get("RANK", "0")  # set by torchrun
    setup_logging("learner" if rank == "0" else f"learner-rank{rank}")
    try:
        cfg, changes = restore_on_resume(cfg, list(HydraConfig.get().overrides.task))
        log_resume(cfg, changes, "learner")
        learner = Learner(cfg)
    except (ValueError, FileNotFoundError, MemoryError) as err:
        log.error("%s", err)
        sys.exit(2)
    try:
        sys.exit(learner.run())
    except MemoryError as err:
        log.error("%s", err)
        sys.exit(1)


if __name__ == "__main__":
    main()
