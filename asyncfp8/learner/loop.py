"""The learner: trains the policy on the workers' trajectories and publishes versions.
`Learner.run` is the algorithm; `build.py` makes its parts; the training step is
`asyncfp8.train` (no sockets); beside this module: `hub.py` (rank 0's sockets, books and
logs), `publisher.py`, `checkpoints.py`, `evaluation.py` and `colocated.py`."""

from __future__ import annotations

import logging
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig

from asyncfp8.checks import (
    check_config,
    max_staleness_of,
    placement_of,
)
from asyncfp8.learner import build
from asyncfp8.models import load_tokenizer, run_model_dir
from asyncfp8.moe import moe_layout
from asyncfp8.precision.fp8_kv import kv_scale_names
from asyncfp8.run import distributed
from asyncfp8.run.files import GUARD_STOP_FILE, GUARD_STOPPED
from asyncfp8.run.process import StopFlag, set_threads, worker_count
from asyncfp8.sync.endpoints import endpoints
from asyncfp8.train.batches import Group, check_split
from asyncfp8.train.step import Share, plan_shares
from asyncfp8.train.step_metrics import StepMetrics
from asyncfp8.train.sums import StepSums

from .checkpoints import Checkpointer
from .hub import Hub, Preempted, RankHub
from .publisher import Publisher

log = logging.getLogger("asyncfp8.learner")


