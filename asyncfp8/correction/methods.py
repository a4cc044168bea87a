"""The built-in corrections: importance sampling (truncated or masked, per token or
per sequence), geometric and KL-estimator rejection, and a staleness-aware example.

Each is `method(batch, **params) -> MethodResult`; see DESIGN.md §4 for the formulas.
"""

from __future__ import annotations

import math

import torch

from .base import CorrectionBatch, MethodResult


def check_range(method: str, lower: float, upper: float) -> None:
    if math.isnan(lower) or math.isnan(upper):
        raise ValueError(f"{method}: bounds must be numbers, got lower={lower}, upper={upper}")
    if lower > upper:
        raise ValueError(f"{method}: lower ({lower}) must not exceed upper ({upper})")


def check_positive(method: str, name: str, value: float) -> None:
    if not value > 0:
        raise ValueError(f"{method}: {name} must be > 0, got {value}")


def none(batch: CorrectionBatch) -> MethodResult:
    """No correction: every token weighs 1 (metrics are still computed)."""
    return MethodResult(weights=torch.ones_like(batch.log_ratio), keep=batch.mask)


def token_tis(batch: CorrectionBatch, threshold: float = 2.0) -> MethodResult:
    """Truncated IS per token: w_t = min(ρ_t, C)."""
    check_positive("token_tis", "threshold", threshold)
    ratio = batch.log_ratio.exp()
    return MethodResult(
        weights=ratio.clamp(max=threshold),
        keep=batch.mask,
        clipped=batch.mask & (ratio > threshold),
    )


def token_mis(batch: CorrectionBatch, lower: float = 0.5, upper: float = 5.0) -> MethodResult:
    """Masked IS per token (IcePop): w_t = ρ_t if lower ≤ ρ_t ≤ upper, else the token is masked."""
    check_range("token_mis", lower, upper)
    ratio = batch.log_ratio.exp()
    return MethodResult(weights=ratio, keep=batch.mask & (ratio >= lower) & (ratio <= upper))


def seq_tis(batch: CorrectionBatch, threshold: float = 2.0) -> MethodResult:
    """Truncated IS per sequence: every token of a sequence weighs min(Π_t ρ_t, C), the
    product taken as the clamped sum of the unclamped token log-ratios."""
    check_positive("seq_tis", "threshold", threshold)
    ratio = batch.seq_log_ratio.exp()[:, None]
    return MethodResult(
        weights=ratio.clamp(max=threshold),
        keep=batch.mask,
        clipped=batch.mask & (ratio > threshold),
    )


def seq_mis(batch: CorrectionBatch, lower: float = 0.5, upper: float = 5.0) -> MethodResult:
    """Masked IS per sequence: weight Π_t ρ_t, the whole sequence masked outside [lower, upper]."""
    check_range("seq_mis", lower, upper)
    ratio = batch.seq_log_ratio.exp()[:, None]
    return MethodResult(weights=ratio, keep=batch.mask & (ratio >= lower) & (ratio <= upper))


def geo_rs(batch: CorrectionBatch, lower: float = 0.999, upper: float = 1.001) -> MethodResult:
    """Geometric-mean rejection: a sequence is masked if exp(mean_t log ρ_t) ∉ [lower, upper];
    kept tokens weigh 1. Length-neutral, unlike the product of sequence IS. The bounds
    apply to ρ (learner over rollout); veRL states its presets on 1/ρ (its k1 = −log ρ),
    so veRL's [lo, hi] is lower=1/hi, upper=1/lo here."""
    check_range("geo_rs", lower, upper)
    geometric = batch.seq_mean_log_ratio.exp()[:, None]
    return MethodResult(
        weights=torch.ones_like(batch.log_ratio),
        keep=batch.mask & (geometric >= lower) & (geometric <= upper),
    )


KL_ESTIMATORS = {
    "k1": lambda delta: -delta,
    "k2": lambda delta: 0.5 * delta.square(),
    "k3": lambda delta: torch.expm1(delta) - delta,
}


def kl_rejection(estimator: str, level: str):
    """A rejection method from a KL estimator of δ = log ρ (k1 = −δ, k2 = δ²/2,
    k3 = e^δ − 1 − δ), applied per token or aggregated per sequence (sum, mean, max).
    A token / sequence is masked when the estimate is outside [lower, upper]; kept
    tokens weigh 1."""
    estimate_tokens = KL_ESTIMATORS[estimator]
    name = f"token_{estimator}" if level == "token" else f"seq_{level}_{estimator}"

    def reject(
        batch: CorrectionBatch, upper: float = 0.01, lower: float = -math.inf
    ) -> MethodResult:
        check_range(name, lower, upper)
        per_token = estimate_tokens(batch.log_ratio).masked_fill(~batch.mask, 0.0)
        if level == "token":
            estimate = per_token
        elif level == "sum":
            estimate = per_token.sum(-1, keepdim=True)
        elif level == "mean":
            estimate = (per_token.sum(-1) / batch.lengths)[:, None]
        else:  # max over the real tokens only
            estimate = per_token.masked_fill(~batch.mask, -math.inf).amax(-1, keepdim=True)
        keep = batch.mask & (estimate >= lower) & (estimate <= upper)
        return MethodResult(weights=torch.ones_like(batch.log_ratio), keep=keep)

    reject.__name__ = name
    reject.__doc__ = (
        f"Rejection when the {level}-level {estimator} KL estimate leaves [lower, upper]."
    )
    return reject


def stale_tis(batch: CorrectionBatch, threshold: float = 2.0, decay: float = 0.5) -> MethodResult:
    """Truncated IS whose cap shrinks with staleness: a token generated s versions ago
    is capped at 1 + (C − 1)·decay^s, so fresh tokens get the full cap C and very old
    ones little more than 1: the older the behaviour policy, the less its ratio is trusted.
    An example of a correction that reads per-token versions."""
    check_positive("stale_tis", "threshold", threshold)
    if not 0.0 <= decay <= 1.0:
        raise ValueError(f"stale_tis: decay must be in [0, 1], got {decay}")
    cap = 1.0 + (threshold - 1.0) * decay ** batch.staleness.to(batch.log_ratio.dtype)
    ratio = batch.log_ratio.exp()
    return MethodResult(
        weights=torch.minimum(ratio, cap), keep=batch.mask, clipped=batch.mask & (ratio > cap)
    )
