"""Summaries and plots of finished runs, from their metrics.jsonl.

    python -m asyncfp8.report runs/bf16 runs/fp8 runs/fp8_tis --out docs/results/compare.png

One PNG: reward, mismatch KL (k3) and the correction's IS-weight statistics per policy
version, one line per run, labelled by precision and correction (from each run's
config.yaml) unless `--labels` says otherwise.
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
    """One record per step; a step written twice (re-run after a resume) keeps the last."""
    return sorted({r["step"]: r for r in read_metrics(run_dir)}.values(), key=lambda r: r["step"])


def _mean(records: list[dict], key: str) -> float:
    values = [r[key] for r in records if r.get(key) is not None]
    return float(np.mean(values)) if values else float("nan")


def summarize(run_dir: str | Path) -> dict[str, Any]:
    records = per_step(run_dir)
    if not records:
        raise ValueError(f"{run_dir}: no metrics (metrics.jsonl is missing or empty)")
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
    }


def label(run_dir: str | Path) -> str:
    config = Path(run_dir) / "config.yaml"
    if not config.exists():
        return Path(run_dir).name
    cfg = OmegaConf.load(config)
    return f"{cfg.precision.name} · {cfg.correction.name} · {cfg.run.mode}"


def _smooth(values: np.ndarray, window: int) -> np.ndarray:
    if len(values) < window or window < 2:
        return values
    kernel = np.ones(window) / window
    padded = np.concatenate([np.full(window - 1, values[0]), values])
    return np.convolve(padded, kernel, mode="valid")


def plot_runs(run_dirs: list[str | Path], out: str | Path, labels: list[str] | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("reward/mean", "mean reward (smoothed)", "linear"),
        ("mismatch/kl_k3", "mismatch KL k3 (rollout ‖ learner)", "log"),
        ("correction/weight_mean", "IS weight: mean (line), min–max (band)", "linear"),
        ("correction/frac_clipped", "fraction of tokens clipped", "linear"),
    ]
    figure, axes = plt.subplots(2, 2, figsize=(11, 7))
    for index, run_dir in enumerate(run_dirs):
        records = per_step(run_dir)
        if not records:
            continue
        name = labels[index] if labels else label(run_dir)
        versions = np.array([r.get("version", r["step"]) for r in records], dtype=float)
        for ax, (key, title, scale) in zip(axes.flat, panels, strict=True):
            values = np.array([np.nan if r.get(key) is None else r[key] for r in records])
            if key == "reward/mean":
                values = _smooth(values, max(1, len(values) // 10))
            (line,) = ax.plot(versions, values, label=name, linewidth=1.2)
            if key == "correction/weight_mean":
                low = [r.get("correction/weight_min", np.nan) for r in records]
                high = [r.get("correction/weight_max", np.nan) for r in records]
                ax.fill_between(versions, low, high, color=line.get_color(), alpha=0.15)
            ax.set_title(title, fontsize=10)
            ax.set_yscale(scale)
            ax.set_xlabel("policy version")
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
