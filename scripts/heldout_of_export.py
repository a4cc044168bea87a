"""Held-out greedy pass@1 of the model a run exported (`<run.dir>/model/`, its masters in
BF16; exported from its latest checkpoint first if it has none), on the run's own
held-out prompts, as the learner evaluates (same prompts, greedy,
the run's max_new_tokens), with the FP32 forward of those weights.

    python scripts/heldout_of_export.py runs/parity/harsh_qfwd_seed* [--prompts 256]

It matters where the learner evaluated something else: with
`precision.learner_forward=quantized` the learner's held-out pass@1 is that of its
quantized forward (the rollout policy), not of the masters it exports.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from asyncfp8.export import MODEL_DIR, export_run
from asyncfp8.stats import binomial_se
from asyncfp8.tasks import build_task


@torch.no_grad()
def greedy_pass1(run_dir: Path, prompts: int) -> float:
    cfg = OmegaConf.load(run_dir / "config.yaml")
    model_dir = run_dir / MODEL_DIR
    if not model_dir.is_dir():  # a run from before the learner exported: from its checkpoint
        export_run(run_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    task = build_task(cfg.task, model_dir)
    heldout = task.heldout_prompts(prompts)
    config = GenerationConfig(
        do_sample=False,
        max_new_tokens=cfg.run.max_new_tokens,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    batch = tokenizer([p.text for p in heldout], return_tensors="pt", padding=True)
    output = model.generate(**batch, generation_config=config)
    completions = tokenizer.batch_decode(
        output[:, batch["input_ids"].shape[1] :], skip_special_tokens=True
    )
    return sum(task.score(c, p) for c, p in zip(completions, heldout, strict=True)) / len(heldout)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--prompts", type=int, default=256)
    args = parser.parse_args()
    torch.set_num_threads(1)
    for run_dir in args.runs:
        score = greedy_pass1(run_dir, args.prompts)
        print(
            f"{run_dir}: exported model's held-out greedy pass@1 {score:.3f} "
            f"(± {binomial_se(score, args.prompts):.3f} SE, {args.prompts} prompts)",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
