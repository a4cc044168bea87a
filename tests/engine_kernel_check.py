"""Run under TRITON_INTERPRET=1 (tests/test_engine_kernels.py does, in a subprocess: the
variable must be set before triton is imported): the Triton kernels of the formats
(asyncfp8/precision/<format>/) against their torch references on random shapes, odd ones
and batch 1 included.

    TRITON_INTERPRET=1 python tests/engine_kernel_check.py quant|fused|fp8_gemm|int8_gemm|attention

Prints one line per mismatch and a summary line `<n> cases checked, <m> mismatches,
worst <ratio>` (the largest error seen as a fraction of what the tolerance allows); exits
1 on any mismatch. The tolerances, and why they are what they are, are with each check.
"""

from __future__ import annotations

import sys

import torch

from asyncfp8.precision.fp8 import (
    FP8BlockLinear,
    dequantize_blockwise,
    quantize_blockwise_reference,
)
from asyncfp8.precision.fp8.fused import fp8_linear_fused
from asyncfp8.precision.fp8.gemm import fp8_block_matmul_reference, fp8_block_matmul_triton
from asyncfp8.precision.fp8.quant import (
    fake_quantize_activations_fp8,
    quantize_activations_fp8,
    quantize_activations_fp8_reference,
    to_column_major,
)
from asyncfp8.precision.fp8_kv.attention import (
    fp8_kv_decode_attention_reference,
    fp8_kv_decode_attention_triton,
)
from asyncfp8.precision.int8 import Int8Linear, quantize_per_channel_reference
from asyncfp8.precision.int8.fused import int8_linear_fused
from asyncfp8.precision.int8.gemm import int8_matmul_reference, int8_matmul_triton
from asyncfp8.precision.int8.quant import quantize_activations_int8

FP8 = torch.float8_e4m3fn


class Report:
    def __init__(self):
        self.checked = self.failures = 0
        self.worst = 0.0

    def exact(self, label: str, same: bool) -> None:
        self.checked += 1
        if not same:
            self.failures += 1
            print(f"{label}: not bit-identical")

    def within(self, label: str, error: torch.Tensor, allowed: torch.Tensor) -> None:
        """error <= allowed elementwise; records the worst error/allowed ratio."""
        self.checked += 1
        ratio = (error / allowed).max().item() if error.numel() else 0.0
        self.worst = max(self.worst, ratio)
        if not ratio <= 1.0:
            self.failures += 1
            print(f"{label}: error {error.max().item():.3g} is {ratio:.3g}x the tolerance")

    def finish(self) -> int:
        print(f"{self.checked} cases checked, {self.failures} mismatches, worst {self.worst:.3g}")
        return 1 if self.failures else 0


def activations(rows: int, cols: int, generator: torch.Generator) -> torch.Tensor:
    # Rows of very different magnitudes (every e4m3 exponent is reached), exact zeros, a
    # zero row (the 1e-10 amax floor) and values at the e4m3 rounding ties.
    x = torch.randn(rows, cols, generator=generator) * torch.logspace(-6, 3, rows)[:, None]
    x[:, ::7] = 0.0
    if rows > 2:
        x[1] = 0.0
        ties = torch.tensor([448.0, 17.0, 19.0, 9.5, 2**-7 + 2**-10, -17.0, 3 * 2**-10])
        x[2, : min(cols, 7)] = ties[: min(cols, 7)]
    return x


# --- activation quantizer: bit for bit -----------------------------------------------------
QUANT_CASES = [  # (tokens, K, group)
    (1, 128, 128),
    (1, 7, 128),
    (3, 1536, 128),
    (5, 300, 128),
    (4, 96, 32),
    (3, 200, 48),  # a group that is not a power of two
    (2, 64, 1),
    (9, 129, 64),
]


