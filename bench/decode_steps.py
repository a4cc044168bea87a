"""The kernels one decode step of the torch engine launches on CUDA, per precision, counted on
this CPU, and the step time an H100 would take by the count.

    python bench/decode_steps.py [--out bench/results/decode-steps-cpu.json] [--tokens 9]

How it counts. The engine decodes a random Qwen2 of Qwen2.5-1.5B's depth (28 layers; the
widths are a toy's: the count does not depend on them) for `--tokens` tokens and for one;
the step's count is the difference over the extra tokens. A `TorchDispatchMode` counts
every aten op the step dispatches, less those that launch no kernel (views, allocations,
metadata). The quantized linears and the FP8-KV attention run their CPU references here,
so each call of them counts as the kernels its CUDA path launches instead (`CUDA_PATHS`):
a fused 8-bit linear 1; the unfused path (before the fused kernels) its quantizer, GEMM,
K-split reduction and casts, with the K splits the H100 (132 multiprocessors) takes at
Qwen2.5-1.5B's widths; the FP8-KV attention 1, or 2 where its cache is split.

How it predicts. step = floor + kernels × cost per kernel. The floor is the bytes a step
must read over the copy bandwidth (bench/results/rollout-h100.json's `floor_tokens_per_s`
for the same precision, batch and context); the cost per kernel is fitted on one row of
that file, BF16 at batch 1 after a 256-token prompt, from this count. The other rows are
predictions, and the unfused counts against the measured steps test the model.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Table
from rollout import QWEN_1_5B, TOY, gpu_engine

from asyncfp8.engines import SamplingParams
from asyncfp8.engines import decode as decode_module
from asyncfp8.precision.fp8 import FP8BlockLinear
from asyncfp8.precision.int8 import Int8Linear
from asyncfp8.precision.kernel_support import DeviceFacts, ceil_div, gemm_tiles

ROOT = Path(__file__).resolve().parents[1]
H100_TABLE = ROOT / "bench" / "results" / "rollout-h100.json"
PRECISIONS = ("bf16", "fp8", "fp8_kv", "fp8+fp8_kv", "int8")
BATCHES = (1, 8, 64)
PROMPT = 256  # the H100 table's short context
H100_SMS = 132
H100 = DeviceFacts(cuda=True, multiprocessors=H100_SMS, fp8_mma=True)
# The 28 layers of Qwen2.5-1.5B at a toy's widths (every K a whole 128-column group).
SHAPE = TOY | {"num_hidden_layers": QWEN_1_5B["num_hidden_layers"]}
# ops that launch no kernel on CUDA
NO_KERNEL = {
    "empty",
    "empty_strided",
    "empty_like",
    "detach",
    "alias",
    "lift_fresh",
    "set_",
    "resize_",
    "_reshape_alias",
    "_unsafe_view",
    "sym_size",
    "sym_stride",
    "sym_numel",
    "is_same_size",
}


class KernelCount(TorchDispatchMode):
    """Counts the aten ops that would each launch a kernel on CUDA, by name."""

    def __init__(self):
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.paused = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not self.paused and name not in NO_KERNEL and not func.is_view:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))

    def add(self, name: str, kernels: int) -> None:
        self.ops[name] += kernels

    @contextmanager
    def pause(self):
        self.paused += 1
        try:
            yield
        finally:
            self.paused -= 1


def h100_splits(m: int, n: int, k: int) -> int:
    """The K splits the Triton GEMM (`kernel_support.gemm_tiles`) takes on an H100."""
    return gemm_tiles(m, n, ceil_div(k, 128), H100, None)[2]


# Qwen2.5-1.5B's (N, K) for each projection, for the unfused path's K splits.
WIDTHS = {
    "q_proj": (1536, 1536),
    "k_proj": (256, 1536),
    "v_proj": (256, 1536),
    "o_proj": (1536, 1536),
    "gate_proj": (8960, 1536),
    "up_proj": (8960, 1536),
    "down_proj": (1536, 8960),
}


def unfused_fp8(rows: int, projection: str, bias: bool) -> int:
    """FP8BlockLinear before the fused kernel, on CUDA with Triton: the activation
    quantizer, the GEMM; split K: the sum of the partials (and a cast to 16 bits without a
    bias); with a bias: the bias cast to fp32, the add and the cast back."""
    split = h100_splits(rows, *WIDTHS[projection]) > 1
    return 2 + split + (3 if bias else split)


def unfused_int8(rows: int, projection: str, bias: bool) -> int:
    """Int8Linear before the fused kernel: quantize_activations_int8's ten torch ops (float,
    abs, amax, clamp_min, full_like, div, div, round, clamp, to int8), the GEMM; split K:
    the int32 sum, a float cast and the two scale products; the bias cast and add; the
    cast back to 16 bits."""
    split = h100_splits(rows, *WIDTHS[projection]) > 1
    return 10 + 1 + 4 * split + 2 * bias + 1


def attention_kernels(batch: int, context: int) -> int:
    """fp8_kv_decode_attention on an H100: one kernel, and the merge where the cache is split
    (attention._splits: about two programs per multiprocessor, ≥ 4 tiles of 64 each)."""
    tiles = ceil_div(context, 64)
    splits = max(
        1, min(ceil_div(2 * H100_SMS, batch * QWEN_1_5B["num_key_value_heads"]), tiles // 4)
    )
    return 1 + (splits > 1)


@contextmanager
def cuda_paths(counter: KernelCount, engine, fused: bool, batch: int, context: int):
    """The quantized linears and the FP8-KV attention counted as their CUDA launches."""
    wrapped = []
    for name, module in engine.model.named_modules():
        if not isinstance(module, FP8BlockLinear | Int8Linear):
            continue
        projection = name.rsplit(".", 1)[-1]
        unfused = unfused_fp8 if isinstance(module, FP8BlockLinear) else unfused_int8

        def forward(
            x, original=module.forward, projection=projection, module=module, unfused=unfused
        ):
            with counter.pause():
                out = original(x)
            rows = x.numel() // x.shape[-1]
            bias = module.bias is not None
            counter.add("linear_8bit", 1 if fused else unfused(rows, projection, bias))
            return out

        module.forward = forward
        wrapped.append(module)
    attention = decode_module.fp8_kv_decode_attention

    def counted_attention(*args, **kwargs):
        with counter.pause():
            out = attention(*args, **kwargs)
        counter.add("fp8_kv_attention", attention_kernels(batch, context))
        return out

    decode_module.fp8_kv_decode_attention = counted_attention
    try:
        yield
    finally:
        decode_module.fp8_kv_decode_attention = attention
        for module in wrapped:
            del module.forward


def count_step(engine, batch: int, tokens: int, fused: bool) -> tuple[float, Counter]:
    """Kernels per decode step: the count of `tokens` tokens less that of one, per token."""
    prompts = [list(range(3, 3 + PROMPT))] * batch
    for new in (tokens, 1):  # each length's first call builds its decoder: not a step
        sampling = SamplingParams(temperature=1.0, max_new_tokens=new, ignore_eos=True, seed=0)
        engine.generate_requests(prompts, [new] * batch, sampling)
    counts = []
    for new in (tokens, 1):
        counter = KernelCount()
        sampling = SamplingParams(temperature=1.0, max_new_tokens=new, ignore_eos=True, seed=0)
        with cuda_paths(counter, engine, fused, batch, PROMPT + tokens), counter:
            engine.generate_requests(prompts, [new] * batch, sampling)
        counts.append(counter.ops)
    per_step = (sum(counts[0].values()) - sum(counts[1].values())) / (tokens - 1)
    by_op = Counter({op: (counts[0][op] - counts[1][op]) / (tokens - 1) for op in counts[0]})
    return per_step, by_op


def h100_rows() -> dict:
    rows = json.loads(H100_TABLE.read_text())["rows"]
    return {
        (r["precision"], r["batch"]): r
        for r in rows
        if r.get("prompt_tokens") == PROMPT and "decode_tokens_per_s" in r
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench/results/decode-steps-cpu.json")
    parser.add_argument("--tokens", type=int, default=9, help="tokens decoded per count")
    parser.add_argument("--precisions", type=lambda s: s.split(","), default=PRECISIONS)
    args = parser.parse_args()
    if args.tokens < 2:
        parser.error("--tokens must be at least 2 (the step is the difference to one token)")
    measured = h100_rows()
    table = Table(
        args.out,
        model=f"qwen2, {SHAPE['num_hidden_layers']} layers at toy widths, random init",
        model_config=SHAPE,
        prompt_tokens=PROMPT,
        tokens=args.tokens,
        h100_source=str(H100_TABLE.relative_to(ROOT)),
        unfused_splits_on=f"H100, {H100_SMS} multiprocessors, Qwen2.5-1.5B widths",
    )
    counted = {}
    for precision in args.precisions:
        engine = gpu_engine(precision, torch.device("cpu"), SHAPE, eager=True)
        for batch in BATCHES:
            for fused in (True, False):
                counted[precision, batch, fused] = count_step(engine, batch, args.tokens, fused)
        engine.close()
    bf16 = measured[("bf16", 1)]
    excess = 1 / bf16["decode_tokens_per_s"] - 1 / bf16["floor_tokens_per_s"]
    per_kernel = excess / counted["bf16", 1, True][0]
    table.update(h100_seconds_per_kernel=per_kernel)
    for precision in args.precisions:
        for batch in BATCHES:
            kernels, by_op = counted[precision, batch, True]
            unfused, _ = counted[precision, batch, False]
            row = {
                "precision": precision,
                "batch": batch,
                "kernels_per_step": kernels,
                "kernels_per_step_unfused": unfused,
                "top_ops": dict(by_op.most_common(8)),
            }
            if (precision, batch) in measured:
                h100 = measured[precision, batch]
                floor_s = batch / h100["floor_tokens_per_s"]
                row["floor_h100_ms"] = 1e3 * floor_s
                row["predicted_h100_ms"] = 1e3 * (floor_s + kernels * per_kernel)
                row["predicted_h100_ms_unfused"] = 1e3 * (floor_s + unfused * per_kernel)
                row["measured_h100_ms_unfused"] = 1e3 * batch / h100["decode_tokens_per_s"]
            table.add(row)
            print(
                f"{precision:>10} batch {batch:>2}: {kernels:6.1f} kernels/step "
                f"(unfused {unfused:6.1f})"
                + (
                    f", H100 predicted {row['predicted_h100_ms']:.2f} ms "
                    f"(unfused {row['predicted_h100_ms_unfused']:.2f}, measured "
                    f"{row['measured_h100_ms_unfused']:.2f})"
                    if "predicted_h100_ms" in row
                    else ""
                ),
                flush=True,
            )
    print(f"fitted on bf16 batch 1: {per_kernel * 1e6:.2f} us per kernel; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
