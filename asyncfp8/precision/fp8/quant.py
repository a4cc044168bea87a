"""FP8 (e4m3) quantizers: weights per 128x128 block, activations per token per group.

Each has a Triton kernel and a torch reference giving the same bytes: amax floored at 1e-10,
scale = amax / 448 (IEEE division), q = clamp(x / scale, ±448) cast to e4m3 (nearest even).
Layouts and padding: docs/precision.md, "The formats' tensors"."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernel_support import (
    ceil_div,
    check_impl,
    divide_exactly,
    next_power_of_2,
    triton,
    triton_enabled,
    triton_runs_on,
    unavailable,
    why_no_triton,
)
from ..policy import check_weight

FP8_MAX = 448.0  # largest finite float8_e4m3fn
AMAX_FLOOR = 1e-10
BLOCK = (128, 128)  # the weight block (rows, columns); activations group by its columns
GROUP = 128
SCALE_SUFFIX = "_scale_inv"
# float64 too: both paths round x to fp32 first.
ACTIVATION_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)

if triton is not None:
    import triton.language as tl

    from ..kernel_support import round_to_e4m3_grid

    @triton.jit
    def _fp8_blockwise_kernel(
        w_ptr, q_ptr, scale_ptr, rows, cols, grid_cols, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr
    ):
        block_row = tl.program_id(0)
        block_col = tl.program_id(1)
        r = block_row * BLOCK_M + tl.arange(0, BLOCK_M)
        c = block_col * BLOCK_N + tl.arange(0, BLOCK_N)
        inside = (r[:, None] < rows) & (c[None, :] < cols)
        offsets = r[:, None] * cols + c[None, :]
        w = tl.load(w_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
        amax = tl.maximum(tl.max(tl.abs(w)), 1e-10)
        scale = tl.div_rn(amax, 448.0)
        q = round_to_e4m3_grid(tl.clamp(tl.div_rn(w, scale), -448.0, 448.0))
        tl.store(q_ptr + offsets, q.to(tl.float8e4nv), mask=inside)
        tl.store(scale_ptr + block_row * grid_cols + block_col, scale)

    @triton.jit
    def _quantize_activations_kernel(
        x_ptr,
        q_ptr,
        scale_ptr,
        cols,
        stride_x,
        stride_q,
        stride_scale_row,
        stride_scale_group,
        GROUP_SIZE: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        group = tl.program_id(1)
        offsets = tl.arange(0, BLOCK)
        c = group * GROUP_SIZE + offsets
        inside = (offsets < GROUP_SIZE) & (c < cols)
        x = tl.load(x_ptr + row * stride_x + c, mask=inside, other=0.0).to(tl.float32)
        # The same operations as the reference, in the same order: IEEE divisions
        # (div_rn; Triton's default `/` is approximate on the GPU) and an exact e4m3
        # rounding before the cast, so the bytes match it everywhere.
        scale = tl.div_rn(tl.maximum(tl.max(tl.abs(x)), 1e-10), 448.0)
        q = round_to_e4m3_grid(tl.clamp(tl.div_rn(x, scale), -448.0, 448.0))
        tl.store(q_ptr + row * stride_q + c, q.to(tl.float8e4nv), mask=inside)
        tl.store(scale_ptr + row * stride_scale_row + group * stride_scale_group, scale)


# --- weights ----------------------------------------------------------------------------------


def quantize_blockwise_reference(
    w: torch.Tensor, block: tuple[int, int] = BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch reference (any device). See `quantize_blockwise`."""
    rows, cols = w.shape
    block_rows, block_cols = block
    grid_rows, grid_cols = ceil_div(rows, block_rows), ceil_div(cols, block_cols)
    padded = torch.zeros(
        grid_rows * block_rows, grid_cols * block_cols, dtype=torch.float32, device=w.device
    )
    padded[:rows, :cols] = w
    blocks = padded.view(grid_rows, block_rows, grid_cols, block_cols)
    amax = blocks.abs().amax(dim=(1, 3)).clamp_min(AMAX_FLOOR)
    scale = divide_exactly(amax, FP8_MAX)
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(padded.shape)[:rows, :cols].contiguous(), scale


