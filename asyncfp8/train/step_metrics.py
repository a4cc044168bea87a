"""Rank 0's metrics of a step: what the batch was (rewards, lengths, the correction's
view of the mismatch), what the update did (losses, gradient norm), what the rollout
side did meanwhile (throughput, queues, per-worker engine and refit-probe stats), and a
warning when most groups carry no reward spread."""

from __future__ import annotations

import logging
from typing import Any

import torch

from asyncfp8.correction.metrics import mismatch_metrics
from asyncfp8.correction.registry import Correction, make_batch
from asyncfp8.refit.probe import refit_summary
from asyncfp8.report.summary import ZERO_SPREAD_WARN, ZERO_SPREAD_WINDOW
from asyncfp8.train.batches import Group, TrainBatch, batch_tensors
from asyncfp8.train.step import all_rewards_equal
from asyncfp8.train.sums import StepSums

log = logging.getLogger("asyncfp8.learner")


class StepMetrics:
    def __init__(self, correction: Correction, pad_token_id: int):
        self.correction, self.pad_token_id = correction, pad_token_id
        self.zero_spread: list[float] = []  # recent steps' share of groups without reward spread
        self.samples_before = 0  # samples received up to the previous step

    def of_step(
        self, groups: list[Group], sums: StepSums, version: int, lr: float, kl_ref: bool
    ) -> dict[str, Any]:
        """The step's metrics over the whole batch (every rank's samples)."""
        if sums.rolled_back:
            return self._rolled_back(groups, sums, version, lr)
        trajectories = [t for group in groups for t in group.trajectories]
        batch = batch_tensors(trajectories, self.pad_token_id)
        learner_logp = torch.zeros_like(batch.rollout_logp)
        for rows in sums.seen:
            for index, values in rows.items():
                learner_logp[index, : len(values)] = values.float()
        metrics = self.correction(
            learner_logp, batch.rollout_logp, batch.mask, batch.versions, version
        ).metrics
        rewards = torch.tensor([t.reward for t in trajectories])
        lengths = batch.mask.sum(-1).float()
        totals = sums.totals
        updates, kept = totals.updates, max(totals.kept, 1.0)
        # An update an FP16 overflow or a starved skip left out still measured its loss.
        passes = max(totals.passes, 1)
        metrics |= {
            "version": version,
            "reward/mean": rewards.mean().item(),
            "reward/std": rewards.std().item(),
            "response/length_mean": lengths.mean().item(),
            "response/frac_stopped": sum(t.finish_reason == "stop" for t in trajectories)
            / len(trajectories),
            "groups/frac_zero_advantage": sum(map(all_rewards_equal, groups)) / len(groups),
            "loss/policy": totals.policy_loss / passes,
            "loss/total": totals.total_loss / passes,
            "loss/ppo_clip_frac": totals.clipped / kept,
            "loss/entropy": totals.entropy / kept,
            "optim/grad_norm": totals.grad_norm / max(updates, 1),
            "optim/updates": int(updates),
            # what the correction kept of the real tokens, and the learning-rate factor of
            # the updates (below 1: starved, asyncfp8/correction/calibration.py)
            "correction/kept_frac": totals.kept / max(totals.real_tokens, 1.0),
            # the mean over the updates the starved rule judged (an FP16 overflow skips an
            # update before it); 1 where it judged none
            "correction/update_scale": (
                totals.update_scale / (totals.updates + totals.starved_skipped)
                if totals.updates + totals.starved_skipped
                else 1.0
            ),
            "correction/starved": totals.starved,
            "optim/lr": lr,
            "time/train_s": sums.seconds,
        }
        if kl_ref:
            metrics["loss/kl_ref"] = totals.kl / kept
        if totals.proximal_version_tokens is not None:  # correction.proximal=version
            metrics["proximal/version_tokens"] = totals.proximal_version_tokens
            metrics["proximal/fallback_tokens"] = totals.proximal_fallback_tokens
            metrics["proximal/ahead_tokens"] = totals.proximal_ahead_tokens
        self._warn_without_reward_spread(metrics["groups/frac_zero_advantage"])
        fresh = fresh_mismatch(learner_logp, batch, version)
        return metrics | fresh | sums.guard | sums.loss_scale | sums.rejection | sums.moe

    def _rolled_back(
        self, groups: list[Group], sums: StepSums, version: int, lr: float
    ) -> dict[str, Any]:
        """A step the guard rolled back trained nothing: what its batch was, and the
        guard's metrics (the loss, the correction's view and the gradient norm are those
        of no update)."""
        rewards = torch.tensor([t.reward for group in groups for t in group.trajectories])
        return (
            {
                "version": version,
                "reward/mean": rewards.mean().item(),
                "reward/std": rewards.std().item(),
                "groups/frac_zero_advantage": sum(map(all_rewards_equal, groups)) / len(groups),
                "optim/updates": 0,
                "optim/lr": lr,
                "time/train_s": sums.seconds,
            }
            | sums.guard
            | sums.loss_scale
            | sums.rejection  # bounds calibrated before the guard judged the batch stay set
        )

    def throughput(self, counts: dict, seconds: float) -> dict[str, float]:
        """The rollout side since the previous step, from the inbox's counts."""
        samples = counts["counts"]["samples"]
        metrics = {
            key: value for key, value in counts.items() if key.startswith(("queue/", "data/"))
        }
        metrics["throughput/samples_per_s"] = (samples - self.samples_before) / max(seconds, 1e-9)
        self.samples_before = samples
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
                metrics |= {  # the online drafter's (engine.speculative), the refit probe's,
                    # the colocated engine's memory released between turns
                    f"worker/{worker}/{key}": value
                    for key, value in stats.items()
                    if key.startswith(("spec/", "drafter/", "refit/", "memory/"))
                }
        if tokens_per_s:
            metrics["throughput/tokens_per_s"] = sum(tokens_per_s)
        return metrics | refit_summary(counts["workers"])

    def _warn_without_reward_spread(self, share_without: float) -> None:
        """A group whose samples all got the same reward has zero advantage and trains
        nothing; when most groups are like that for a while, say so (once per window)."""
        self.zero_spread.append(share_without)
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


def fresh_mismatch(learner_logp, batch: TrainBatch, version: int) -> dict[str, float]:
    """The mismatch on tokens of the current version only: precision, without staleness
    (the correction's mismatch/ metrics mix both)."""
    fresh = batch.mask & (batch.versions == version)
    if not fresh.any():
        return {}
    measured = mismatch_metrics(make_batch(learner_logp, batch.rollout_logp, fresh))
    return {
        "fresh/" + key.split("/", 1)[1]: value
        for key, value in measured.items()
        if key.startswith("mismatch/")
    } | {
        "fresh/frac_tokens": (fresh.sum() / batch.mask.sum()).item(),
        "fresh/tokens": int(fresh.sum()),
    }
