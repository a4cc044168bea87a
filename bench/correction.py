"""Cost of every correction on a [256, 8192] batch, against the loss it corrects.

    python bench/correction.py [--batch 256] [--tokens 8192] [--out bench/results/correction.json]

Three references, measured in the same run: the policy loss itself (PPO-clip forward
and backward on the same tensors), and a forward + backward of the tiny model's
loss on the batch (measured on a few sequences and scaled linearly by the sequence
count: each sequence costs the same). The goal is every method under 5% of the latter.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import median_seconds, write_json

from asyncfp8.correction import get_correction, registered_corrections
from asyncfp8.train.losses import aggregate, per_token_policy_loss


def model_step_seconds(batch: int, tokens: int, sample: int) -> float:
    from asyncfp8.models import load_model, make_tiny_model

    model = load_model(make_tiny_model("tiny", progress=False), dtype=torch.float32)
    ids = torch.randint(0, 256, (sample, tokens))

    def step():
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()

    return median_seconds(step, repeats=2) * batch / sample


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument(
        "--model-sample", type=int, default=2, help="sequences the model step is timed on"
    )
    parser.add_argument("--out", default="bench/results/correction.json")
    args = parser.parse_args()

    torch.manual_seed(0)
    shape = (args.batch, args.tokens)
    rollout = -torch.rand(shape) * 4 - 0.1
    learner = (rollout + 0.05 * torch.randn(shape)).clamp(max=0)
    lengths = torch.randint(args.tokens // 4, args.tokens + 1, (args.batch, 1))
    mask = torch.arange(args.tokens)[None] < lengths
    versions = torch.randint(5, 9, shape)
    advantages = torch.randn(args.batch)

    def policy_loss():
        logp = learner.clone().requires_grad_()
        loss, _ = per_token_policy_loss(logp, rollout, advantages)
        aggregate(loss, mask).backward()

    loss_s = median_seconds(policy_loss)
    model_s = model_step_seconds(args.batch, args.tokens, args.model_sample)
    rows = []
    for name in registered_corrections():
        correction = get_correction(name)
        seconds = median_seconds(lambda c=correction: c(learner, rollout, mask, versions, 9))
        rows.append(
            {
                "method": name,
                "seconds": seconds,
                "vs_policy_loss": seconds / loss_s,
                "vs_model_step": seconds / model_s,
            }
        )

    print(
        f"[{args.batch}, {args.tokens}] batch; policy loss fwd+bwd {loss_s * 1e3:.1f} ms; "
        f"tiny-model fwd+bwd {model_s:.1f} s (from {args.model_sample} sequences)"
    )
    print(f"{'method':<14} {'ms':>8} {'x policy loss':>14} {'% model step':>13}")
    for row in rows:
        print(
            f"{row['method']:<14} {row['seconds'] * 1e3:>8.1f} {row['vs_policy_loss']:>14.2f} "
            f"{100 * row['vs_model_step']:>12.2f}%"
        )
    worst = max(rows, key=lambda r: r["vs_model_step"])
    verdict = "meets" if worst["vs_model_step"] < 0.05 else "MISSES"
    print(
        f"slowest: {worst['method']} at {100 * worst['vs_model_step']:.2f}% of a model step "
        f"({verdict} the 5% goal)"
    )
    path = write_json(
        args.out,
        {
            "batch": args.batch,
            "tokens": args.tokens,
            "policy_loss_seconds": loss_s,
            "model_step_seconds": model_s,
            "model_sample": args.model_sample,
            "methods": rows,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
