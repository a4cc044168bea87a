"""Run under TRITON_INTERPRET=1 (tests/test_precision.py does): the Triton kernels must
produce the same bytes as the torch references on random shapes, odd ones included.
Prints one line per mismatch and exits 1 if there is any."""

import sys

import torch

from asyncfp8.precision.fp8 import quantize_blockwise_reference
from asyncfp8.precision.fp8.quant import quantize_blockwise_triton
from asyncfp8.precision.int8 import quantize_per_channel_reference
from asyncfp8.precision.int8.quant import quantize_per_channel_triton

SHAPES = [(128, 128), (256, 384), (64, 352), (200, 129), (1, 7), (300, 260), (129, 1), (17, 1000)]


def ties() -> torch.Tensor:
    """Values exactly halfway between two representable results, where rounding to
    nearest *even* decides: with amax 448 (FP8) and 127 (INT8) the scales are exactly 1."""
    fp8_row = [448.0, 17.0, 19.0, 9.0, 9.5, 2**-7 + 2**-10, -17.0, 0.5 + 2**-5, 3 * 2**-10]
    int8_row = [127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, 0.0]
    return torch.tensor([fp8_row, int8_row])


def cases(generator):
    yield ties()
    for rows, cols in SHAPES:
        # Rows of very different magnitudes, and exact zeros, to reach every e4m3 range.
        w = torch.randn(rows, cols, generator=generator) * torch.logspace(-6, 2, rows)[:, None]
        w[:, ::5] = 0.0
        yield w


def main() -> int:
    generator = torch.Generator().manual_seed(0)
    failures = checked = 0
    for case in cases(generator):
        rows, cols = case.shape
        for dtype in (torch.float32, torch.bfloat16):
            w = case.to(dtype)
            checked += 1
            q, scale = quantize_blockwise_triton(w)
            q_ref, scale_ref = quantize_blockwise_reference(w)
            if not (
                torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
                and torch.equal(scale, scale_ref)
            ):
                failures += 1
                print(
                    f"fp8 {rows}x{cols} {dtype}: "
                    f"{(q.view(torch.uint8) != q_ref.view(torch.uint8)).sum()} bytes differ"
                )
            q8, scale8 = quantize_per_channel_triton(w)
            q8_ref, scale8_ref = quantize_per_channel_reference(w)
            if not (torch.equal(q8, q8_ref) and torch.equal(scale8, scale8_ref)):
                failures += 1
                print(f"int8 {rows}x{cols} {dtype}: {(q8 != q8_ref).sum()} values differ")
    print(f"{checked} shapes x dtypes checked, {failures} mismatches")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
