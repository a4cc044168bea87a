"""Policy-gradient losses: group advantages, PPO-clip (clip-higher, dual-clip) / REINFORCE
per token, the KL-to-reference estimators, loss aggregation, and `policy_loss_terms` /
`corrected_policy_loss`, where behaviour, proximal and current policies meet the correction
(decoupled or bypass mode: docs/correction.md#decoupled-or-bypass; with PPO-clip, bypass
applies only the correction's mask, as the ratio already is the importance ratio)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import TypeVar

import torch

from asyncfp8.conf.schemas import AdvantageScale, Aggregation, KLEstimator, Loss
from asyncfp8.correction import LOG_RATIO_CLAMP, Correction
from asyncfp8.correction.schema import Mode
from asyncfp8.train.batches import TrainBatch

E = TypeVar("E", bound=StrEnum)
# REINFORCE's staleness ratio is truncated here, as token TIS truncates by default: a token
# the update raised far above its version's probability cannot carry the whole update.
REINFORCE_RATIO_CAP = 2.0


def _member(kind: type[E], value: str, what: str) -> E:
    """`value` as a member of the config enum `kind`, or a ValueError naming the choices."""
    try:
        return kind(value)
    except ValueError:
        choices = ", ".join(member.value for member in kind)
        raise ValueError(f"unknown {what} {value!r}; use one of: {choices}") from None


def group_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    scale: AdvantageScale = AdvantageScale.std,
    eps: float = 1e-6,
) -> torch.Tensor:
    """GRPO advantages: each reward minus its group's mean, divided by the group's
    (unbiased) std when scale="std"; scale="none" is the Dr. GRPO variant, which drops
    the std division (it up-weights easy and hard prompts). A group of one gets 0."""
    if rewards.dim() != 1 or group_ids.shape != rewards.shape:
        raise ValueError(
            f"rewards and group_ids must be [N]; got {tuple(rewards.shape)}, "
            f"{tuple(group_ids.shape)}"
        )
    scale = _member(AdvantageScale, scale, "advantage scale")
    _, index = torch.unique(group_ids, return_inverse=True)
    n_groups = int(index.max()) + 1 if index.numel() else 0
    rewards = rewards.double()
    count = torch.zeros(n_groups, dtype=torch.float64).index_add_(
        0, index, torch.ones_like(rewards)
    )
    mean = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, index, rewards) / count
    centred = rewards - mean[index]
    if scale == AdvantageScale.none:
        return centred.float()
    sq = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, index, centred.square())
    std = (sq / (count - 1).clamp_min(1)).sqrt()
    return (centred / (std[index] + eps)).float()


def aggregate(
    per_token: torch.Tensor, mask: torch.Tensor, how: Aggregation = Aggregation.token_mean
) -> torch.Tensor:
    """token_mean: mean over all real tokens of the batch; seq_mean_token_sum: per
    sequence sum, then mean over sequences; seq_mean_token_mean: per-sequence mean, then
    mean over sequences. Sequences with no real token are left out of the means."""
    numerator, denominator = aggregate_parts(per_token, mask, how)
    return numerator / max(denominator, 1.0)


def aggregate_parts(
    per_token: torch.Tensor, mask: torch.Tensor, how: Aggregation = Aggregation.token_mean
) -> tuple[torch.Tensor, float]:
    """`aggregate` as (numerator, denominator): the numerator is a sum over this part of a
    batch, the denominator a count (real tokens, or sequences with one), so that the
    aggregate over micro-batches and ranks is Σ numerators / Σ denominators."""
    how = _member(Aggregation, how, "aggregation")
    mask = mask.to(per_token.dtype)
    masked = per_token * mask
    if how == Aggregation.token_mean:
        return masked.sum(), mask.sum().item()
    n_seqs = (mask.sum(-1) > 0).sum().item()
    if how == Aggregation.seq_mean_token_sum:
        return masked.sum(), n_seqs
    return (masked.sum(-1) / mask.sum(-1).clamp_min(1)).sum(), n_seqs


def kl_penalty(
    logp: torch.Tensor,
    reference_logp: torch.Tensor,
    estimator: KLEstimator = KLEstimator.low_var_kl,
) -> torch.Tensor:
    """Per-token estimate of KL(π_θ ‖ π_ref) from tokens sampled by the rollout, as veRL
    computes it: k1 = log π_θ − log π_ref; k3 = e^(−k1) − 1 + k1 (unbiased, never negative),
    k1 clamped to ±20 before the exp so one far token cannot make the gradient inf or NaN;
    low_var_kl = k3 clamped to [−10, 10]."""
    estimator = _member(KLEstimator, estimator, "KL estimator")
    k1 = logp - reference_logp
    if estimator == KLEstimator.k1:
        return k1
    k1 = k1.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    k3 = torch.expm1(-k1) + k1
    return k3.clamp(-10, 10) if estimator == KLEstimator.low_var_kl else k3


def per_token_policy_loss(
    logp: torch.Tensor,
    proximal_logp: torch.Tensor,
    advantages: torch.Tensor,
    kind: Loss = Loss.ppo_clip,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    clip_ratio_c: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss [B, T], clipped [B, T] bool). PPO-clip over [1 − clip_low, 1 + clip_high]
    (clip-higher keeps rare tokens able to grow) and, with `clip_ratio_c` = c > 1, dual-clip
    (for A < 0 the loss is capped at −A·c); `clipped` marks the tokens a clip made constant.
    REINFORCE is −A·r·log π_θ, r = min(π_θ/π_prox, 2) held constant: its gradient carries
    the staleness ratio, truncated (r = 1 where π_prox is π_θ itself; docs/running.md)."""
    advantages = advantages[:, None] if advantages.dim() == 1 else advantages
    if _member(Loss, kind, "policy loss") == Loss.reinforce:
        log_ratio = torch.nan_to_num(logp.detach() - proximal_logp.detach(), nan=0.0)
        ratio = torch.exp(log_ratio.clamp(-20, 20)).clamp(max=REINFORCE_RATIO_CAP)
        return -advantages * ratio * logp, torch.zeros_like(logp, dtype=torch.bool)
    if not (0 <= clip_low < 1 and clip_high >= 0):
        raise ValueError(f"need 0 <= clip_low < 1 and clip_high >= 0; got {clip_low}, {clip_high}")
    if clip_ratio_c is not None and not clip_ratio_c > 1:
        raise ValueError(f"dual-clip needs clip_ratio_c > 1 (or None: off), got {clip_ratio_c}")
    ratio = torch.exp((logp - proximal_logp.detach()).clamp(-20, 20))
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - clip_low, 1 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    was_clipped = clipped > unclipped
    if clip_ratio_c is not None:
        cap = -advantages * clip_ratio_c
        dual = (advantages < 0) & (loss > cap)
        loss = torch.where(dual, cap, loss)
        was_clipped = was_clipped | dual
    return loss, was_clipped