def check_quant(report: Report, generator: torch.Generator) -> None:
    # Exactness is possible and required: the same IEEE divisions, floor, clamp and
    # round-to-nearest-even as the reference (and today's precision.modules quantizer).
    for tokens, cols, group in QUANT_CASES:
        base = activations(tokens, cols, generator)
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            x = base.clamp(-6e4, 6e4).to(dtype)
            for column_major in (False, True):
                q, s = quantize_activations_fp8(x, group, column_major, impl="triton")
                q_ref, s_ref = quantize_activations_fp8_reference(x, group, column_major)
                label = f"quant {tokens}x{cols} group {group} {dtype} column_major={column_major}"
                report.exact(
                    label,
                    torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
                    and torch.equal(s, s_ref)
                    and (not column_major or s.stride() == (1, tokens)),
                )
    # A strided input (a column slice) reads the same values.
    x = activations(4, 320, generator)
    q, s = quantize_activations_fp8(x[:, 32:288], 128, impl="triton")
    q_ref, s_ref = quantize_activations_fp8_reference(x[:, 32:288].contiguous(), 128)
    report.exact("quant strided", torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)))


# --- FP8 block GEMM: fp32 summation order -----------------------------------------------
FP8_CASES = [  # (M, N, K, (bn, bk), split_k)
    (1, 256, 384, (128, 128), None),
    (1, 200, 300, (128, 128), 1),
    (5, 200, 300, (128, 128), 3),
    (17, 130, 129, (128, 128), 2),
    (3, 96, 160, (64, 32), 1),
    (2, 50, 96, (48, 48), 2),  # bk 48: K tiles of 16, run as exact fp16 tiles
    (33, 40, 64, (1, 64), 1),  # per-row weight scales
    (2, 33, 256, (128, 128), 1),
]


def check_fp8_gemm(report: Report, generator: torch.Generator) -> None:
    # Tolerance: both sides form exact e4m3 products and add them in fp32, in different
    # orders (the reference per K block inside torch._scaled_mm, the kernel per tile
    # inside tl.dot, and K splits added at the end) and multiply the scales in at
    # different points. fp32 rounding bounds the difference by K·2^-24·Σ|x·w| per output
    # in the worst case (2e-5·Σ|x·w| at K = 384); measured on these cases: ≤ 8e-7·Σ|x·w|
    # (either side against float64 too), so 4e-6·Σ|x·w| is allowed. bf16 outputs may then
    # land on neighbouring bf16
    # values: one bf16 step (2^-7 relative at most) more; Triton's interpreter also
    # truncates fp32 -> bf16 where the GPU rounds to nearest even (as torch does).
    for m, n, k, block, split_k in FP8_CASES:
        x = activations(m, k, generator).clamp(-1e3, 1e3)
        w = torch.randn(n, k, generator=generator) * torch.logspace(-3, 0, n)[:, None]
        w_q, w_scale = quantize_blockwise_reference(w, block)
        x_q, x_scale = quantize_activations_fp8_reference(x, block[1])
        x_deq = x_q.double() * x_scale.double().repeat_interleave(block[1], 1)[:, :k]
        w_scales = w_scale.double().repeat_interleave(block[0], 0)[:n]
        w_deq = w_q.double() * w_scales.repeat_interleave(block[1], 1)[:, :k]
        magnitude = (x_deq.abs() @ w_deq.abs().t()).float()
        for out_dtype in (torch.float32, torch.bfloat16):
            ref = fp8_block_matmul_reference(x_q, x_scale, w_q, w_scale, block, out_dtype)
            got = fp8_block_matmul_triton(
                x_q, x_scale, w_q, w_scale, block, out_dtype, split_k=split_k
            )
            allowed = 4e-6 * magnitude + 1e-30
            if out_dtype == torch.bfloat16:
                allowed = allowed + ref.float().abs() * 2**-7
            label = f"fp8 gemm {m}x{n}x{k} block {block} split {split_k} {out_dtype}"
            report.within(label, (got.float() - ref.float()).abs(), allowed)
        # Column-major activation scales (the sm90 layout) read the same numbers.
        got = fp8_block_matmul_triton(
            x_q, to_column_major(x_scale), w_q, w_scale, block, torch.float32, split_k
        )
        ref = fp8_block_matmul_triton(x_q, x_scale, w_q, w_scale, block, torch.float32, split_k)
        report.exact(f"fp8 gemm {m}x{n}x{k} column-major scales", torch.equal(got, ref))


