"""The kernels one decode step launches with the step compiled (`engine.compile`), per
precision, counted on this CPU beside the eager count of bench/decode_steps.py, and the
step an H100 would take by the count (the same per-kernel cost and floors).

    python bench/decode_steps_compiled.py [--out bench/results/decode-steps-compiled-cpu.json]
        [--precisions bf16,fp8,int8] [--batches 1,64] [--layers 28]

How it counts. Inside the step: the launches in the `call` of the code inductor generates
for it (`run_and_get_code`): its fused kernels, and the extern ones (GEMMs, attention).
Outside it: the compiled sampler's launches (its generated code too), and the slot
loop's bookkeeping, eager: the aten ops that launch a kernel (decode_steps.KernelCount),
counted with the step and the sampler paused. Inductor here emits
C++ kernels; on CUDA it emits Triton ones from the same graph, and the 8-bit linears there
are asyncfp8's fused Triton kernels (one launch each, counted as one here whatever the CPU
reference's GEMMs are; its quantizer, fused into a C++ kernel of its own here, is inside
that launch on CUDA and still counted), so the count estimates the CUDA step's.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections import Counter
from pathlib import Path

import torch
from torch._inductor.utils import run_and_get_code

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Table
from decode_steps import PROMPT, SHAPE, KernelCount, h100_rows
from rollout import gpu_engine

from asyncfp8.engines import SamplingParams, slot_loop
from asyncfp8.engines.request_sampling import SAMPLE, CompiledSampler, stream_keys
from asyncfp8.precision.fp8 import FP8BlockLinear
from asyncfp8.precision.int8 import Int8Linear

ROOT = Path(__file__).resolve().parents[1]
EAGER_TABLE = ROOT / "bench" / "results" / "decode-steps-cpu.json"
# a statement of the generated `call` that launches a kernel: a fused kernel or an extern
LAUNCH = re.compile(
    r"^\s+(?:\w+ = )?(cpp_fused_\w+|extern_kernels\.\w+|torch\.ops\.[\w.]+)\(", re.M
)
# the CPU references' GEMMs of one 8-bit linear, one fused Triton launch on CUDA
EIGHT_BIT_GEMMS = {"extern_kernels._scaled_mm", "extern_kernels._int_mm"}


def step_code_launches(code: str) -> Counter:
    """Kernel launches in the generated `call` of one compiled graph, by kernel kind."""
    body = code[code.index("def call(") :]
    launches = Counter()
    for name in LAUNCH.findall(body):
        launches["fused" if name.startswith("cpp_fused_") else name] += 1
    return launches


class Paused:
    """`run` called with `counter` paused: its kernels are counted elsewhere."""

    def __init__(self, run, counter: KernelCount):
        self.run, self.counter = run, counter

    def __call__(self, *args):
        with self.counter.pause():
            return self.run(*args)


def outside_step(engine, batch: int, tokens: int) -> float:
    """Eager kernels per decode step outside the step and its sampler (bookkeeping)."""
    prompts = [list(range(3, 3 + PROMPT))] * batch
    counts = []
    sampler = slot_loop.step_sampler
    for new in (tokens, 1):
        sampling = SamplingParams(temperature=1.0, max_new_tokens=new, ignore_eos=True, seed=0)
        engine.generate_requests(prompts, [new] * batch, sampling)  # builds its decoder
        decoder, counter = engine._slot_decoder, KernelCount()
        decoder._run_step = Paused(decoder._run_step, counter)
        slot_loop.step_sampler = lambda compiled, counter=counter: Paused(
            sampler(compiled), counter
        )
        try:
            with counter:
                engine.generate_requests(prompts, [new] * batch, sampling)
        finally:
            del decoder._run_step
            slot_loop.step_sampler = sampler
        counts.append(sum(counter.ops.values()))
    return (counts[0] - counts[1]) / (tokens - 1)


def sampler_launches(batch: int, vocab: int) -> Counter:
    """The compiled sampler's launches for one step of `batch` rows (temperature 1)."""
    logits = torch.randn(batch, vocab)
    keys = stream_keys(torch.arange(batch), SAMPLE)
    sampling = SamplingParams(temperature=1.0)
    _, codes = run_and_get_code(
        lambda: CompiledSampler()(logits, sampling, keys, torch.zeros(batch, dtype=torch.long))
    )
    return step_code_launches(codes[0])


