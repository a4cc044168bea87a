"""The learner: trains the policy on the workers' trajectories and publishes versions.

    python -m asyncfp8.learner precision=fp8 correction=token_tis run.steps=100

One step, top to bottom (`Learner.train_step`): take `groups_per_step` complete GRPO
groups whose samples are at most `max_staleness` versions old (older ones are dropped
and counted), recompute the sampled tokens' logprobs with the FP32 master weights,
let the configured correction weigh them against the rollout engine's logprobs, take
the policy loss and an AdamW step. Every `sync.every` steps the weights go out as a new
version through the precision policy (quantized, KV scales recalibrated). Receiving
runs on its own thread (`Inbox`), so trajectories are acknowledged and work is leased
out while the learner computes.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import random
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hydra
import numpy as np
import torch
import zmq
from omegaconf import DictConfig, OmegaConf

from asyncfp8.correction import build_correction
from asyncfp8.correction.metrics import mismatch_metrics
from asyncfp8.correction.registry import make_batch
from asyncfp8.failpoints import failpoint
from asyncfp8.leases import LeaseBook
from asyncfp8.ledger import Ledger
from asyncfp8.losses import corrected_policy_loss, group_advantages
from asyncfp8.metrics import MetricsLog
from asyncfp8.models import load_model, load_tokenizer, resolve_model_dir
from asyncfp8.precision import build_policy
from asyncfp8.process import (
    StopFlag,
    check_counts,
    curve,
    endpoints,
    set_threads,
    setup_logging,
)
from asyncfp8.sync import (
    BackgroundPublisher,
    HandshakeWatch,
    Limits,
    Trajectory,
    TrajectoryReceiver,
    VersionPublisher,
)
from asyncfp8.tasks import build_task

log = logging.getLogger("asyncfp8.learner")
CHECKPOINT_DIR = "checkpoints"
# The newest version number ever used in this run dir, written before the version goes
# out. A learner killed after its last checkpoint may have published beyond it (or died
# halfway through sending one), and workers ignore a version number they have passed: a
# resumed learner numbers its versions after this one.
LATEST_VERSION_FILE = "latest_version"


class Preempted(Exception):
    """SIGTERM / Ctrl-C while waiting for data."""


@dataclass
class Group:
    """The `group_size` samples of one prompt, as one worker generated them."""

    lease: int
    prompt: int
    trajectories: list[Trajectory]

    @property
    def oldest_version(self) -> int:
        return min(min(t.versions, default=0) for t in self.trajectories)


class Inbox:
    """The learner's receiving side, on its own thread: acknowledges trajectories,
    assembles them into groups, answers lease requests from the `LeaseBook`, and
    expires the leases of workers that died holding them."""

    def __init__(
        self,
        address: str,
        book: LeaseBook,
        group_size: int,
        sampling: dict,
        seed: int,
        curve,
        limits: Limits | None = None,
        watch: HandshakeWatch | None = None,
    ):
        self.book, self.group_size, self.sampling, self.seed = book, group_size, sampling, seed
        self.receiver = TrajectoryReceiver(
            address, curve=curve, limits=limits, on_lease=self._on_lease, watch=watch
        )
        self.lock = threading.Condition()
        self.ready: deque[Group] = deque()
        self.dropped: list[tuple[int, int, int]] = []  # stale groups since the last step
        self.partial: dict[tuple[int, int], list[Trajectory]] = {}
        self.version: int | None = None  # the newest published version: leases start from it
        self.finished = False
        self.workers: dict[str, dict[str, float]] = {}  # worker id -> its latest counters
        self.told_done: set[str] = set()
        self.reported: set[tuple[int, int]] = set()  # groups already reported as not owed
        self.last_request: dict[str, float] = {}
        self.counts = dict.fromkeys(
            ("samples", "tokens", "stale_groups", "late_samples", "bad_trajectories", "waits"), 0
        )
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="asyncfp8-inbox", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _serve(self) -> None:
        last_expiry = time.monotonic()
        while not self._stop.is_set():
            trajectories = self.receiver.poll(timeout_ms=50)
            with self.lock:
                for trajectory in trajectories:
                    self._add(trajectory)
                if time.monotonic() - last_expiry > 1.0:
                    last_expiry = time.monotonic()
                    for lease in self.book.expire(time.monotonic()):
                        log.warning(
                            "lease %d of %s expired after %.0f s: prompts %s go to another worker",
                            lease.id,
                            lease.worker,
                            self.book.timeout,
                            sorted(lease.pending),
                        )
                        for prompt in lease.pending:
                            self.partial.pop((lease.id, prompt), None)

    def _add(self, trajectory: Trajectory) -> None:
        lease = trajectory.meta.get("lease")
        if not isinstance(lease, int) or not trajectory.token_ids:
            self.counts["bad_trajectories"] += 1
            log.warning(
                "dropped a trajectory from %s without a lease or tokens", trajectory.worker_id
            )
            return
        key = (lease, trajectory.prompt_index)
        owed = self.book.leases.get(lease)
        if owed is None or trajectory.prompt_index not in owed.pending:
            self.counts["late_samples"] += 1
            if key not in self.reported:  # once per group, not per sample
                self.reported.add(key)
                log.warning(
                    "dropping samples of (lease %d, prompt %d) from %s: not owed (the lease "
                    "expired, or an earlier learner granted it after its last checkpoint)",
                    lease,
                    trajectory.prompt_index,
                    trajectory.worker_id,
                )
            return
        part = self.partial.setdefault(key, [])
        part.append(trajectory)
        if len(part) < self.group_size:
            return
        del self.partial[key]
        self.book.returned(lease, trajectory.prompt_index)
        self.ready.append(Group(lease, trajectory.prompt_index, part))
        self.counts["samples"] += len(part)
        self.counts["tokens"] += sum(len(t.token_ids) for t in part)
        self.lock.notify_all()

    def _on_lease(self, request: dict[str, Any]) -> dict[str, Any]:
        now = time.monotonic()
        with self.lock:
            self.workers[request["worker_id"]] = request["stats"]
            self.last_request[request["sender"]] = now
            if self.finished:
                self.told_done.add(request["sender"])
                return {"done": True}
            if self.version is None:
                return {"wait": 0.5}
            lease = self.book.grant(request["sender"], request["want"], self.version, now)
            if lease is None:
                self.counts["waits"] += 1
                return {"wait": 0.2}
            return {
                "lease": lease.id,
                "prompts": lease.prompts,
                "min_version": lease.min_version,
                "sampling": self.sampling | {"seed": self.seed * 1_000_003 + lease.serial},
            }

    def take(
        self, count: int, version: int, max_staleness: int, timeout: float
    ) -> list[Group] | None:
        """`count` groups no older than `max_staleness` versions, oldest first; None if
        they did not arrive within `timeout` s. Stale groups met on the way are dropped
        (and their prompts queued again)."""
        deadline = time.monotonic() + timeout
        with self.lock:
            while True:
                stale = [g for g in self.ready if version - g.oldest_version > max_staleness]
                for group in stale:
                    self.ready.remove(group)
                    self.book.dropped(group.prompt)
                    self.dropped.append((group.lease, group.prompt, group.oldest_version))
                    self.counts["stale_groups"] += 1
                    log.info(
                        "dropped the group of (lease %d, prompt %d) from %s: too stale (version "
                        "%d, training %d, max staleness %d); the prompt is queued again",
                        group.lease,
                        group.prompt,
                        group.trajectories[0].worker_id,
                        group.oldest_version,
                        version,
                        max_staleness,
                    )
                if len(self.ready) >= count:
                    return [self.ready.popleft() for _ in range(count)]
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self.lock.wait(min(left, 0.5))

    def take_dropped(self) -> list[tuple[int, int, int]]:
        """(lease, prompt, oldest version) of the groups dropped as stale since the last call."""
        with self.lock:
            dropped, self.dropped = self.dropped, []
            return dropped

    def trained(self, groups: int, version: int | None) -> None:
        """A step consumed `groups` (after its version went out): capacity for new leases."""
        with self.lock:
            self.book.close(groups)
            if version is not None:
                self.version = version

    def finish(self, linger: float) -> None:
        """Tells every worker the run is over (at its next lease request), waiting up to
        `linger` s for the workers heard from in the last minute to have been told."""
        deadline = time.monotonic() + linger
        with self.lock:
            self.finished = True
        while time.monotonic() < deadline:
            with self.lock:
                recent = {s for s, t in self.last_request.items() if time.monotonic() - t < 60}
                if recent <= self.told_done:
                    return
            time.sleep(0.1)

    def state_dict(self) -> dict[str, Any]:
        with self.lock:
            return {
                "book": self.book.state_dict(),
                "receiver": self.receiver.state_dict(),
                "ready": [
                    (g.lease, g.prompt, [dataclasses.asdict(t) for t in g.trajectories])
                    for g in self.ready
                ],
                "partial": [
                    (lease, prompt, [dataclasses.asdict(t) for t in part])
                    for (lease, prompt), part in self.partial.items()
                ],
            }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with self.lock:
            self.book.load_state_dict(state["book"], time.monotonic())
            self.receiver.load_state_dict(state["receiver"])
            self.ready = deque(
                Group(lease, prompt, [Trajectory(**t) for t in part])
                for lease, prompt, part in state["ready"]
            )
            self.partial = {
                (lease, prompt): [Trajectory(**t) for t in part]
                for lease, prompt, part in state["partial"]
            }

    def snapshot_counts(self) -> dict[str, Any]:
        with self.lock:
            return {
                "queue/ready_groups": len(self.ready),
                "queue/partial_groups": len(self.partial),
                "queue/open_groups": self.book.open_groups,
                "queue/leases": len(self.book.leases),
                "data/next_prompt": self.book.next_prompt,
                "data/expired_groups": self.book.expired_groups,
                "counts": dict(self.counts),
                "workers": {name: dict(stats) for name, stats in self.workers.items()},
                "rejected": self.receiver.rejected,
                "rejected_by_source": dict(self.receiver.rejections.counts),
                "duplicates": self.receiver.duplicates,
            }

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.receiver.close()


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


def max_staleness_of(run: DictConfig) -> int:
    if run.mode not in ("async", "sync"):
        raise ValueError(f"run.mode must be async or sync, got {run.mode!r}")
    if run.mode == "sync":
        return 0
    if run.max_staleness is None or run.max_staleness < 0:
        raise ValueError(f"run.max_staleness must be >= 0, got {run.max_staleness!r}")
    return int(run.max_staleness)


class Learner:
    def __init__(self, cfg: DictConfig):
        self.cfg, run = cfg, cfg.run
        self.stop = StopFlag()
        self.max_staleness = max_staleness_of(run)
        check_counts(cfg)
        if run.group_size < 2:
            raise ValueError(
                f"run.group_size must be >= 2 (GRPO compares samples of a prompt), got {run.group_size}"
            )
        set_threads(run.threads, run.workers + 1)
        torch.manual_seed(run.seed)
        random.seed(run.seed)
        np.random.seed(run.seed)
        self.dir = Path(run.dir)
        self.dir.mkdir(parents=True, exist_ok=True)

        model_dir = resolve_model_dir(cfg.model.path, cfg.model.size, cfg.model.seed)
        self.model = load_model(model_dir, dtype=torch.float32)
        self.tokenizer = load_tokenizer(model_dir)
        self.task = build_task(cfg.task)
        self.policy = build_policy(cfg.precision)
        self.correction = build_correction(cfg.correction)
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
        self.metrics = MetricsLog(self.dir, run.tensorboard)
        OmegaConf.save(cfg, self.dir / "config.yaml")
        log.info(
            "model %s (%.2fM parameters), precision %s, correction %s (%s), %s mode, "
            "max staleness %d, listening on %s",
            model_dir,
            sum(p.numel() for p in self.model.parameters()) / 1e6,
            self.policy.name,
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
                metrics["time/elapsed_s"] = now - self.started
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
        } | {"fresh/frac_tokens": (fresh.sum() / batch["mask"].sum()).item()}

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
            extra = (
                self.policy.calibrate(self.model, self.calibration_batch)
                if self.policy.needs_calibration
                else {}
            )
            # Snapshots this step's weights (as BF16) and returns; quantizing, encoding and
            # sending happen on a thread while the next step trains.
            waited = self.background.submit(
                self.version,
                self.model.named_parameters(),
                self.policy.quantize_weights,
                extra=extra,
                policy=self.policy.name,
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
        learner = Learner(cfg)
    except (ValueError, FileNotFoundError) as err:
        log.error("%s", err)
        sys.exit(2)
    sys.exit(learner.run())


if __name__ == "__main__":
    main()