# --- INT8 GEMM: bit for bit -------------------------------------------------------------
INT8_CASES = [  # (M, N, K, split_k)
    (1, 64, 128, None),
    (1, 33, 100, 1),
    (3, 50, 97, 2),
    (17, 40, 256, 3),
    (40, 24, 64, 1),
]


def check_int8_gemm(report: Report, generator: torch.Generator) -> None:
    # Exactness is possible and required: int8 products summed in int32 are exact on both
    # sides, and the fp32 epilogue (float(sum) · x scale · w scale) is the same operations
    # in the same order. Except for bf16 outputs here: Triton's interpreter truncates
    # fp32 -> bf16 (the GPU rounds to nearest even, as torch; test_engine_kernels.py's GPU
    # test asserts those bits), so they may differ by one bf16 step (2^-7 relative).
    for m, n, k, split_k in INT8_CASES:
        x_q = torch.randint(-128, 128, (m, k), generator=generator, dtype=torch.int8)
        w_q = torch.randint(-128, 128, (n, k), generator=generator, dtype=torch.int8)
        x_q[0, :] = 127  # the largest sums
        w_q[0, :] = -128
        x_scale = torch.rand(m, 1, generator=generator) * 1e-2
        w_scale = torch.rand(n, 1, generator=generator) * 1e-3
        for out_dtype in (torch.float32, torch.float16, torch.bfloat16):
            ref = int8_matmul_reference(x_q, x_scale, w_q, w_scale, out_dtype)
            got = int8_matmul_triton(x_q, x_scale, w_q, w_scale, out_dtype, split_k=split_k)
            label = f"int8 gemm {m}x{n}x{k} split {split_k} {out_dtype}"
            if out_dtype == torch.bfloat16:
                error = (got.float() - ref.float()).abs()
                report.within(label, error, ref.float().abs() * 2**-7 + 1e-30)
            else:
                report.exact(label, torch.equal(got, ref))


# --- FP8-KV decode attention: fp32 softmax order -----------------------------------------
ATTENTION_CASES = [  # (B, Hq, Hkv, Tmax, D, splits)
    (1, 1, 1, 16, 16, 1),
    (1, 12, 2, 50, 32, None),
    (2, 6, 2, 37, 24, 1),  # head dim not a power of two
    (3, 8, 8, 64, 16, 3),
    (2, 4, 1, 100, 64, 4),
    (1, 16, 2, 33, 32, 2),
]


