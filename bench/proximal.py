"""What π_prox of the sample's version (`correction.proximal=version`, what the default
`auto` takes on one learner rank) costs in trained samples/s, against π_prox of the
current weights, on a job whose learner is the bottleneck.

    python bench/proximal.py [--model-path DIR] [--steps 60] [--repeats 3]
        [--out bench/results/proximal-cpu.json]

The job is bench/cluster.py's (the small model, 60 steps of 8 groups of 8, a learner and
two workers as separate processes, one thread each): on two cores its learner is busy
about 0.9 of a core and the rollouts wait on it, so the learner's extra forward (without
gradient, over the micro-batches holding stale tokens) shows in full. The default job
(one colocated process) hides most of it behind the rollouts. Runs alternate (current,
version, version, current, ...) and each repeat's pair gives one ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.cluster import measure, paired_ratios
from bench.common import write_json

MODES = {"current": ["correction.proximal=current"], "version": ["correction.proximal=version"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--skip", type=int, default=10, help="warm-up steps left out")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", default="small")
    parser.add_argument("--model-path", default=None, help="a model made already (model.path)")
    parser.add_argument("--out", default="bench/results/proximal-cpu.json")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for repeat in range(args.repeats):
            for mode in list(MODES)[:: 1 if repeat % 2 == 0 else -1]:
                row = measure(
                    mode, args, Path(scratch) / f"{mode}-{repeat}", dict(os.environ), MODES
                )
                rows.append({**row, "repeat": repeat})
                print(
                    f"{mode:<8} #{repeat}: {row['trained_samples_per_s']:7.1f} trained samples/s, "
                    f"learner {row['cores_busy_in_steady_state']['learner']:.2f} cores, "
                    f"workers {row['cores_busy_in_steady_state']['workers']:.2f}",
                    flush=True,
                )
    paired = paired_ratios(rows, "version", "current")
    medians = {
        mode: statistics.median(r["trained_samples_per_s"] for r in rows if r["mode"] == mode)
        for mode in MODES
    }
    print(
        f"\nversion / current, trained samples/s: per repeat {paired['mean']:.3f} "
        f"({paired.pop('interval')}); "
        f"medians {medians['version']:.1f} / {medians['current']:.1f}"
    )
    path = write_json(
        args.out,
        {
            "benchmark": "proximal",
            "model": args.model_path or args.model,
            "steps": args.steps,
            "skip": args.skip,
            "workers": 2,
            "trained_samples_per_s_median": medians,
            "version_over_current_paired": paired,
            "rows": rows,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
