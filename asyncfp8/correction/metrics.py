"""Metrics computed on every batch, whatever the correction (docs/correction.md lists
each with its meaning). Means over real tokens or sequences, and extremes, as Python
floats."""

from __future__ import annotations

import torch

from .base import CorrectionBatch, MethodResult

# A token whose |log ρ| exceeds this is one the two policies no longer agree on at all
# (ρ outside [0.0067, 148]): rounding moves a log-prob by ~1e-2, a broken update by tens.
FAR_LOG_RATIO = 5.0


def _mean(values: torch.Tensor, mask: torch.Tensor) -> float:
    count = mask.sum()
    return (values.masked_fill(~mask, 0).sum() / count).item() if count > 0 else 0.0


def mismatch_metrics(batch: CorrectionBatch) -> dict[str, float]:
    """How far π_rollout is from π_learner on the rollout's own tokens."""
    delta, mask = batch.log_ratio.double(), batch.mask
    ratio = delta.exp()
    seq_ratio = batch.seq_log_ratio.double().exp()
    has_tokens = mask.any(-1)
    return {
        "mismatch/kl_k1": _mean(-delta, mask),
        "mismatch/kl_k3": _mean(ratio - delta - 1, mask),
        "mismatch/chi2_token": _mean(ratio.square() - 1, mask),
        "mismatch/chi2_seq": _mean(seq_ratio.square() - 1, has_tokens),
        "mismatch/log_ratio_abs_max": delta.abs().masked_fill(~mask, 0).max().item()
        if mask.any()
        else 0.0,
    } | log_ratio_extremes(batch)


def log_ratio_extremes(batch: CorrectionBatch) -> dict[str, float]:
    """The token log-ratios before the ±20 clamp: a token the engine sampled at log p
    −0.00 that the learner now gives −37 must read −37 (the clamp would show −20, which
    also a far milder break gives), and the share of tokens past ±FAR_LOG_RATIO."""
    raw = batch.raw_log_ratio if batch.raw_log_ratio is not None else batch.log_ratio
    mask = batch.mask
    if not mask.any():
        return {
            "mismatch/log_ratio_min": 0.0,
            "mismatch/log_ratio_max": 0.0,
            "mismatch/frac_abs_log_ratio_gt5": 0.0,
        }
    real = raw[mask].double()
    return {
        "mismatch/log_ratio_min": real.min().item(),
        "mismatch/log_ratio_max": real.max().item(),
        "mismatch/frac_abs_log_ratio_gt5": (real.abs() > FAR_LOG_RATIO).double().mean().item(),
    }


def weight_metrics(
    batch: CorrectionBatch, result: MethodResult, weights: torch.Tensor, keep: torch.Tensor
) -> dict[str, float]:
    """What the correction did: the weights it gave kept tokens and what it removed."""
    valid = batch.mask
    n_valid = valid.sum().item()
    kept_weights = weights[keep].double()
    n_kept = kept_weights.numel()
    seq_valid = valid.any(-1)
    seq_rejected = seq_valid & ~keep.any(-1)
    clipped = result.clipped if result.clipped is not None else torch.zeros_like(valid)
    metrics = {
        "correction/weight_mean": kept_weights.mean().item() if n_kept else 0.0,
        "correction/weight_max": kept_weights.max().item() if n_kept else 0.0,
        "correction/weight_min": kept_weights.min().item() if n_kept else 0.0,
        # Kish's effective sample size over kept tokens, as a fraction of them (1 = uniform).
        "correction/ess": (
            kept_weights.sum().square() / (n_kept * kept_weights.square().sum())
        ).item()
        if n_kept and kept_weights.square().sum() > 0
        else 0.0,
        "correction/frac_clipped": (clipped & keep).sum().item() / max(n_valid, 1),
        "correction/frac_masked": (valid & ~keep).sum().item() / max(n_valid, 1),
        "correction/frac_seq_rejected": seq_rejected.sum().item() / max(seq_valid.sum().item(), 1),
    }
    return metrics


def staleness_metrics(batch: CorrectionBatch) -> dict[str, float]:
    if batch.versions is None or batch.current_version is None:
        return {}
    staleness = batch.staleness.double()
    return {
        "staleness/mean": _mean(staleness, batch.mask),
        "staleness/max": staleness.masked_fill(~batch.mask, 0).max().item()
        if batch.mask.any()
        else 0.0,
    }
