"""Rejection that does not starve (docs/correction.md, "Bounds from the measured mismatch").

Calibration: with `target_rejected=f`, each unset bound of token_mis, seq_mis or geo_rs is set
at a quantile of the first step's fresh log-ratios, so about f falls outside (ρ = 1 is kept).
Starvation: an update keeping under `min_kept` of its tokens steps at a scaled rate, or none.
"""

from __future__ import annotations

import enum
import math

import torch

from .base import CorrectionBatch

# The statistic each calibratable method bounds (its bounds are on exp of it), and whether
# it counts tokens or sequences.
CALIBRATED_STATISTIC = {
    "token_mis": "token",
    "icepop": "token",
    "seq_mis": "seq_sum",
    "geo_rs": "seq_mean",
}


class Starved(enum.StrEnum):
    scale = "scale"  # the update taken at lr × kept / (min_kept × tokens)
    skip = "skip"  # no update


def check_rejection_settings(correction: str, target, min_kept, starved) -> None:
    """`correction.target_rejected`, `min_kept` and `starved`, refused at start naming the
    key."""
    if target is not None:
        if isinstance(target, bool) or not isinstance(target, int | float):
            raise ValueError(f"correction.target_rejected must be a number, got {target!r}")
        if not 0.0 < target < 1.0:
            raise ValueError(
                f"correction.target_rejected must be in (0, 1) or null (off), got {target}"
            )
        if correction not in CALIBRATED_STATISTIC:
            raise ValueError(
                f"correction.target_rejected calibrates the bounds of "
                f"{', '.join(sorted(CALIBRATED_STATISTIC))}; correction {correction!r} has "
                "none to calibrate (set correction.target_rejected=null)"
            )
    if isinstance(min_kept, bool) or not isinstance(min_kept, int | float):
        raise ValueError(f"correction.min_kept must be a number in [0, 1], got {min_kept!r}")
    if not 0.0 <= min_kept <= 1.0:
        raise ValueError(f"correction.min_kept must be in [0, 1] (0: off), got {min_kept}")
    if str(starved) not in {s.value for s in Starved}:
        raise ValueError(f"correction.starved must be scale or skip, got {starved!r}")


def calibration_values(name: str, batch: CorrectionBatch) -> torch.Tensor:
    """The statistic `name`'s bounds apply to, float64 [N]: a log-ratio per real token
    (token_mis) or per sequence with a real token (seq_mis: summed, geo_rs: mean), computed
    as the method computes it (sequence sums of the unclamped token log-ratios, clamped)."""
    level = CALIBRATED_STATISTIC[name]
    if level == "token":
        return batch.log_ratio[batch.mask].double()
    has_tokens = batch.mask.any(-1)
    values = batch.seq_log_ratio if level == "seq_sum" else batch.seq_mean_log_ratio
    return values[has_tokens].double()


def quantile_bounds(log_values: torch.Tensor, target_rejected: float) -> tuple[float, float]:
    """(lower, upper) on ρ: exp of the target/2 and 1 − target/2 quantiles of `log_values`
    (linear interpolation, as numpy's default), widened to include ρ = 1."""
    if not 0.0 < target_rejected < 1.0:
        raise ValueError(f"target_rejected must be in (0, 1), got {target_rejected}")
    values = log_values.double().flatten()
    if values.numel() == 0:
        raise ValueError("no values to calibrate on")
    half = target_rejected / 2
    low, high = torch.quantile(values, torch.tensor([half, 1 - half], dtype=torch.float64))
    return math.exp(min(low.item(), 0.0)), math.exp(max(high.item(), 0.0))


def rejected_fraction(log_values: torch.Tensor, lower: float, upper: float) -> float:
    """The share of `log_values` whose exp falls outside [lower, upper]."""
    ratio = log_values.double().exp()
    return ((ratio < lower) | (ratio > upper)).double().mean().item()


def starved_scale(kept: float, tokens: float, min_kept: float, starved: str) -> float:
    """The factor on the learning rate of an update that kept `kept` of `tokens` real
    tokens: 1 when kept ≥ min_kept × tokens (or nothing to judge), else kept / (min_kept ×
    tokens) (`scale`, continuous at the threshold) or 0 (`skip`)."""
    if tokens <= 0 or min_kept <= 0 or kept >= min_kept * tokens:
        return 1.0
    return kept / (min_kept * tokens) if starved == Starved.scale else 0.0


class BoundCalibration:
    """The learner's calibration of `correction`'s bounds (the module's docstring): the
    bounds the user set stay; the others are set from the first values measured."""

    def __init__(self, correction, target_rejected: float):
        self.correction, self.target_rejected = correction, target_rejected
        self.explicit = {
            key: correction.params[key] for key in ("lower", "upper") if key in correction.params
        }
        self.done = False

    def measure(self, log_values: torch.Tensor) -> dict[str, float]:
        """The bounds from `log_values` (the method's statistic, `calibration_values`), the
        user's where set, and the share of `log_values` they reject, as metrics."""
        lower, upper = quantile_bounds(log_values, self.target_rejected)
        bounds = {"lower": lower, "upper": upper} | self.explicit
        return {
            "correction/calibrated_lower": bounds["lower"],
            "correction/calibrated_upper": bounds["upper"],
            "correction/calibration_values": float(log_values.numel()),
            "correction/calibration_rejected": rejected_fraction(log_values, **bounds),
        }

    def apply(self, measured: dict[str, float]) -> None:
        """The correction takes the bounds `measure` chose."""
        self.correction.rebind(
            lower=measured["correction/calibrated_lower"],
            upper=measured["correction/calibrated_upper"],
        )
        self.done = True

    # Checkpointed (learner/checkpoints.py, Checkpointer.stateful): a resumed run keeps the
    # bounds its first step measured, as a run that never stopped does. Measured again at
    # the first step after a resume they would come from the trained policy's mismatch,
    # and the correction would change under the run.
    def state_dict(self) -> dict[str, float | bool]:
        if not self.done:
            return {"done": False}
        params = self.correction.params
        return {"done": True, "lower": params["lower"], "upper": params["upper"]}

    def load_state_dict(self, state) -> None:
        if state["done"]:
            self.correction.rebind(lower=float(state["lower"]), upper=float(state["upper"]))
            self.done = True
