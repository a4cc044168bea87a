"""What the rejection did in each run of scripts/rejection_runs.sh (docs/results.md):
the bounds calibrated at step 1, the share of tokens masked and of updates starved per
50-step window, the mismatch, and held-out greedy pass@1 at every evaluation.

    python scripts/rejection_metrics.py runs/rejection/fp8_geors_cal_seed* [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

WINDOW = 50


def window_means(rows: list[dict], key: str) -> list[float | None]:
    last = max(r["step"] for r in rows)
    means = []
    for start in range(1, last + 1, WINDOW):
        values = [r[key] for r in rows if start <= r["step"] < start + WINDOW and key in r]
        means.append(statistics.fmean(values) if values else None)
    return means


def of_run(run: Path) -> dict:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r.get("step", 0) >= 1 and "correction/frac_masked" in r]
    first = next((r for r in steps if r["step"] == 1), {})
    return {
        "run": run.name,
        "calibrated": [
            first.get("correction/calibrated_lower"),
            first.get("correction/calibrated_upper"),
        ],
        "masked_step1": first.get("correction/frac_masked"),
        "masked_by_window": window_means(steps, "correction/frac_masked"),
        "update_scale_by_window": window_means(steps, "correction/update_scale"),
        "starved_updates": max((r.get("correction/starved_steps", 0) for r in steps), default=0),
        "k3_by_window": window_means(steps, "mismatch/kl_k3"),
        "far_tokens_by_window": window_means(steps, "mismatch/frac_abs_log_ratio_gt5"),
        "reward_by_window": window_means(steps, "reward/mean"),
        "heldout_greedy": {
            r["step"]: r["eval/pass1_greedy"] for r in rows if "eval/pass1_greedy" in r
        },
        "guard_rollbacks": max((r.get("guard/rollbacks", 0) for r in rows), default=0),
    }


def fmt(values) -> str:
    return " / ".join("-" if v is None else f"{v:.3g}" for v in values)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    out = [of_run(run) for run in args.runs if (run / "metrics.jsonl").exists()]
    for r in out:
        print(
            f"{r['run']}: bounds {fmt(r['calibrated'])}; masked step 1 {fmt([r['masked_step1']])}, "
            f"by {WINDOW}-step window {fmt(r['masked_by_window'])}; lr factor "
            f"{fmt(r['update_scale_by_window'])}; starved updates {r['starved_updates']}; "
            f"k3 {fmt(r['k3_by_window'])}; |log ρ|>5 {fmt(r['far_tokens_by_window'])}; "
            f"reward {fmt(r['reward_by_window'])}; held-out {fmt(r['heldout_greedy'].values())}; "
            f"rollbacks {r['guard_rollbacks']}"
        )
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
