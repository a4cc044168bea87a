"""The formats' GEMM, activation and attention kernels (asyncfp8/precision/fp8, int8,
fp8_kv): the Triton kernels against their torch references (under
TRITON_INTERPRET=1, in a subprocess: tests/engine_kernel_check.py, whose checks state
their tolerances), the references against float64 and against today's modules, the scale
layouts, the errors for paths a device cannot run, and (marked `gpu`, skipped without
CUDA) the GPU paths against each other."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from asyncfp8.precision import kernel_support
from asyncfp8.precision.fp8 import FP8BlockLinear, quantize_blockwise_reference
from asyncfp8.precision.fp8.fused import fp8_linear_fused
from asyncfp8.precision.fp8.gemm import (
    fp8_block_matmul,
    fp8_block_matmul_reference,
    pad_fp8_weight,
    scaled_mm_available,
    scaled_mm_weight_scales,
    triton_fp8_block_k,
)
from asyncfp8.precision.fp8.quant import (
    empty_activation_scales,
    quantize_activations_fp8,
    quantize_activations_fp8_reference,
    to_column_major,
)
from asyncfp8.precision.fp8_kv.attention import (
    fp8_kv_decode_attention,
    fp8_kv_decode_attention_reference,
)
from asyncfp8.precision.int8 import quantize_per_channel_reference
from asyncfp8.precision.int8.fused import int8_linear_fused
from asyncfp8.precision.int8.gemm import int8_matmul
from asyncfp8.precision.int8.quant import quantize_activations_int8
from asyncfp8.precision.kernel_support import KernelUnavailable

REPO = Path(__file__).resolve().parents[1]
FP8 = torch.float8_e4m3fn


def float64_matmul(x_q, x_scale, w_q, w_scale, block):
    """(x_q · x_scale)(w_q · w_scale)ᵀ in float64, each scale broadcast over its block."""
    k, n = x_q.shape[1], w_q.shape[0]
    bn, bk = block
    x = x_q.double() * x_scale.double().repeat_interleave(bk, 1)[:, :k]
    w_scales = w_scale.double().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    w = w_q.double() * w_scales
    return x @ w.t(), x.abs() @ w.abs().t()


def fp8_operands(m, n, k, block, seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=generator) * torch.logspace(-2, 2, m)[:, None]
    w = torch.randn(n, k, generator=generator) * 0.05
    w_q, w_scale = quantize_blockwise_reference(w, block)
    x_q, x_scale = quantize_activations_fp8_reference(x, block[1])
    return x, x_q, x_scale, w_q, w_scale


# --- the Triton kernels, under the interpreter ----------------------------------------------


def under_the_interpreter(script: str, *args: str) -> subprocess.CompletedProcess:
    """tests/`script` run with TRITON_INTERPRET=1 (read when triton is imported: hence a
    process of its own), from the checkout under test."""
    pytest.importorskip("triton")
    env = {
        **os.environ,
        "TRITON_INTERPRET": "1",
        "ASYNCFP8_TRITON": "1",
        # The checkout under test, before any installed copy of asyncfp8.
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    return subprocess.run(
        [sys.executable, str(REPO / "tests" / script), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.slow
@pytest.mark.parametrize("check", ["quant", "fused", "fp8_gemm", "int8_gemm", "attention"])
def test_triton_kernels_match_the_torch_references_under_the_interpreter(check):
    result = under_the_interpreter("engine_kernel_check.py", check)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert " 0 mismatches" in result.stdout
    checked = int(result.stdout.strip().splitlines()[-1].split()[0])
    assert checked >= 10  # the cases ran (a check that found nothing to compare fails here)


# --- activation quantizer and scale layouts --------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("tokens", "cols"), [(1, 128), (5, 384), (3, 300)])
def test_reference_quantizer_gives_the_bytes_of_the_formula(dtype, tokens, cols):
    x = (torch.randn(tokens, cols) * torch.logspace(-4, 3, tokens)[:, None]).to(dtype)
    # DESIGN.md §4 written out, on x zero-padded to whole groups of 128.
    padded = torch.nn.functional.pad(x.float(), (0, -cols % 128))
    groups = padded.view(tokens, -1, 128)
    s_old = groups.abs().amax(-1).clamp_min(1e-10) / 448.0
    q_old = (groups / s_old[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn).view(tokens, -1)
    q, s = quantize_activations_fp8_reference(x, 128)
    assert q.shape == (tokens, cols) and s.shape == (tokens, math.ceil(cols / 128))
    assert torch.equal(q.view(torch.uint8), q_old[:, :cols].view(torch.uint8))
    assert torch.equal(s, s_old)
    # impl="auto" on the CPU is the reference.
    q_auto, s_auto = quantize_activations_fp8(x, 128)
    assert torch.equal(q_auto.view(torch.uint8), q.view(torch.uint8)) and torch.equal(s_auto, s)


@pytest.mark.parametrize("rows", [1, 2, 7, 64])
def test_column_major_scales_have_strides_1_m_including_m_1(rows):
    empty = empty_activation_scales(rows, 12, "cpu", column_major=True)
    assert empty.shape == (rows, 12) and empty.stride() == (1, rows)
    x = torch.randn(rows, 12 * 128)
    q_row, s_row = quantize_activations_fp8(x, 128)
    q_col, s_col = quantize_activations_fp8(x, 128, column_major_scales=True)
    assert s_row.stride() == (12, 1)
    assert s_col.stride() == (1, rows)
    assert torch.equal(s_col, s_row) and torch.equal(
        q_col.view(torch.uint8), q_row.view(torch.uint8)
    )
    moved = to_column_major(s_row)
    assert moved.stride() == (1, rows) and torch.equal(moved, s_row)
    assert to_column_major(s_col) is s_col  # already laid out: no copy
    # What gpu/README.md warns about: the transpose trick is not (1, M) at M = 1.
    if rows == 1:
        assert s_row.t().contiguous().t().stride() != (1, rows)


def test_scaled_mm_weight_scales_pad_k_blocks_to_a_multiple_of_4_and_transpose():
    scale_inv = torch.rand(12, 70) + 0.5  # Qwen2.5-1.5B's down_proj: K/128 = 70
    laid_out = scaled_mm_weight_scales(scale_inv)
    assert laid_out.shape == (72, 12) and laid_out.stride() == (1, 72)
    assert torch.equal(laid_out[:70], scale_inv.t())
    assert torch.equal(laid_out[70:], torch.zeros(2, 12))
    already = scaled_mm_weight_scales(torch.rand(2, 8))
    assert already.shape == (8, 2) and already.stride() == (1, 8)


# --- FP8 GEMM reference --------------------------------------------------------------------------


@pytest.mark.parametrize(("m", "n", "k"), [(1, 200, 352), (5, 256, 384), (3, 130, 129)])
def test_reference_fp8_gemm_is_todays_fp8_block_linear_bit_for_bit(m, n, k):
    x, x_q, x_scale, w_q, w_scale = fp8_operands(m, n, k, (128, 128))
    module = FP8BlockLinear("w", w_q, w_scale, None, real=True)
    with torch.no_grad():
        expected = module(x)
    got = fp8_block_matmul_reference(x_q, x_scale, w_q, w_scale, (128, 128), torch.float32)
    assert torch.equal(got, expected)
    column_major = to_column_major(x_scale)  # the sm90 layout reads the same numbers
    assert torch.equal(
        fp8_block_matmul_reference(x_q, column_major, w_q, w_scale, (128, 128), torch.float32),
        expected,
    )
    assert torch.equal(
        fp8_block_matmul(x_q, x_scale, w_q, w_scale, out_dtype=torch.float32), expected
    )


@pytest.mark.parametrize(
    ("m", "n", "k", "block"),
    [
        (1, 256, 384, (128, 128)),
        (7, 200, 300, (128, 128)),
        (4, 96, 160, (64, 32)),
        (2, 33, 70, (1, 16)),
    ],
)
def test_reference_fp8_gemm_matches_a_float64_dequantized_matmul(m, n, k, block):
    # Exact e4m3 products added in fp32: the difference from float64 is fp32 rounding,
    # at worst K·2^-24·Σ|x·w| per output (2.3e-5·Σ|x·w| at K = 384); measured ≤ 1e-7·Σ|x·w|.
    # 2e-6·Σ|x·w| allowed. A dropped or doubled block would be off by whole products.
    _, x_q, x_scale, w_q, w_scale = fp8_operands(m, n, k, block, seed=1)
    exact, magnitude = float64_matmul(x_q, x_scale, w_q, w_scale, block)
    got = fp8_block_matmul_reference(x_q, x_scale, w_q, w_scale, block, torch.float32)
    assert got.shape == (m, n)
    assert ((got.double() - exact).abs() <= 2e-6 * magnitude + 1e-30).all()


def test_a_padded_weight_gives_the_same_output_cropped():
    _, x_q, x_scale, w_q, w_scale = fp8_operands(3, 200, 256, (128, 128), seed=2)
    padded = pad_fp8_weight(w_q)
    assert padded.shape == (256, 256) and padded.dtype == FP8
    assert torch.equal(padded[:200].view(torch.uint8), w_q.view(torch.uint8))
    assert not padded[200:].view(torch.uint8).any()
    full = fp8_block_matmul(x_q, x_scale, padded, w_scale, out_dtype=torch.float32)
    assert full.shape == (3, 256) and not full[:, 200:].any()
    assert torch.equal(
        full[:, :200], fp8_block_matmul(x_q, x_scale, w_q, w_scale, out_dtype=torch.float32)
    )


def test_fp8_gemm_refuses_what_its_layout_does_not_allow():
    _, x_q, x_scale, w_q, w_scale = fp8_operands(2, 64, 96, (32, 24))
    with pytest.raises(ValueError, match="multiple of 16"):
        fp8_block_matmul(x_q, x_scale, w_q, w_scale, (32, 24), impl="triton")
    _, x_q, x_scale, w_q, w_scale = fp8_operands(2, 64, 256, (128, 128))
    with pytest.raises(ValueError, match="w_scale_inv has shape"):
        fp8_block_matmul(x_q, x_scale, w_q, w_scale[:, :1])
    with pytest.raises(ValueError, match="x_scales has shape"):
        fp8_block_matmul(x_q, x_scale[:1], w_q, w_scale)
    with pytest.raises(ValueError, match="same K"):
        fp8_block_matmul(x_q[:, :128], x_scale[:, :1], w_q, w_scale)
    with pytest.raises(ValueError, match="128x128"):
        fp8_block_matmul(x_q, x_scale, w_q, w_scale, (64, 128), impl="scaled_mm")
    assert [triton_fp8_block_k(bk) for bk in (16, 48, 96, 128, 256)] == [16, 16, 32, 128, 128]


# --- INT8 GEMM reference -------------------------------------------------------------------------


@pytest.mark.parametrize(("m", "n", "k"), [(1, 64, 128), (3, 33, 97), (20, 48, 256)])
def test_int8_reference_is_exact_integer_sums_then_the_fp32_epilogue(m, n, k):
    generator = torch.Generator().manual_seed(m)
    x_q = torch.randint(-128, 128, (m, k), generator=generator, dtype=torch.int8)
    w_q = torch.randint(-128, 128, (n, k), generator=generator, dtype=torch.int8)
    x_scale, w_scale = torch.rand(m, 1) * 1e-2, torch.rand(n, 1) * 1e-3
    sums = (x_q.double() @ w_q.double().t()).float()  # exact in float64, and then in fp32 here
    expected = sums * x_scale * w_scale.t()
    for impl in ("reference", "auto"):
        got = int8_matmul(x_q, x_scale, w_q, w_scale, torch.float32, impl=impl)
        assert torch.equal(got, expected)
    flat = int8_matmul(x_q, x_scale.reshape(m), w_q, w_scale.reshape(n), torch.bfloat16)
    assert torch.equal(flat, expected.to(torch.bfloat16))


# --- attention reference ------------------------------------------------------------------------


def float64_attention(q, k_cache, v_cache, k_scale, v_scale, valid, sm_scale):
    """Head by head, position by position, in float64: an independent formulation."""
    batch, q_heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    out = torch.zeros(batch, q_heads, dim, dtype=torch.float64)
    for b in range(batch):
        positions = valid[b].nonzero().flatten()
        if positions.numel() == 0:
            continue
        for h in range(q_heads):
            kv = h // (q_heads // kv_heads)
            keys = k_cache[b, kv, positions].double() * k_scale
            values = v_cache[b, kv, positions].double() * v_scale
            scores = keys @ q[b, h].double() * sm_scale
            weights = torch.exp(scores - scores.max())
            out[b, h] = (weights / weights.sum()) @ values
    return out


@pytest.mark.parametrize(
    ("batch", "q_heads", "kv_heads", "t_max", "dim"), [(1, 12, 2, 40, 32), (3, 4, 4, 17, 16)]
)
def test_attention_reference_matches_float64_with_padding_gqa_and_kv_len(
    batch, q_heads, kv_heads, t_max, dim
):
    # fp32 against float64: fp32 rounding of the scores, softmax and sums; measured
    # ≤ 2e-7·max|v|, 1e-5·max|v| allowed. A wrong GQA mapping or mask is off by O(|v|).
    generator = torch.Generator().manual_seed(batch)
    k_cache = (torch.randn(batch, kv_heads, t_max, dim, generator=generator) * 50).to(FP8)
    v_cache = (torch.randn(batch, kv_heads, t_max, dim, generator=generator) * 50).to(FP8)
    q = torch.randn(batch, q_heads, dim, generator=generator)
    valid = torch.rand(batch, t_max, generator=generator) > 0.3
    valid[0, :5] = False  # left padding
    valid[0, 5] = True
    if batch > 2:
        valid[2] = False  # nothing to attend: zeros
    kv_len = torch.full((batch,), t_max - 3)
    k_scale, v_scale = torch.tensor(0.03), torch.tensor(0.05)
    sm_scale = 1 / math.sqrt(dim)
    v_max = v_cache.float().abs().max().item() * 0.05
    for lengths in (None, kv_len):
        attended = valid if lengths is None else valid & (torch.arange(t_max) < t_max - 3)
        expected = float64_attention(q, k_cache, v_cache, 0.03, 0.05, attended, sm_scale)
        got = fp8_kv_decode_attention(q, k_cache, v_cache, k_scale, v_scale, valid, kv_len=lengths)
        assert got.shape == q.shape and got.dtype == q.dtype
        assert ((got.double() - expected).abs() <= 1e-5 * v_max).all()
    if batch > 2:
        assert not got[2].any()


def test_attention_refuses_mismatched_shapes():
    q = torch.randn(2, 6, 16)
    cache = torch.zeros(2, 4, 8, 16, dtype=FP8)  # 6 query heads do not share 4 KV heads
    valid = torch.ones(2, 8, dtype=torch.bool)
    with pytest.raises(ValueError, match="multiple of Hkv"):
        fp8_kv_decode_attention(q, cache, cache, torch.tensor(1.0), torch.tensor(1.0), valid)
    cache = torch.zeros(2, 2, 8, 16, dtype=FP8)
    with pytest.raises(ValueError, match="kv_valid must be bool"):
        fp8_kv_decode_attention(q, cache, cache, torch.tensor(1.0), torch.tensor(1.0), valid[:, :4])


# --- paths a device cannot run ----------------------------------------------------------------


def test_a_path_the_device_cannot_run_names_the_device_the_kernel_and_what_works(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    _, x_q, x_scale, w_q, w_scale = fp8_operands(1, 128, 128, (128, 128))
    with pytest.raises(KernelUnavailable) as raised:
        fp8_block_matmul(x_q, x_scale, w_q, w_scale, impl="scaled_mm")
    message = str(raised.value)
    assert "fp8_block_matmul (scaled_mm)" in message and "cpu" in message
    assert "sm90" in message and "impl='reference'" in message
    monkeypatch.setattr(kernel_support, "triton", None)  # as without the triton extra
    with pytest.raises(KernelUnavailable, match=r"Triton is not installed.*impl='reference'"):
        fp8_block_matmul(x_q, x_scale, w_q, w_scale, impl="triton")
    monkeypatch.undo()
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("ASYNCFP8_TRITON", "0")
    x_i8 = torch.ones(1, 32, dtype=torch.int8)
    with pytest.raises(KernelUnavailable, match=r"int8_matmul \(Triton\) cannot run on cpu"):
        int8_matmul(x_i8, torch.ones(1, 1), x_i8, torch.ones(1, 1), impl="triton")
    with pytest.raises(KernelUnavailable, match="ASYNCFP8_TRITON=0"):
        quantize_activations_fp8(torch.ones(1, 128), impl="triton")
    cache = torch.zeros(1, 1, 16, 16, dtype=FP8)
    with pytest.raises(KernelUnavailable, match=r"fp8_kv_decode_attention \(Triton\)"):
        fp8_kv_decode_attention(
            torch.ones(1, 1, 16),
            cache,
            cache,
            torch.tensor(1.0),
            torch.tensor(1.0),
            torch.ones(1, 16, dtype=torch.bool),
            impl="triton",
        )
    with pytest.raises(ValueError, match="impl must be one of"):
        int8_matmul(x_i8, torch.ones(1, 1), x_i8, torch.ones(1, 1), impl="cuda")


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the benchmark runs for minutes")
def test_the_kernel_benchmark_without_a_gpu_says_so_and_exits_non_zero(tmp_path):
    out = tmp_path / "kernels.json"
    result = subprocess.run(
        [sys.executable, str(REPO / "bench" / "kernels.py"), "--out", str(out)],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1, result.stdout + result.stderr[-2000:]
    assert "found no CUDA GPU" in result.stderr and "Nothing was measured" in result.stderr
    assert not out.exists()


# --- on a GPU ----------------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
needs_triton = pytest.mark.skipif(kernel_support.triton is None, reason="needs Triton")

# Decode shapes of a 1.5B-shaped Qwen2 (hidden 1536, intermediate 8960, 12/2 heads × 128):
# q/o, k/v, gate/up, down.
QWEN_LINEARS = [(1536, 1536), (256, 1536), (8960, 1536), (1536, 8960)]


@pytest.mark.gpu
@needs_cuda
@needs_triton
@pytest.mark.parametrize("m", [1, 64])
def test_gpu_activation_quantizer_is_bit_exact(m):
    x = (torch.randn(m, 8960, device="cuda") * 3).to(torch.bfloat16)
    q, s = quantize_activations_fp8(x, 128, column_major_scales=True)
    q_ref, s_ref = quantize_activations_fp8_reference(x, 128)
    assert s.stride() == (1, m)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)


@pytest.mark.gpu
@needs_cuda
@needs_triton
@pytest.mark.parametrize("m", [1, 64])
@pytest.mark.parametrize(("n", "k"), QWEN_LINEARS)
def test_gpu_fp8_gemm_paths_agree(m, n, k):
    # FP8 tensor cores add within a tile at reduced precision (Hopper's FP8 MMA keeps
    # fewer accumulator bits than fp32): 1e-3·Σ|x·w| allowed against float64, plus one bf16
    # step of the output. A wrong scale or block is off by far more.
    generator = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, k, device="cuda", generator=generator).to(torch.bfloat16)
    w = torch.randn(n, k, device="cuda", generator=generator) * 0.02
    w_q, w_scale = quantize_blockwise_reference(w)
    x_q, x_scale = quantize_activations_fp8(x, 128, column_major_scales=True)
    exact, magnitude = float64_matmul(
        x_q.cpu(), x_scale.cpu(), w_q.cpu(), w_scale.cpu(), (128, 128)
    )
    outputs = {"triton": fp8_block_matmul(x_q, x_scale, w_q, w_scale, impl="triton")}
    assert torch.equal(fp8_block_matmul(x_q, x_scale, w_q, w_scale), outputs["triton"])
    if scaled_mm_available(x_q):
        try:
            outputs["scaled_mm"] = fp8_block_matmul(x_q, x_scale, w_q, w_scale, impl="scaled_mm")
        except RuntimeError as err:
            # cuBLASLt has no blockwise kernel for one row (an H100, torch 2.11+cu130): the
            # engine takes Triton on sm90, and falls back from scaled_mm where it fails.
            assert m == 1 and "CUBLAS_STATUS_NOT_SUPPORTED" in str(err), err
    for impl, out in outputs.items():
        assert out.shape == (m, n) and out.dtype == torch.bfloat16, impl
        error = (out.double().cpu() - exact).abs()
        assert (error <= 1e-3 * magnitude + exact.abs() * 2**-7 + 1e-30).all(), impl


@pytest.mark.gpu
@needs_cuda
@needs_triton
@pytest.mark.parametrize("m", [1, 64])
def test_gpu_fp8_gemm_writes_bf16_as_a_cast_of_its_fp32_result_would(m):
    # FP8BlockLinear without a bias asks the GEMM for BF16 directly (one kernel fewer):
    # the same bits as the FP32 result cast, with split K (one row) and without (64).
    generator = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(m, 1536, device="cuda", generator=generator).to(torch.bfloat16)
    w_q, w_scale = quantize_blockwise_reference(
        torch.randn(8960, 1536, device="cuda", generator=generator) * 0.02
    )
    x_q, x_scale = quantize_activations_fp8(x, 128)
    wide = fp8_block_matmul(x_q, x_scale, w_q, w_scale, out_dtype=torch.float32, impl="triton")
    narrow = fp8_block_matmul(x_q, x_scale, w_q, w_scale, out_dtype=torch.bfloat16, impl="triton")
    assert narrow.dtype == torch.bfloat16 and torch.equal(narrow, wide.to(torch.bfloat16))


@pytest.mark.gpu
@needs_cuda
@needs_triton
@pytest.mark.parametrize("m", [1, 3, 64])
def test_gpu_int8_gemm_is_bit_exact_at_any_batch(m):
    x_q = torch.randint(-128, 128, (m, 1536), dtype=torch.int8, device="cuda")
    w_q = torch.randint(-128, 128, (256, 1536), dtype=torch.int8, device="cuda")
    x_scale = torch.rand(m, 1, device="cuda") * 1e-2
    w_scale = torch.rand(256, 1, device="cuda") * 1e-3
    got = int8_matmul(x_q, x_scale, w_q, w_scale, torch.bfloat16)
    padded = int8_matmul(x_q, x_scale, w_q, w_scale, torch.bfloat16, impl="reference")
    assert torch.equal(got, padded)


@pytest.mark.gpu
@needs_cuda
@needs_triton
@pytest.mark.parametrize("m", [1, 64])
@pytest.mark.parametrize(("n", "k"), QWEN_LINEARS)
def test_gpu_fused_linears_match_the_unfused_path(m, n, k):
    # INT8: exact int32 sums and the same epilogue, so the same bits. FP8: the GEMM's
    # tolerance against float64 (its tiles may differ from the unfused kernel's).
    generator = torch.Generator(device="cuda").manual_seed(2)
    x = torch.randn(m, k, device="cuda", generator=generator).to(torch.bfloat16)
    w = torch.randn(n, k, device="cuda", generator=generator) * 0.02
    bias = torch.randn(n, device="cuda", generator=generator).to(torch.bfloat16)
    w8, w8_scale = quantize_per_channel_reference(w)
    x8, x8_scale = quantize_activations_int8(x)
    unfused = int8_matmul(x8, x8_scale, w8, w8_scale, torch.float32) + bias.float()
    assert torch.equal(int8_linear_fused(x, w8, w8_scale, bias, torch.float32), unfused)
    w_q, w_scale = quantize_blockwise_reference(w)
    x_q, x_scale = quantize_activations_fp8(x, 128)
    exact, magnitude = float64_matmul(
        x_q.cpu(), x_scale.cpu(), w_q.cpu(), w_scale.cpu(), (128, 128)
    )
    exact = exact + bias.double().cpu()
    got = fp8_linear_fused(x, w_q, w_scale, bias, (128, 128), n)
    assert got.shape == (m, n) and got.dtype == torch.bfloat16
    error = (got.double().cpu() - exact).abs()
    assert (error <= 1e-3 * magnitude + exact.abs() * 2**-7 + 1e-30).all()


def gpu_cache(batch, t_max, seed=0):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    shape = (batch, 2, t_max, 128)
    # Clamped to e4m3's range: torch casts a value past ±448 to NaN, not to the largest
    # e4m3 (a million normals times 100 have a few; the first GPU run got NaN references).
    k_cache = (torch.randn(shape, device="cuda", generator=generator) * 100).clamp(-448, 448)
    v_cache = (torch.randn(shape, device="cuda", generator=generator) * 100).clamp(-448, 448)
    k_cache, v_cache = k_cache.to(FP8), v_cache.to(FP8)
    q = torch.randn(batch, 12, 128, device="cuda", generator=generator).to(torch.bfloat16)
    valid = torch.ones(batch, t_max, dtype=torch.bool, device="cuda")
    valid[:, : t_max // 10] = False  # left padding
    return q, k_cache, v_cache, valid


@pytest.mark.gpu
@needs_cuda
@needs_triton
@pytest.mark.parametrize(("batch", "t_max"), [(1, 8192), (64, 256)])
def test_gpu_fp8_kv_attention_matches_the_reference(batch, t_max):
    # TF32 dots round the softmax weights to 2^-11: 2e-3·max|v| allowed, plus one bf16 step.
    q, k_cache, v_cache, valid = gpu_cache(batch, t_max)
    scales = (torch.tensor(0.02, device="cuda"), torch.tensor(0.03, device="cuda"))
    got = fp8_kv_decode_attention(q, k_cache, v_cache, *scales, valid)
    ref = fp8_kv_decode_attention_reference(q, k_cache, v_cache, *scales, valid)
    v_max = v_cache.float().abs().max() * 0.03
    assert ((got.float() - ref.float()).abs() <= 2e-3 * v_max + ref.float().abs() * 2**-7).all()


@pytest.mark.gpu
@needs_cuda
@needs_triton
def test_gpu_fp8_kv_attention_in_a_cuda_graph_follows_new_scales_and_lengths():
    q, k_cache, v_cache, valid = gpu_cache(4, 1024)
    k_scale = torch.tensor(0.02, device="cuda")
    v_scale = torch.tensor(0.03, device="cuda")
    kv_len = torch.full((4,), 300, dtype=torch.int32, device="cuda")
    args = (q, k_cache, v_cache, k_scale, v_scale, valid)
    fp8_kv_decode_attention(*args, kv_len=kv_len)  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp8_kv_decode_attention(*args, kv_len=kv_len)
    k_scale.fill_(0.05)  # a new version's scales, the next decode step's length
    v_scale.fill_(0.01)
    kv_len.fill_(301)
    graph.replay()
    ref = fp8_kv_decode_attention_reference(*args, kv_len=kv_len)
    v_max = v_cache.float().abs().max() * 0.01
    assert ((out.float() - ref.float()).abs() <= 2e-3 * v_max + ref.float().abs() * 2**-7).all()


def test_a_layer_the_fused_kernel_cannot_take_is_unfused_and_said_once(monkeypatch, caplog):
    from asyncfp8.precision.fp8 import linear as fp8_linear

    monkeypatch.setattr(fp8_linear, "triton_enabled", lambda tensor: True)  # as on CUDA
    monkeypatch.setattr(fp8_linear, "_unfused_reasons", set())
    w = torch.randn(64, 192) * 0.05
    w_q, w_scale = quantize_blockwise_reference(w, (64, 96))
    with caplog.at_level("WARNING", logger=fp8_linear.__name__):
        layers = [FP8BlockLinear(f"l{i}.weight", w_q, w_scale, None, (64, 96)) for i in range(3)]
    assert not any(layer.fused for layer in layers)
    said = [r.getMessage() for r in caplog.records if "fused kernel cannot take" in r.getMessage()]
    assert len(said) == 1 and "96 columns" in said[0] and "l0.weight" in said[0]
    w_q, w_scale = quantize_blockwise_reference(w)
    assert FP8BlockLinear("ok.weight", w_q, w_scale, None).fused  # 128-column groups