def check_attention(report: Report, generator: torch.Generator) -> None:
    # Tolerance: the interpreter takes the dots in fp32 (on the GPU they are TF32, which
    # holds every e4m3 and bf16 input exactly and rounds the softmax weights to 2^-11),
    # and the online softmax rescales the running sums in another order than torch's
    # softmax: fp32 rounding, measured ≤ 5e-7·max|v·v_scale|, 2e-6 allowed. bf16/fp16
    # outputs add one step of the output format (2^-7 / 2^-10 relative at most; the
    # interpreter truncates to bf16 where the GPU rounds to nearest).
    for batch, q_heads, kv_heads, t_max, dim, splits in ATTENTION_CASES:
        k_cache = (torch.randn(batch, kv_heads, t_max, dim, generator=generator) * 100).to(FP8)
        v_cache = (torch.randn(batch, kv_heads, t_max, dim, generator=generator) * 100).to(FP8)
        k_scale = torch.tensor(0.02)
        v_scale = torch.tensor(0.03)
        q = torch.randn(batch, q_heads, dim, generator=generator) * 2
        valid = torch.rand(batch, t_max, generator=generator) > 0.2
        valid[0, : t_max // 3] = False  # left padding
        valid[0, -1] = True
        if batch > 2:
            valid[2] = False  # a sequence with nothing to attend: zeros
        lengths = torch.randint(1, t_max + 1, (batch,), generator=generator)
        v_max = (v_cache.float().abs().max() * v_scale).item()
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            for kv_len in (None, lengths):
                args = (q.to(dtype), k_cache, v_cache, k_scale, v_scale, valid, None, kv_len)
                ref = fp8_kv_decode_attention_reference(*args)
                got = fp8_kv_decode_attention_triton(*args, num_splits=splits)
                allowed = torch.full_like(ref, 2e-6 * v_max, dtype=torch.float32)
                if dtype != torch.float32:
                    step = 2**-7 if dtype == torch.bfloat16 else 2**-10
                    allowed = allowed + ref.float().abs() * step
                label = (
                    f"attention B{batch} Hq{q_heads} Hkv{kv_heads} T{t_max} D{dim} "
                    f"splits {splits} {dtype} kv_len={kv_len is not None}"
                )
                report.within(label, (got.float() - ref.float()).abs(), allowed)
                if batch > 2:
                    report.exact(label + " (empty sequence -> 0)", bool((got[2] == 0).all()))
    # A cache laid out [B, Tmax, Hkv, D] and viewed as [B, Hkv, Tmax, D] (strided).
    cache = (torch.randn(2, 40, 2, 32, generator=generator) * 100).to(FP8)
    q = torch.randn(2, 4, 32, generator=generator)
    valid = torch.ones(2, 40, dtype=torch.bool)
    scales = (torch.tensor(0.01), torch.tensor(0.02))
    args = (q, cache.transpose(1, 2), cache.transpose(1, 2), *scales, valid)
    ref = fp8_kv_decode_attention_reference(*args)
    got = fp8_kv_decode_attention_triton(*args, num_splits=2)
    report.within(
        "attention strided cache",
        (got - ref).abs(),
        torch.full_like(ref, 2e-6 * (cache.float().abs().max() * 0.02).item()),
    )
    # The decoder's mask: the first 40 positions of a wider buffer (row stride 64), read
    # in place.
    buffer = torch.rand(2, 64, generator=generator) > 0.3
    buffer[:, 39] = True
    args = (q, cache.transpose(1, 2), cache.transpose(1, 2), *scales, buffer[:, :40])
    ref = fp8_kv_decode_attention_reference(*args[:-1], buffer[:, :40].contiguous())
    got = fp8_kv_decode_attention_triton(*args, num_splits=2)
    report.within(
        "attention mask sliced from a wider buffer",
        (got - ref).abs(),
        torch.full_like(ref, 2e-6 * (cache.float().abs().max() * 0.02).item()),
    )


# --- the fused linears: one kernel, the unfused path's bits --------------------------------
FUSED_CASES = [  # (M, N, K, (bn, bk))
    (1, 64, 128, (128, 128)),
    (1, 200, 300, (128, 128)),  # K not a multiple of the group: masked, as if zero-padded
    (5, 130, 256, (128, 128)),
    (17, 40, 129, (128, 128)),
    (40, 33, 96, (64, 32)),
    (3, 48, 64, (1, 64)),  # per-row weight scales
]


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a, b)


