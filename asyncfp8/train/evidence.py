"""The guard's evidence of a batch (asyncfp8/train/guard.py judges it): its tokens' log-ratios
and its samples' rewards, measured with the weights the previous step left. Element-wise
ops on [B, T]; why each rule is what it is: docs/running.md#the-guard-undoing-a-fatal-step."""

from __future__ import annotations

import math

import torch

from asyncfp8.correction.base import LOG_RATIO_CLAMP
from asyncfp8.correction.metrics import FAR_LOG_RATIO
from asyncfp8.run import distributed
from asyncfp8.train.batches import TrainBatch
from asyncfp8.train.guard import Evidence


@torch.no_grad()
def add_token_evidence(
    logp: torch.Tensor,
    micro: TrainBatch,
    bound: float,
    ignored_versions: tuple[int, int] | None,
    evidence: Evidence,
    own_version: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Adds a micro-batch's tokens to `evidence`: those with log ρ beyond −`bound` and −5,
    and their k3 (log ρ clamped to ±20); tokens of `ignored_versions` (after, up to] are
    counted apart. With `own_version` (π of stale tokens under their version's weights), such
    a token is judged by what the update did to it, and far means far below: rounding the
    update sided with raises a token, a break makes sampled tokens unlikely."""
    mask = micro.mask.bool()
    if ignored_versions is not None:
        after, up_to = ignored_versions
        ignored = mask & (micro.versions > after) & (micro.versions <= up_to)
        evidence.ignored_tokens += ignored.sum().item()
        mask = mask & ~ignored
    learner = logp.detach().float()
    delta = torch.nan_to_num(learner - micro.rollout_logp.float(), nan=0.0)
    judged, on_version = delta, torch.zeros_like(mask)
    if own_version is not None:
        values, on_version = own_version
        # a version log-prob that is not finite says nothing of what the update did: such
        # a token is judged on the rollout, as one whose version was not kept
        on_version = on_version & torch.isfinite(values)
        judged = torch.where(on_version, torch.nan_to_num(learner - values.float(), nan=0.0), delta)
        excused = (delta.abs() > bound) & (judged.abs() <= bound) & mask
        evidence.excused_tokens += excused.sum().item()
    clamped = delta.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    evidence.tokens += mask.sum().item()

    def beyond(limit: float) -> torch.Tensor:
        # below for a token judged on its version; either way on the rollout, whose
        # log-probs far below the learner's are themselves a fault (the refit probe's)
        return mask & ((judged < -limit) | (~on_version & (judged > limit)))

    evidence.far_tokens += beyond(bound).sum().item()
    evidence.raised_tokens += (mask & on_version & (judged > bound)).sum().item()
    evidence.far5_tokens += beyond(FAR_LOG_RATIO).sum().item()
    evidence.k3_sum += (torch.expm1(clamped) - clamped)[mask].sum().item()


def add_reward_evidence(
    trajectories, ignored_versions: tuple[int, int] | None, evidence: Evidence
) -> int | None:
    """Adds this rank's samples and how many were rewarded to `evidence`, leaving out those
    with a token of the versions in `ignored_versions` (after, up to]; returns the oldest
    version that sampled a token of those counted (None: none)."""
    after, up_to = ignored_versions or (0, -1)
    counted = [t for t in trajectories if not any(after < v <= up_to for v in t.versions)]
    evidence.samples += len(counted)
    evidence.rewarded += sum(t.reward > 0 for t in counted)
    return min((min(t.versions) for t in counted if t.versions), default=None)


def oldest_over_ranks(oldest: int | None) -> int | None:
    """The oldest of the ranks' `oldest` versions (collective; None where no rank had one)."""
    negated = -(math.inf if oldest is None else oldest)  # the oldest is the largest negated
    reduced = -distributed.max_over_ranks({"oldest": negated})["oldest"]
    return None if math.isinf(reduced) else int(reduced)
