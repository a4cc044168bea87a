"""Decode-shaped kernel speed on a GPU: one-call FP8 GEMM, INT8 GEMM and FP8-KV attention
against what they replace, and against the memory-bandwidth floor.

    python bench/kernels.py [--repeats 5] [--out bench/results/kernels-<device>.json]

GEMMs, at the linear layers of a 1.5B-shaped Qwen2 (hidden 1536, intermediate 8960,
12/2 heads × 128: q/o 1536×1536, k/v 256×1536, gate/up 8960×1536, down 1536×8960) and
M = 1 and 64 tokens: BF16 `F.linear`; the one-call FP8 GEMM as `impl="auto"` picks it
(torch `scaled_mm` on sm90, Triton elsewhere) and the Triton kernel by itself, each alone
and with its activation quantization; the old per-block `torch._scaled_mm` loop
(`fp8_block_matmul_reference`); INT8 through Triton and through `torch._int_mm` with the
batch padded. Attention, one decode step of 12 query / 2 KV heads × 128 at batch 1 and
64 and context 256 and 8192: the Triton FP8-KV kernel, dequantize-then-SDPA (what
`FP8KVLayer` does today) and SDPA over a BF16 cache.

Each time is the median over `--repeats` of a CUDA graph holding 20 calls, divided by 20
(decode runs as a graph; this leaves out Python's launch cost); `floor_us` is the bytes
the call must read (weights or cache, plus activations) over the copy bandwidth measured
in the same run, and `fraction_of_floor` = floor / time. Without a GPU it says so and
exits 1: there is nothing to measure. `--dry-run` runs the same code on the CPU at toy
shapes (timed without graphs; the Triton rows fail there and say so): what
`bash bench/gpu.sh --dry-run` checks. The JSON is written after every row.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import re
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Table, failure

from asyncfp8.precision.fp8 import quantize_blockwise_reference
from asyncfp8.precision.fp8.gemm import (
    fp8_block_matmul,
    scaled_mm_available,
    scaled_mm_weight_scales,
)
from asyncfp8.precision.fp8.quant import quantize_activations_fp8
from asyncfp8.precision.fp8_kv.attention import fp8_kv_decode_attention
from asyncfp8.precision.int8 import quantize_per_channel_reference
from asyncfp8.precision.int8.gemm import int8_matmul
from asyncfp8.precision.kernel_support import triton_runs_on

HIDDEN, INTERMEDIATE, Q_HEADS, KV_HEADS, HEAD_DIM = 1536, 8960, 12, 2, 128
LINEARS = {  # name: (N, K)
    "q_proj/o_proj": (HIDDEN, HIDDEN),
    "k_proj/v_proj": (KV_HEADS * HEAD_DIM, HIDDEN),
    "gate/up_proj": (INTERMEDIATE, HIDDEN),
    "down_proj": (HIDDEN, INTERMEDIATE),
}
TOKENS = (1, 64)
CONTEXTS = (256, 8192)
BATCHES = (1, 64)
CALLS_PER_GRAPH = 20
GPU_SIZES = {"linears": LINEARS, "tokens": TOKENS, "contexts": CONTEXTS, "batches": BATCHES}
TOY_SIZES = {  # --dry-run
    "linears": {"toy q_proj": (256, 256), "toy down_proj": (128, 384)},
    "tokens": (1, 4),
    "contexts": (64,),
    "batches": (1, 2),
}


def device_tag() -> str:
    """h100, h200, a100, ... from the GPU's name (bench/results/kernels-<tag>.json)."""
    name = torch.cuda.get_device_name()
    found = re.search(r"\b([A-Z]{1,2}\d{2,4}[A-Z]?)\b", name)
    return (found.group(1) if found else re.sub(r"[^a-z0-9]+", "-", name.lower())).lower()