@dataclass(frozen=True)
class PolicyLoss:
    """How the policy loss is made: the clipped objective (`optim.loss`, `clip_low`,
    `clip_high`, `clip_ratio_c`: `per_token_policy_loss`), how the correction meets it
    (`correction.mode`: the module docstring) and how tokens add up (`optim.aggregation`:
    `aggregate`). Checked when made."""

    kind: Loss = Loss.ppo_clip
    clip_low: float = 0.2
    clip_high: float = 0.28
    clip_ratio_c: float | None = None
    mode: Mode = Mode.decoupled
    aggregation: Aggregation = Aggregation.token_mean

    def __post_init__(self):
        object.__setattr__(self, "kind", _member(Loss, self.kind, "policy loss"))
        object.__setattr__(self, "mode", _member(Mode, self.mode, "correction mode"))
        aggregation = _member(Aggregation, self.aggregation, "aggregation")
        object.__setattr__(self, "aggregation", aggregation)
        one = torch.zeros(1, 1)
        self.per_token(one, one, torch.zeros(1))  # the kind and clip settings, checked

    @classmethod
    def from_config(cls, optim, mode: str) -> PolicyLoss:
        """From the run's `optim` settings and `correction.mode`."""
        return cls(
            kind=optim.loss,
            clip_low=optim.clip_low,
            clip_high=optim.clip_high,
            clip_ratio_c=optim.clip_ratio_c,
            mode=mode,
            aggregation=optim.aggregation,
        )

    def per_token(
        self, logp: torch.Tensor, proximal_logp: torch.Tensor, advantages: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`per_token_policy_loss` with these settings."""
        return per_token_policy_loss(
            logp,
            proximal_logp,
            advantages,
            self.kind,
            self.clip_low,
            self.clip_high,
            self.clip_ratio_c,
        )


@dataclass
class PolicyLossTerms:
    """One batch's policy loss before aggregation: `per_token` (the clipped loss times
    the correction's weights), the tokens it counts (`mask`: real tokens the correction
    kept), the tokens a clip made constant, and the correction's metrics."""

    per_token: torch.Tensor
    mask: torch.Tensor
    clipped: torch.Tensor
    metrics: dict[str, float]


def policy_loss_terms(
    loss: PolicyLoss,
    correction: Correction,
    logp: torch.Tensor,
    batch: TrainBatch,
    proximal_logp: torch.Tensor | None = None,
    current_version: int | None = None,
) -> PolicyLossTerms:
    """The correction applied to one batch's per-token policy loss (module docstring:
    decoupled vs bypass). `logp`: π_θ of the sampled tokens [B, T]; `batch`: their
    rollout log-probs, advantages, mask and versions (read by the correction where
    `current_version` is given); `proximal_logp`: π_prox (decoupled)."""
    rollout_logp, mask = batch.rollout_logp, batch.mask
    versions = batch.versions if current_version is not None else None
    if loss.mode == Mode.decoupled:
        if proximal_logp is None:
            raise ValueError(
                "decoupled mode needs proximal_logp (a learner recompute); "
                "correction.mode=bypass skips it"
            )
        result = correction(proximal_logp, rollout_logp, mask, versions, current_version)
        weights = result.weights
    else:  # bypass: REINFORCE's ratio is the correction's weight, so π_prox is π_θ itself
        result = correction(logp.detach(), rollout_logp, mask, versions, current_version)
        if loss.kind == Loss.reinforce:
            proximal_logp, weights = logp.detach(), result.weights
        else:
            proximal_logp, weights = rollout_logp, result.mask.to(logp.dtype)
    per_token, clipped = loss.per_token(logp, proximal_logp, batch.advantages)
    return PolicyLossTerms(per_token * weights, result.mask, clipped & result.mask, result.metrics)


def corrected_policy_loss(
    loss: PolicyLoss,
    correction: Correction,
    logp: torch.Tensor,
    batch: TrainBatch,
    proximal_logp: torch.Tensor | None = None,
    current_version: int | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss of one whole batch with the correction applied (`policy_loss_terms`,
    aggregated by `loss.aggregation`), and its metrics."""
    terms = policy_loss_terms(loss, correction, logp, batch, proximal_logp, current_version)
    value = aggregate(terms.per_token, terms.mask, loss.aggregation)
    n_kept = terms.mask.sum().clamp_min(1)
    metrics = dict(terms.metrics)
    metrics["loss/policy"] = value.item()
    metrics["loss/ppo_clip_frac"] = (terms.clipped.sum() / n_kept).item()
    return value, metrics
