"""BF16: the weights as the learner has them, cast to bfloat16."""

from __future__ import annotations

import torch

from .policy import PrecisionPolicy, dtype_name
from .registry import register_policy


@register_policy("bf16")
class BF16Policy(PrecisionPolicy):
    """Identity in BF16. `lm_head_fp32=True` ships the LM head in FP32 and asks the
    engine to run the last projection in FP32 (FlashRL's and PipelineRL's remedy for
    the logprob mismatch that a BF16 LM head adds over a large vocabulary)."""

    name = "bf16"

    def __init__(self, lm_head_fp32: bool = False):
        self.lm_head_fp32 = bool(lm_head_fp32)

    def bind_model(self, config):
        if self.lm_head_fp32 and getattr(config, "tie_word_embeddings", False):
            # One tensor for both: an FP32 head would make the input embeddings FP32 too,
            # feeding FP32 activations into the BF16 layers.
            raise ValueError(
                "precision.lm_head_fp32=true needs an LM head of its own; this model ties it "
                "to its input embeddings (tie_word_embeddings=true): drop the setting"
            )
        return super().bind_model(config)

    def engine_config(self) -> dict:
        return {
            "dtype": dtype_name(self.engine_dtype),
            "lm_head_dtype": "float32" if self.lm_head_fp32 else dtype_name(self.engine_dtype),
        }

    def passthrough(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if self.lm_head_fp32 and name.startswith("lm_head") and tensor.is_floating_point():
            # The learner's FP32 master values, not a BF16 rounding of them.
            return tensor.float()
        return super().passthrough(name, tensor)