class Learner:
    def __init__(self, cfg: DictConfig):
        self.cfg, run = cfg, cfg.run
        self.stop = StopFlag()
        # The whole config, before a socket is bound or the model loaded.
        self.model_dir = model_dir = run_model_dir(cfg)
        checked = check_config(cfg, model_dir, "learner")
        self.task, self.policy, self.correction = checked.task, checked.policy, checked.correction
        self.ranks = ranks = distributed.start(run.device, run.dist_timeout)
        check_split(run.groups_per_step * run.group_size, cfg.optim.mini_batches, ranks.world)
        self.colocated_placement = placement_of(run) == "colocated"
        self._set_process_state()
        self.dtype = distributed.compute_dtype(run.compute_dtype, ranks.device)
        self.model = self._sharded(frozen=False)
        # KL-to-reference: a frozen copy of the starting policy, sharded like it.
        self.reference = self._sharded(frozen=True) if cfg.optim.kl_coef > 0 else None
        self.tokenizer = tokenizer = load_tokenizer(model_dir)
        self.optimizer, self.scheduler = build.optimizer_and_schedule(
            self.model, cfg.optim, run.steps
        )
        self.proximal, self.version_weights = build.proximal_weights(
            cfg, self.model, max_staleness_of(run), self.policy
        )
        self.proximal_thread = build.proximal_thread(
            cfg,
            self.policy,
            model_dir,
            self.version_weights,
            ranks,
            self.dtype,
            tokenizer.pad_token_id,
        )
        self.train_step = build.train_step(
            cfg,
            self.model,
            self.optimizer,
            self.scheduler,
            self.correction,
            tokenizer.pad_token_id,
            ranks,
            self.dtype,
            self.reference,
            self.proximal,
            self.version_weights,
            self.proximal_thread,
        )
        self.rolled_back = False  # the latest step undid the one before it
        self.checkpointed_step: int | None = None
        self.colocated = None
        if self.colocated_placement:
            self.colocated = build.colocated_engine(cfg, model_dir, self.task, self.policy, ranks)
        self.hub = self._hub()
        if self.proximal_thread is not None:  # one rank: the hub has the inbox
            self.hub.inbox.on_group = self.proximal_thread.submit
        self.publisher = self._publisher()
        self.checkpointer = self._checkpointer()
        self.heldout = build.heldout(
            cfg, self.task, tokenizer, ranks, self.dtype, self._evaluation_kv_scales
        )
        self.heldout_guard = build.heldout_guard(
            cfg.guard, self.heldout is not None, self.model, self.optimizer
        )
        self.heldout_rolled_back = False  # this step's evaluation put back earlier weights
        self.step = 0
        # Training time before this process (a resumed run), and the step it resumed at.
        self.elapsed_before, self.resumed_from = 0.0, None
        self.started = time.perf_counter()
        if run.resume:
            self._restore()
        self.hub.open_logs(self.dir, self.step if run.resume else None)
        self._log_start()

    def _set_process_state(self) -> None:
        """Threads, seeds and the run directory."""
        run = self.cfg.run
        # Colocated and async, on every rank a rollout thread generates beside the training
        # one: the cores are split between all of them as between processes.
        if self.colocated_placement:
            busy = (1 + int(run.mode == "async")) * self.ranks.world
        else:
            busy = worker_count(run) + self.ranks.world
        set_threads(run.threads, busy)
        for seed in (torch.manual_seed, random.seed, np.random.seed):
            seed(run.seed)
        self.dir = Path(run.dir)
        self.dir.mkdir(parents=True, exist_ok=True)

    def _sharded(self, frozen: bool) -> torch.nn.Module:
        checkpointing = self.cfg.optim.activation_checkpointing
        return build.sharded_model(
            self.policy, self.model_dir, self.ranks, self.dtype, checkpointing, frozen
        )

    def _hub(self) -> Hub | RankHub:
        if not self.ranks.main:
            return RankHub(self.stop, self.colocated)
        metrics = StepMetrics(self.correction, self.tokenizer.pad_token_id)
        staleness = max_staleness_of(self.cfg.run)
        layout = moe_layout(self.model.config)  # an MoE's: the routes samples may carry
        hub = Hub(self.cfg, staleness, self.ranks.world, self.stop, metrics, self.colocated)
        hub.inbox.route_layout = layout
        return hub

    def _publisher(self) -> Publisher:
        cfg, ranks = self.cfg, self.ranks
        return Publisher(
            self.model,
            self.policy,
            cfg.sync,
            ranks,
            self.dir,
            self.dtype,
            self.tokenizer.pad_token_id,
            build.first_calibration_batch(self.task, self.tokenizer, ranks.device),
            self.hub.sender,
            build.probe_reference(
                cfg, self.model_dir, self.policy, ranks, self.colocated_placement
            ),
            every_rank=self.colocated_placement,
            drift=build.layout_drift(self.policy, self.model_dir, self.task, self.tokenizer, ranks),
        )

    def _checkpointer(self) -> Checkpointer:
        keep = self.cfg.run.keep_checkpoints
        checkpointer = Checkpointer(
            self.dir, self.model, self.optimizer, self.scheduler, self.ranks, keep
        )
        if self.train_step.loss_scaler is not None:  # FP16: a resume keeps the scale it reached
            checkpointer.stateful["loss_scale"] = self.train_step.loss_scaler
        if self.train_step.calibration is not None:  # and the bounds its first step measured
            checkpointer.stateful["bound_calibration"] = self.train_step.calibration
        return checkpointer

    @property
    def version(self) -> int | None:
        """The latest version published."""
        return self.publisher.version

    @version.setter
    def version(self, number: int | None) -> None:
        self.publisher.version = number

    # -- the loop ----------------------------------------------------------------------------

    def run(self) -> int:
        run, hub = self.cfg.run, self.hub
        hub.start()
        hub.published(self._publish())
        if self.step == 0:
            self.checkpoint()  # so that a learner killed before its first interval can resume
            if baseline := self._evaluation():  # the policy before any step
                hub.write(0, baseline | {"version": self.version})
        self.started = self.last_step = time.perf_counter()
        try:
            while self.step < run.steps:
                share, groups, waited = hub.next_share(self.step, self.version, self.shares)
                metrics = self.train(share, groups)
                # a rollback's weights go out at once: workers stop sampling the broken ones
                due = self.step % self.cfg.sync.every == 0 or self.step == run.steps
                due = due or self.rolled_back
                with self.train_step.clock("publish"):
                    published = self._publish() if due else {}
                if warning := self._drift_warning(published):
                    hub.say("warning: %s", warning)
                with self.train_step.clock("eval"):
                    evaluated = self._evaluation()
                if self.heldout_rolled_back and self.step < run.steps:
                    published |= self._publish()  # the restored weights out at once
                metrics |= published | evaluated
                hub.record(self.step, metrics, len(groups or ()), published, self._times(waited))
                if self.rolled_back and self.train_step.guard.exhausted:
                    return self._stop_by_guard()
                if self._checkpoint_due():  # timed in the next step's record
                    with self.train_step.clock("checkpoint"):
                        self.checkpoint()
                export_every = run.export_every
                if export_every and self.step % export_every == 0 and self.step < run.steps:
                    self.export()
        except Preempted:
            hub.say(
                "stopped by signal %s at step %d; checkpoint %s; continue with "
                "run.resume=true run.dir=%s",
                self.stop.signal,
                self.step,
                self.checkpoint(),
                self.dir,
            )
            self.close()
            return 128 + (self.stop.signal or 15)
        except BaseException:
            hub.abort()
            raise
        self.checkpoint()
        self.export()
        hub.finish()
        hub.say(
            "finished %d steps; last version %d; %s", self.step, self.version, self._guard_line()
        )
        self.close()
        return 0

    def shares(self, groups: list[Group]) -> list[Share]:
        """Every rank's share of a batch (rank 0 plans, `Hub.next_share` hands out)."""
        return plan_shares(groups, self.cfg.optim, self.ranks.world)

    def train(self, share: Share, groups: list[Group] | None) -> dict[str, Any]:
        """One step on this rank's share (every rank calls it; rank 0 also passes the
        step's groups and gets the step's metrics back)."""
        sums: StepSums = self.train_step(share, self.step, self.version)
        self.rolled_back = sums.rolled_back
        if self.version_weights is not None:
            self.version_weights.changed()
        self.publisher.calibrate_on(share.calibration)
        self.step += 1
        lr = self.scheduler.get_last_lr()[0]
        return self.hub.trained(
            self.step, self.version, groups, sums, lr, self.reference is not None
        )

    # -- parts of the loop -------------------------------------------------------------------

    def _times(self, waited: float) -> dict[str, float]:
        now = time.perf_counter()
        times = {
            "time/wait_s": waited,
            "time/step_total_s": now - self.last_step,
            "time/elapsed_s": self.elapsed_before + now - self.started,
            **self.train_step.clock.take(),
        }
        self.last_step = now
        if self.resumed_from is not None:  # the first step after a resume says so
            times["run/resumed_from_step"], self.resumed_from = self.resumed_from, None
        return times

    def _evaluation(self) -> dict[str, Any]:
        """Held-out pass@1 when it is due: before the first step, every `eval.every`
        steps and after the last (collective)."""
        every, self.heldout_rolled_back = self.cfg.eval.every, False
        if self.heldout is None or (self.step % every and self.step != self.cfg.run.steps):
            return {}
        started = time.perf_counter()
        metrics = self.heldout.evaluate(self.model)
        metrics |= self._judge_heldout(metrics)
        metrics["time/eval_s"] = time.perf_counter() - started
        self.hub.say(
            "held-out pass@1 after %d steps: greedy %.3f, sampled %.3f (%d prompts, %.1f s)",
            self.step,
            metrics["eval/pass1_greedy"],
            metrics["eval/pass1_sampled"],
            metrics["eval/prompts"],
            metrics["time/eval_s"],
        )
        return metrics

    def _publish(self) -> dict[str, Any]:
        """The current weights out as the next version (and kept, with
        correction.proximal=version)."""
        published = self.publisher.publish()
        if self.version_weights is not None:
            self.version_weights.record(self.version)
        return published

    def _drift_warning(self, published: dict[str, Any]) -> str | None:
        drift = self.publisher.drift
        return drift.over_budget(published) if drift is not None else None

    def checkpoint(self) -> Path:
        elapsed = self.elapsed_before + time.perf_counter() - self.started
        self.checkpointed_step = self.step
        return self.checkpointer.save(self.step, self.version, self.hub.state_dict(), elapsed)

    # -- the guard ---------------------------------------------------------------------------

    def _judge_heldout(self, metrics: dict[str, Any]) -> dict[str, Any]:
        """guard.heldout_below (train/rollback.py, HeldOutGuard): an evaluation far
        below the run's best puts back the weights of the last one that was not; what the
        run goes on with is evaluated again, and the undone score kept beside it."""
        guard = self.heldout_guard
        if guard is None:
            return {}
        why = guard.judge(metrics["eval/pass1_greedy"], self.step, self.version)
        if why is None:
            return {"guard/heldout_rollbacks": guard.rollbacks}
        log.warning("guard: %s", why)
        self.heldout_rolled_back = True
        if self.version_weights is not None:
            self.version_weights.changed()
        if self.train_step.guard is not None:  # its kept states are of the undone weights
            self.train_step.guard.restart_from(guard.kept.step, guard.kept.version, self.version)
        return self.heldout.evaluate(self.model) | {
            "guard/heldout_rolled_back": 1,
            "guard/heldout_rollbacks": guard.rollbacks,
            "guard/heldout_undone_greedy": metrics["eval/pass1_greedy"],
            "guard/heldout_restored_step": guard.kept.step,
        }

    def _checkpoint_due(self) -> bool:
        """Every `run.checkpoint_every` steps; after a held-out rollback; and after a
        rollback when a checkpoint was written after the last good step (with the weights
        the guard has just undone): a resume must not read that one."""
        run = self.cfg.run
        if self.step < run.steps and (
            self.step % run.checkpoint_every == 0 or self.heldout_rolled_back
        ):
            return True
        if not self.rolled_back:
            return False
        good, saved = self.train_step.guard.good_step, self.checkpointed_step
        return saved is not None and good is not None and saved > good

    def _stop_by_guard(self) -> int:
        """`guard.max_rollbacks` in a row: the weights are the oldest good state kept (or,
        with none yet, the ones this process started from); a checkpoint of them, the
        workers told, and a message naming the signal, the setting and the checkpoint."""
        guard = self.train_step.guard
        good = guard.fall_back()
        folder = self.checkpoint() if good is not None else self.checkpointer.latest()
        guard.report_stop(self.step, good, folder, self.dir, write=self.ranks.main)
        self.hub.finish()
        self.close()
        return GUARD_STOPPED

    def _guard_line(self) -> str:
        guard, heldout = self.train_step.guard, self.heldout_guard
        line = "guard off" if guard is None else guard.summary_line()
        if heldout is not None and heldout.rollbacks:
            line += f"; {heldout.rollbacks} held-out rollback(s) (guard.heldout_below)"
        return line

    def export(self) -> Path:
        return self.checkpointer.export(self.step, self.model_dir)

    def close(self) -> None:
        self.hub.close()
        if self.proximal_thread is not None:
            self.proximal_thread.close()
        distributed.close()

    # -- start -------------------------------------------------------------------------------

    def _evaluation_kv_scales(self) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """The latest version's KV scales when the learner's forward rounds keys and
        values to e4m3 with them (an FP8 KV cache, precision.learner_forward=quantized):
        evaluation's cache then stores e4m3 with them, as the engine's does."""
        fp8_cache = self.policy.engine_config().get("kv_cache_dtype") == "fp8"
        if not fp8_cache or self.policy.learner_forward != "quantized":
            return None
        extra = self.publisher.latest_extra
        names = [kv_scale_names(layer) for layer in range(self.model.config.num_hidden_layers)]
        device = self.ranks.device
        return [(extra[n["k"]].float().to(device), extra[n["v"]].float().to(device)) for n in names]

    def _restore(self) -> None:
        restored = self.checkpointer.restore()
        if self.ranks.main:  # a run the guard stopped goes on: no longer stopped
            (self.dir / GUARD_STOP_FILE).unlink(missing_ok=True)
        self.step, self.version = restored.step, restored.version
        self.elapsed_before, self.resumed_from = restored.elapsed_s, restored.step
        self.hub.load_state_dict(restored.inbox)
        self.hub.say(
            "resumed from %s: step %d, version %d (the next is %d), next prompt %d; saved "
            "by %d rank(s), resumed on %d",
            restored.folder,
            self.step,
            self.version,
            self.version + 1,
            restored.inbox["book"]["next_prompt"],
            restored.world_size,
            self.ranks.world,
        )

    def _log_start(self) -> None:
        cfg, run = self.cfg, self.cfg.run
        self.hub.say(
            "model %s (%.2fM parameters), precision %s (learner forward: %s, quantized from: "
            "%s, engine computing in %s), correction %s (%s), %s mode, max staleness %d, %d "
            "rank(s) on %s computing in %s, %s",
            self.model_dir,
            sum(p.numel() for p in self.model.parameters()) / 1e6,
            self.policy.spec,
            self.policy.learner_forward,
            self.policy.quantize_from,
            str(self.policy.engine_dtype).removeprefix("torch."),
            self.correction.name,
            cfg.correction.mode,
            run.mode,
            max_staleness_of(run),
            self.ranks.world,
            self.ranks.device.type,
            str(self.dtype).removeprefix("torch."),
            f"generating with its own {cfg.engine.name} engine (run.placement=colocated"
            + (
                "; its memory released while the learner trains: run.release_engine_memory)"
                if self.colocated.release_memory
                else ")"
            )
            if self.colocated_placement
            else f"listening on {endpoints(cfg.sync, 'bind').trajectories}",
        )
        policy = self.policy
        quantizes = policy.quantizes_weights or policy.needs_calibration
        if (
            self.ranks.main
            and quantizes
            and policy.learner_forward == "quantized"
            and self.dtype != policy.engine_dtype
        ):
            log.warning(
                "precision.learner_forward=quantized with the learner computing in %s and "
                "the engine in %s: the 8-bit quantizers turn that rounding difference into "
                "whole quantization steps, so the two forwards will not match (docs/"
                'precision.md, "The engine\'s compute dtype"); set precision.engine_dtype '
                "and run.compute_dtype alike",
                str(self.dtype).removeprefix("torch."),
                str(policy.engine_dtype).removeprefix("torch."),
            )
