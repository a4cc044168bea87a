"""GPU kernels for the built-in torch engine, each a plain function over tensors with a
torch reference that runs anywhere.

- `quantize_activations_fp8(x, group, column_major_scales)`: FP8 activations per token per
  group (Triton on CUDA, torch elsewhere; the same bytes).
- `fp8_block_matmul(x_q, x_scales, w_q, w_scale_inv, block, out_dtype)`: block-scaled FP8
  GEMM in one call (torch `scaled_mm` on sm90, Triton on other GPUs, the per-block
  `torch._scaled_mm` loop on the CPU).
- `int8_matmul(x_q, x_scale, w_q, w_scale, out_dtype)`: INT8 W8A8 at any batch (Triton on
  CUDA, `torch._int_mm` elsewhere).
- `fp8_kv_decode_attention(q, k_cache, v_cache, k_scale, v_scale, kv_valid, sm_scale)`:
  one decode step of attention reading an e4m3 KV cache (Triton on CUDA, torch elsewhere).

Each takes `impl="auto" | "triton" | "reference"` (and "scaled_mm" for the FP8 GEMM); a
path the device cannot run raises `KernelUnavailable` naming the device, the kernel and
what would work. The modules' docstrings give the shapes, dtypes and layouts.
"""

from .attention import (
    fp8_kv_decode_attention,
    fp8_kv_decode_attention_reference,
    fp8_kv_decode_attention_triton,
)
from .common import KernelUnavailable
from .gemm import (
    fp8_block_matmul,
    fp8_block_matmul_reference,
    fp8_block_matmul_scaled_mm,
    fp8_block_matmul_triton,
    int8_matmul,
    int8_matmul_reference,
    int8_matmul_triton,
    pad_fp8_weight,
    scaled_mm_available,
    scaled_mm_weight_scales,
    triton_fp8_block_k,
)
from .quant import (
    empty_activation_scales,
    quantize_activations_fp8,
    quantize_activations_fp8_reference,
    quantize_activations_fp8_triton,
    to_column_major,
)

__all__ = [
    "KernelUnavailable",
    "empty_activation_scales",
    "fp8_block_matmul",
    "fp8_block_matmul_reference",
    "fp8_block_matmul_scaled_mm",
    "fp8_block_matmul_triton",
    "fp8_kv_decode_attention",
    "fp8_kv_decode_attention_reference",
    "fp8_kv_decode_attention_triton",
    "int8_matmul",
    "int8_matmul_reference",
    "int8_matmul_triton",
    "pad_fp8_weight",
    "quantize_activations_fp8",
    "quantize_activations_fp8_reference",
    "quantize_activations_fp8_triton",
    "scaled_mm_available",
    "scaled_mm_weight_scales",
    "to_column_major",
    "triton_fp8_block_k",
]
