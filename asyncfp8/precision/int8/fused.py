"""INT8 W8A8 linear in one Triton kernel: each row's per-token scale from a first pass over
its K, the row quantized inside the GEMM on the second, the int32 sums scaled and the bias
added in the epilogue, the output written in the input's dtype. Its fp32 result is
`Int8Linear`'s unfused one (quantize_activations_int8, int8_matmul, + bias) bit for bit:
the integer sums are exact and the float operations are the same, in the same order."""

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

    from ..kernel_support import round_half_even

    @triton.jit
    def _int8_linear_kernel(
        x_ptr,
        w_ptr,
        w_scale_ptr,
        bias_ptr,
        out_ptr,
        M,
        N,
        K,
        stride_xm,
        stride_wn,
        stride_ws,
        stride_om,
        HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        m_in = rm < M
        n_in = rn < N
        x_rows = x_ptr + rm[:, None].to(tl.int64) * stride_xm
        w_cols = w_ptr + rn[None, :].to(tl.int64) * stride_wn
        amax = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for start in range(0, K, BLOCK_K):  # the rows' amax: their per-token scales
            k = start + rk
            x = tl.load(x_rows + k[None, :], mask=m_in[:, None] & (k < K)[None, :], other=0.0)
            amax = tl.maximum(amax, tl.max(tl.abs(x.to(tl.float32)), axis=1))
        x_scale = tl.div_rn(tl.maximum(amax, 1e-10), 127.0)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
        for start in range(0, K, BLOCK_K):
            k = start + rk
            k_in = k < K
            x = tl.load(x_rows + k[None, :], mask=m_in[:, None] & k_in[None, :], other=0.0)
            q = round_half_even(tl.div_rn(x.to(tl.float32), x_scale[:, None]))
            a = tl.clamp(q, -128.0, 127.0).to(tl.int8)
            b = tl.load(w_cols + k[:, None], mask=k_in[:, None] & n_in[None, :], other=0)
            acc += tl.dot(a, b, out_dtype=tl.int32)
        w_scale = tl.load(w_scale_ptr + rn * stride_ws, mask=n_in, other=0.0)
        scaled = acc.to(tl.float32) * x_scale[:, None] * w_scale[None, :]
        if HAS_BIAS:
            scaled += tl.load(bias_ptr + rn, mask=n_in, other=0.0).to(tl.float32)[None, :]
        out = out_ptr + rm[:, None].to(tl.int64) * stride_om + rn[None, :]
        tl.store(out, scaled.to(out_ptr.dtype.element_ty), mask=m_in[:, None] & n_in[None, :])


def int8_linear_fused(
    x: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype | None = None,
    device: DeviceFacts | None = None,
) -> torch.Tensor:
    """x [M, K] (bf16/fp16/fp32) @ (w_q · w_scale)ᵀ + bias -> [M, N] in `out_dtype` (x's
    dtype by default): w_q int8 [N, K], w_scale fp32 [N, 1] per channel, x quantized per
    token. Exact int32 sums while K < 2^31 / 128² ≈ 131k."""
    if not triton_runs_on(x):
        raise unavailable("int8_linear_fused", x, why_no_triton(x), "the unfused Int8Linear")
    x = x if x.stride(1) == 1 else x.contiguous()
    w_q = w_q if w_q.stride(1) == 1 else w_q.contiguous()
    (m, k), n = x.shape, w_q.shape[0]
    if w_q.shape[1] != k or w_scale.numel() != n:
        raise ValueError(
            f"x is [M, {k}], w_q {tuple(w_q.shape)} and w_scale has {w_scale.numel()} values: "
            "need w_q [N, K] and N scales"
        )
    out = torch.empty((m, n), dtype=out_dtype or x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    block_m, block_n = fused_tiles(m, n, device or DeviceFacts.of(x))
    grid = (ceil_div(m, block_m), ceil_div(n, block_n))
    _int8_linear_kernel[grid](
        x,
        w_q,
        w_scale,
        bias if bias is not None else out,  # not read without HAS_BIAS
        out,
        m,
        n,
        k,
        x.stride(0),
        w_q.stride(0),
        w_scale.reshape(n, -1).stride(0),
        out.stride(0),
        HAS_BIAS=bias is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=128 if x.is_cuda else 32,
    )
    return out
