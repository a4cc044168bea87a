"""Where the learner's step goes on the default job: the mean seconds a step spends in each
phase (`time/phase/*`, run.phase_times), over a run's training steps, beside the step's
wall time; the phases of the train step lie inside `time/train_s`, the rest is the loop's.

    python bench/learner_phases.py --launch [OVERRIDES...]   # runs the default job first
    python bench/learner_phases.py --run-dir runs/x          # a finished run
        [--out bench/results/learner-phases-cpu.json] [--label NAME]

Steps that evaluate or checkpoint are averaged with the others (eval.every, checkpoint_every
say how often); `eval` and `checkpoint` are shown per step as they fall over the run.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from asyncfp8.report.summary import per_step
from bench.common import Table

ROOT = Path(__file__).resolve().parents[1]
TRAIN_PHASES = ("prepare", "proximal", "forward", "backward", "guard", "optimizer")
LOOP_PHASES = ("publish", "eval", "checkpoint")
WALL = ("time/wait_s", "time/train_s", "time/step_total_s")


def phase_means(run_dir: Path) -> dict[str, float]:
    """Mean seconds per training step of every phase and wall-time key (0 for a phase a
    step did not run); ValueError when the run timed no phase."""
    steps = per_step(run_dir)
    if not steps or not any(k.startswith("time/phase/") for s in steps for k in s):
        raise ValueError(f"{run_dir}: no time/phase/* in its metrics (run.phase_times=false?)")
    means = {
        name: statistics.fmean(s.get(f"time/phase/{name}_s") or 0.0 for s in steps)
        for name in (*TRAIN_PHASES, *LOOP_PHASES)
    }
    means |= {key: statistics.fmean(s.get(key) or 0.0 for s in steps) for key in WALL}
    means["steps"] = len(steps)
    return means


def rows_of(means: dict[str, float]) -> list[dict]:
    """The table: each phase's mean and share of the step; inside the train step, what no
    phase covers (metrics, gathers); outside it, what neither the train step, the loop's
    phases nor the wait cover."""
    total = means["time/step_total_s"]
    train = means["time/train_s"]
    covered = sum(means[p] for p in TRAIN_PHASES if p != "proximal")  # proximal: in prepare
    loop = sum(means[p] for p in LOOP_PHASES)
    rows = [{"phase": p, "seconds": means[p], "where": "train step"} for p in TRAIN_PHASES]
    rows.append({"phase": "train step, untimed", "seconds": train - covered, "where": "train step"})
    rows += [{"phase": p, "seconds": means[p], "where": "loop"} for p in LOOP_PHASES]
    rows.append({"phase": "wait for data", "seconds": means["time/wait_s"], "where": "loop"})
    rest = total - train - loop - means["time/wait_s"]
    rows.append({"phase": "loop, untimed", "seconds": rest, "where": "loop"})
    for row in rows:
        row["share_of_step"] = row["seconds"] / total if total else None
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run-dir")
    parser.add_argument("--launch", nargs="*", metavar="OVERRIDE")
    parser.add_argument("--out", default=str(ROOT / "bench/results/learner-phases-cpu.json"))
    parser.add_argument("--label", default="default job")
    args = parser.parse_args()
    if (args.run_dir is None) == (args.launch is None):
        parser.error("give --run-dir or --launch, one of the two")
    run_dir = Path(args.run_dir or ROOT / "runs" / "learner-phases")
    if args.launch is not None:
        command = [sys.executable, "-m", "asyncfp8.launch", f"run.dir={run_dir}", *args.launch]
        print("[bench]", " ".join(command), flush=True)
        subprocess.run(command, check=True, cwd=ROOT)
    means = phase_means(run_dir)
    table = Table(args.out, label=args.label, run_dir=str(run_dir), overrides=args.launch)
    table.update(steps=means["steps"], step_total_s=means["time/step_total_s"])
    print(f"{args.label}: {means['steps']} steps, {means['time/step_total_s']:.3f} s a step")
    print(f"{'phase':<22} {'where':<11} {'s/step':>8} {'share':>6}")
    for row in rows_of(means):
        table.add(row)
        print(
            f"{row['phase']:<22} {row['where']:<11} {row['seconds']:>8.4f} "
            f"{row['share_of_step']:>6.1%}"
        )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
