"""The correction registry: what repairs low-precision and stale rollouts (docs/correction.md).
Add a method with `register_correction`: `fn(batch: CorrectionBatch, **params) -> MethodResult`.

    out = get_correction("token_tis", threshold=2.0)(learner_logp, rollout_logp, mask)
    out.weights, out.mask, out.metrics
"""

from .base import LOG_RATIO_CLAMP, CorrectionBatch, CorrectionResult, MethodResult
from .registry import (
    Correction,
    build_correction,
    get_correction,
    make_batch,
    register_correction,
    registered_corrections,
)

__all__ = [
    "LOG_RATIO_CLAMP",
    "Correction",
    "CorrectionBatch",
    "CorrectionResult",
    "MethodResult",
    "build_correction",
    "get_correction",
    "make_batch",
    "register_correction",
    "registered_corrections",
]
