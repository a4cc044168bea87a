"""Held-out greedy pass@1 of the model a run exported (`<run.dir>/model/`, its masters in
BF16; exported from its latest checkpoint first if it has none), on the run's own
held-out prompts, as the learner evaluates (same prompts, greedy,
the run's max_new_tokens), with the FP32 forward of those weights.

    python scripts/heldout_of_export.py runs/parity/harsh_qfwd_seed* [--prompts 256]
    python scripts/heldout_of_export.py runs/stability/fp8_seed4 --step 280 --quantized
        [--json scores.json]

It matters where the learner evaluated something else: with
`precision.learner_forward=quantized` the learner's held-out pass@1 is that of its
quantized forward (the rollout policy), not of the masters it exports.

`--step N` evaluates the run's checkpoint of step N instead (exported to a temporary
directory). `--quantized` also evaluates the same weights through the run's precision as
its engine computes them (the policy's fake-quantized forward,
`precision.learner_forward=quantized`): where the masters fell and the rollout policy did
not, the two part; where the weights themselves broke, both fall.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from asyncfp8.export import MODEL_DIR, export_run
from asyncfp8.precision import build_policy
from asyncfp8.report.stats import binomial_se
from asyncfp8.tasks import build_task


@torch.no_grad()
def greedy_pass1(run_dir: Path, model_dir: Path, prompts: int, quantized: bool = False) -> float:
    cfg = OmegaConf.load(run_dir / "config.yaml")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if quantized:
        precision = OmegaConf.to_container(cfg.precision, resolve=True)
        precision["learner_forward"] = "quantized"
        model = build_policy(precision, model_dir).prepare_learner(model)
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


def evaluated_model(run_dir: Path, step: int | None, scratch: Path) -> tuple[Path, str]:
    """The model directory to evaluate and what it is."""
    if step is not None:
        out = scratch / f"{run_dir.name}-step{step}"
        export_run(run_dir, step, out)
        return out, f"checkpoint of step {step}"
    if not (run_dir / MODEL_DIR).is_dir():  # a run from before the learner exported
        export_run(run_dir)
    return run_dir / MODEL_DIR, "exported model"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--step", type=int, default=None, help="a checkpoint's step")
    parser.add_argument("--quantized", action="store_true", help="also through the run's precision")
    parser.add_argument("--json", type=Path, help="also write {run: {forward: pass@1}} here")
    args = parser.parse_args()
    scores: dict[str, dict[str, float]] = {}
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as scratch:
        for run_dir in args.runs:
            model_dir, what = evaluated_model(run_dir, args.step, Path(scratch))
            forwards = (False, True) if args.quantized else (False,)
            for quantized in forwards:
                score = greedy_pass1(run_dir, model_dir, args.prompts, quantized)
                forward = "quantized forward" if quantized else "FP32 forward"
                scores.setdefault(str(run_dir), {})[forward] = score
                print(
                    f"{run_dir}: {what}'s held-out greedy pass@1 {score:.3f} ({forward}; "
                    f"± {binomial_se(score, args.prompts):.3f} SE, {args.prompts} prompts)",
                    flush=True,
                )
    if args.json:
        args.json.write_text(json.dumps({"prompts": args.prompts, "runs": scores}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