def check_fused(report: Report, generator: torch.Generator) -> None:
    # Exactness is possible and required in fp32: the fused kernels run the quantizer's
    # operations, the GEMM's tiles and the epilogue in the unfused path's order (FP8: the
    # Triton GEMM with one K split; INT8: exact int32 sums either way). A 16-bit output is
    # that fp32 result cast: one step of its format (the interpreter truncates to bf16).
    for m, n, k, block in FUSED_CASES:
        x = activations(m, k, generator).clamp(-1e3, 1e3)
        w = torch.randn(n, k, generator=generator) * torch.logspace(-3, 0, n)[:, None]
        bias = torch.randn(n, generator=generator)
        w_q, w_scale = quantize_blockwise_reference(w, block)
        w8, w8_scale = quantize_per_channel_reference(w)
        for b in (None, bias):
            label = f"{m}x{n}x{k} {block} bias={b is not None}"
            x_q, x_scale = quantize_activations_fp8(x, block[1], impl="triton")
            unfused = fp8_block_matmul_triton(
                x_q, x_scale, w_q, w_scale, block, torch.float32, split_k=1
            )
            unfused = unfused if b is None else unfused + b
            got = fp8_linear_fused(x, w_q, w_scale, b, block, n, torch.float32)
            report.exact(f"fused fp8 {label}", same(got, unfused))
            x8_q, x8_scale = quantize_activations_int8(x)
            unfused8 = int8_matmul_triton(x8_q, x8_scale, w8, w8_scale, torch.float32, split_k=1)
            unfused8 = unfused8 if b is None else unfused8 + b
            got8 = int8_linear_fused(x, w8, w8_scale, b, torch.float32)
            report.exact(f"fused int8 {label}", same(got8, unfused8))
            # bf16 in, bf16 out: the fp32 result of the same bf16 values, cast
            x16 = x.bfloat16()
            pairs = (
                (
                    "fp8",
                    fp8_linear_fused(x16, w_q, w_scale, b, block, n),
                    fp8_linear_fused(x16.float(), w_q, w_scale, b, block, n),
                ),
                (
                    "int8",
                    int8_linear_fused(x16, w8, w8_scale, b),
                    int8_linear_fused(x16.float(), w8, w8_scale, b),
                ),
            )
            for kind, half, want in pairs:
                report.exact(f"fused {kind} writes bf16", half.dtype == torch.bfloat16)
                report.within(
                    f"fused {kind} {label} bf16",
                    (half.float() - want).abs(),
                    want.abs() * 2**-7 + 1e-30,
                )
    check_fused_modules(report, generator)


def check_fused_modules(report: Report, generator: torch.Generator) -> None:
    # The engine's layers with `fused` on give what they give with it off (the CPU's
    # reference GEMMs): INT8 the same bits; FP8 within the FP8 GEMM check's tolerance
    # (the reference adds per K block inside torch._scaled_mm).
    n, k = 72, 200
    w = torch.randn(n, k, generator=generator) * 0.05
    bias = torch.randn(n, generator=generator)
    w_q, w_scale = quantize_blockwise_reference(w)
    w8, w8_scale = quantize_per_channel_reference(w)
    for b in (None, bias):
        fp8_layer = FP8BlockLinear("w", w_q, w_scale, b)
        int8_layer = Int8Linear("w", w8, w8_scale, b)
        x = activations(6, k, generator).clamp(-10, 10).view(2, 3, k)
        for layer in (fp8_layer, int8_layer):
            assert not layer.fused  # CPU tensors: the unfused path unless asked
            unfused = layer(x)
            layer.fused = True
            fused = layer(x)
            layer.fused = False
            label = f"{type(layer).__name__} fused bias={b is not None}"
            if layer is int8_layer:
                report.exact(label, torch.equal(fused, unfused))
            else:
                x_deq = fake_quantize_activations_fp8(x.view(6, k), 128).double()
                magnitude = x_deq.abs() @ dequantize_blockwise(w_q, w_scale).double().abs().t()
                report.within(
                    label, (fused - unfused).abs().view(6, n), 4e-6 * magnitude.float() + 1e-30
                )


CHECKS = {
    "quant": check_quant,
    "fused": check_fused,
    "fp8_gemm": check_fp8_gemm,
    "int8_gemm": check_int8_gemm,
    "attention": check_attention,
}


def main(names: list[str]) -> int:
    report = Report()
    for name in names or list(CHECKS):
        CHECKS[name](report, torch.Generator().manual_seed(0))
    return report.finish()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