def copy_bandwidth(numel: int = 1 << 28, device: str | torch.device = "cuda") -> float:
    """Bytes per second of `dst.copy_(src)` (read + write), the floor's yardstick."""
    device = torch.device(device)
    numel = numel if device.type == "cuda" else min(numel, 1 << 24)
    src = torch.empty(numel, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    return 2 * numel / seconds_per_call(lambda: dst.copy_(src), 5, device)


def seconds_per_call(fn: Callable[[], object], repeats: int, device: torch.device) -> float:
    """`graph_seconds` on CUDA; elsewhere (the dry run) the median over `repeats` of
    CALLS_PER_GRAPH calls in a row, per call."""
    if device.type == "cuda":
        return graph_seconds(fn, repeats)
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(CALLS_PER_GRAPH):
            fn()
        times.append((time.perf_counter() - start) / CALLS_PER_GRAPH)
    return statistics.median(times)


def graph_seconds(fn: Callable[[], object], repeats: int) -> float:
    """Median seconds per call of `fn`, replayed from a CUDA graph of CALLS_PER_GRAPH calls."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up: compiles Triton, autotunes cuBLAS
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS_PER_GRAPH):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / CALLS_PER_GRAPH)
    return statistics.median(times)


def measure(fn: Callable[[], object], repeats: int, device: torch.device) -> tuple:
    """(seconds per call, None), or (None, the error) for a path this device cannot run:
    reported in its row, not fatal."""
    try:
        return seconds_per_call(fn, repeats, device), None
    except Exception as err:
        if device.type == "cuda":
            with contextlib.suppress(RuntimeError):  # a broken context: later rows say so
                torch.cuda.synchronize()
        return None, failure(err)


def gemm_cases(x: torch.Tensor, w: torch.Tensor) -> dict[str, tuple[Callable[[], object], int]]:
    """What to time for activations x [M, K] bf16 and a weight w [N, K]: name -> (call,
    bytes per weight element the call must read)."""
    w_bf16 = w.to(torch.bfloat16)
    w_q, w_scale = quantize_blockwise_reference(w)
    w_scale_mm = scaled_mm_weight_scales(w_scale)
    w_i8, w_i8_scale = quantize_per_channel_reference(w)
    x_q, x_scale = quantize_activations_fp8(x, 128, column_major_scales=True)
    x_i8 = torch.randint(-128, 128, x.shape, dtype=torch.int8, device=x.device)
    x_i8_scale = torch.rand(x.shape[0], 1, device=x.device)
    # What impl="auto" runs here (the table in asyncfp8/precision/fp8/gemm.py).
    auto = "scaled_mm" if scaled_mm_available(x_q) else "triton" if x.is_cuda else "reference"

    def fp8(impl: str, quantize: bool = False):
        def call():
            xq, xs = quantize_activations_fp8(x, 128, True) if quantize else (x_q, x_scale)
            return fp8_block_matmul(xq, xs, w_q, w_scale, impl=impl, w_scale_mm=w_scale_mm)

        return call

    def int8(impl: str):
        return lambda: int8_matmul(x_i8, x_i8_scale, w_i8, w_i8_scale, impl=impl)

    return {
        "bf16 F.linear": (lambda: F.linear(x, w_bf16), 2),
        f"fp8 one call ({auto})": (fp8("auto"), 1),
        f"fp8 quant + one call ({auto})": (fp8("auto", quantize=True), 1),
        "fp8 triton": (fp8("triton"), 1),
        "fp8 old per-block loop": (fp8("reference"), 1),
        "int8 triton": (int8("triton"), 1),
        "int8 _int_mm (rows padded)": (int8("reference"), 1),
    }


def gemm_rows(table: Table, repeats: int, bandwidth: float, device, sizes: dict) -> None:
    for name, (n, k) in sizes["linears"].items():
        w = torch.randn(n, k, device=device) * 0.02
        for m in sizes["tokens"]:
            x = torch.randn(m, k, device=device).to(torch.bfloat16)
            base = None
            for impl, (fn, weight_bytes) in gemm_cases(x, w).items():
                seconds, error = measure(fn, repeats, device)
                floor = (n * k * weight_bytes + m * k * 2 + m * n * 2) / bandwidth
                if impl.startswith("bf16"):
                    base = seconds
                row = table.add(
                    {
                        "kernel": "gemm",
                        "layer": name,
                        "n": n,
                        "k": k,
                        "m": m,
                        "impl": impl,
                        "us": seconds * 1e6 if seconds else None,
                        "floor_us": floor * 1e6,
                        "fraction_of_floor": floor / seconds if seconds else None,
                        "speedup_vs_bf16": base / seconds if seconds and base else None,
                        "error": error,
                    }
                )
                print_row(row, f"{name} M={m}")


def attention_cases(
    batch: int, context: int, device: str = "cuda"
) -> dict[str, tuple[Callable[[], object], int]]:
    """One decode step over a cache of `context` positions: name -> (call, bytes per
    cache element the call must read)."""
    shape = (batch, KV_HEADS, context, HEAD_DIM)
    k_cache = (torch.randn(shape, device=device) * 50).to(torch.float8_e4m3fn)
    v_cache = (torch.randn(shape, device=device) * 50).to(torch.float8_e4m3fn)
    k_bf16, v_bf16 = k_cache.to(torch.bfloat16), v_cache.to(torch.bfloat16)
    k_scale = torch.tensor(0.02, device=device)
    v_scale = torch.tensor(0.03, device=device)
    q = torch.randn(batch, Q_HEADS, HEAD_DIM, device=device).to(torch.bfloat16)
    valid = torch.ones(batch, context, dtype=torch.bool, device=device)
    sm_scale = 1 / math.sqrt(HEAD_DIM)

    def sdpa(keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(
            q[:, :, None],
            keys,
            values,
            attn_mask=valid[:, None, None, :],
            scale=sm_scale,
            enable_gqa=True,
        )

    def dequantize_sdpa():  # what FP8KVLayer does today: a BF16 copy of the whole cache
        return sdpa(k_cache.to(torch.bfloat16) * k_scale, v_cache.to(torch.bfloat16) * v_scale)

    auto = "triton" if triton_runs_on(q) else "reference"  # what impl="auto" runs here

    def fp8_kv_kernel():
        return fp8_kv_decode_attention(q, k_cache, v_cache, k_scale, v_scale, valid, sm_scale)

    return {
        f"fp8-kv {auto}": (fp8_kv_kernel, 1),
        "fp8-kv dequantize + SDPA": (dequantize_sdpa, 1),
        "bf16-kv SDPA": (lambda: sdpa(k_bf16, v_bf16), 2),
    }


def attention_rows(table: Table, repeats: int, bandwidth: float, device, sizes: dict) -> None:
    for context in sizes["contexts"]:
        for batch in sizes["batches"]:
            cases = attention_cases(batch, context, device)
            cache_elements = 2 * batch * KV_HEADS * context * HEAD_DIM
            measured = []
            for impl, (fn, cache_bytes) in cases.items():
                seconds, error = measure(fn, repeats, device)
                floor = cache_elements * cache_bytes / bandwidth
                row = {
                    "kernel": "decode_attention",
                    "batch": batch,
                    "context": context,
                    "impl": impl,
                    "us": seconds * 1e6 if seconds else None,
                    "floor_us": floor * 1e6,
                    "fraction_of_floor": floor / seconds if seconds else None,
                    "error": error,
                }
                measured.append(table.add(row))
                print_row(row, f"attention B={batch} T={context}")
            base = measured[-1]["us"]  # bf16-kv SDPA
            for row in measured:
                row["speedup_vs_bf16_kv"] = base / row["us"] if row["us"] and base else None
            table.save()
            del cases  # free the caches before the next shape


def print_row(row: dict, what: str) -> None:
    if row["error"]:
        print(f"{what:<28} {row['impl']:<32} failed: {row['error']}", flush=True)
        return
    print(
        f"{what:<28} {row['impl']:<32} {row['us']:>9.1f} us  floor {row['floor_us']:>8.1f} us  "
        f"{row['fraction_of_floor']:>6.1%} of floor",
        flush=True,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="the same code on the CPU at toy shapes (bench/gpu.sh --dry-run)",
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.dry_run:
        device, sizes, tag = torch.device("cpu"), TOY_SIZES, "dry-run"
        args.repeats = 1
    elif not torch.cuda.is_available():
        print(
            "bench/kernels.py measures GPU kernels and found no CUDA GPU (torch "
            f"{torch.__version__}); run it on a GPU machine. Nothing was measured.",
            file=sys.stderr,
        )
        return 1
    else:
        device, sizes, tag = torch.device("cuda"), GPU_SIZES, device_tag()
    torch.manual_seed(0)
    bandwidth = copy_bandwidth(device=device)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (dry run)"
    print(f"{name}: copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    out = args.out or Path(__file__).resolve().parent / "results" / f"kernels-{tag}.json"
    table = Table(
        out,
        copy_bandwidth_bytes_per_s=bandwidth,
        calls_per_graph=CALLS_PER_GRAPH,
        repeats=args.repeats,
        scaled_mm_available=scaled_mm_available(torch.empty(1, device=device)),
    )
    gemm_rows(table, args.repeats, bandwidth, device, sizes)
    attention_rows(table, args.repeats, bandwidth, device, sizes)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
