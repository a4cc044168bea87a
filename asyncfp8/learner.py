"""The learner: trains the policy on the workers' trajectories and publishes versions.

    python -m asyncfp8.learner precision=fp8 correction=token_tis run.steps=100

One step, top to bottom (`Learner.train_step`): take `groups_per_step` complete GRPO
groups whose samples are at most `max_staleness` versions old (older ones are dropped
and counted), recompute the sampled tokens' logprobs with the FP32 master weights (or,
with `precision.learner_forward=quantized`, through the engine's quantized forward),
let the configured correction weigh them against the rollout engine's logprobs, take
the policy loss and an AdamW step. Every `sync.every` steps the weights go out as a new
version through the precision policy (quantized, KV scales recalibrated). Receiving
runs on its own thread (`asyncfp8.inbox.Inbox`), so trajectories are acknowledged and
work is leased out while the learner computes.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import hydra
import numpy as np
import torch
import zmq
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

import asyncfp8.conf  # noqa: F401  (stores the config schemas before Hydra composes)
from asyncfp8.checks import check_config, max_staleness_of
from asyncfp8.correction.metrics import mismatch_metrics
from asyncfp8.correction.registry import make_batch
from asyncfp8.failpoints import failpoint
from asyncfp8.inbox import Group, Inbox
from asyncfp8.leases import LeaseBook
from asyncfp8.ledger import Ledger
from asyncfp8.losses import corrected_policy_loss, group_advantages
from asyncfp8.metrics import MetricsLog
from asyncfp8.models import load_model, load_tokenizer, resolve_model_dir
from asyncfp8.precision import calibrate_version, version_weights
from asyncfp8.process import (
    StopFlag,
    curve,
    endpoints,
    set_threads,
    setup_logging,
)
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
# The newest version number ever used in this run dir, written before the version goes
# out. A learner killed after its last checkpoint may have published beyond it (or died
# halfway through sending one), and workers ignore a version number they have passed: a
# resumed learner numbers its versions after this one.
LATEST_VERSION_FILE = "latest_version"
# Warn when more than this share of groups had no reward spread over this many steps.
ZERO_SPREAD_WARN, ZERO_SPREAD_WINDOW = 0.5, 20


class Preempted(Exception):
    """SIGTERM / Ctrl-C while waiting for data."""


def completion_logprobs(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], temperature: float
) -> torch.Tensor:
    """[N, T] log-probabilities of the completion tokens under `model` at `temperature`
    (the distribution the engine sampled from; no top-k/top-p), from a right-padded
    batch of prompt + completion as built by `batch_tensors`."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    logits = logits.float()
    if temperature > 0:
        logits = logits / temperature
    # logits[:, j] predicts token j + 1; completion token k sits at prompt_len + k.
    positions = batch["positions"]
    rows = logits[:, :-1].gather(1, positions[..., None].expand(-1, -1, logits.shape[-1]))
    targets = batch["input_ids"][:, 1:].gather(1, positions)
    return torch.log_softmax(rows, dim=-1).gather(-1, targets[..., None])[..., 0]


