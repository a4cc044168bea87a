"""The built-in engine's runtime module for blockwise FP8 W8A8 (`FP8BlockLinear`)."""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch
import torch.nn.functional as F

from ..kernel_support import DeviceFacts, KernelUnavailable, triton_enabled, triton_runs_on
from ..modules import QuantizedLinear
from .fused import fp8_linear_fused, fused_fp8_takes
from .gemm import fp8_block_matmul, scaled_mm_available, scaled_mm_weight_scales
from .quant import BLOCK, SCALE_SUFFIX, dequantize_blockwise, quantize_activations_fp8

log = logging.getLogger(__name__)
# The scaled_mm failures already reported (one warning per kind, not one per layer).
_scaled_mm_failures: set[str] = set()
# The reasons a layer on CUDA could not take the fused kernel, each logged once.
_unfused_reasons: set[str] = set()


class FP8BlockLinear(QuantizedLinear):
    """W8A8 blockwise FP8 for the built-in engine: activations per token per `block[1]`
    columns, weights per `block` block, FP32 accumulation through `gemm.fp8_block_matmul`
    (`real=False`: the fake-quant twin). On CUDA with Triton, one fused kernel per call
    (fused.py); else the quantizer and `gemm.fp8_block_matmul`, where a `scaled_mm` that
    raises is reported once and replaced. The weight is held zero-padded to whole blocks."""

    def __init__(
        self,
        name: str,
        q: torch.Tensor,
        scale_inv: torch.Tensor,
        bias: torch.Tensor | None,
        block: tuple[int, int] = BLOCK,
        real: bool = True,
    ):
        super().__init__({name: q, name + SCALE_SUFFIX: scale_inv}, bias)
        self.weight_name, self.block, self.real = name, tuple(block), real
        self.out_features, self.in_features = q.shape
        grid_rows, grid_cols = scale_inv.shape
        block_rows, block_cols = self.block
        # The padding stays zero across updates (`load` writes the unpadded part only).
        self.register_buffer(
            "q",
            torch.zeros(
                grid_rows * block_rows,
                grid_cols * block_cols,
                dtype=torch.float8_e4m3fn,
                device=q.device,
            ),
            persistent=False,
        )
        self.register_buffer(
            "scale_inv", torch.empty_like(scale_inv, dtype=torch.float32), persistent=False
        )
        # torch's one-call scaled_mm only where Triton cannot run: on an H100 the Triton
        # GEMM was faster at 64 rows (13.1 against 17.5 us on down_proj) and cuBLASLt
        # refused one row (bench/results/kernels-h100.json).
        one_call = (
            real
            and self.block == BLOCK
            and scaled_mm_available(self.q)
            and not triton_runs_on(self.q)
        )
        self.register_buffer(
            "scale_mm",
            scaled_mm_weight_scales(self.scale_inv) if one_call else None,
            persistent=False,
        )
        #: the GEMM path `fp8_block_matmul` takes ("scaled_mm" on sm90 without Triton,
        #: until it fails)
        self.impl = "scaled_mm" if one_call else "auto"
        #: one Triton kernel per call (fused.py): quantizer, GEMM and bias together
        self.fused = real and triton_enabled(self.q) and not self._unfused_because()
        self.device_facts = DeviceFacts.of(self.q)  # read once: no host query per call
        self.load({name: q, name + SCALE_SUFFIX: scale_inv})

    def load(self, tensors: Mapping[str, torch.Tensor]) -> None:
        q, scale_inv = tensors[self.weight_name], tensors[self.weight_name + SCALE_SUFFIX]
        rows, cols = q.shape
        self.q.view(torch.uint8)[:rows, :cols].copy_(q.view(torch.uint8))
        self.scale_inv.copy_(scale_inv)
        if self.scale_mm is not None:
            self.scale_mm.copy_(scaled_mm_weight_scales(self.scale_inv))

    def _unfused_because(self) -> str | None:
        why = fused_fp8_takes(self.block)
        if why and why not in _unfused_reasons:
            _unfused_reasons.add(why)
            log.warning(
                "FP8 linear: the fused kernel cannot take %s: %s; the unfused path "
                "runs (a quantizer, the GEMM and a cast per layer)",
                self.weight_name,
                why,
            )
        return why

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, dtype = x.shape, x.dtype
        group = self.block[1]
        x = x.reshape(-1, self.in_features)
        if self.fused:
            out = fp8_linear_fused(
                x,
                self.q,
                self.scale_inv,
                self.bias,
                self.block,
                self.out_features,
                device=self.device_facts,
            )
            return out.reshape(*shape[:-1], self.out_features)
        padding = self.q.shape[1] - self.in_features
        if padding:  # zero columns up to the padded K: no group's amax changes, they quantize to 0
            x = F.pad(x, (0, padding))
        if self.real:
            # Without a bias the GEMM writes the activations' 16-bit dtype itself (rounded
            # as a cast of its FP32 result would be): one kernel fewer per layer, where an
            # H100's batch-1 decode step is bound by its count of small kernels.
            direct = self.bias is None and dtype in (torch.bfloat16, torch.float16)
            out = self._real_matmul(x, group, dtype if direct else torch.float32)
        else:
            xq, x_scale = quantize_activations_fp8(x, group)
            x_deq = (xq.float().view(x.shape[0], -1, group) * x_scale[..., None]).view(x.shape)
            rows, cols = self.out_features, self.in_features
            w_deq = dequantize_blockwise(self.q[:rows, :cols], self.scale_inv, self.block)
            out = x_deq[:, :cols] @ w_deq.t()
        out = out[:, : self.out_features]
        if self.bias is not None:
            out = out + self.bias.float()
        return out.to(dtype).reshape(*shape[:-1], self.out_features)

    def _real_matmul(self, x: torch.Tensor, group: int, out_dtype: torch.dtype) -> torch.Tensor:
        one_call = self.impl == "scaled_mm"
        xq, x_scale = quantize_activations_fp8(x, group, column_major_scales=one_call)
        try:
            return fp8_block_matmul(
                xq,
                x_scale,
                self.q,
                self.scale_inv,
                self.block,
                out_dtype,
                impl=self.impl,
                w_scale_mm=self.scale_mm,
            )
        except RuntimeError as err:
            if not one_call or isinstance(err, KernelUnavailable):
                raise
            self.impl = "triton" if triton_runs_on(self.q) else "reference"
            self.scale_mm = None
            reason = str(err).splitlines()[0] if str(err) else type(err).__name__
            log.log(
                logging.DEBUG if reason in _scaled_mm_failures else logging.WARNING,
                "FP8 GEMM: torch's one-call scaled_mm failed for %s (%d tokens, weight %s): "
                "%s; the layer (and any other it fails in) uses impl=%r from now on",
                self.weight_name,
                x.shape[0],
                list(self.q.shape),
                reason,
                self.impl,
            )
            _scaled_mm_failures.add(reason)
            return self._real_matmul(x, group, out_dtype)
