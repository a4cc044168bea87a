"""Where asynchrony pays on one host: the separate placement's asynchronous speed-up over
`run.mode=sync`, for N cores (1 and every core this process may use) and 1 or 2 workers,
and what the planner's RL-step model (`asyncfp8.plan.rlstep.step_times`) predicts from
the synchronous run's own phases.

    python bench/scaling.py [--steps 150] [--cores 1 2] [--workers 1 2]
                            [--out bench/results/scaling-cpu.json]

Each run is the launcher's default job (as `bench/peers.py` runs it: `small` model,
`addition`, 8 prompts × 8 samples, 40 new tokens; held-out evaluation off),
`run.placement=separate`, its CPU affinity set to the first N cores (the learner and the
workers inherit it and split those cores between them: `asyncfp8.run.process.set_threads`).
Asynchronous runs use `run.max_staleness=1`. Trained samples/s: the steps after the
first `--skip` over their seconds.

The planner's check: from a synchronous run, the generation time (the learner's wait for
trajectories), the training time and the publish on the learner's thread; the planner
predicts the asynchronous step as the longer of generation and training + publishing,
a model of rollout and training on devices of their own. The table sets that beside the
asynchronous step measured with the same N and workers.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import Table
from bench.peers import compose, run_asyncfp8

MODES = {"sync": ["run.mode=sync"], "async": ["run.mode=async", "run.max_staleness=1"]}


def planner_prediction(sync_row: dict, cores: int, workers: int) -> dict:
    """The planner's asynchronous step from a synchronous run's phases (medians): the
    rollout as measured (its long tail included), the learner's training, and the
    version's publish on the learner's thread as its transfer. Beside it, the bound the
    planner lacks when both sides share the host's `cores`: overlapped, the step cannot
    take less than the core-seconds the synchronous step kept busy over `cores` (the
    generation on min(workers × threads, cores) cores, the learner on min(threads,
    cores); every process runs `threads` = cores ÷ processes, at least 1)."""
    from asyncfp8.plan.rlstep import WeightSync, step_times

    phases = sync_row["phase_s_median"]
    publish = phases["publish_on_thread"] or 0.0
    sync = WeightSync("full", 0.0, 0.0, publish, 0.0)
    times = step_times(phases["generate"], phases["generate"], phases["train"], sync, 1)
    threads = max(1, cores // (workers + 1))
    busy = (
        phases["generate"] * min(workers * threads, cores)
        + (phases["train"] + publish) * min(threads, cores)
    ) / cores
    shared = max(times["step_async_s"], busy)
    return {
        "predicted_async_step_s": times["step_async_s"],
        # against the sync step the planner would compute from the same phases
        "predicted_speedup": times["async_speedup"],
        "shared_cores_async_step_s": shared,
        "shared_cores_speedup": times["step_sync_s"] / shared,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    usable = sorted(os.sched_getaffinity(0))
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--skip", type=int, default=20, help="warm-up steps left out")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--cores", type=int, nargs="+", default=sorted({1, len(usable)}), help="values of N"
    )
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--out", default="bench/results/scaling-cpu.json")
    parser.add_argument(
        "--report", type=Path, help="print the table of a JSON this wrote (predictions redone)"
    )
    args = parser.parse_args()
    if args.report:
        rows = json.loads(args.report.read_text())["rows"]
        for sync_row, async_row in zip(rows[::2], rows[1::2], strict=True):
            async_row.update(planner_prediction(sync_row, sync_row["cores"], sync_row["workers"]))
        print_table(rows)
        return 0
    if max(args.cores) > len(usable):
        parser.error(f"--cores: this process may use {len(usable)} cores ({usable})")
    job = [
        f"run.steps={args.steps}",
        f"run.seed={args.seed}",
        "eval.every=0",
        "run.tensorboard=false",
        "run.placement=separate",
    ]
    cfg = compose(job)
    samples_per_step = cfg.run.groups_per_step * cfg.run.group_size
    table = Table(
        args.out,
        benchmark="scaling",
        job="the launcher's default job, eval.every=0, run.placement=separate",
        steps=args.steps,
        skip=args.skip,
        seed=args.seed,
    )
    with tempfile.TemporaryDirectory(prefix="scaling-") as root:
        for cores in args.cores:
            for workers in args.workers:
                rows = {}
                for mode, overrides in MODES.items():
                    name = f"N={cores}, {workers} worker(s), {mode}"
                    print(f"{name}: {args.steps} steps ...", flush=True)
                    out = Path(root) / f"n{cores}_w{workers}_{mode}"
                    row = run_asyncfp8(
                        [*job, f"run.workers={workers}", *overrides],
                        out,
                        args.skip,
                        samples_per_step,
                        cores=set(usable[:cores]),
                    )
                    row.update(cores=cores, workers=workers, mode=mode)
                    row.pop("model_dir")
                    rows[mode] = row
                rows["async"]["speedup_vs_sync"] = (
                    rows["async"]["trained_samples_per_s"] / rows["sync"]["trained_samples_per_s"]
                )
                rows["async"].update(planner_prediction(rows["sync"], cores, workers))
                rows["async"]["measured_async_step_s"] = rows["async"]["phase_s_median"]["step"]
                for row in rows.values():
                    table.add(row)
    print_table(table.rows)
    print(f"wrote {args.out}")
    return 0


def print_table(rows: list[dict]) -> None:
    print(
        f"\n{'N':>2} {'workers':>7} {'mode':>5} {'samples/s':>9} {'async/sync':>10} "
        f"{'step s':>7} {'generate':>8} {'train':>6} {'publish':>7} "
        f"{'planner: step / speed-up':>24} {'shared-cores bound: step / speed-up':>35}"
    )
    for row in rows:
        phases = row["phase_s_median"]
        speedup, planner, shared = "1.00x", "", ""
        if row["mode"] == "async":
            speedup = f"{row['speedup_vs_sync']:.2f}x"
            planner = f"{row['predicted_async_step_s']:.3f} / {row['predicted_speedup']:.2f}x"
            shared = f"{row['shared_cores_async_step_s']:.3f} / {row['shared_cores_speedup']:.2f}x"
        print(
            f"{row['cores']:>2} {row['workers']:>7} {row['mode']:>5} "
            f"{row['trained_samples_per_s']:>9.1f} {speedup:>10} "
            f"{phases['step']:>7.3f} {phases['generate']:>8.3f} {phases['train']:>6.3f} "
            f"{phases['publish_on_thread'] or 0:>7.3f} {planner:>24} {shared:>35}"
        )


if __name__ == "__main__":
    raise SystemExit(main())
