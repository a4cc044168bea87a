"""The block-scaled FP8 GEMM in one call (W8A8, DESIGN.md §4): Triton, torch's one-call
blockwise `scaled_mm` on sm90, or the per-block `torch._scaled_mm` loop (the reference).

What runs where, why Triton comes first on sm90, and the layouts: docs/precision.md, "Kernels"."""

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
from .quant import to_column_major

FP8 = torch.float8_e4m3fn
SCALED_MM_BLOCK = (128, 128)

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _fp8_block_matmul_kernel(
        x_ptr,
        w_ptr,
        out_ptr,
        x_scale_ptr,
        w_scale_ptr,
        M,
        N,
        K,
        group_n,
        group_k,
        k_tiles_per_split,
        stride_xm,
        stride_wn,
        stride_out_split,
        stride_om,
        stride_xs_m,
        stride_xs_k,
        stride_ws_n,
        stride_ws_k,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        UPCAST: tl.constexpr,
    ):
        # One program per (BLOCK_M × BLOCK_N output tile, K split). BLOCK_K divides the
        # weight block's K size, so every K tile has one activation scale per row and one
        # weight scale per column: each tile's exact e4m3 dot is scaled, then summed in fp32.
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
        x_scale_rows = x_scale_ptr + rm * stride_xs_m
        w_scale_cols = w_scale_ptr + (rn // group_n) * stride_ws_n
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        first = pid_k * k_tiles_per_split
        last = tl.minimum(first + k_tiles_per_split, tl.cdiv(K, BLOCK_K))
        for tile in range(first, last):
            k = tile * BLOCK_K + rk
            k_in = k < K
            a = tl.load(x_rows + k[None, :], mask=m_in[:, None] & k_in[None, :], other=0.0)
            b = tl.load(w_cols + k[:, None], mask=k_in[:, None] & n_in[None, :], other=0.0)
            if UPCAST:  # no FP8 MMA before sm89, none 16 deep; e4m3 -> fp16 is exact
                a = a.to(tl.float16)
                b = b.to(tl.float16)
            group = (tile * BLOCK_K) // group_k
            a_scale = tl.load(x_scale_rows + group * stride_xs_k, mask=m_in, other=0.0)
            b_scale = tl.load(w_scale_cols + group * stride_ws_k, mask=n_in, other=0.0)
            acc += tl.dot(a, b) * a_scale[:, None] * b_scale[None, :]
        out = (
            out_ptr + pid_k * stride_out_split + rm[:, None].to(tl.int64) * stride_om + rn[None, :]
        )
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_in[:, None] & n_in[None, :])


# --- FP8 --------------------------------------------------------------------------------------


def _check_block(block) -> tuple[int, int]:
    if len(block) != 2 or not all(isinstance(b, int) and b >= 1 for b in block):
        raise ValueError(f"block must be two positive ints (bn, bk), got {block!r}")
    return int(block[0]), int(block[1])


def _check_fp8_operands(x_q, x_scales, w_q, w_scale_inv, block, out_dtype) -> tuple[int, int]:
    bn, bk = _check_block(block)
    check_2d("x_q", x_q, FP8)
    check_2d("w_q", w_q, FP8)
    check_2d("x_scales", x_scales, torch.float32)
    check_2d("w_scale_inv", w_scale_inv, torch.float32)
    (m, k), (n, k_w) = x_q.shape, w_q.shape
    if k != k_w or k == 0:
        raise ValueError(f"x_q is [M, {k}] and w_q is [N, {k_w}]: need the same K, at least 1")
    if tuple(w_scale_inv.shape) != (ceil_div(n, bn), ceil_div(k, bk)):
        raise ValueError(
            f"w_scale_inv has shape {tuple(w_scale_inv.shape)}; a {n}x{k} weight in "
            f"{bn}x{bk} blocks needs {(ceil_div(n, bn), ceil_div(k, bk))}"
        )
    if tuple(x_scales.shape) != (m, ceil_div(k, bk)):
        raise ValueError(
            f"x_scales has shape {tuple(x_scales.shape)}; {m} tokens of {k} columns in "
            f"groups of {bk} need {(m, ceil_div(k, bk))}"
        )
    if out_dtype not in GEMM_OUT_DTYPES:
        raise ValueError(f"out_dtype must be bf16, fp16 or fp32, got {out_dtype}")
    return bn, bk


