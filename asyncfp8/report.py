"""Summaries and plots of finished runs, from their metrics.jsonl.

    python -m asyncfp8.report runs/bf16 runs/fp8 runs/fp8_tis --out docs/results/compare.png

One PNG: reward, mismatch KL (k3) and the correction's IS-weight statistics per step
(one version per step unless sync.every > 1), one line per setting, labelled by
precision, correction and mode (from each run's config.yaml) unless `--labels` says
otherwise; runs of the same setting (other seeds) are averaged.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np
from omegaconf import OmegaConf

from asyncfp8.metrics import read_metrics

TAIL = 0.2  # "final" numbers are means over the last 20% of steps


def per_step(run_dir: str | Path) -> list[dict[str, Any]]:
    """One record per training step (1, 2, ...); a step written twice (re-run after a
    resume) keeps the last. The held-out evaluation before the first step, recorded as
    step 0, is in `evaluations`."""
    records = {r["step"]: r for r in read_metrics(run_dir) if r["step"] >= 1}
    return sorted(records.values(), key=lambda r: r["step"])


def evaluations(run_dir: str | Path) -> list[dict[str, Any]]:
    """The records with held-out pass@1 (`eval/pass1_greedy`, `eval/pass1_sampled`), by
    step, the one before training (step 0) included."""
    records = {r["step"]: r for r in read_metrics(run_dir) if "eval/pass1_greedy" in r}
    return sorted(records.values(), key=lambda r: r["step"])


def _mean(records: list[dict], key: str) -> float:
    values = [r[key] for r in records if r.get(key) is not None]
    return float(np.mean(values)) if values else float("nan")


def summarize(run_dir: str | Path) -> dict[str, Any]:
    records = per_step(run_dir)
    if not records:
        raise ValueError(f"{run_dir}: no metrics (metrics.jsonl is missing or empty)")
    evaluated = evaluations(run_dir)
    n = max(1, round(len(records) * TAIL))
    last = records[-1]
    elapsed = last.get("time/elapsed_s") or float("nan")
    return {
        "run": str(run_dir),
        "label": label(run_dir),
        "steps": last["step"],
        "versions": last.get("sync/version", last.get("version")),
        "samples": last.get("total/samples", 0),
        "samples_per_s": last.get("total/samples", 0) / elapsed,
        "reward_start": _mean(records[:n], "reward/mean"),
        "reward_end": _mean(records[-n:], "reward/mean"),
        "kl_k3_mean": _mean(records, "mismatch/kl_k3"),
        "fresh_kl_k3_mean": _mean(records, "fresh/kl_k3"),
        "staleness_mean": _mean(records, "staleness/mean"),
        "weight_min_mean": _mean(records, "correction/weight_min"),
        "frac_clipped_mean": _mean(records, "correction/frac_clipped"),
        "stale_groups": last.get("total/stale_groups", 0),
        # pass@1 on held-out prompts: before training (or the first evaluation) and the last
        "eval_steps": [r["step"] for r in evaluated],
        "eval_pass1_greedy_start": _first(evaluated, "eval/pass1_greedy"),
        "eval_pass1_greedy_end": _last(evaluated, "eval/pass1_greedy"),
        "eval_pass1_sampled_start": _first(evaluated, "eval/pass1_sampled"),
        "eval_pass1_sampled_end": _last(evaluated, "eval/pass1_sampled"),
    }


def _first(records: list[dict], key: str) -> float:
    return records[0][key] if records else float("nan")


def _last(records: list[dict], key: str) -> float:
    return records[-1][key] if records else float("nan")


def label(run_dir: str | Path) -> str:
    config = Path(run_dir) / "config.yaml"
    if not config.exists():
        return Path(run_dir).name
    cfg = OmegaConf.load(config)
    return f"{cfg.precision.name} · {cfg.correction.name} · {cfg.run.mode}"


def smooth(values: np.ndarray, window: int) -> np.ndarray:
    """Trailing mean over the last `window` values (fewer at the start); NaNs skipped."""
    present = ~np.isnan(values)
    total = np.cumsum(np.where(present, values, 0.0))
    count = np.cumsum(present)
    shifted_total = np.concatenate([np.zeros(window), total[:-window]])[: len(values)]
    shifted_count = np.concatenate([np.zeros(window), count[:-window]])[: len(values)]
    with np.errstate(invalid="ignore", divide="ignore"):
        return (total - shifted_total) / (count - shifted_count)


PANELS = [
    ("reward/mean", "mean reward", "linear"),
    ("fresh/kl_k3", "mismatch KL k3, current-version tokens (precision only)", "log"),
    ("correction/weight_max", "IS weight max (solid) and min (dashed)", "linear"),
    ("correction/frac_clipped", "fraction of tokens clipped or masked", "linear"),
]


def _mean_over_runs(series: list[np.ndarray]) -> np.ndarray:
    """Step-wise mean over runs; NaN where no run has the value (no warning)."""
    stacked = np.array(series)
    present = ~np.isnan(stacked)
    total = np.where(present, stacked, 0.0).sum(axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        return total / present.sum(axis=0)


def _series(records: list[dict], key: str, steps: int) -> np.ndarray:
    values = np.full(steps, np.nan)
    for r in records:
        if r["step"] <= steps and r.get(key) is not None:
            values[r["step"] - 1] = r[key]
    return values


def plot_runs(run_dirs: list[str | Path], out: str | Path, labels: list[str] | None = None) -> Path:
    """Runs that share a label (the same setting with other seeds) are averaged step by
    step; every curve is a trailing mean over a tenth of the run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings: dict[str, list[list[dict]]] = {}
    for index, run_dir in enumerate(run_dirs):
        records = per_step(run_dir)
        if records:
            settings.setdefault(labels[index] if labels else label(run_dir), []).append(records)
    figure, axes = plt.subplots(2, 2, figsize=(11, 7))
    for name, runs in settings.items():
        steps = min(r[-1]["step"] for r in runs)
        window = max(1, steps // 10)
        x = np.arange(1, steps + 1)
        color = None
        for ax, (key, title, scale) in zip(axes.flat, PANELS, strict=True):
            mean = _mean_over_runs([_series(r, key, steps) for r in runs])
            (line,) = ax.plot(
                x,
                smooth(mean, window),
                color=color,
                linewidth=1.4,
                label=f"{name} ({len(runs)} run{'s' if len(runs) > 1 else ''})",
            )
            color = line.get_color()
            if key == "correction/weight_max":
                low = _mean_over_runs([_series(r, "correction/weight_min", steps) for r in runs])
                ax.plot(x, smooth(low, window), color=color, linewidth=1.0, linestyle="--")
            if key == "correction/frac_clipped":
                masked = _mean_over_runs(
                    [_series(r, "correction/frac_masked", steps) for r in runs]
                )
                ax.plot(x, smooth(masked, window), color=color, linewidth=1.0, linestyle=":")
            ax.set_title(title, fontsize=10)
            ax.set_yscale(scale)
            ax.set_xlabel("step (one policy version per step)")
    axes.flat[0].legend(fontsize=8)
    figure.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=110)
    plt.close(figure)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="run directories (each with metrics.jsonl)")
    parser.add_argument("--out", default="compare.png", help="PNG to write")
    parser.add_argument("--labels", nargs="*", help="one label per run (default: from config)")
    parser.add_argument("--json", help="also write the summaries here")
    args = parser.parse_args(argv)
    if args.labels and len(args.labels) != len(args.runs):
        parser.error(f"{len(args.labels)} labels for {len(args.runs)} runs")
    summaries = [summarize(run) for run in args.runs]
    print(
        f"{'run':<40} {'steps':>5} {'reward start':>12} {'reward end':>10} {'KL k3':>9} {'fresh KL':>9} {'samples/s':>9}"
    )
    for s in summaries:
        print(
            f"{s['label'][:40]:<40} {s['steps']:>5} {s['reward_start']:>12.3f} {s['reward_end']:>10.3f} "
            f"{s['kl_k3_mean']:>9.2e} {s['fresh_kl_k3_mean']:>9.2e} {s['samples_per_s']:>9.1f}"
        )
    print(f"plot: {plot_runs(args.runs, args.out, args.labels)}")
    if args.json:
        Path(args.json).write_text(json.dumps(summaries, indent=2))


if __name__ == "__main__":
    main()
