"""The built-in engine's runtime module for INT8 W8A8 (`Int8Linear`)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..kernel_support import DeviceFacts, triton_enabled
from ..modules import QuantizedLinear
from .fused import int8_linear_fused
from .gemm import int8_matmul
from .quant import SCALE_SUFFIX, quantize_activations_int8


class Int8Linear(QuantizedLinear):
    """W8A8 INT8 for the built-in engine: activations quantized per token, an int8 × int8
    → int32 GEMM scaled by the per-token and per-channel scales: one fused Triton kernel on
    CUDA (fused.py), `gemm.int8_matmul` (`torch._int_mm`) on the CPU.
    `real=False` is the fake-quant twin (exact integer sums in float64)."""

    def __init__(
        self,
        name: str,
        q: torch.Tensor,
        scale: torch.Tensor,
        bias: torch.Tensor | None,
        real: bool = True,
    ):
        super().__init__({name: q, name + SCALE_SUFFIX: scale}, bias)
        self.weight_name, self.real = name, real
        self.out_features, self.in_features = q.shape
        self.register_buffer("q", torch.empty_like(q), persistent=False)
        self.register_buffer(
            "scale", torch.empty_like(scale, dtype=torch.float32), persistent=False
        )
        self.load({name: q, name + SCALE_SUFFIX: scale})
        #: one Triton kernel per call (fused.py): quantizer, GEMM and bias together
        self.fused = real and triton_enabled(self.q)
        self.device_facts = DeviceFacts.of(self.q)  # read once: no host query per call

    def load(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self.q.copy_(tensors[self.weight_name])
        self.scale.copy_(tensors[self.weight_name + SCALE_SUFFIX])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        if self.fused:
            rows = x.reshape(-1, self.in_features)
            out = int8_linear_fused(rows, self.q, self.scale, self.bias, device=self.device_facts)
            return out.reshape(*shape[:-1], self.out_features)
        xq, x_scale = quantize_activations_int8(x.reshape(-1, self.in_features))
        if self.real:
            # float(int32 sum) · x scale · w scale in fp32, as the float64 twin below.
            out = int8_matmul(xq, x_scale, self.q, self.scale, torch.float32)
        else:
            accumulated = xq.double() @ self.q.double().t()  # exact integer sums
            out = accumulated.float() * x_scale * self.scale.t()
        if self.bias is not None:
            out = out + self.bias.float()
        return out.to(x.dtype).reshape(*shape[:-1], self.out_features)
