"""The correction registry: what repairs low-precision and stale rollouts.

    from asyncfp8.correction import get_correction, register_correction
    corr = get_correction("token_tis", threshold=2.0)
    out = corr(learner_logp, rollout_logp, mask)        # [B, T] each
    out.weights, out.mask, out.metrics

Methods: none, token_tis, token_mis (= icepop), seq_tis, seq_mis, geo_rs, stale_tis,
and KL-estimator rejection token_k{1,2,3} and seq_{sum,mean,max}_k{1,2,3}. Any of them
takes `reject=[...]` (more rejection filters) and `max_staleness=N`. A new method is
`fn(batch: CorrectionBatch, **params) -> MethodResult`, registered by name.
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
