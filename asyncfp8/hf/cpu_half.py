"""BF16 and FP16 linear layers on a CPU without GEMM kernels for them, computed as such a GEMM
computes: one FP64 GEMM of the 16-bit operands, rounded to the format (the exact sum's
rounding), several times faster than torch's scalar fallback and, unlike an FP32 GEMM, with
rows that never depend on the batch. `load_model` swaps them in where oneDNN lacks the
format's kernels (docs/testing.md, 'On a CPU without native BF16 arithmetic').
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.nn import functional as F

#: the most weights a swapped layer holds (the `tiny` and `small` models' largest: 45,056);
#: larger layers keep the fallback, as widening a weight costs about its GEMM at one row
LARGEST_SWAPPED = 1 << 17


HALF_DTYPES = (torch.bfloat16, torch.float16)


@functools.cache
def cpu_has_gemm(dtype: torch.dtype) -> bool:
    """Whether torch's CPU backend multiplies `dtype` (BF16 or FP16) matrices with oneDNN
    kernels (AVX-512 BF16 / FP16 or AMX), rather than its slow scalar fallback."""
    supported = {
        torch.bfloat16: torch.ops.mkldnn._is_mkldnn_bf16_supported,
        torch.float16: torch.ops.mkldnn._is_mkldnn_fp16_supported,
    }[dtype]
    return bool(torch.backends.mkldnn.is_available() and supported())


class ExactSumLinear(nn.Linear):
    """An nn.Linear (the same `weight` and `bias` parameters, so the same names, ties and
    state dict) whose BF16 or FP16 product on a CPU is one FP64 GEMM rounded to that
    format."""

    def __init__(self, linear: nn.Linear):
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.training = linear.training

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (x.dtype in HALF_DTYPES and self.weight.dtype == x.dtype and x.device.type == "cpu"):
            return F.linear(x, self.weight, self.bias)
        bias = self.bias.double() if self.bias is not None else None
        return F.linear(x.double(), self.weight.double(), bias).to(x.dtype)


def is_plain_linear(module: nn.Module) -> bool:
    """Whether `module` is an nn.Linear that computes F.linear and nothing else: a layer
    the precision modules may swap for their own."""
    return type(module) in (nn.Linear, ExactSumLinear)


def sum_half_linears_exactly(model: nn.Module) -> nn.Module:
    """Swaps, in place, every plain nn.Linear of `model` with at most `LARGEST_SWAPPED`
    weights for an ExactSumLinear holding the same parameters. Returns the model."""
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if type(child) is nn.Linear and child.weight.numel() <= LARGEST_SWAPPED:
                setattr(module, child_name, ExactSumLinear(child))
    return model


def where_cpu_lacks_gemm(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """`sum_half_linears_exactly(model)` for a BF16 or FP16 `dtype` on a CPU without GEMM
    kernels for it, else the model unchanged: what a model in `dtype` must go through to
    compute on this machine what `load_model`'s models in `dtype` compute."""
    if dtype not in HALF_DTYPES or cpu_has_gemm(dtype):
        return model
    return sum_half_linears_exactly(model)
