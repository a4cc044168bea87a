"""The data a correction sees and what it returns.

ρ_t = π_learner(y_t) / π_rollout(y_t) is computed once in log space, clamped to ±20 (finite
in float32 even squared or summed) and zeroed at padded positions. Sequence quantities sum
the *unclamped* token log-ratios and clamp the sum, as veRL does (docs/correction.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

LOG_RATIO_CLAMP = 20.0
# Infinite token log-ratios (a log-probability of -inf on one side) enter sequence sums
# at this magnitude, so that +inf and -inf in one sequence cannot make a NaN.
RAW_LOG_RATIO_LIMIT = 1e4


@dataclass(frozen=True)
class CorrectionBatch:
    """Validated inputs of one correction call, [B, T] each."""

    learner_logp: torch.Tensor
    rollout_logp: torch.Tensor
    mask: torch.Tensor  # bool, True on real (response) tokens
    log_ratio: torch.Tensor  # log ρ_t, clamped, 0 where mask is False; float32, detached
    versions: torch.Tensor | None = None  # policy version of each token
    current_version: int | None = None
    # log ρ_t before the ±20 clamp (±RAW_LOG_RATIO_LIMIT at most), 0 where mask is False;
    # None: sequence sums fall back to the clamped `log_ratio`
    raw_log_ratio: torch.Tensor | None = None

    @property
    def lengths(self) -> torch.Tensor:
        """Real tokens per sequence, [B] (at least 1, so that means never divide by 0)."""
        return self.mask.sum(-1).clamp_min(1)

    @property
    def seq_log_ratio(self) -> torch.Tensor:
        """log Π_t ρ_t per sequence, [B]: the sum of the unclamped token log-ratios,
        clamped to ±20."""
        return self._unclamped.sum(-1).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)

    @property
    def seq_mean_log_ratio(self) -> torch.Tensor:
        """mean_t log ρ_t per sequence, [B] (over real tokens), unclamped tokens, the mean
        clamped to ±20."""
        mean = self._unclamped.sum(-1) / self.lengths
        return mean.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)

    @property
    def _unclamped(self) -> torch.Tensor:
        return self.log_ratio if self.raw_log_ratio is None else self.raw_log_ratio

    @property
    def staleness(self) -> torch.Tensor:
        """current_version − version of each token, [B, T] (0 where masked)."""
        if self.versions is None or self.current_version is None:
            raise ValueError("this correction needs per-token `versions` and `current_version`")
        return (self.current_version - self.versions).masked_fill(~self.mask, 0)


@dataclass
class MethodResult:
    """What a correction method decides: a weight per token (a [B, 1] column is
    broadcast over the sequence), which tokens it keeps, and optionally which kept
    tokens had their weight truncated."""

    weights: torch.Tensor
    keep: torch.Tensor
    clipped: torch.Tensor | None = None
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class CorrectionResult:
    """weights: [B, T], detached, 0 off the mask; mask: [B, T] bool, never True where the
    input mask was False; metrics: floats keyed as in docs/correction.md."""

    weights: torch.Tensor
    mask: torch.Tensor
    metrics: dict[str, float]