def compiled_step(precision: str, batch: int, shape: dict) -> tuple[Counter, float, int]:
    """(the compiled step's launches by kind, seconds to compile and run it once, the
    model's 8-bit linears)."""
    engine = gpu_engine(precision, torch.device("cpu"), shape, eager=True, compile=True)
    prompts = [list(range(3, 3 + PROMPT))] * batch
    sampling = SamplingParams(temperature=1.0, max_new_tokens=2, ignore_eos=True, seed=0)
    started = time.perf_counter()
    _, codes = run_and_get_code(lambda: engine.generate_requests(prompts, [2] * batch, sampling))
    seconds = time.perf_counter() - started
    # the step's graph and the compiled sampler's (much the smaller)
    if not engine._slot_decoder.compiled or len(codes) != 2:
        raise RuntimeError(f"{precision} batch {batch}: the step did not compile to one graph")
    codes = sorted(codes, key=len)[1:]
    linears = sum(isinstance(m, FP8BlockLinear | Int8Linear) for m in engine.model.modules())
    engine.close()
    return step_code_launches(codes[0]), seconds, linears


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench/results/decode-steps-compiled-cpu.json")
    parser.add_argument(
        "--precisions", type=lambda s: s.split(","), default=["bf16", "fp8", "int8"]
    )
    parser.add_argument("--batches", type=lambda s: [int(b) for b in s.split(",")], default=[1, 64])
    parser.add_argument("--layers", type=int, default=SHAPE["num_hidden_layers"])
    parser.add_argument("--tokens", type=int, default=5, help="tokens decoded per outside count")
    args = parser.parse_args()
    if args.tokens < 2:
        parser.error("--tokens must be at least 2 (the step is the difference to one token)")
    shape = SHAPE | {"num_hidden_layers": args.layers}
    eager_table = json.loads(EAGER_TABLE.read_text())
    eager = {(r["precision"], r["batch"]): r for r in eager_table["rows"]}
    per_kernel = eager_table["h100_seconds_per_kernel"]
    measured = h100_rows()
    table = Table(
        args.out,
        model=f"qwen2, {args.layers} layers at toy widths, random init",
        prompt_tokens=PROMPT,
        h100_seconds_per_kernel=per_kernel,
        eager_source=str(EAGER_TABLE.relative_to(ROOT)),
    )
    for precision in args.precisions:
        for batch in args.batches:
            launches, seconds, linears = compiled_step(precision, batch, shape)
            gemms_8bit = sum(launches[name] for name in EIGHT_BIT_GEMMS)
            # on CUDA one fused Triton launch per 8-bit linear, whatever the CPU's GEMMs
            inside = sum(launches.values()) - gemms_8bit + linears
            engine = gpu_engine(precision, torch.device("cpu"), shape, eager=True)
            sampler = sampler_launches(batch, engine.model.config.vocab_size)
            outside = outside_step(engine, batch, args.tokens) + sum(sampler.values())
            engine.close()
            row = {
                "precision": precision,
                "batch": batch,
                "kernels_per_step": inside + outside,
                "kernels_in_step": inside,
                "kernels_outside_step": outside,
                "launches_by_kind": dict(launches),
                "sampler_launches": dict(sampler),
                "eight_bit_gemms_cpu": gemms_8bit,
                "eight_bit_linears": linears,
                "compile_and_first_run_s": round(seconds, 1),
            }
            if (precision, batch) in eager and args.layers == SHAPE["num_hidden_layers"]:
                row["kernels_per_step_eager"] = eager[precision, batch]["kernels_per_step"]
            if (precision, batch) in measured and args.layers == SHAPE["num_hidden_layers"]:
                floor_s = batch / measured[precision, batch]["floor_tokens_per_s"]
                row["predicted_h100_ms"] = 1e3 * (floor_s + row["kernels_per_step"] * per_kernel)
            table.add(row)
            print(
                f"{precision:>6} batch {batch:>2}: {row['kernels_per_step']:.0f} kernels/step "
                f"({inside} in the compiled step, {outside:.0f} outside; eager "
                f"{row.get('kernels_per_step_eager', '-')}), compiled in {seconds:.0f} s",
                flush=True,
            )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
