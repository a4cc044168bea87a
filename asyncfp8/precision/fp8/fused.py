"""Blockwise FP8 W8A8 linear in one Triton kernel: the 16-bit input quantized per token per
group inside the GEMM, the bias added in its epilogue, the output in the input's dtype; no
quantizer, K-split reduction or cast kernel beside it (docs/precision.md, "Kernels"). Its
fp32 result is the unfused Triton path's with one K split, bit for bit."""

from __future__ import annotations

import torch

from ..kernel_support import (
    DeviceFacts,
    ceil_div,
    fused_tiles,
    triton,
    triton_runs_on,
    unavailable,
    why_no_triton,
)

if triton is not None:
    import triton.language as tl

    from ..kernel_support import round_to_e4m3_grid

    @triton.jit
    def _fp8_linear_kernel(
        x_ptr,
        w_ptr,
        w_scale_ptr,
        bias_ptr,
        out_ptr,
        M,
        N,
        K,
        group_n,
        stride_xm,
        stride_wn,
        stride_ws_n,
        stride_om,
        HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        GROUP_K: tl.constexpr,
        UPCAST: tl.constexpr,
    ):
        # One program per output tile. A K tile is one activation group, so its per-row
        # amax is the quantizer's: the same IEEE divisions and e4m3 rounding as
        # quant._quantize_activations_kernel, then the GEMM's scaled dot.
        rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, GROUP_K)
        m_in = rm < M
        n_in = rn < N
        x_rows = x_ptr + rm[:, None].to(tl.int64) * stride_xm
        w_cols = w_ptr + rn[None, :].to(tl.int64) * stride_wn
        w_scale_cols = w_scale_ptr + (rn // group_n) * stride_ws_n
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for tile in range(0, tl.cdiv(K, GROUP_K)):
            k = tile * GROUP_K + rk
            k_in = k < K
            x = tl.load(x_rows + k[None, :], mask=m_in[:, None] & k_in[None, :], other=0.0)
            x = x.to(tl.float32)
            a_scale = tl.div_rn(tl.maximum(tl.max(tl.abs(x), axis=1), 1e-10), 448.0)
            a = round_to_e4m3_grid(tl.clamp(tl.div_rn(x, a_scale[:, None]), -448.0, 448.0))
            a = a.to(tl.float8e4nv)
            b = tl.load(w_cols + k[:, None], mask=k_in[:, None] & n_in[None, :], other=0.0)
            if UPCAST:  # no FP8 MMA before sm89; e4m3 -> fp16 is exact
                a = a.to(tl.float16)
                b = b.to(tl.float16)
            b_scale = tl.load(w_scale_cols + tile, mask=n_in, other=0.0)
            acc += tl.dot(a, b) * a_scale[:, None] * b_scale[None, :]
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn, mask=n_in, other=0.0).to(tl.float32)[None, :]
        out = out_ptr + rm[:, None].to(tl.int64) * stride_om + rn[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_in[:, None] & n_in[None, :])


def fused_fp8_takes(block: tuple[int, int]) -> str | None:
    """Why the fused kernel cannot take weights in `block`s, or None when it can: a K tile
    must be one whole activation group, a power of two tl.dot can take."""
    group = block[1]
    if group & (group - 1) or not 16 <= group <= 256:
        return f"its activation groups are {group} columns (it takes 16, 32, 64, 128 or 256)"
    return None


def fp8_linear_fused(
    x: torch.Tensor,
    w_q: torch.Tensor,
    w_scale_inv: torch.Tensor,
    bias: torch.Tensor | None,
    block: tuple[int, int],
    out_features: int,
    out_dtype: torch.dtype | None = None,
    device: DeviceFacts | None = None,
) -> torch.Tensor:
    """x [M, K] (bf16/fp16/fp32) @ dequant(w_q)ᵀ + bias -> [M, out_features] in `out_dtype`
    (x's dtype by default). w_q float8_e4m3fn [≥ N, ≥ K] (an engine's zero-padded buffer
    is read in place), w_scale_inv fp32 per `block`; the bias is added in fp32. `device`:
    its facts, read once by the caller (default: read now)."""
    if not triton_runs_on(x):
        raise unavailable(
            "fp8_linear_fused", x, why_no_triton(x), "the unfused path (FP8BlockLinear)"
        )
    why = fused_fp8_takes(block)
    if why:
        raise ValueError(f"fp8_linear_fused cannot take this layer: {why}")
    x = x if x.stride(1) == 1 else x.contiguous()
    (m, k), n = x.shape, out_features
    out = torch.empty((m, n), dtype=out_dtype or x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    device = device or DeviceFacts.of(x)
    block_m, block_n = fused_tiles(m, n, device)
    upcast = not device.fp8_mma
    grid = (ceil_div(m, block_m), ceil_div(n, block_n))
    _fp8_linear_kernel[grid](
        x,
        w_q,
        w_scale_inv,
        bias if bias is not None else out,  # not read without HAS_BIAS
        out,
        m,
        n,
        k,
        block[0],
        x.stride(0),
        w_q.stride(0),
        w_scale_inv.stride(0),
        out.stride(0),
        HAS_BIAS=bias is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        GROUP_K=block[1],
        UPCAST=upcast,
    )
    return out