def quantize_blockwise_triton(
    w: torch.Tensor, block: tuple[int, int] = BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernel (CUDA, or the CPU under TRITON_INTERPRET=1); one program per block."""
    if not triton_runs_on(w):
        raise unavailable(
            "quantize_blockwise (Triton)", w, why_no_triton(w), "the torch reference, any device"
        )
    w = w.contiguous()
    rows, cols = w.shape
    grid = (ceil_div(rows, block[0]), ceil_div(cols, block[1]))
    q = torch.empty((rows, cols), dtype=torch.float8_e4m3fn, device=w.device)
    scale = torch.empty(grid, dtype=torch.float32, device=w.device)
    _fp8_blockwise_kernel[grid](
        w, q, scale, rows, cols, grid[1], BLOCK_M=block[0], BLOCK_N=block[1]
    )
    return q, scale


def quantize_blockwise(
    w: torch.Tensor, block: tuple[int, int] = BLOCK, name: str = "weight"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q float8_e4m3fn [M, N], scale_inv fp32 [⌈M/bm⌉, ⌈N/bn⌉]) with w ≈ q · scale_inv
    per block. Uses the Triton kernel on CUDA when it is available, the torch reference
    elsewhere; both give the same bytes."""
    check_weight(name, w)
    if triton_enabled(w):
        return quantize_blockwise_triton(w, block)
    return quantize_blockwise_reference(w, block)


def dequantize_blockwise(
    q: torch.Tensor,
    scale_inv: torch.Tensor,
    block: tuple[int, int] = BLOCK,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """q · scale_inv, each scale broadcast over its block."""
    rows, cols = q.shape
    expected = (ceil_div(rows, block[0]), ceil_div(cols, block[1]))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(
            f"scale_inv has shape {tuple(scale_inv.shape)}; a {rows}x{cols} weight needs {expected}"
        )
    scale = (
        scale_inv.float()
        .repeat_interleave(block[0], 0)[:rows]
        .repeat_interleave(block[1], 1)[:, :cols]
    )
    return (q.float() * scale).to(dtype)


# --- activations ------------------------------------------------------------------------------


def empty_activation_scales(
    rows: int, groups: int, device: torch.device | str, column_major: bool = False
) -> torch.Tensor:
    """An uninitialised fp32 [rows, groups] scale tensor. `column_major=True` gives
    strides (1, rows), the layout torch's blockwise `scaled_mm` wants for its 1×128
    operand, for every rows ≥ 1: `x.t().contiguous().t()` gives (groups, 1) when
    rows = 1, which scaled_mm rejects (gpu/README.md)."""
    if column_major:
        return torch.empty_strided(
            (rows, groups), (1, max(rows, 1)), dtype=torch.float32, device=device
        )
    return torch.empty((rows, groups), dtype=torch.float32, device=device)


def to_column_major(scales: torch.Tensor) -> torch.Tensor:
    """`scales` [rows, groups] with strides (1, rows): itself if it has them, else a copy."""
    rows, groups = scales.shape
    if scales.stride(0) == 1 and (scales.stride(1) == rows or groups == 1):
        return scales
    out = empty_activation_scales(rows, groups, scales.device, column_major=True)
    return out.copy_(scales)


def _check_input(x: torch.Tensor, group: int) -> None:
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [tokens, K], got shape {tuple(x.shape)}")
    if x.dtype not in ACTIVATION_DTYPES:
        raise ValueError(f"x must be fp32, bf16, fp16 or float64, got {x.dtype}")
    if not isinstance(group, int) or group < 1:
        raise ValueError(f"group must be a positive int, got {group!r}")


def quantize_activations_fp8_reference(
    x: torch.Tensor, group: int = GROUP, column_major_scales: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch reference (any device); see `quantize_activations_fp8`. A K that is
    not a multiple of `group` is zero-padded to whole groups first (zeros change no
    amax and quantize to zero), then cropped back."""
    _check_input(x, group)
    tokens, width = x.shape
    groups = ceil_div(width, group)
    padded = F.pad(x.float(), (0, groups * group - width))
    blocks = padded.view(tokens, groups, group)
    scale = divide_exactly(blocks.abs().amax(-1).clamp_min(AMAX_FLOOR), FP8_MAX)
    q = (blocks / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    q = q.view(tokens, groups * group)[:, :width].contiguous()
    if column_major_scales:
        scale = to_column_major(scale)
    return q, scale


def quantize_activations_fp8_triton(
    x: torch.Tensor, group: int = GROUP, column_major_scales: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernel (CUDA, or the CPU under TRITON_INTERPRET=1); see
    `quantize_activations_fp8`. One program per (token, group)."""
    _check_input(x, group)
    if not triton_runs_on(x):
        raise unavailable(
            "quantize_activations_fp8 (Triton)",
            x,
            why_no_triton(x),
            "impl='reference' (torch, any device)",
        )
    if x.stride(1) != 1:
        x = x.contiguous()
    tokens, width = x.shape
    groups = ceil_div(width, group)
    q = torch.empty((tokens, width), dtype=torch.float8_e4m3fn, device=x.device)
    scale = empty_activation_scales(tokens, groups, x.device, column_major_scales)
    if tokens and width:
        _quantize_activations_kernel[(tokens, groups)](
            x,
            q,
            scale,
            width,
            x.stride(0),
            q.stride(0),
            scale.stride(0),
            scale.stride(1),
            GROUP_SIZE=group,
            BLOCK=next_power_of_2(group),
        )
    return q, scale


def quantize_activations_fp8(
    x: torch.Tensor, group: int = GROUP, column_major_scales: bool = False, impl: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic FP8 quantization of activations x [M, K] (fp32 / bf16 / fp16 / float64), per
    token per `group` columns: (q float8_e4m3fn [M, K], scales fp32 [M, ceil(K / group)]), the
    last group quantized as if zero-padded; scales row-major, or strided (1, M) with
    `column_major_scales` (docs/precision.md, "The formats' tensors"). impl: "auto" (Triton on
    CUDA when installed, else the torch reference), "triton" or "reference": the same bytes."""
    check_impl(impl, ("auto", "triton", "reference"))
    if impl == "triton" or (impl == "auto" and x.is_cuda and triton_runs_on(x)):
        return quantize_activations_fp8_triton(x, group, column_major_scales)
    return quantize_activations_fp8_reference(x, group, column_major_scales)


def fake_quantize_activations_fp8(x: torch.Tensor, group: int) -> torch.Tensor:
    """x as the FP8 GEMM sees it (quantized and dequantized per token per group), in fp32,
    any leading shape; K need not be a multiple of `group` (zero padding, as the engine pads)."""
    width = x.shape[-1]
    flat = F.pad(x.reshape(-1, width).float(), (0, -width % group))
    q, scale = quantize_activations_fp8(flat, group)
    dequantized = q.float().view(flat.shape[0], -1, group) * scale[..., None]
    return dequantized.view(flat.shape)[:, :width].reshape(x.shape)
