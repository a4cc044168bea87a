"""INT8 quantizers: weights per output channel, activations per token (symmetric).

Weights: s = max_row(|w|)/127 (floored at 1e-10/127), q = round(w / s) clamped to
[−128, 127] (round half to even): int8 [M, N] and fp32 scales [M, 1]. The Triton kernel
(CUDA, and the CPU under `TRITON_INTERPRET=1`) gives the torch reference's bytes.
"""

from __future__ import annotations

import torch

from ..kernel_support import (
    divide_exactly,
    triton,
    triton_enabled,
    triton_runs_on,
    unavailable,
    why_no_triton,
)
from ..policy import check_weight

INT8_MAX = 127.0
AMAX_FLOOR = 1e-10
SCALE_SUFFIX = "_scale"

if triton is not None:
    import triton.language as tl

    from ..kernel_support import round_half_even

    @triton.jit
    def _int8_per_channel_kernel(w_ptr, q_ptr, scale_ptr, cols, BLOCK_N: tl.constexpr):
        row = tl.program_id(0)
        running = tl.zeros([BLOCK_N], dtype=tl.float32)
        for start in range(0, cols, BLOCK_N):
            c = start + tl.arange(0, BLOCK_N)
            w = tl.load(w_ptr + row * cols + c, mask=c < cols, other=0.0).to(tl.float32)
            running = tl.maximum(running, tl.abs(w))
        scale = tl.div_rn(tl.maximum(tl.max(running), 1e-10), 127.0)
        for start in range(0, cols, BLOCK_N):
            c = start + tl.arange(0, BLOCK_N)
            w = tl.load(w_ptr + row * cols + c, mask=c < cols, other=0.0).to(tl.float32)
            q = tl.clamp(round_half_even(tl.div_rn(w, scale)), -128.0, 127.0)
            tl.store(q_ptr + row * cols + c, q.to(tl.int8), mask=c < cols)
        tl.store(scale_ptr + row, scale)


def quantize_per_channel_triton(
    w: torch.Tensor, block_n: int = 1024
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernel (CUDA, or the CPU under TRITON_INTERPRET=1); one program per row."""
    if not triton_runs_on(w):
        raise unavailable(
            "quantize_per_channel (Triton)", w, why_no_triton(w), "the torch reference, any device"
        )
    w = w.contiguous()
    rows, cols = w.shape
    q = torch.empty((rows, cols), dtype=torch.int8, device=w.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=w.device)
    block_n = min(block_n, triton.next_power_of_2(cols))
    _int8_per_channel_kernel[(rows,)](w, q, scale, cols, BLOCK_N=block_n)
    return q, scale


def quantize_per_channel_reference(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    w = w.float()
    scale = divide_exactly(w.abs().amax(dim=1, keepdim=True).clamp_min(AMAX_FLOOR), INT8_MAX)
    q = torch.round(w / scale).clamp(-128, 127).to(torch.int8)
    return q, scale


def quantize_per_channel(
    w: torch.Tensor, name: str = "weight"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 [M, N], scale fp32 [M, 1]) with w ≈ q · scale row by row."""
    check_weight(name, w)
    if triton_enabled(w):
        return quantize_per_channel_triton(w)
    return quantize_per_channel_reference(w)


def dequantize_per_channel(
    q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    if scale.shape != (q.shape[0], 1):
        raise ValueError(
            f"scale has shape {tuple(scale.shape)}; "
            f"a {tuple(q.shape)} weight needs ({q.shape[0]}, 1)"
        )
    return (q.float() * scale.float()).to(dtype)


def quantize_activations_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (int8 [T, K], fp32 per-token scales [T, 1])."""
    x = x.float()
    scale = divide_exactly(x.abs().amax(-1, keepdim=True).clamp_min(AMAX_FLOOR), INT8_MAX)
    return torch.round(x / scale).clamp(-128, 127).to(torch.int8), scale
