"""Metrics computed on every batch, whatever the correction (docs/correction.md lists
each with its meaning). All are means over real tokens or sequences, as Python floats."""

from __future__ import annotations

import torch

from .base import CorrectionBatch, MethodResult


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
