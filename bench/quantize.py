"""Weight-quantization throughput: torch reference vs Triton, against copy bandwidth.

    python bench/quantize.py [--layers 32] [--out bench/results/quantize-<device>.json]

Two workloads: one 4096×4096 BF16 matrix, and the stream of a 7B Llama-shaped model
(per layer 4 × 4096² attention + 3 × 4096×11008 MLP weights; `--layers` of them),
quantized tensor by tensor as the learner does each version. Throughput is reported in
GB/s of traffic (BF16 read + 8-bit write + scales: ~3 bytes per weight) and as a
fraction of the copy bandwidth (`dst.copy_(src)`, read + write) measured in the same
run. Triton runs only on CUDA; on a CPU its column says so. `--dry-run`: the same at toy
shapes (bench/gpu.sh --dry-run). The JSON is written after every row; an implementation
that fails is a row with an `error`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Table, failure, median_seconds

from asyncfp8.precision import kernel_support
from asyncfp8.precision.fp8 import quantize_blockwise_reference
from asyncfp8.precision.fp8.quant import quantize_blockwise_triton
from asyncfp8.precision.int8 import quantize_per_channel_reference
from asyncfp8.precision.int8.quant import quantize_per_channel_triton

HIDDEN, INTERMEDIATE = 4096, 11008
TOY_HIDDEN, TOY_INTERMEDIATE = 256, 704  # --dry-run


def layer_shapes(hidden: int, intermediate: int) -> list[tuple[int, int]]:
    """A Llama decoder layer's linear weights: q, k, v, o; gate, up; down."""
    return [(hidden, hidden)] * 4 + [(intermediate, hidden)] * 2 + [(hidden, intermediate)]


def traffic_bytes(shape) -> int:
    """BF16 in, one byte out per weight (scales are negligible beside them)."""
    return shape[0] * shape[1] * 3


def copy_bandwidth(device: str, numel: int = 1 << 27) -> float:
    src = torch.empty(numel, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    seconds = median_seconds(lambda: dst.copy_(src), repeats=5)
    return 2 * src.numel() * src.element_size() / seconds / 1e9


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--layers", type=int, default=32, help="decoder layers in the 7B-shaped stream"
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="toy shapes, one layer (bench/gpu.sh --dry-run)"
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    device = "cuda" if torch.cuda.is_available() and not args.dry_run else "cpu"
    hidden, intermediate = (
        (TOY_HIDDEN, TOY_INTERMEDIATE) if args.dry_run else (HIDDEN, INTERMEDIATE)
    )
    shapes = layer_shapes(hidden, intermediate)
    layers = 1 if args.dry_run else args.layers
    torch.manual_seed(0)
    bandwidth = copy_bandwidth(device, numel=1 << 20 if args.dry_run else 1 << 27)
    weights = {shape: torch.randn(shape, device=device).to(torch.bfloat16) for shape in set(shapes)}
    impls = {
        ("fp8", "torch"): quantize_blockwise_reference,
        ("int8", "torch"): quantize_per_channel_reference,
    }
    if device == "cuda" and kernel_support.triton is not None:
        impls[("fp8", "triton")] = quantize_blockwise_triton
        impls[("int8", "triton")] = quantize_per_channel_triton
    tag = "dry-run" if args.dry_run else device
    table = Table(
        args.out or f"bench/results/quantize-{tag}.json", copy_gb_per_s=bandwidth, layers=layers
    )
    print(
        f"device: {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}; "
        f"copy bandwidth {bandwidth:.1f} GB/s"
    )
    print(f"{'format':<6} {'impl':<7} {'workload':<24} {'seconds':>9} {'GB/s':>8} {'of copy':>8}")
    square = weights[(hidden, hidden)]

    def stream(fn):
        for _ in range(layers):
            for shape in shapes:
                fn(weights[shape])

    stream_name = f"{'toy' if args.dry_run else '7B'} stream ({layers} layers)"
    workloads = {  # name: (run, bytes moved, repeats, warm-up runs)
        f"{hidden}x{hidden}": (lambda fn: fn(square), traffic_bytes(square.shape), 5, 1),
        stream_name: (stream, layers * sum(traffic_bytes(s) for s in shapes), 1, 0),
    }
    for (fmt, impl), fn in impls.items():
        for workload, (run, traffic, repeats, warmup) in workloads.items():
            row = {"format": fmt, "impl": impl, "workload": workload}
            try:
                seconds = median_seconds(
                    lambda run=run, fn=fn: run(fn), repeats=repeats, warmup=warmup
                )
                row |= {"seconds": seconds, "gb_per_s": traffic / seconds / 1e9}
                row["fraction_of_copy"] = row["gb_per_s"] / bandwidth
                print(
                    f"{fmt:<6} {impl:<7} {workload:<24} {seconds:>9.3f} "
                    f"{row['gb_per_s']:>8.2f} {100 * row['fraction_of_copy']:>7.1f}%",
                    flush=True,
                )
            except Exception as err:  # the other implementations are still measured
                row["error"] = failure(err)
                print(f"{fmt:<6} {impl:<7} {workload:<24} failed: {row['error']}", flush=True)
            table.add(row)
    if device != "cuda":
        print(
            "triton: not run (no CUDA device; the kernels are checked for exactness under "
            "TRITON_INTERPRET=1)"
        )
    print(f"wrote {table.path}")
    return 1 if any("error" in row for row in table.rows) else 0


if __name__ == "__main__":
    sys.exit(main())
