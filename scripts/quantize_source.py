"""Which weights should a rollout be quantized from (issue 26, part 6): the learner's FP32
masters, or those masters rounded to BF16, the weights a BF16 learner forward uses
(`precision.quantize_from=master|compute`)? Measured as the mismatch KL between the
rollout engine and the learner, on trained masters.

    python scripts/quantize_source.py runs/parity/bf16_seed* [--prompts 512] [--seeds 0 1 2]
        [--json docs/results/quantize_source.json]

Each run directory gives its latest checkpoint's FP32 masters (trained by RL, so off the
BF16 grid the shipped model starts on: at step 0 the two sources are the same weights).
For each precision (fp8, int8) and source, the torch engine is loaded with the policy's
tensors of those masters and samples `--prompts` stream prompts of the run's task at
temperature 1 (sampling seed from --seeds); the learner recomputes the log-probs of the
sampled tokens, once in BF16 (the masters cast to BF16, what FSDP2's mixed precision
does on a GPU) and once in FP32 (the learner's default on a CPU), and k3 = r - log r - 1
with r = pi_learner / pi_engine is averaged over the tokens (the run's `mismatch/kl_k3`).
Printed: k3 per precision, learner dtype and source, mean ± 95% CI over runs × seeds, and
the ratio master/compute paired by run and seed. The JSON holds every measurement.
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import sys
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

from asyncfp8.correction import get_correction
from asyncfp8.demo import learner_logprobs
from asyncfp8.engines import SamplingParams
from asyncfp8.engines.torch_engine import TorchEngine
from asyncfp8.export import checkpoint_dir, checkpoint_state
from asyncfp8.models import load_model
from asyncfp8.models.run_model import run_model_dir
from asyncfp8.precision import build_policy
from asyncfp8.report.stats import mean_ci
from asyncfp8.tasks import build_task

PRECISIONS = ("fp8", "int8")
SOURCES = ("master", "compute")
LEARNER_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def k3_of(learner, samples) -> float:
    return get_correction("none")(*learner_logprobs(learner, samples)).metrics["mismatch/kl_k3"]


def measure(run_dir: Path, prompts: int, seeds: list[int], max_new_tokens: int) -> list[dict]:
    cfg = OmegaConf.load(run_dir / "config.yaml")
    model_dir = run_model_dir(cfg)
    checkpoint = checkpoint_dir(run_dir, step=None)  # the latest
    masters = {n: t.float() for n, t in checkpoint_state(checkpoint, model_dir).items()}
    learners = {}
    for label, dtype in LEARNER_DTYPES.items():
        model = load_model(model_dir, dtype=torch.float32)
        model.load_state_dict(masters, strict=False)  # tied weights appear once or twice
        learners[label] = model.to(dtype).eval()
    off_grid = sum(int((t != t.bfloat16().float()).sum()) for t in masters.values()) / sum(
        t.numel() for t in masters.values()
    )
    task = build_task(cfg.task, model_dir)
    texts = [task.prompt(i).text for i in range(prompts)]
    rows = []
    for precision, source in itertools.product(PRECISIONS, SOURCES):
        policy = build_policy({"name": precision, "quantize_from": source}, model_dir)
        weights = (
            masters if source == "master" else {n: t.to(torch.bfloat16) for n, t in masters.items()}
        )
        engine = TorchEngine(str(model_dir), policy, device="cpu")
        engine.update_weights(0, dict(policy.quantize_weights(weights.items())))
        for seed in seeds:
            started = time.perf_counter()
            sampling = SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens, seed=seed)
            samples = engine.generate(texts, sampling)
            row = {
                "run": str(run_dir),
                "checkpoint": checkpoint.name,
                "masters_off_bf16_grid": off_grid,
                "precision": precision,
                "source": source,
                "seed": seed,
                "tokens": sum(len(s.token_ids) for s in samples),
            }
            for label, learner in learners.items():
                row[f"k3_learner_{label}"] = k3_of(learner, samples)
            row["seconds"] = time.perf_counter() - started
            print(
                f"  {run_dir.name} {precision:4s} from {source:7s} seed {seed}: "
                + ", ".join(
                    f"k3 vs {d} learner {row[f'k3_learner_{d}']:.3e}" for d in LEARNER_DTYPES
                ),
                flush=True,
            )
            rows.append(row)
    return rows


def summarize(rows: list[dict]) -> list[dict]:
    """Per precision and learner dtype: each run's k3 (its mean over the sampling seeds,
    which share one model and so are not independent), then mean ± 95% CI over runs, and
    the ratio master/compute paired by run."""
    groups = []
    for precision, dtype in itertools.product(PRECISIONS, LEARNER_DTYPES):
        key = f"k3_learner_{dtype}"
        by_source = {}
        for source in SOURCES:
            per_run: dict[str, list[float]] = {}
            for r in rows:
                if r["precision"] == precision and r["source"] == source:
                    per_run.setdefault(r["run"], []).append(r[key])
            by_source[source] = {run: sum(v) / len(v) for run, v in per_run.items()}
        paired = sorted(set(by_source["master"]) & set(by_source["compute"]))
        ratios = [by_source["master"][run] / by_source["compute"][run] for run in paired]
        group = {"precision": precision, "learner_dtype": dtype, "runs": len(paired)}
        for source in SOURCES:
            group[f"k3_{source}_mean"], group[f"k3_{source}_ci95"] = mean_ci(
                list(by_source[source].values())
            )
        group["ratio_master_over_compute_mean"], group["ratio_ci95"] = mean_ci(ratios)
        groups.append(group)
    return groups


def print_table(groups: list[dict], seeds: list[int]) -> None:
    runs = groups[0]["runs"] if groups else 0
    print(
        f"\nk3 (engine vs learner): each run's mean over {len(seeds)} sampling seeds, then "
        f"mean ± 95% CI over {runs} runs"
    )
    print(
        f"{'precision':10s}{'learner':10s}{'from master':>24s}{'from compute':>24s}"
        f"{'master/compute':>20s}"
    )
    for g in groups:
        cells = []
        for source in SOURCES:
            mean, half = g[f"k3_{source}_mean"], g[f"k3_{source}_ci95"]
            cells.append(f"{mean:.3e} ± {half:.1e}" if half is not None else f"{mean:.3e}")
        ratio, half = g["ratio_master_over_compute_mean"], g["ratio_ci95"]
        ratio_cell = f"{ratio:.3f} ± {half:.3f}" if half is not None else f"{ratio:.3f}"
        print(
            f"{g['precision']:10s}{g['learner_dtype']:10s}{cells[0]:>24s}{cells[1]:>24s}{ratio_cell:>20s}"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="*", type=Path, help="run directories with checkpoints")
    parser.add_argument("--prompts", type=int, default=512)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--max-new-tokens", type=int, default=None, help="default: the run's")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--table", action="store_true", help="only print the table of an earlier --json"
    )
    args = parser.parse_args()
    if args.table:
        saved = json.loads(args.json.read_text())
        print_table(summarize(saved["rows"]), saved["seeds"])
        return 0
    if not args.runs:
        parser.error("give run directories (or --table --json FILE)")
    torch.set_num_threads(1)
    started = time.perf_counter()
    rows = []
    for run_dir in args.runs:
        cfg = OmegaConf.load(run_dir / "config.yaml")
        tokens = args.max_new_tokens or cfg.run.max_new_tokens
        rows += measure(run_dir, args.prompts, args.seeds, tokens)
    groups = summarize(rows)
    print_table(groups, args.seeds)
    wall = time.perf_counter() - started
    print(f"{wall:.0f} s on {platform.processor() or platform.machine()}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        record = {
            "machine": platform.platform(),
            "cpu": platform.processor() or platform.machine(),
            "torch": torch.__version__,
            "prompts": args.prompts,
            "seeds": args.seeds,
            "wall_s": wall,
            "groups": groups,
            "rows": rows,
        }
        args.json.write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