def batch_tensors(trajectories: list[Trajectory], pad: int) -> dict[str, torch.Tensor]:
    """Right-padded prompt + completion ids, and per completion token [N, T]: its
    position in the sequence, the rollout logprob, the version, and the mask."""
    width = max(len(t.prompt_ids) + len(t.token_ids) for t in trajectories)
    steps = max(len(t.token_ids) for t in trajectories)
    n = len(trajectories)
    input_ids = torch.full((n, width), pad, dtype=torch.long)
    attention = torch.zeros(n, width, dtype=torch.long)
    positions = torch.zeros(n, steps, dtype=torch.long)
    rollout = torch.zeros(n, steps)
    versions = torch.zeros(n, steps, dtype=torch.long)
    mask = torch.zeros(n, steps, dtype=torch.bool)
    for row, t in enumerate(trajectories):
        ids = list(t.prompt_ids) + list(t.token_ids)
        k = len(t.token_ids)
        input_ids[row, : len(ids)] = torch.tensor(ids)
        attention[row, : len(ids)] = 1
        positions[row, :k] = torch.arange(len(t.prompt_ids) - 1, len(ids) - 1)
        rollout[row, :k] = torch.tensor(t.logprobs)
        versions[row, :k] = torch.tensor(t.versions)
        mask[row, :k] = True
    return {
        "input_ids": input_ids,
        "attention_mask": attention,
        "positions": positions,
        "rollout_logp": rollout,
        "versions": versions,
        "mask": mask,
    }


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
        self.cfg, run = cfg, cfg.run
        self.stop = StopFlag()
        # The whole config, before a socket is bound or the model loaded.
        model_dir = resolve_model_dir(cfg.model.path, cfg.model.size, cfg.model.seed)
        checked = check_config(cfg, model_dir, "learner")
        self.task, self.policy, self.correction = checked.task, checked.policy, checked.correction
        self.max_staleness = max_staleness_of(run)
        set_threads(run.threads, run.workers + 1)
        torch.manual_seed(run.seed)
        random.seed(run.seed)
        np.random.seed(run.seed)
        self.dir = Path(run.dir)
        self.dir.mkdir(parents=True, exist_ok=True)

        self.model = self.policy.prepare_learner(load_model(model_dir, dtype=torch.float32))
        self.tokenizer = load_tokenizer(model_dir)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=cfg.optim.lr,
            betas=tuple(cfg.optim.betas),
            eps=cfg.optim.eps,
            weight_decay=cfg.optim.weight_decay,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(cfg.optim, run.steps)
        )
        self.step, self.version = 0, None
        # Training time before this process (a resumed run), and the step it resumed at.
        self.elapsed_before, self.resumed_from = 0.0, None
        self.started = time.perf_counter()
        self.zero_spread: list[float] = []  # recent steps' share of groups without reward spread
        self.calibration_batch = self._prompt_batch()

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
        if run.resume:
            self._restore()
        self.ledger = Ledger(self.dir, resumed_step=self.step if run.resume else None)
        self.metrics = MetricsLog(
            self.dir, run.tensorboard, resumed_step=self.step if run.resume else None
        )
        OmegaConf.save(cfg, self.dir / CONFIG_FILE, resolve=True)
        log.info(
            "model %s (%.2fM parameters), precision %s (learner forward: %s), correction %s (%s), %s mode, "
            "max staleness %d, listening on %s",
            model_dir,
            sum(p.numel() for p in self.model.parameters()) / 1e6,
            self.policy.spec,
            self.policy.learner_forward,
            self.correction.name,
            cfg.correction.mode,
            run.mode,
            self.max_staleness,
            addresses.trajectories,
        )

    # -- the loop ----------------------------------------------------------------------------

    def run(self) -> int:
        run = self.cfg.run
        self.inbox.start()
        self.inbox.trained(0, self.publish()["sync/version"])
        if self.step == 0:
            self.checkpoint()  # so that a learner killed before its first interval can resume
        last = self.started = time.perf_counter()
        samples_before = 0
        try:
            while self.step < run.steps:
                waited = time.perf_counter()
                groups = self._wait_for_groups()
                waited = time.perf_counter() - waited
                metrics = self.train_step(groups)
                self.step += 1
                self.ledger.write(self.step, self.version, groups, self.inbox.take_dropped())
                published = None
                if self.step % self.cfg.sync.every == 0 or self.step == run.steps:
                    sync_metrics = self.publish()
                    metrics |= sync_metrics
                    published = sync_metrics["sync/version"]
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
                    metrics["run/resumed_from_step"], self.resumed_from = self.resumed_from, None
                self._warn_without_reward_spread(metrics)
                last = now
                self.metrics.write(self.step, metrics)
                if self.step % run.checkpoint_every == 0 and self.step < run.steps:
                    self.checkpoint()
                if self.stop:
                    raise Preempted
        except Preempted:
            path = self.checkpoint()
            log.info(
                "stopped by signal %s at step %d; checkpoint %s; continue with run.resume=true run.dir=%s",
                self.stop.signal,
                self.step,
                path,
                self.dir,
            )
            self._close()
            return 128 + (self.stop.signal or 15)
        self.checkpoint()
        self.inbox.finish(linger=15)
        log.info("finished %d steps; last version %d", self.step, self.version)
        self._close()
        return 0

    def _wait_for_groups(self) -> list[Group]:
        run = self.cfg.run
        waited_since = time.monotonic()
        while True:
            groups = self.inbox.take(run.groups_per_step, self.version, self.max_staleness, 5.0)
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

    def train_step(self, groups: list[Group]) -> dict[str, Any]:
        cfg, optim = self.cfg, self.cfg.optim
        started = time.perf_counter()
        trajectories = [t for group in groups for t in group.trajectories]
        batch = batch_tensors(trajectories, self.tokenizer.pad_token_id)
        logp = completion_logprobs(self.model, batch, cfg.run.temperature)
        rewards = torch.tensor([t.reward for t in trajectories])
        group_index = torch.tensor([i for i, g in enumerate(groups) for _ in g.trajectories])
        advantages = group_advantages(rewards, group_index, scale=optim.advantage_scale)
        loss, metrics = corrected_policy_loss(
            self.correction,
            logp,
            batch["rollout_logp"],
            advantages,
            batch["mask"],
            proximal_logp=logp.detach(),  # one optimizer step per batch: π_prox is π_θ before it
            versions=batch["versions"],
            current_version=self.version,
            mode=cfg.correction.mode,
            kind=optim.loss,
            clip_low=optim.clip_low,
            clip_high=optim.clip_high,
            aggregation=optim.aggregation,
        )
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), optim.grad_clip)
        if not torch.isfinite(grad_norm):
            raise FloatingPointError(f"step {self.step}: gradient norm is {grad_norm.item()}")
        self.optimizer.step()
        self.scheduler.step()
        failpoint("learner.mid_step")  # weights changed; nothing recorded or published yet
        self.calibration_batch = {
            "input_ids": batch["input_ids"],
            "attention_mask": batch["attention_mask"],
        }
        lengths = batch["mask"].sum(-1).float()
        all_same = sum(len({t.reward for t in g.trajectories}) == 1 for g in groups)
        metrics |= {
            "version": self.version,
            "reward/mean": rewards.mean().item(),
            "reward/std": rewards.std().item(),
            "response/length_mean": lengths.mean().item(),
            "response/frac_stopped": sum(t.finish_reason == "stop" for t in trajectories)
            / len(trajectories),
            "groups/frac_zero_advantage": all_same / len(groups),
            "optim/grad_norm": grad_norm.item(),
            "optim/lr": self.scheduler.get_last_lr()[0],
            "time/train_s": time.perf_counter() - started,
        }
        metrics |= self._fresh_mismatch(logp.detach(), batch)
        return metrics

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

    def _prompt_batch(self) -> dict[str, torch.Tensor]:
        """Calibration data before the first step: the task's first prompts."""
        texts = [self.task.prompt(i).text for i in range(32)]
        return dict(self.tokenizer(texts, return_tensors="pt", padding=True))

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
        if tokens_per_s:
            metrics["throughput/tokens_per_s"] = sum(tokens_per_s)
        return metrics

    # -- versions ----------------------------------------------------------------------------

    def publish(self) -> dict[str, float]:
        """The current weights as the precision policy wants them, streamed out as a
        new version (with freshly calibrated KV scales when the policy has them)."""
        self.version = 0 if self.version is None else self.version + 1
        started = time.perf_counter()
        # Reserve the number before any chunk leaves: if this learner dies mid-send, the
        # one that resumes must not reuse a number workers may hold part of.
        latest = self.dir / LATEST_VERSION_FILE
        latest.with_suffix(".tmp").write_text(str(self.version))
        os.replace(latest.with_suffix(".tmp"), latest)
        with torch.no_grad():
            extra = calibrate_version(self.model, self.policy, self.calibration_batch)
            # Snapshots this step's master weights and returns; quantizing (by the policy,
            # from those FP32 values), encoding and sending happen on a thread while the
            # next step trains.
            waited = self.background.submit(
                self.version,
                self.model.named_parameters(),
                functools.partial(version_weights, self.policy),
                extra=extra,
                policy=self.policy.spec,
                engine_config=self.policy.engine_config(),
            )
        last = self.background.last  # the latest publish that finished
        return {
            "sync/version": self.version,
            "sync/bytes": last.bytes if last else 0,
            "sync/publish_s": last.seconds if last else 0.0,
            "sync/publish_wait_s": waited,
            "sync/seconds": time.perf_counter() - started,
        }

    # -- checkpoints -------------------------------------------------------------------------

    def checkpoint(self) -> Path:
        """Model, optimizer, schedule, version counter, data position (the lease book),
        what was received but not yet trained on, and the RNG states, written
        atomically; the oldest beyond `run.keep_checkpoints` are removed."""
        folder = self.dir / CHECKPOINT_DIR
        folder.mkdir(exist_ok=True)
        path = folder / f"step_{self.step:08d}.pt"
        state = {
            "step": self.step,
            "version": self.version,
            "elapsed_s": self.elapsed_before + time.perf_counter() - self.started,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "inbox": self.inbox.state_dict(),
            "rng": {
                "torch": torch.get_rng_state(),
                "python": random.getstate(),
                "numpy": np.random.get_state(),
            },
        }
        temporary = path.with_suffix(".tmp")
        torch.save(state, temporary)
        os.replace(temporary, path)
        for old in sorted(folder.glob("step_*.pt"))[: -self.cfg.run.keep_checkpoints]:
            old.unlink()
        return path

    def _restore(self) -> None:
        saved = sorted((self.dir / CHECKPOINT_DIR).glob("step_*.pt"))
        if not saved:
            raise SystemExit(
                f"learner: run.resume=true but {self.dir / CHECKPOINT_DIR} holds no checkpoint; "
                "point run.dir at the run to continue"
            )
        state = torch.load(saved[-1], weights_only=False)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.inbox.load_state_dict(state["inbox"])
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
        np.random.set_state(state["rng"]["numpy"])
        self.step, self.version = state["step"], state["version"]
        self.elapsed_before, self.resumed_from = state.get("elapsed_s", 0.0), self.step
        latest = self.dir / LATEST_VERSION_FILE
        if latest.exists():
            self.version = max(self.version, int(latest.read_text()))
        log.info(
            "resumed from %s: step %d, version %d (the next is %d), next prompt %d",
            saved[-1],
            self.step,
            self.version,
            self.version + 1,
            state["inbox"]["book"]["next_prompt"],
        )

    def _close(self) -> None:
        self.inbox.close()
        self.publisher.close()
        self.watch.close()
        self.ledger.close()
        self.metrics.close()


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    setup_logging("learner")
    try:
        cfg, changes = restore_on_resume(cfg, list(HydraConfig.get().overrides.task))
        log_resume(cfg, changes, "learner")
        learner = Learner(cfg)
    except (ValueError, FileNotFoundError) as err:
        log.error("%s", err)
        sys.exit(2)
    sys.exit(learner.run())


if __name__ == "__main__":
    main()
