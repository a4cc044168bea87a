"""FP32 rollouts: a control, not a speed-up. The engine runs the learner's FP32 weights in
FP32, so the rollout and the learner differ only by kernel order, not by rounding: what a
run with no precision mismatch learns, to set beside BF16, FP8 or INT8 rollouts.

    PYTHONPATH=examples python -m asyncfp8.launch precision._target_=fp32_policy.FP32Policy

With the built-in torch engine (its refit probe compares against an FP32 reference).
"""

from __future__ import annotations

import torch

from asyncfp8.precision import register_policy
from asyncfp8.precision.bf16 import BF16Policy


@register_policy("fp32")
class FP32Policy(BF16Policy):
    name = "fp32"
    engine_dtype = torch.float32

    def __init__(self):
        super().__init__(lm_head_fp32=True)

    def engine_config(self) -> dict:
        return {"dtype": "float32", "lm_head_dtype": "float32"}
