"""What the guard (docs/running.md#the-guard-undoing-a-fatal-step) adds to a training step,
against the step's own forward and backward.

    python bench/guard.py [--groups 8] [--group-size 8] [--tokens 48]
        [--out bench/results/guard.json]

Per model (the shipped `small`, and `tiny` when it is cached or `--tiny` names it): the
copy of the good state the guard writes every step (weights and AdamW's two moments to
host memory, `LastGood.keep`), its evidence on a batch of the default job's shape
(`add_token_evidence`), and a forward + backward of the model on that batch.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import median_seconds, write_json

from asyncfp8.models import load_model
from asyncfp8.train.batches import TrainBatch
from asyncfp8.train.evidence import add_token_evidence
from asyncfp8.train.guard import Evidence
from asyncfp8.train.rollback import LastGood


def measure(name: str, model_dir: Path, rows: int, tokens: int) -> dict:
    model = load_model(model_dir, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, model.config.vocab_size, (rows, tokens))

    def train_step():
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    train_s = median_seconds(train_step, repeats=3)  # also gives AdamW its state
    saved = LastGood(model, optimizer)
    keep_s = median_seconds(lambda: saved.keep(0), repeats=5)
    zeros = torch.zeros(rows, tokens, dtype=torch.long)
    mask = torch.ones(rows, tokens, dtype=torch.bool)
    micro = TrainBatch(zeros, zeros, zeros, -torch.rand(rows, tokens) * 3, zeros, mask)
    logp = micro.rollout_logp + 0.05 * torch.randn(rows, tokens)
    evidence_s = median_seconds(
        lambda: add_token_evidence(logp, micro, 20.0, None, Evidence()), repeats=5
    )
    parameters = sum(p.numel() for p in model.parameters())
    return {
        "model": name,
        "parameters": parameters,
        "state_mib": saved.nbytes / 2**20,
        "keep_s": keep_s,
        "evidence_s": evidence_s,
        "train_step_s": train_s,
        "guard_share": (keep_s + evidence_s) / train_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=48, help="prompt + answer per sample")
    parser.add_argument("--tiny", help="a tiny model's directory (default: the cached one)")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (the learner's share)"
    )
    parser.add_argument("--out", default="bench/results/guard.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from asyncfp8.models.tiny import make_tiny_model, shipped_on

    torch.manual_seed(0)
    models = {"small": shipped_on("small", "addition")}
    models["tiny"] = Path(args.tiny) if args.tiny else make_tiny_model("tiny", progress=False)
    rows = args.groups * args.group_size
    results = [measure(name, path, rows, args.tokens) for name, path in models.items()]
    print(
        f"{'model':<6} {'params':>9} {'state MiB':>9} {'keep ms':>8} {'evidence ms':>11} "
        f"{'step ms':>8} {'guard/step':>10}"
    )
    for r in results:
        print(
            f"{r['model']:<6} {r['parameters']:>9} {r['state_mib']:>9.1f} "
            f"{r['keep_s'] * 1e3:>8.2f} {r['evidence_s'] * 1e3:>11.3f} "
            f"{r['train_step_s'] * 1e3:>8.1f} {r['guard_share']:>10.1%}"
        )
    print(
        f"written {write_json(args.out, {'rows': rows, 'tokens': args.tokens, 'results': results})}"
    )


if __name__ == "__main__":
    main()
