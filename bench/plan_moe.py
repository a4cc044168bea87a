"""The planner against a measured MoE rollout on this CPU: each cell of the torch engine's
decode table on `small_moe` (bench/rollout.py --model <the shipped small_moe>) predicted by
the `cpu-torch` calibration, whose factors were fitted to the dense `small` model's cells
only; beside it, that calibration's own held-out error on the dense cells (the error the
planner states, docs/plan.md).

    python bench/rollout.py --model asyncfp8/models/shipped/small_moe-seed0-<hash> \
        --engines torch --out bench/results/rollout-cpu-small_moe.json
    python bench/plan_moe.py [--table bench/results/rollout-cpu-small_moe.json]
        [--out bench/results/plan-moe-cpu.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from asyncfp8.plan.calibration import load_calibration
from asyncfp8.plan.fitting import Point, predict_points
from bench.common import write_json
from bench.plan_check import cpu_cells

RESULTS = Path(__file__).resolve().parent / "results"


def moe_points(table: dict, model: str = "small_moe") -> list[Point]:
    """The torch engine's cells of a CPU decode table as the planner's points."""
    return [
        Point(
            model=model,
            precision=row["precision"],
            batch=row["batch"],
            prompt_tokens=16 if row["context"] == "short" else table["long_prompt"],
            new_tokens=table["new_tokens"],
            decode_tokens_per_s=row["decode_tokens_per_s"],
            label=f"torch {row['precision']} {row['context']} batch {row['batch']}",
        )
        for row in table["rows"]
        if row["engine"] == "torch" and not row.get("error")
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--table", default=str(RESULTS / "rollout-cpu-small_moe.json"))
    parser.add_argument("--calibration", default="cpu-torch")
    parser.add_argument("--out", default=str(RESULTS / "plan-moe-cpu.json"))
    args = parser.parse_args()
    table = json.loads(Path(args.table).read_text())
    calibration = load_calibration(args.calibration)
    cells = predict_points(moe_points(table), calibration.device, calibration.efficiency)
    if not cells:
        raise SystemExit(f"{args.table}: no torch-engine cell to predict")
    dense = cpu_cells(args.calibration)
    stated = dense["median_abs_error_held_out"]
    median = statistics.median(abs(c["error"]) for c in cells)
    print(
        f"{args.calibration} (fitted to the dense small model) on small_moe: median |error| "
        f"{median:.1%}; its stated error (held out on the dense cells) {stated:.1%}"
    )
    for cell in cells:
        print(
            f"  {cell['label']:<34} measured {cell['measured_tokens_per_s']:>8.0f} "
            f"predicted {cell['predicted_tokens_per_s']:>8.0f} ({cell['error']:+.0%})"
        )
    path = write_json(
        args.out,
        {
            "calibration": args.calibration,
            "table": os.path.relpath(args.table, RESULTS.parent.parent),
            "cells": cells,
            "median_abs_error": float(median),
            "stated_median_abs_error_held_out": float(stated),
            "within_stated_error": bool(median <= stated),
        },
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
