"""Policy-gradient losses: group advantages, PPO-clip / REINFORCE per token, loss
aggregation, and `corrected_policy_loss`, the one place where behaviour, proximal and
current policies meet the correction.

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

from typing import Literal

import torch

from asyncfp8.correction import Correction

Aggregation = Literal["token_mean", "seq_mean_token_sum", "seq_mean_token_mean"]
LossKind = Literal["ppo_clip", "reinforce"]
Mode = Literal["decoupled", "bypass"]


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
    mask = mask.to(per_token.dtype)
    masked = per_token * mask
    if how == "token_mean":
        return masked.sum() / mask.sum().clamp_min(1)
    has_tokens = mask.sum(-1) > 0
    n_seqs = has_tokens.sum().clamp_min(1)
    if how == "seq_mean_token_sum":
        return masked.sum(-1).sum() / n_seqs
    if how == "seq_mean_token_mean":
        return (masked.sum(-1) / mask.sum(-1).clamp_min(1)).sum() / n_seqs
    raise ValueError(
        f"unknown aggregation {how!r}; use token_mean, seq_mean_token_sum or seq_mean_token_mean"
    )


def per_token_policy_loss(
    logp: torch.Tensor,
    proximal_logp: torch.Tensor,
    advantages: torch.Tensor,
    kind: LossKind = "ppo_clip",
    clip_low: float = 0.2,
    clip_high: float = 0.28,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss [B, T], clipped [B, T] bool). PPO-clip with an asymmetric range
    [1 − clip_low, 1 + clip_high] (clip-higher keeps low-probability tokens able to
    grow); REINFORCE is −A·log π_θ."""
    advantages = advantages[:, None] if advantages.dim() == 1 else advantages
    if kind == "reinforce":
        return -advantages * logp, torch.zeros_like(logp, dtype=torch.bool)
    if kind != "ppo_clip":
        raise ValueError(f"unknown policy loss {kind!r}; use ppo_clip or reinforce")
    if not (0 <= clip_low < 1 and clip_high >= 0):
        raise ValueError(f"need 0 <= clip_low < 1 and clip_high >= 0; got {clip_low}, {clip_high}")
    ratio = torch.exp((logp - proximal_logp.detach()).clamp(-20, 20))
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - clip_low, 1 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    return loss, clipped > unclipped


def corrected_policy_loss(
    correction: Correction,
    logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    proximal_logp: torch.Tensor | None = None,
    versions: torch.Tensor | None = None,
    current_version: int | None = None,
    mode: Mode = "decoupled",
    kind: LossKind = "ppo_clip",
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    aggregation: Aggregation = "token_mean",
) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss of one batch with the correction applied, and its metrics."""
    if mode == "decoupled":
        if proximal_logp is None:
            raise ValueError(
                "decoupled mode needs proximal_logp (a learner recompute); use mode='bypass' to skip it"
            )
        result = correction(proximal_logp, rollout_logp, mask, versions, current_version)
        weights = result.weights
    elif mode == "bypass":
        proximal_logp = rollout_logp
        result = correction(logp.detach(), rollout_logp, mask, versions, current_version)
        weights = result.weights if kind == "reinforce" else result.mask.to(logp.dtype)
    else:
        raise ValueError(f"unknown mode {mode!r}; use decoupled or bypass")
    per_token, clipped = per_token_policy_loss(
        logp, proximal_logp, advantages, kind, clip_low, clip_high
    )
    loss = aggregate(per_token * weights, result.mask, aggregation)
    n_kept = result.mask.sum().clamp_min(1)
    metrics = dict(result.metrics)
    metrics["loss/policy"] = loss.item()
    metrics["loss/ppo_clip_frac"] = ((clipped & result.mask).sum() / n_kept).item()
    return loss, metrics
