"""A PrecisionPolicy of your own, in one file: FP8 everywhere except the first and last
decoder layers, which stay in BF16 (they are the most sensitive to quantization).

    PYTHONPATH=examples python -m asyncfp8.launch \
        precision._target_=mixed_precision_policy.FP8EdgesBF16Policy precision.keep_first=2

Only the per-tensor decision differs from the built-in FP8 policy. Everything else
follows from it: the learner ships those layers in BF16, the torch engine keeps them as
plain linear layers, an exported checkpoint lists them in `ignored_layers` (so vLLM and
SGLang skip them), and the number of layers comes from the model itself.
"""

from __future__ import annotations

import re

from asyncfp8.precision import register_policy
from asyncfp8.precision.fp8 import FP8Policy

LAYER = re.compile(r"\.layers\.(\d+)\.")


@register_policy("fp8_edges_bf16")  # also selectable as get_policy("fp8_edges_bf16")
class FP8EdgesBF16Policy(FP8Policy):
    name = "fp8_edges_bf16"

    def __init__(self, keep_first: int = 1, keep_last: int = 1, block_size=(128, 128)):
        super().__init__(block_size)
        self.keep_first, self.keep_last = keep_first, keep_last

    def quantizes(self, name, tensor) -> bool:
        layers = self.require_model().num_hidden_layers
        match = LAYER.search(name)
        if match and not self.keep_first <= int(match.group(1)) < layers - self.keep_last:
            return False
        return super().quantizes(name, tensor)
