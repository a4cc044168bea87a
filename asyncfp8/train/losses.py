"""Policy-gradient losses: group advantages, PPO-clip (clip-higher, dual-clip) /
REINFORCE per token, the KL-to-reference estimators, loss aggregation, and
`policy_loss_terms` / `corrected_policy_loss`, the one place where behaviour, proximal
and current policies meet the correction, under the settings of a `PolicyLoss`.

Decoupled (three policies): behaviour = rollout logprobs, proximal = a learner
recompute, θ = the policy being optimized. The PPO ratio is π_θ/π_prox; the correction
sees (π_prox, π_behaviour) and its weight multiplies the clipped per-token loss.

Bypass (proximal := behaviour, no recompute): the correction sees (π_θ detached,
π_behaviour). With REINFORCE its weights multiply the loss (off-policy REINFORCE with
truncated IS). With PPO-clip the ratio π_θ/π_behaviour already *is* the importance
ratio, clipped, so only the correction's mask (its rejections) is applied: multiplying
by its weights as well would count the ratio twice.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import torch

from asyncfp8.correction import Correction

Aggregation = Literal["token_mean", "seq_mean_token_sum", "seq_mean_token_mean"]
LossKind = Literal["ppo_clip", "reinforce"]
Mode = Literal["decoupled", "bypass"]
KLEstimator = Literal["k1", "k3", "low_var_kl"]
KL_ESTIMATORS = ("k1", "k3", "low_var_kl")


def group_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    scale: Literal["std", "none"] = "std",
    eps: float = 1e-6,
) -> torch.Tensor:
    """GRPO advantages: each reward minus its group's mean, divided by the group's
    (unbiased) std when scale="std"; scale="none" is the Dr. GRPO variant, which drops
    the std division (it up-weights easy and hard prompts). A group of one gets 0."""
    if rewards.dim() != 1 or group_ids.shape != rewards.shape:
        raise ValueError(
            f"rewards and group_ids must be [N]; got {tuple(rewards.shape)}, {tuple(group_ids.shape)}"
        )
    if scale not in ("std", "none"):
        raise ValueError(f"scale must be 'std' or 'none', got {scale!r}")
    _, index = torch.unique(group_ids, return_inverse=True)
    n_groups = int(index.max()) + 1 if index.numel() else 0
    rewards = rewards.double()
    count = torch.zeros(n_groups, dtype=torch.float64).index_add_(
        0, index, torch.ones_like(rewards)
    )
    mean = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, index, rewards) / count
    centred = rewards - mean[index]
    if scale == "none":
        return centred.float()
    sq = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, index, centred.square())
    std = (sq / (count - 1).clamp_min(1)).sqrt()
    return (centred / (std[index] + eps)).float()


def aggregate(
    per_token: torch.Tensor, mask: torch.Tensor, how: Aggregation = "token_mean"
) -> torch.Tensor:
    """token_mean: mean over all real tokens of the batch; seq_mean_token_sum: per
    sequence sum, then mean over sequences; seq_mean_token_mean: per-sequence mean, then
    mean over sequences. Sequences with no real token are left out of the means."""
    numerator, denominator = aggregate_parts(per_token, mask, how)
    return numerator / max(denominator, 1.0)


def aggregate_parts(
    per_token: torch.Tensor, mask: torch.Tensor, how: Aggregation = "token_mean"
) -> tuple[torch.Tensor, float]:
    """`aggregate` as (numerator, denominator): the numerator is a sum over this part of a
    batch, the denominator a count (real tokens, or sequences with one), so that the
    aggregate over micro-batches and ranks is Σ numerators / Σ denominators."""
    mask = mask.to(per_token.dtype)
    masked = per_token * mask
    if how == "token_mean":
        return masked.sum(), mask.sum().item()
    n_seqs = (mask.sum(-1) > 0).sum().item()
    if how == "seq_mean_token_sum":
        return masked.sum(), n_seqs
    if how == "seq_mean_token_mean":
        return (masked.sum(-1) / mask.sum(-1).clamp_min(1)).sum(), n_seqs
    raise ValueError(
        f"unknown aggregation {how!r}; use token_mean, seq_mean_token_sum or seq_mean_token_mean"
    )


def kl_penalty(
    logp: torch.Tensor, reference_logp: torch.Tensor, estimator: KLEstimator = "low_var_kl"
) -> torch.Tensor:
    """Per-token estimate of KL(π_θ ‖ π_ref) from tokens sampled by the rollout, as veRL
    computes it: k1 = log π_θ − log π_ref; k3 = e^(−k1) − 1 + k1 (unbiased, never
    negative); low_var_kl = k3 clamped to [−10, 10]."""
    k1 = logp - reference_logp
    if estimator == "k1":
        return k1
    if estimator not in ("k3", "low_var_kl"):
        raise ValueError(f"unknown KL estimator {estimator!r}; use one of {KL_ESTIMATORS}")
    k3 = torch.expm1(-k1) + k1
    return k3.clamp(-10, 10) if estimator == "low_var_kl" else k3


def per_token_policy_loss(
    logp: torch.Tensor,
    proximal_logp: torch.Tensor,
    advantages: torch.Tensor,
    kind: LossKind = "ppo_clip",
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    clip_ratio_c: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss [B, T], clipped [B, T] bool). PPO-clip with an asymmetric range
    [1 − clip_low, 1 + clip_high] (clip-higher keeps low-probability tokens able to
    grow) and, with `clip_ratio_c` = c > 1, dual-clip: for A < 0 the loss is capped at
    −A·c (a ratio far above 1 on a bad token cannot blow the step up); `clipped` marks
    the tokens either clip made constant. REINFORCE is −A·log π_θ."""
    advantages = advantages[:, None] if advantages.dim() == 1 else advantages
    if kind == "reinforce":
        return -advantages * logp, torch.zeros_like(logp, dtype=torch.bool)
    if kind != "ppo_clip":
        raise ValueError(f"unknown policy loss {kind!r}; use ppo_clip or reinforce")
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

    kind: LossKind = "ppo_clip"
    clip_low: float = 0.2
    clip_high: float = 0.28
    clip_ratio_c: float | None = None
    mode: Mode = "decoupled"
    aggregation: Aggregation = "token_mean"

    def __post_init__(self):
        if self.mode not in ("decoupled", "bypass"):
            raise ValueError(f"unknown mode {self.mode!r}; use decoupled or bypass")
        if self.aggregation not in ("token_mean", "seq_mean_token_sum", "seq_mean_token_mean"):
            raise ValueError(
                f"unknown aggregation {self.aggregation!r}; use token_mean, "
                "seq_mean_token_sum or seq_mean_token_mean"
            )
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
    batch: Mapping[str, torch.Tensor],
    proximal_logp: torch.Tensor | None = None,
    current_version: int | None = None,
) -> PolicyLossTerms:
    """The correction applied to one batch's per-token policy loss (module docstring:
    decoupled vs bypass). `logp`: π_θ of the sampled tokens [B, T]; `batch`: their
    `rollout_logp` [B, T], `advantages` [B], `mask` [B, T] and (for corrections that
    read staleness) `versions` [B, T], as `batches.batch_tensors` makes them;
    `proximal_logp`: π_prox (decoupled)."""
    rollout_logp, mask = batch["rollout_logp"], batch["mask"]
    versions = batch.get("versions")
    if loss.mode == "decoupled":
        if proximal_logp is None:
            raise ValueError(
                "decoupled mode needs proximal_logp (a learner recompute); "
                "correction.mode=bypass skips it"
            )
        result = correction(proximal_logp, rollout_logp, mask, versions, current_version)
        weights = result.weights
    else:  # bypass
        proximal_logp = rollout_logp
        result = correction(logp.detach(), rollout_logp, mask, versions, current_version)
        weights = result.weights if loss.kind == "reinforce" else result.mask.to(logp.dtype)
    per_token, clipped = loss.per_token(logp, proximal_logp, batch["advantages"])
    return PolicyLossTerms(per_token * weights, result.mask, clipped & result.mask, result.metrics)


def corrected_policy_loss(
    loss: PolicyLoss,
    correction: Correction,
    logp: torch.Tensor,
    batch: Mapping[str, torch.Tensor],
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
