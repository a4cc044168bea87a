"""Asynchronous vs synchronous RL, end to end, on this machine: one learner and two
torch-engine workers (the launcher), the same model, task and batch for every mode.

    python bench/e2e.py [--steps 150] [--model small] [--out bench/results/e2e-cpu.json]
    python bench/e2e.py --publish-compare [--out bench/results/e2e-publish-cpu.json]

The number that matters is trained samples per second in the steady state (the first
`--skip` steps, which include process start-up, are left out), for run.mode=sync (the
classic generate -> train -> publish loop, max_staleness 0) and run.mode=async with
max_staleness 1 and 4. Samples a worker made that were then dropped as too stale do not
count: they are wasted work.

`--publish-compare` runs one mode (async, max_staleness 1) twice instead, with the
version published on the learner's thread (`sync.background=false`, before) and in the
background (`sync.background=true`, after), and compares the learner's
`time/step_total_s` (and the publish time it still waits for, `sync/seconds`).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from asyncfp8.report.summary import per_step, summarize
from bench.common import write_json

PUBLISH_MODES = {
    "publish on the learner thread": [
        "run.mode=async",
        "run.max_staleness=1",
        "sync.background=false",
    ],
    "publish in the background": ["run.mode=async", "run.max_staleness=1", "sync.background=true"],
}
MODES = {
    "sync": ["run.mode=sync"],
    "async, max_staleness 1": ["run.mode=async", "run.max_staleness=1"],
    "async, max_staleness 4": ["run.mode=async", "run.max_staleness=4"],
}


def measure(name: str, overrides: list[str], args, root: Path) -> dict:
    run_dir = root / name.replace(" ", "_").replace(",", "")
    command = [
        sys.executable,
        "-m",
        "asyncfp8.launch",
        f"model={args.model}",
        # The job its published figures measured (docs/results.md): 8-token arithmetic.
        "task=arithmetic",
        "run.max_new_tokens=8",
        f"precision={args.precision}",
        f"run.steps={args.steps}",
        "run.workers=2",
        f"run.dir={run_dir}",
        "run.tensorboard=false",
        *overrides,
    ]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"{name}: the run failed\n{result.stdout[-2000:]}{result.stderr[-2000:]}")
    records = per_step(run_dir)
    first, last = records[args.skip - 1], records[-1]
    samples = (last["step"] - first["step"]) * args.groups * args.group_size
    seconds = last["time/elapsed_s"] - first["time/elapsed_s"]
    tail = records[args.skip :]
    steps = [r["time/step_total_s"] for r in tail]
    on_thread = [r["sync/seconds"] for r in tail if "sync/seconds" in r]
    waits = [r["sync/publish_wait_s"] for r in tail if "sync/publish_wait_s" in r]
    return {
        "step_total_s_median": statistics.median(steps),
        "step_total_s_mean": statistics.fmean(steps),
        "publish_on_learner_thread_s_median": statistics.median(on_thread) if on_thread else None,
        "publish_wait_s_median": statistics.median(waits) if waits else None,
        "mode": name,
        "trained_samples_per_s": samples / seconds,
        "seconds": seconds,
        "staleness_mean": sum(r["staleness/mean"] for r in tail) / len(tail),
        "learner_wait_frac": sum(r["time/wait_s"] for r in tail)
        / sum(r["time/step_total_s"] for r in tail),
        "generated_samples": last["total/samples"],
        "stale_groups_dropped": last["total/stale_groups"],
        "reward_last_20pct": summarize(run_dir)["reward_end"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--skip", type=int, default=20, help="warm-up steps left out")
    parser.add_argument("--model", default="small")
    parser.add_argument("--groups", type=int, default=8, help="run.groups_per_step (default)")
    parser.add_argument("--group-size", type=int, default=8, help="run.group_size (default)")
    parser.add_argument("--precision", default="bf16")
    parser.add_argument("--out", default=None)
    parser.add_argument(
        "--publish-compare",
        action="store_true",
        help="publish on the learner thread vs in the background, async max_staleness 1",
    )
    args = parser.parse_args()
    modes = PUBLISH_MODES if args.publish_compare else MODES
    args.out = args.out or (
        "bench/results/e2e-publish-cpu.json"
        if args.publish_compare
        else "bench/results/e2e-cpu.json"
    )
    with tempfile.TemporaryDirectory() as root:
        rows = [measure(name, overrides, args, Path(root)) for name, overrides in modes.items()]
    base = rows[0]["trained_samples_per_s"]
    print(
        f"\n{'mode':<31} {'trained samples/s':>17} {'vs first':>8} {'mean staleness':>14} "
        f"{'learner waits':>13} {'step s (median)':>15} {'publish s on thread':>19}"
    )
    ratio = "ratio_to_first" if args.publish_compare else "ratio_to_sync"
    for row in rows:
        row[ratio] = row["trained_samples_per_s"] / base
        print(
            f"{row['mode']:<31} {row['trained_samples_per_s']:>17.1f} {row[ratio]:>7.2f}x "
            f"{row['staleness_mean']:>14.2f} {row['learner_wait_frac']:>12.0%} "
            f"{row['step_total_s_median']:>15.4f} "
            f"{row['publish_on_learner_thread_s_median'] or 0:>19.4f}"
        )
    path = write_json(
        args.out,
        {
            "benchmark": "e2e-publish" if args.publish_compare else "e2e",
            "model": args.model,
            "precision": args.precision,
            "steps": args.steps,
            "skip": args.skip,
            "workers": 2,
            "rows": rows,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
