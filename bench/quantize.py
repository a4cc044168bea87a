"""Weight-quantization throughput: torch reference vs Triton, against copy bandwidth.

    python bench/quantize.py [--layers 32] [--out bench/results/quantize-<device>.json]

Two workloads: one 4096×4096 BF16 matrix, and the stream of a 7B Llama-shaped model
(per layer 4 × 4096² attention + 3 × 4096×11008 MLP weights; `--layers` of them),
quantized tensor by tensor as the learner does each version. Throughput is reported in
GB/s of traffic (BF16 read + 8-bit write + scales: ~3 bytes per weight) and as a
fraction of the copy bandwidth (`dst.copy_(src)`, read + write) measured in the same
run. Triton runs only on CUDA; on a CPU its column says so.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import median_seconds, write_json

from asyncfp8.precision import kernels
from asyncfp8.precision.fp8 import quantize_blockwise_reference
from asyncfp8.precision.int8 import quantize_per_channel_reference

HIDDEN, INTERMEDIATE = 4096, 11008
LAYER_SHAPES = [(HIDDEN, HIDDEN)] * 4 + [(INTERMEDIATE, HIDDEN)] * 2 + [(HIDDEN, INTERMEDIATE)]


def traffic_bytes(shape) -> int:
    """BF16 in, one byte out per weight (scales are negligible beside them)."""
    return shape[0] * shape[1] * 3


def copy_bandwidth(device: str, numel: int = 1 << 27) -> float:
    src = torch.empty(numel, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    seconds = median_seconds(lambda: dst.copy_(src), repeats=5)
    return 2 * src.numel() * src.element_size() / seconds / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--layers", type=int, default=32, help="decoder layers in the 7B-shaped stream"
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    bandwidth = copy_bandwidth(device)
    weights = {
        shape: torch.randn(shape, device=device).to(torch.bfloat16) for shape in set(LAYER_SHAPES)
    }
    impls = {
        ("fp8", "torch"): quantize_blockwise_reference,
        ("int8", "torch"): quantize_per_channel_reference,
    }
    if device == "cuda" and kernels.triton is not None:
        impls[("fp8", "triton")] = kernels.quantize_blockwise_triton
        impls[("int8", "triton")] = kernels.quantize_per_channel_triton

    rows = []
    for (fmt, impl), fn in impls.items():
        square = weights[(HIDDEN, HIDDEN)]
        seconds = median_seconds(lambda fn=fn, w=square: fn(w))
        rows.append(
            {
                "format": fmt,
                "impl": impl,
                "workload": "4096x4096",
                "seconds": seconds,
                "gb_per_s": traffic_bytes(square.shape) / seconds / 1e9,
            }
        )

        def stream(fn=fn):
            for _ in range(args.layers):
                for shape in LAYER_SHAPES:
                    fn(weights[shape])

        seconds = median_seconds(stream, repeats=1, warmup=0)
        total = args.layers * sum(traffic_bytes(s) for s in LAYER_SHAPES)
        rows.append(
            {
                "format": fmt,
                "impl": impl,
                "workload": f"7B stream ({args.layers} layers)",
                "seconds": seconds,
                "gb_per_s": total / seconds / 1e9,
            }
        )
    for row in rows:
        row["fraction_of_copy"] = row["gb_per_s"] / bandwidth

    print(
        f"device: {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}; copy bandwidth {bandwidth:.1f} GB/s"
    )
    print(f"{'format':<6} {'impl':<7} {'workload':<24} {'seconds':>9} {'GB/s':>8} {'of copy':>8}")
    for row in rows:
        print(
            f"{row['format']:<6} {row['impl']:<7} {row['workload']:<24} {row['seconds']:>9.3f} "
            f"{row['gb_per_s']:>8.2f} {100 * row['fraction_of_copy']:>7.1f}%"
        )
    if device != "cuda":
        print(
            "triton: not run (no CUDA device; the kernels are checked for exactness under TRITON_INTERPRET=1)"
        )
    path = write_json(
        args.out or f"bench/results/quantize-{device}.json",
        {"copy_gb_per_s": bandwidth, "layers": args.layers, "rows": rows},
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
