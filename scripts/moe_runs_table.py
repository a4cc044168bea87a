"""One markdown row per MoE run directory under the folder given: held-out greedy (end, its
standard error), sampled, mean k3, routing mismatch, replayed tokens, samples/s, collapse
and late slide (asyncfp8.report's definitions)."""

import json
import statistics
import sys
from pathlib import Path

from asyncfp8.report.stats import mean_ci


def row(run: Path) -> str:
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in steps if "moe/routing_mismatch" in r]
    summary = json.loads((run / "summary.json").read_text())
    k3s = [r["mismatch/kl_k3"] for r in steps if r.get("mismatch/kl_k3") is not None]
    mismatch = statistics.mean(r["moe/routing_mismatch"] for r in steps)
    replayed = statistics.mean(r.get("moe/replayed_tokens", 0) for r in steps)
    return (
        f"| {run.name} | {summary['eval_pass1_greedy_end']:.3f} ± "
        f"{summary['eval_pass1_greedy_end_se']:.3f} | {summary['eval_pass1_sampled_end']:.3f} | "
        f"{statistics.mean(k3s):.2e} | {mismatch:.2%} | {replayed:.0f} | "
        f"{summary['samples_per_s']:.1f} | {summary['collapsed']} | "
        f"{summary.get('late_slide', '-')} |"
    )


def summary(folder: Path) -> None:
    """Per setting (precision, replay): held-out greedy mean ± 95% t over its seeds; and
    replay on − off paired by seed within each precision."""
    runs = {}
    for run in sorted(folder.iterdir()):
        if (run / "summary.json").is_file():
            precision, seed, _, replay = run.name.split("-")
            held = json.loads((run / "summary.json").read_text())["eval_pass1_greedy_end"]
            runs[(precision, replay, seed)] = held
    for precision in sorted({key[0] for key in runs}):
        for replay in ("false", "true"):
            values = [v for (p, r, _), v in runs.items() if (p, r) == (precision, replay)]
            mean, half = mean_ci(values)
            if half is not None:
                print(f"{precision} replay={replay}: {mean:.3f} ± {half:.3f} ({len(values)} seeds)")
        seeds = sorted({s for (p, _, s) in runs if p == precision})
        diffs = [
            runs[(precision, "true", s)] - runs[(precision, "false", s)]
            for s in seeds
            if (precision, "true", s) in runs and (precision, "false", s) in runs
        ]
        mean, half = mean_ci(diffs)
        if half is not None:
            print(f"{precision} replay on − off: {mean:+.3f} ± {half:.3f} ({len(diffs)} pairs)")


if __name__ == "__main__":
    for run in sorted(Path(sys.argv[1]).iterdir()):
        if (run / "summary.json").is_file():
            print(row(run))
    summary(Path(sys.argv[1]))
