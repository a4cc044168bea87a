"""Where a GPU decode step's time goes: the rollout table's engine under torch.profiler.

    python bench/rollout_profile.py [--out bench/results/rollout-profile-<gpu>.json]
    python bench/rollout_profile.py --dry-run      (the same code on the CPU, toy sizes)

For each case (a precision at a context and batch, the ones where bench/rollout.py's
goals were missed), it builds the engine as bench/rollout.py does (the Qwen2.5-1.5B
shape, random init, CUDA-graph decode), times a generation of `--new-tokens` tokens and
one of 1 token (prefill and first token), and profiles each once. Per decode step:

- `wall_ms`: the difference of the two timings over the new tokens less one;
- `gpu_ms`: the difference of the two profiles' summed kernel time, the same way;
- `gpu_busy`: gpu_ms / wall_ms. Far under 1, the step waits on the host (Python
  bookkeeping, sampling, launches): kernels cannot explain the time.
- `kernels`: the heaviest kernels of the long generation, ms per decode step and share.

The JSON is written after every case.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Table, failure
from rollout import QWEN_1_5B, TOY, gpu_engine

from asyncfp8.engines import SamplingParams

# (precision, prompt tokens, batch): the goals of issue 48 were FP8 >= 1.5x BF16 at batch 1
# and FP8 KV >= 1.3x at 8k x 64; each against its BF16 case.
CASES = (
    ("bf16", 256, 1),
    ("fp8", 256, 1),
    ("int8", 256, 1),
    ("bf16", 8192, 64),
    ("fp8_kv", 8192, 64),
)
TOY_CASES = (("bf16", 8, 1), ("fp8", 8, 1), ("fp8_kv", 40, 4))


def kernel_times(profile) -> dict[str, float]:
    """Seconds of device time by kernel name: the device's own events only (a CPU op
    also carries the time of the kernels it launched)."""
    times: dict[str, float] = {}
    for event in profile.key_averages():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        spent = getattr(event, "self_device_time_total", None)
        if spent is None:
            spent = getattr(event, "self_cuda_time_total", 0.0)
        if spent:
            times[event.key] = times.get(event.key, 0.0) + spent / 1e6
    return times


def generation(engine, prompts, tokens: int, device) -> float:
    sampling = SamplingParams(temperature=1.0, max_new_tokens=tokens, ignore_eos=True, seed=0)
    if device.type == "cuda":
        torch.cuda.synchronize()
    begin = time.perf_counter()
    engine.generate_requests(prompts, [tokens] * len(prompts), sampling)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - begin


def profiled(engine, prompts, tokens: int, device) -> dict[str, float]:
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as profile:
        generation(engine, prompts, tokens, device)
    return kernel_times(profile)


def profile_case(engine, device, prompt_tokens: int, batch: int, new_tokens: int) -> dict:
    eos = engine.tokenizer.eos_token_id
    generator = torch.Generator(device=device).manual_seed(1)
    prompt = torch.randint(3, eos, (prompt_tokens,), device=device, generator=generator).tolist()
    prompts = [prompt] * batch
    for tokens in (new_tokens, 1):  # compiles, captures
        generation(engine, prompts, tokens, device)
    long_s = min(generation(engine, prompts, new_tokens, device) for _ in range(3))
    short_s = min(generation(engine, prompts, 1, device) for _ in range(3))
    steps = new_tokens - 1
    long_k, short_k = (
        profiled(engine, prompts, new_tokens, device),
        profiled(engine, prompts, 1, device),
    )
    wall = (long_s - short_s) / steps
    gpu = (sum(long_k.values()) - sum(short_k.values())) / steps
    per_step = {name: (spent - short_k.get(name, 0.0)) / steps for name, spent in long_k.items()}
    heaviest = sorted(per_step.items(), key=lambda item: -item[1])[:8]
    return {
        "wall_ms": wall * 1e3,
        "gpu_ms": gpu * 1e3,
        "gpu_busy": gpu / wall if wall > 0 else None,
        "tokens_per_s": batch * steps / (long_s - short_s) if long_s > short_s else None,
        "kernels": [
            {"name": name[:120], "ms": spent * 1e3, "share": spent / gpu if gpu > 0 else None}
            for name, spent in heaviest
        ],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--dry-run", action="store_true", help="the CPU, toy sizes, eager")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.dry_run:
        device, shape, cases, tag, eager = torch.device("cpu"), TOY, TOY_CASES, "dry-run", True
        args.new_tokens = min(args.new_tokens, 16)  # a toy step is short: enough to time
    elif not torch.cuda.is_available():
        print("bench/rollout_profile.py needs a CUDA GPU (or --dry-run)", file=sys.stderr)
        return 1
    else:
        from kernels import device_tag

        device, shape, cases, tag, eager = (
            torch.device("cuda"),
            QWEN_1_5B,
            CASES,
            device_tag(),
            False,
        )
    out = args.out or Path(__file__).resolve().parent / "results" / f"rollout-profile-{tag}.json"
    table = Table(out, new_tokens=args.new_tokens, cuda_graph=not eager)
    print(
        f"{'precision':<11} {'prompt':>6} {'batch':>5} {'wall ms':>8} {'gpu ms':>7} {'busy':>5}  "
        f"heaviest kernels"
    )
    for precision, prompt_tokens, batch in cases:
        row = {"precision": precision, "prompt_tokens": prompt_tokens, "batch": batch}
        engine = None
        try:
            engine = gpu_engine(precision, device, shape, eager)
            row |= profile_case(engine, device, prompt_tokens, batch, args.new_tokens)
        except Exception as err:  # the other cases are still measured
            row["error"] = failure(err)
        table.add(row)
        if "error" in row:
            print(f"{precision:<11} {prompt_tokens:>6} {batch:>5} failed: {row['error']}")
        else:
            top = ", ".join(f"{k['name'][:40]} {k['ms']:.3f}" for k in row["kernels"][:3])
            busy = f"{row['gpu_busy']:.2f}" if row["gpu_busy"] is not None else "-"
            print(
                f"{precision:<11} {prompt_tokens:>6} {batch:>5} {row['wall_ms']:>8.3f} "
                f"{row['gpu_ms']:>7.3f} {busy:>5}  {top}"
            )
        if engine is not None:
            engine.close()
        del engine
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
