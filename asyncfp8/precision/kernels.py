"""Triton kernels for the weight quantizers, used on CUDA; the torch references in
fp8.py / int8.py run everywhere else. The kernels reproduce the references bit for
bit: IEEE division (`div_rn`, not Triton's default fast division), the same 1e-10
amax floor, round-to-nearest-even casts. On a CPU they run under `TRITON_INTERPRET=1`
(tests/kernel_check.py). `ASYNCFP8_TRITON=0` turns them off.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the `triton` extra is optional
    triton = None


def triton_enabled(tensor: torch.Tensor) -> bool:
    return triton is not None and tensor.is_cuda and os.environ.get("ASYNCFP8_TRITON", "1") != "0"


if triton is not None:

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
        q = _round_to_e4m3_grid(tl.clamp(tl.div_rn(w, scale), -448.0, 448.0))
        tl.store(q_ptr + offsets, q.to(tl.float8e4nv), mask=inside)
        tl.store(scale_ptr + block_row * grid_cols + block_col, scale)

    @triton.jit
    def _round_half_even(x):
        floor = tl.floor(x)
        frac = x - floor
        odd = (floor - 2.0 * tl.floor(floor * 0.5)) != 0.0
        up = (frac > 0.5) | ((frac == 0.5) & odd)
        return tl.where(up, floor + 1.0, floor)

    @triton.jit
    def _round_to_e4m3_grid(x):
        # Round an fp32 already in [-448, 448] to the nearest e4m3 value (ties to even)
        # in fp32, so that the cast below is exact. The cast alone would round too, but
        # Triton's interpreter drops the carry into the exponent (31.8 -> 16, not 32),
        # and the kernel must match the torch reference bit for bit everywhere.
        exponent = ((x.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
        # e4m3 has 3 mantissa bits; below 2^-6 its values are subnormal, spaced 2^-9.
        step_exponent = tl.maximum(exponent, -6) - 3
        step = ((step_exponent + 127) << 23).to(tl.float32, bitcast=True)
        rounded = _round_half_even(x / step) * step
        return tl.where(rounded == 0.0, x * 0.0, rounded)  # keep the sign of zero: -0.0001 -> -0

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
            q = tl.clamp(_round_half_even(tl.div_rn(w, scale)), -128.0, 127.0)
            tl.store(q_ptr + row * cols + c, q.to(tl.int8), mask=c < cols)
        tl.store(scale_ptr + row, scale)


def _require_triton() -> None:
    if triton is None:
        raise RuntimeError("Triton is not installed (pip install 'asyncfp8[triton]')")


def quantize_blockwise_triton(
    w: torch.Tensor, block: tuple[int, int] = (128, 128)
) -> tuple[torch.Tensor, torch.Tensor]:
    _require_triton()
    w = w.contiguous()
    rows, cols = w.shape
    grid = (triton.cdiv(rows, block[0]), triton.cdiv(cols, block[1]))
    q = torch.empty((rows, cols), dtype=torch.float8_e4m3fn, device=w.device)
    scale = torch.empty(grid, dtype=torch.float32, device=w.device)
    _fp8_blockwise_kernel[grid](
        w, q, scale, rows, cols, grid[1], BLOCK_M=block[0], BLOCK_N=block[1]
    )
    return q, scale


def quantize_per_channel_triton(
    w: torch.Tensor, block_n: int = 1024
) -> tuple[torch.Tensor, torch.Tensor]:
    _require_triton()
    w = w.contiguous()
    rows, cols = w.shape
    q = torch.empty((rows, cols), dtype=torch.int8, device=w.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=w.device)
    block_n = min(block_n, triton.next_power_of_2(cols))
    _int8_per_channel_kernel[(rows,)](w, q, scale, cols, BLOCK_N=block_n)
    return q, scale