def _pad_fp8(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    # F.pad has no e4m3 kernel; zero bytes are e4m3 zeros.
    padded = F.pad(t.view(torch.uint8), (0, cols - t.shape[1], 0, rows - t.shape[0]))
    return padded.view(FP8)


def pad_fp8_weight(w_q: torch.Tensor, block: tuple[int, int] = SCALED_MM_BLOCK) -> torch.Tensor:
    """`w_q` [N, K] zero-padded to whole blocks, [ceil(N/bn)·bn, ceil(K/bk)·bk]; its
    `w_scale_inv` stays as it is. Do this once when a weight is loaded: the sm90
    `scaled_mm` path needs N and K multiples of 128, and `fp8_block_matmul` then returns
    the padded width (crop it: `out[:, :N]`). The activations must be padded to the same
    K (pad x before quantizing it)."""
    bn, bk = _check_block(block)
    n, k = w_q.shape
    return _pad_fp8(w_q, ceil_div(n, bn) * bn, ceil_div(k, bk) * bk).contiguous()


def scaled_mm_weight_scales(w_scale_inv: torch.Tensor) -> torch.Tensor:
    """`w_scale_inv` [N/128, K/128] in the layout torch's BlockWise128x128 `scaled_mm`
    operand wants: K/128 zero-padded to L4 = a multiple of 4, transposed to [L4, N/128]
    with strides (1, L4). Tiny; compute it once per weight version to save a copy per
    call (`fp8_block_matmul(..., w_scale_mm=...)`)."""
    k_blocks = w_scale_inv.shape[1]
    padded = F.pad(w_scale_inv.float(), (0, ceil_div(k_blocks, 4) * 4 - k_blocks))
    return padded.contiguous().t()


def scaled_mm_available(tensor: torch.Tensor) -> bool:
    """torch's blockwise `scaled_mm` can run on this tensor's device: an sm90 GPU (it is
    SM90-only), a torch that has `F.scaled_mm` with the blockwise recipes, CUDA ≥ 12.9."""
    if not tensor.is_cuda or not hasattr(F, "scaled_mm") or not hasattr(F, "ScalingType"):
        return False
    if "BlockWise128x128" not in F.ScalingType.__members__:
        return False
    cuda = tuple(int(p) for p in (torch.version.cuda or "0.0").split(".")[:2])
    return cuda >= (12, 9) and torch.cuda.get_device_capability(tensor.device) == (9, 0)


def _scaled_mm_takes(x_q, w_q, block, out_dtype) -> bool:
    return (
        tuple(block) == SCALED_MM_BLOCK
        and x_q.shape[1] % 128 == 0
        and w_q.shape[0] % 128 == 0
        and out_dtype in (torch.bfloat16, torch.float32)
        and scaled_mm_available(x_q)
    )


def fp8_block_matmul_reference(
    x_q: torch.Tensor,
    x_scales: torch.Tensor,
    w_q: torch.Tensor,
    w_scale_inv: torch.Tensor,
    block: tuple[int, int] = SCALED_MM_BLOCK,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """The CPU reference: one `torch._scaled_mm` per K block (rowwise scales: the activation
    scales of that group × the weight scale of each output row's block), accumulated in fp32
    in K order, both operands zero-padded to whole blocks first, as `FP8BlockLinear` computes
    on the CPU. Runs on CUDA too where `_scaled_mm`'s rowwise fp32 output does (sm90,
    cuBLAS ≥ 12.9)."""
    bn, bk = _check_fp8_operands(x_q, x_scales, w_q, w_scale_inv, block, out_dtype)
    n = w_q.shape[0]
    grid_rows, grid_cols = w_scale_inv.shape
    x_pad = _pad_fp8(x_q, x_q.shape[0], grid_cols * bk)
    w_pad = _pad_fp8(w_q, grid_rows * bn, grid_cols * bk)
    row_scales = w_scale_inv.t().repeat_interleave(bn, 1)  # [K blocks, N padded]
    out = torch.zeros(x_q.shape[0], grid_rows * bn, dtype=torch.float32, device=x_q.device)
    for g in range(grid_cols):
        cols = slice(g * bk, (g + 1) * bk)
        out += torch._scaled_mm(
            x_pad[:, cols],
            w_pad[:, cols].t(),
            # A fresh [M, 1] with strides (1, 1): _scaled_mm checks strides literally, and
            # .contiguous() keeps the slice's (1, M) or (G, 1) where a dimension is 1.
            scale_a=x_scales[:, g : g + 1].clone(memory_format=torch.contiguous_format),
            scale_b=row_scales[g : g + 1].contiguous(),
            out_dtype=torch.float32,
        )
    return out[:, :n].to(out_dtype)


def triton_fp8_block_k(bk: int) -> int:
    """The K tile of the Triton FP8 kernel for weight blocks bk wide: the largest power
    of two dividing bk, at most 128. tl.dot needs a tile of at least 16, so bk must be a
    multiple of 16; bn may be any positive size (scales are looked up per column)."""
    if bk % 16:
        raise ValueError(
            f"the Triton FP8 GEMM takes weight blocks whose K size is a multiple of 16 "
            f"(tl.dot tiles of 16 or more, one scale per tile); got bk = {bk}"
        )
    return min(bk & -bk, 128)


def fp8_block_matmul_triton(
    x_q: torch.Tensor,
    x_scales: torch.Tensor,
    w_q: torch.Tensor,
    w_scale_inv: torch.Tensor,
    block: tuple[int, int] = SCALED_MM_BLOCK,
    out_dtype: torch.dtype = torch.bfloat16,
    split_k: int | None = None,
) -> torch.Tensor:
    """The Triton block-scaled FP8 GEMM (CUDA, or the CPU under TRITON_INTERPRET=1): tl.dot
    on e4m3 tiles (fp16 tiles, exactly converted, before sm89 or for 16-deep tiles), each
    tile's result scaled by its activation and weight scales and accumulated in fp32. Any N and
    K, bk a multiple of 16 (`triton_fp8_block_k`), M ≥ 1. `split_k` (default: by the machine's
    size) splits K across programs whose fp32 partials are added in order."""
    bn, bk = _check_fp8_operands(x_q, x_scales, w_q, w_scale_inv, block, out_dtype)
    block_k = triton_fp8_block_k(bk)
    if not triton_runs_on(x_q):
        raise unavailable(
            "fp8_block_matmul (Triton)",
            x_q,
            why_no_triton(x_q),
            "impl='scaled_mm' on an sm90 GPU, or impl='reference' on the CPU",
        )
    x_q = x_q if x_q.stride(1) == 1 else x_q.contiguous()
    w_q = w_q if w_q.stride(1) == 1 else w_q.contiguous()
    (m, k), n = x_q.shape, w_q.shape[0]
    block_m, block_n, splits, per_split = gemm_tiles(
        m, n, ceil_div(k, block_k), DeviceFacts.of(x_q), split_k
    )
    if splits == 1:
        out = torch.empty((1, m, n), dtype=out_dtype, device=x_q.device)
    else:
        out = torch.empty((splits, m, n), dtype=torch.float32, device=x_q.device)
    if m and n:
        upcast = block_k < 32 or (
            x_q.is_cuda and torch.cuda.get_device_capability(x_q.device) < (8, 9)
        )
        grid = (ceil_div(m, block_m), ceil_div(n, block_n), splits)
        _fp8_block_matmul_kernel[grid](
            x_q,
            w_q,
            out,
            x_scales,
            w_scale_inv,
            m,
            n,
            k,
            bn,
            bk,
            per_split,
            x_q.stride(0),
            w_q.stride(0),
            out.stride(0),
            out.stride(1),
            x_scales.stride(0),
            x_scales.stride(1),
            w_scale_inv.stride(0),
            w_scale_inv.stride(1),
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_K=block_k,
            UPCAST=upcast,
        )
    if splits == 1:
        return out[0]
    return out.sum(0).to(out_dtype)


def fp8_block_matmul_scaled_mm(
    x_q: torch.Tensor,
    x_scales: torch.Tensor,
    w_q: torch.Tensor,
    w_scale_inv: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    w_scale_mm: torch.Tensor | None = None,
) -> torch.Tensor:
    """One `torch.nn.functional.scaled_mm` call (sm90; BlockWise1x128 activations ×
    BlockWise128x128 weights): 128×128 blocks, K and N multiples of 128 (`pad_fp8_weight`),
    bf16 or fp32 output. Activation scales not strided (1, M) already are copied into that
    layout; `w_scale_mm` is `scaled_mm_weight_scales(w_scale_inv)`, computed when not given."""
    _check_fp8_operands(x_q, x_scales, w_q, w_scale_inv, SCALED_MM_BLOCK, out_dtype)
    if not scaled_mm_available(x_q):
        raise unavailable(
            "fp8_block_matmul (scaled_mm)",
            x_q,
            "torch's blockwise scaled_mm runs only on sm90 GPUs with CUDA >= 12.9 and a torch "
            "that has F.scaled_mm",
            "impl='triton' on another GPU, or impl='reference' on the CPU",
        )
    if not _scaled_mm_takes(x_q, w_q, SCALED_MM_BLOCK, out_dtype):
        raise ValueError(
            f"scaled_mm needs K and N multiples of 128 (pad_fp8_weight) and a bf16 or fp32 "
            f"output; got K = {x_q.shape[1]}, N = {w_q.shape[0]}, {out_dtype}"
        )
    if w_scale_mm is None:
        w_scale_mm = scaled_mm_weight_scales(w_scale_inv)
    return F.scaled_mm(
        x_q.contiguous(),
        w_q.contiguous().t(),
        to_column_major(x_scales),
        F.ScalingType.BlockWise1x128,
        w_scale_mm,
        F.ScalingType.BlockWise128x128,
        output_dtype=out_dtype,
    )


def fp8_block_matmul(
    x_q: torch.Tensor,
    x_scales: torch.Tensor,
    w_q: torch.Tensor,
    w_scale_inv: torch.Tensor,
    block: tuple[int, int] = SCALED_MM_BLOCK,
    out_dtype: torch.dtype = torch.bfloat16,
    impl: str = "auto",
    w_scale_mm: torch.Tensor | None = None,
) -> torch.Tensor:
    """out [M, N] = Σ_k (x_q · x_scale)[m, k] · (w_q · w_scale)[n, k] in out_dtype, M ≥ 1,
    bias not added. The operands' layouts, and what impl="auto" picks where: docs/precision.md,
    "Kernels"; impl "scaled_mm", "triton" or "reference" forces one, and one the device cannot
    run raises `KernelUnavailable` naming what would work. `w_scale_mm`: see `..._scaled_mm`."""
    check_impl(impl, ("auto", "scaled_mm", "triton", "reference"))
    if impl == "auto":
        impl = _choose_fp8_impl(x_q, w_q, block, out_dtype)
    if impl == "scaled_mm":
        if tuple(block) != SCALED_MM_BLOCK:
            raise ValueError(f"scaled_mm takes 128x128 weight blocks only, got {block}")
        return fp8_block_matmul_scaled_mm(x_q, x_scales, w_q, w_scale_inv, out_dtype, w_scale_mm)
    if impl == "triton":
        return fp8_block_matmul_triton(x_q, x_scales, w_q, w_scale_inv, block, out_dtype)
    return fp8_block_matmul_reference(x_q, x_scales, w_q, w_scale_inv, block, out_dtype)


def _choose_fp8_impl(x_q, w_q, block, out_dtype) -> str:
    if not x_q.is_cuda:
        return "reference"
    if triton_runs_on(x_q):
        return "triton"
    if _scaled_mm_takes(x_q, w_q, block, out_dtype):
        return "scaled_mm"
    raise unavailable(
        "fp8_block_matmul",
        x_q,
        f"{why_no_triton(x_q)}, and torch's one-call blockwise scaled_mm "
        + (
            "does not take these operands (it needs 128x128 blocks, K and N multiples of 128, "
            "a bf16 or fp32 output)"
            if scaled_mm_available(x_q)
            else "runs only on sm90 GPUs (CUDA >= 12.9)"
        ),
        "install Triton (pip install 'asyncfp8[triton]') for the Triton GEMM on any CUDA GPU; "
        "on sm90, 128x128 blocks with pad_fp8_weight; or run the engine on the CPU",
    )
