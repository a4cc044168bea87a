"""Speculative decoding with an online-trained drafter, on the reference decode loop.

    python bench/speculative.py [--model tiny|small] [--rounds 6] [--steps 100] [--out ...]

Each round generates `--batch` rollouts by plain sampling (temperature `--temperature`,
exactly `--new-tokens` tokens with ignore_eos), feeds their hidden states to the drafter
trainer and trains `--steps` AdamW steps; before the first round and after every round it
measures, on `--held-out` held-out prompts and for each k in `--ks`, target forwards per
generated token (prefill included; 1.0 without speculation; hardware-independent) and the
mean accepted length (tokens per verify forward). At the end it times plain and
speculative decoding (the best k) at batch 1 and at batch `--held-out` on this machine:
the reference loop (transformers forwards over a DynamicCache), not the torch engine,
whose decode loop takes speculation over later. Table on stdout, JSON to `--out`.
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

from asyncfp8.engines.base import SamplingParams
from asyncfp8.engines.speculative.drafter import Drafter
from asyncfp8.engines.speculative.reference import generate
from asyncfp8.engines.speculative.training import DrafterTrainer
from asyncfp8.models import load_model, load_tokenizer, make_tiny_model
from asyncfp8.tasks import ArithmeticTask


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", choices=["tiny", "small"])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=100, help="training steps per round")
    parser.add_argument("--batch", type=int, default=32, help="rollouts per round")
    parser.add_argument("--held-out", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--ks", default="1,2,4,6,8")
    parser.add_argument("--repeats", type=int, default=3, help="timings: median of this many")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    ks = [int(k) for k in args.ks.split(",")]

    model_dir = make_tiny_model(args.model)
    model = load_model(str(model_dir), dtype=torch.float32).eval()
    tokenizer = load_tokenizer(str(model_dir))
    task = ArithmeticTask(seed=3)

    def prompts(start: int, count: int) -> list[list[int]]:
        return [tokenizer(task.prompt(i).text)["input_ids"] for i in range(start, start + count)]

    sampling = SamplingParams(
        temperature=args.temperature, max_new_tokens=args.new_tokens, ignore_eos=True
    )

    def run(batch_prompts, drafter=None, k=4, seed=0):
        return generate(
            model,
            batch_prompts,
            sampling,
            drafter=drafter,
            k=k,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            generator=torch.Generator().manual_seed(seed),
        )

    torch.manual_seed(0)
    drafter = Drafter(model)
    trainer = DrafterTrainer(drafter, lr=3e-3, batch_size=16, seed=0)
    held_out = prompts(100_000, args.held_out)

    def measure(round_: int) -> dict:
        row = {"round": round_, "train_steps": trainer.steps, **trainer.last, "ks": {}}
        for k in ks:
            rollout = run(held_out, drafter, k, seed=1)
            row["ks"][k] = {
                "target_forwards_per_token": rollout.forwards_per_token,
                "mean_accepted_length": rollout.mean_accepted_length,
                "acceptance_rate": rollout.accepted / rollout.drafted,
            }
        return row

    rows = [measure(0)]
    for round_ in range(1, args.rounds + 1):
        rollout = run(prompts(args.batch * round_, args.batch), seed=10 + round_)
        trainer.observe(rollout.hidden, rollout.input_ids, rollout.mask)
        trainer.train(args.steps)
        rows.append(measure(round_))

    header = f"{'round':>5} {'steps':>5} {'kl':>6} {'top1':>5} " + " ".join(
        f"{f'k={k} fwd/tok (len)':>20}" for k in ks
    )
    print(f"model {args.model}, temperature {args.temperature}, {args.new_tokens} new tokens")
    print(header)
    for row in rows:
        cells = " ".join(
            f"{row['ks'][k]['target_forwards_per_token']:>12.3f} "
            f"({row['ks'][k]['mean_accepted_length']:.2f})"
            for k in ks
        )
        kl = f"{row['kl']:.3f}" if "kl" in row else "-"
        top1 = f"{row['top1']:.2f}" if "top1" in row else "-"
        print(f"{row['round']:>5} {row['train_steps']:>5} {kl:>6} {top1:>5} {cells}")

    final = rows[-1]["ks"]
    best_k = min(ks, key=lambda k: final[k]["target_forwards_per_token"])
    timings = []
    for batch in (1, args.held_out):
        batch_prompts = held_out[:batch]
        for mode, k in (("plain", None), ("speculative", best_k)):
            seconds, tokens = [], 0
            for repeat in range(args.repeats):
                started = time.perf_counter()
                rollout = run(batch_prompts, drafter if k else None, k or 1, seed=repeat)
                seconds.append(time.perf_counter() - started)
                tokens = rollout.tokens
            median = statistics.median(seconds)
            timings.append(
                {
                    "batch": batch,
                    "mode": mode,
                    "k": k,
                    "seconds": median,
                    "tokens_per_s": tokens / median,
                    "target_forwards_per_token": rollout.forwards_per_token,
                }
            )
    print(
        f"\nwall clock on this machine (reference loop, {args.threads} thread(s)), best k={best_k}:"
    )
    for t in timings:
        print(
            f"  batch {t['batch']:>3} {t['mode']:>11}: {t['tokens_per_s']:8.1f} tokens/s, "
            f"{t['target_forwards_per_token']:.3f} target forwards per token"
        )
    out = args.out or f"bench/results/speculative-{args.model}-cpu.json"
    path = write_json(
        out,
        {
            "settings": vars(args),
            "rounds": rows,
            "best_k": best_k,
            "timings": timings,
            "drafter_metrics": trainer.metrics(),
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
