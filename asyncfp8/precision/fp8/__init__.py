"""FP8 W8A8, blockwise: the DeepSeek-V3 / vLLM / SGLang checkpoint format.

This folder (plus conf/precision/fp8.yaml) is the whole format: the policy (here), the
quantizers (quant.py), the block-scaled GEMM (gemm.py) and the torch engine's module
(linear.py). The tensors and their scales: docs/precision.md, "The formats' tensors"."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F

from ..policy import PrecisionPolicy, dtype_name
from ..registry import register_policy
from ..storage import ScaleLayout, Storage
from .fused import fused_fp8_takes
from .linear import FP8BlockLinear
from .quant import (
    BLOCK,
    FP8_MAX,
    SCALE_SUFFIX,
    dequantize_blockwise,
    fake_quantize_activations_fp8,
    quantize_activations_fp8,
    quantize_blockwise,
    quantize_blockwise_reference,
)

__all__ = [
    "BLOCK",
    "FP8_MAX",
    "SCALE_SUFFIX",
    "FP8BlockLinear",
    "FP8Policy",
    "dequantize_blockwise",
    "fake_quantize_activations_fp8",
    "fused_fp8_takes",
    "quantize_activations_fp8",
    "quantize_blockwise",
    "quantize_blockwise_reference",
]


@register_policy("fp8")
class FP8Policy(PrecisionPolicy):
    """W8A8 FP8 with 128×128 weight blocks (`block_size`) and dynamic per-token-group
    activations (groups as wide as a weight block)."""

    name = "fp8"
    quantizes_weights = True

    def __init__(self, block_size: tuple[int, int] | list[int] = BLOCK):
        if len(block_size) != 2 or not all(isinstance(b, int) and b >= 16 for b in block_size):
            raise ValueError(
                f"fp8: block_size must be two ints >= 16 (the e4m3 GEMMs work on slices of at "
                f"least 16), got {list(block_size)}"
            )
        if any(b % 16 for b in block_size):
            raise ValueError(f"fp8: block_size must be multiples of 16, got {list(block_size)}")
        self.block = (int(block_size[0]), int(block_size[1]))

    def checkpoint_config(self, unquantized_layers: Iterable[str] = ()) -> dict:
        config = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": list(self.block),
        }
        layers = sorted(unquantized_layers)
        if layers:
            config["ignored_layers"] = layers  # vLLM / SGLang skip quantization there
        return config

    def engine_config(self) -> dict:
        return {
            "dtype": dtype_name(self.engine_dtype),
            "quantization": "fp8",
            "quantization_config": self.checkpoint_config(),
        }

    def storage(self) -> Storage:
        return Storage(torch.float8_e4m3fn, ScaleLayout(*self.block), compute="fp8")

    def quantize_tensor(
        self, name: str, tensor: torch.Tensor
    ) -> Iterator[tuple[str, torch.Tensor]]:
        q, scale_inv = quantize_blockwise(tensor, self.block, name=name)
        yield name, q
        yield name + SCALE_SUFFIX, scale_inv

    def linear_module(self, name, tensors, bias, real=True):
        return FP8BlockLinear(
            name, tensors[name], tensors[name + SCALE_SUFFIX], bias, self.block, real
        )

    def fake_quantize_weight(self, name: str, weight: torch.Tensor) -> torch.Tensor:
        q, scale_inv = quantize_blockwise(weight, self.block, name=name)
        return dequantize_blockwise(q, scale_inv, self.block)

    def fake_quantize_input(self, name: str, x: torch.Tensor) -> torch.Tensor:
        return fake_quantize_activations_fp8(x, self.block[1])

    def reference_matmul(self, name: str, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # fp8_block_matmul's order: each K block's dequantized product summed alone and
        # added to the FP32 output in K order, the last block zero-padded to full width.
        # One sum over all of K rounds otherwise (1 BF16 ulp in 1 of 20 probes, measured).
        block = self.block[1]
        padding = -x.shape[-1] % block
        inputs = F.pad(self.fake_quantize_input(name, x).float(), (0, padding))
        weight = F.pad(self.fake_quantize_weight(name, weight).float(), (0, padding))
        out = inputs.new_zeros(*inputs.shape[:-1], weight.shape[0])
        for start in range(0, inputs.shape[-1], block):
            out += inputs[..., start : start + block] @ weight[:, start : start + block].t()
        return out
