"""BF16: the weights as the learner has them, cast to bfloat16."""

from __future__ import annotations

import torch

from .policy import PrecisionPolicy, register_policy


@register_policy("bf16")
class BF16Policy(PrecisionPolicy):
    """Identity in BF16. `lm_head_fp32=True` ships the LM head in FP32 and asks the
    engine to run the last projection in FP32 (FlashRL's and PipelineRL's remedy for
    the logprob mismatch that a BF16 LM head adds over a large vocabulary)."""

    name = "bf16"

    def __init__(self, lm_head_fp32: bool = False):
        self.lm_head_fp32 = bool(lm_head_fp32)

    def engine_config(self) -> dict:
        return {
            "dtype": "bfloat16",
            "lm_head_dtype": "float32" if self.lm_head_fp32 else "bfloat16",
        }

    def passthrough(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if self.lm_head_fp32 and name.startswith("lm_head") and tensor.is_floating_point():
            # The learner's FP32 master values, not a BF16 rounding of them.
            return tensor.float()
        return super().passthrough(name, tensor)
