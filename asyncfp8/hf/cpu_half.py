"""BF16 and FP16 linear layers on a CPU without GEMM kernels for them, computed as such a
GEMM computes.

A BF16 or FP16 GEMM (a GPU's, or oneDNN's on a CPU with AVX-512 BF16 / AVX-512 FP16 or
AMX) multiplies 16-bit values, accumulates in FP32 and rounds the result to the 16-bit
format. Where oneDNN has no kernel for the format (BF16 on an AVX2-only CPU:
torch.ops.mkldnn._is_mkldnn_bf16_supported() is False; FP16 on every AMD CPU and every
Intel one before Sapphire Rapids), torch 2.13 falls back to a scalar loop that was
measured 67x slower than its FP32 GEMM on a Zen 3 EPYC (docs/testing.md), and a BF16
model's forward pass 4.8x slower than the FP32 one; the `small` model's FP16 forward
(16 x 24 tokens, one thread) took 59.5 ms on a Zen 4 EPYC against BF16's 8.7 ms (oneDNN)
and 22.9 ms with these layers (session 31). There `ExactSumLinear` computes the product
the fast way: the 16-bit operands widened to FP64 (exactly: so are their products), one
FP64 GEMM, the result converted to the 16-bit format (through FP32, as torch converts:
deterministic). Its sums are within about 1e-16 of the sum of the terms' magnitudes, so
the result is the exact sum's rounding but for ties and cancellation; torch's own BF16
linear gave another value for 6e-5 of a 512-wide layer's outputs (measured), its FP32
sums in another order. A row's result did not depend on the batch around it in any
measured shape (tests/test_cpu_half.py): FP64's differences in summation order are far
below one BF16 or FP16 step. An FP32 GEMM is faster still, but there its rows changed
with the batch (in batches of 2, 3, 6, 7, 10 or 11 of 16 rows, at 1,024 wide), and a
token's log-prob must not depend on which other requests decode beside it (the colocated
engine's samples equal a worker's, to the bit).

Measured on the Zen 3 VM, one thread, the `small` model's BF16 forward (64 × 24 tokens):
fallback 546 ms, FP64 201 ms; one decode step of 16 rows 8.2 and 6.1 ms, of one row 3.4
and 4.6 ms. Widening a weight costs about as much as its GEMM at one row, so large layers
(over `LARGEST_SWAPPED` weights) keep the fallback, which is quick at one row: a 1536 ×
8960 layer took 4 ms there, and 103 ms in FP64.

`load_model` swaps a BF16 or FP16 model's linear layers for these on such a CPU
(`where_cpu_lacks_gemm`), as does any copy that must compute what the torch engine
computes (the mixed-precision planner's `EngineTwin`); elsewhere, and for any other dtype
or device, the layer is nn.Linear's own forward."""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.nn import functional as F

#: the most weights a swapped layer holds (the `tiny` and `small` models' largest: 45,056)
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
