"""The INT8 W8A8 GEMM in one call, at any batch: Triton on CUDA, `torch._int_mm` on the CPU
(and on a GPU without Triton, the batch padded to 32 rows, as `torch._int_mm` needs more than
16 there). Weights int8 [N, K] with fp32 per-row scales [N, 1]; activations from
`quantize_activations_int8` (quant.py). docs/precision.md, "Kernels"."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernel_support import (
    GEMM_OUT_DTYPES,
    DeviceFacts,
    ceil_div,
    check_2d,
    check_impl,
    gemm_tiles,
    triton,
    triton_runs_on,
    unavailable,
    why_no_triton,
)

# cuBLAS's int8 GEMM behind torch._int_mm needs more than 16 rows on CUDA; 32 is also a
# multiple of 8, which its other dimensions need.
INT_MM_MIN_ROWS = 32

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _int8_matmul_kernel(
        x_ptr,
        w_ptr,
        out_ptr,
        x_scale_ptr,
        w_scale_ptr,
        M,
        N,
        K,
        k_tiles_per_split,
        stride_xm,
        stride_wn,
        stride_out_split,
        stride_om,
        stride_xs,
        stride_ws,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        SCALE: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_k = tl.program_id(2)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        m_in = rm < M
        n_in = rn < N
        x_rows = x_ptr + rm[:, None].to(tl.int64) * stride_xm
        w_cols = w_ptr + rn[None, :].to(tl.int64) * stride_wn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
        first = pid_k * k_tiles_per_split
        last = tl.minimum(first + k_tiles_per_split, tl.cdiv(K, BLOCK_K))
        for tile in range(first, last):
            k = tile * BLOCK_K + rk
            k_in = k < K
            a = tl.load(x_rows + k[None, :], mask=m_in[:, None] & k_in[None, :], other=0)
            b = tl.load(w_cols + k[:, None], mask=k_in[:, None] & n_in[None, :], other=0)
            acc += tl.dot(a, b, out_dtype=tl.int32)
        mask = m_in[:, None] & n_in[None, :]
        out = (
            out_ptr + pid_k * stride_out_split + rm[:, None].to(tl.int64) * stride_om + rn[None, :]
        )
        if SCALE:
            # The reference's epilogue, in its order: float(int32 sum) · x scale · w scale.
            x_scale = tl.load(x_scale_ptr + rm * stride_xs, mask=m_in, other=0.0)
            w_scale = tl.load(w_scale_ptr + rn * stride_ws, mask=n_in, other=0.0)
            scaled = acc.to(tl.float32) * x_scale[:, None] * w_scale[None, :]
            tl.store(out, scaled.to(out_ptr.dtype.element_ty), mask=mask)
        else:  # a K split: the exact int32 partial sum, scaled once the splits are added
            tl.store(out, acc, mask=mask)


def _check_int8_operands(x_q, x_scale, w_q, w_scale, out_dtype):
    check_2d("x_q", x_q, torch.int8)
    check_2d("w_q", w_q, torch.int8)
    (m, k), (n, k_w) = x_q.shape, w_q.shape
    if k != k_w or k == 0:
        raise ValueError(f"x_q is [M, {k}] and w_q is [N, {k_w}]: need the same K, at least 1")
    if x_scale.dtype != torch.float32 or x_scale.numel() != m:
        raise ValueError(
            f"x_scale must be fp32 [{m}, 1], got {x_scale.dtype} {tuple(x_scale.shape)}"
        )
    if w_scale.dtype != torch.float32 or w_scale.numel() != n:
        raise ValueError(
            f"w_scale must be fp32 [{n}, 1], got {w_scale.dtype} {tuple(w_scale.shape)}"
        )
    if out_dtype not in GEMM_OUT_DTYPES:
        raise ValueError(f"out_dtype must be bf16, fp16 or fp32, got {out_dtype}")
    return x_scale.reshape(m, 1), w_scale.reshape(n, 1)


def int8_matmul_reference(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """`torch._int_mm` (exact int32 sums), then float(sum) · x scale · w scale in fp32:
    as `Int8Linear` computes. Any M on the CPU; on CUDA the batch is zero-padded to 32 rows
    when it has 16 or fewer (cuBLAS's int8 GEMM needs more than 16), K and N must then
    be multiples of 8."""
    x_scale, w_scale = _check_int8_operands(x_q, x_scale, w_q, w_scale, out_dtype)
    m = x_q.shape[0]
    if x_q.is_cuda and m < INT_MM_MIN_ROWS:
        x_q = F.pad(x_q, (0, 0, 0, INT_MM_MIN_ROWS - m))
    accumulated = torch._int_mm(x_q.contiguous(), w_q.t())[:m].float()
    return (accumulated * x_scale * w_scale.t()).to(out_dtype)


def int8_matmul_triton(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    split_k: int | None = None,
) -> torch.Tensor:
    """The Triton INT8 GEMM (CUDA, or the CPU under TRITON_INTERPRET=1): int8 tl.dot tiles
    summed in int32, any M, N, K; the epilogue is the reference's, so the result is the
    same bits while the int32 sums do not overflow (K < 2^31 / 128² ≈ 131k). A K split
    adds its int32 partials exactly before scaling."""
    x_scale, w_scale = _check_int8_operands(x_q, x_scale, w_q, w_scale, out_dtype)
    if not triton_runs_on(x_q):
        raise unavailable(
            "int8_matmul (Triton)",
            x_q,
            why_no_triton(x_q),
            "impl='reference' (torch._int_mm; any batch on the CPU, padded to 32 rows on CUDA)",
        )
    x_q = x_q if x_q.stride(1) == 1 else x_q.contiguous()
    w_q = w_q if w_q.stride(1) == 1 else w_q.contiguous()
    (m, k), n = x_q.shape, w_q.shape[0]
    block_k = 128 if x_q.is_cuda else 32
    block_m, block_n, splits, per_split = gemm_tiles(
        m, n, ceil_div(k, block_k), DeviceFacts.of(x_q), split_k
    )
    if splits == 1:
        out = torch.empty((1, m, n), dtype=out_dtype, device=x_q.device)
    else:
        out = torch.empty((splits, m, n), dtype=torch.int32, device=x_q.device)
    if m and n:
        grid = (ceil_div(m, block_m), ceil_div(n, block_n), splits)
        _int8_matmul_kernel[grid](
            x_q,
            w_q,
            out,
            x_scale,
            w_scale,
            m,
            n,
            k,
            per_split,
            x_q.stride(0),
            w_q.stride(0),
            out.stride(0),
            out.stride(1),
            x_scale.stride(0),
            w_scale.stride(0),
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_K=block_k,
            SCALE=splits == 1,
        )
    if splits == 1:
        return out[0]
    accumulated = out.sum(0, dtype=torch.int32).float()
    return (accumulated * x_scale * w_scale.t()).to(out_dtype)


def int8_matmul(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    impl: str = "auto",
) -> torch.Tensor:
    """out [M, N] = (x_q · x_scale) (w_q · w_scale)ᵀ at any batch M ≥ 1: x_q int8 [M, K] and
    w_q int8 [N, K] row-major, x_scale fp32 [M, 1] (or [M]) per token, w_scale fp32 [N, 1] (or
    [N]) per output channel; out_dtype [M, N], bias not added. impl: "auto" (Triton on CUDA when
    installed, else `torch._int_mm`, the batch padded to 32 rows on CUDA), "triton" or
    "reference": the same bits (exact int32 sums, the same fp32 epilogue)."""
    check_impl(impl, ("auto", "triton", "reference"))
    if impl == "triton" or (impl == "auto" and x_q.is_cuda and triton_runs_on(x_q)):
        return int8_matmul_triton(x_q, x_scale, w_q, w_scale, out_dtype)
    return int8_matmul_reference(x_q, x_scale, w_q, w_scale, out_dtype)


__all__ = ["int8_matmul", "int8_matmul_reference", "int8_matmul_triton"]
