"""Summaries and plots of finished runs, from their metrics.jsonl.

    python -m asyncfp8.report runs/bf16 runs/fp8 runs/fp8_tis --out docs/results/compare.png

One PNG: reward (trailing mean, raw faint), held-out evaluation, mismatch KL (all tokens,
and precision-only where a step had current-version tokens), IS weights, clipped and
masked tokens, staleness, throughput and loss per step (one version per step unless
sync.every > 1), resumes marked; one line per setting, labelled by precision, correction
and mode (from each run's config.yaml) unless `--labels` says otherwise; runs of the same
setting (other seeds) are averaged. The table gives the precision-only KL with the number
of steps it rests on, and leaves it out below 10.
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


# The precision-only KL rests on the steps that trained current-version tokens; in an
# asynchronous run those are few. Below this many steps it is left out of summaries.
MIN_FRESH_STEPS = 10
# Warn when more than this share of all groups had no reward spread.
ZERO_SPREAD_WARN = 0.5


def summarize(run_dir: str | Path) -> dict[str, Any]:
    """The run as a whole (resumes included): totals from the last step's counters (they
    continue across a resume), means over every step, and the support of each mean."""
    records = per_step(run_dir)
    if not records:
        raise ValueError(f"{run_dir}: no metrics (metrics.jsonl is missing or empty)")
    evaluated = evaluations(run_dir)
    n = max(1, round(len(records) * TAIL))
    last = records[-1]
    elapsed = last.get("time/elapsed_s") or float("nan")
    fresh = [r for r in records if r.get("fresh/kl_k3") is not None]
    fresh_enough = len(fresh) >= MIN_FRESH_STEPS
    zero_spread = _mean(records, "groups/frac_zero_advantage")
    warnings = []
    if zero_spread > ZERO_SPREAD_WARN:
        warnings.append(
            f"{zero_spread:.0%} of groups had no reward spread (every sample scored the same) "
            "and trained nothing: the task is too hard or too easy for this model, or the "
            "reward is constant"
        )
    if fresh and not fresh_enough:
        warnings.append(
            f"the precision-only KL rests on {len(fresh)} steps with current-version tokens "
            f"(< {MIN_FRESH_STEPS}); left out (run.mode=sync measures it at every step)"
        )
    return {
        "run": str(run_dir),
        "label": label(run_dir),
        "steps": last["step"],
        "versions": last.get("sync/version", last.get("version")),
        "samples": last.get("total/samples", 0),
        "samples_per_s": last.get("total/samples", 0) / elapsed,
        "elapsed_s": elapsed,
        "resumes": sum(1 for r in records if r.get("run/resumed_from_step") is not None),
        "reward_start": _mean(records[:n], "reward/mean"),
        "reward_end": _mean(records[-n:], "reward/mean"),
        "kl_k3_mean": _mean(records, "mismatch/kl_k3"),
        "fresh_kl_k3_mean": _mean(fresh, "fresh/kl_k3") if fresh_enough else None,
        "fresh_kl_steps": len(fresh),
        "fresh_kl_tokens": int(sum(r.get("fresh/tokens", 0) for r in fresh)),
        "staleness_mean": _mean(records, "staleness/mean"),
        "weight_min_mean": _mean(records, "correction/weight_min"),
        "frac_clipped_mean": _mean(records, "correction/frac_clipped"),
        "frac_zero_advantage_mean": zero_spread,
        "stale_groups": last.get("total/stale_groups", 0),
        # pass@1 on held-out prompts: before training (or the first evaluation) and the last
        "eval_steps": [r["step"] for r in evaluated],
        "eval_pass1_greedy_start": _first(evaluated, "eval/pass1_greedy"),
        "eval_pass1_greedy_end": _last(evaluated, "eval/pass1_greedy"),
        "eval_pass1_sampled_start": _first(evaluated, "eval/pass1_sampled"),
        "eval_pass1_sampled_end": _last(evaluated, "eval/pass1_sampled"),
        "warnings": warnings,
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
    precision = cfg.precision.get("_target_") or cfg.precision.name
    if cfg.precision.get("learner_forward", "master") != "master":
        precision += f" ({cfg.precision.learner_forward} forward)"
    return f"{precision} · {cfg.correction.name} · {cfg.run.mode}"


def smooth(values: np.ndarray, window: int) -> np.ndarray:
    """Trailing mean over the last `window` values (fewer at the start); NaNs skipped."""
    present = ~np.isnan(values)
    total = np.cumsum(np.where(present, values, 0.0))
    count = np.cumsum(present)
    shifted_total = np.concatenate([np.zeros(window), total[:-window]])[: len(values)]
    shifted_count = np.concatenate([np.zeros(window), count[:-window]])[: len(values)]
    with np.errstate(invalid="ignore", divide="ignore"):
        return (total - shifted_total) / (count - shifted_count)


EVAL_KEYS = ("eval/pass1_greedy", "eval/pass1_sampled")
# (metric, title, y scale) per panel; a panel none of the runs has is left out.
PANELS = [
    ("reward/mean", "reward: trailing mean over a tenth of the run (raw: faint)", "linear"),
    ("eval/pass1_greedy", "held-out pass@1: greedy (solid), sampled (dashed)", "linear"),
    ("mismatch/kl_k3", "mismatch KL k3: all tokens (line), current-version only (dots)", "log"),
    ("correction/weight_max", "IS weight max (solid) and min (dashed)", "linear"),
    ("correction/frac_clipped", "tokens clipped (solid) or masked (dotted)", "linear"),
    ("staleness/mean", "staleness, versions: mean (solid), max (dashed)", "linear"),
    ("throughput/samples_per_s", "samples/s received (solid), tokens/s / 100 (dashed)", "linear"),
    ("loss/policy", "policy loss", "linear"),
]
SECOND_LINE = {
    "eval/pass1_greedy": ("eval/pass1_sampled", "--", 1.0),
    "correction/weight_max": ("correction/weight_min", "--", 1.0),
    "correction/frac_clipped": ("correction/frac_masked", ":", 1.0),
    "staleness/mean": ("staleness/max", "--", 1.0),
    "throughput/samples_per_s": ("throughput/tokens_per_s", "--", 0.01),
}


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


def _eval_points(runs: list[list[dict]], key: str, steps: int) -> tuple[list[int], list[float]]:
    """Held-out evaluations (step 0: before training) up to `steps`, averaged over the
    runs that have one at a step."""
    by_step: dict[int, list[float]] = {}
    for run in runs:
        for r in run:
            if r["step"] <= steps and r.get(key) is not None:
                by_step.setdefault(r["step"], []).append(r[key])
    points = sorted(by_step)
    return points, [float(np.mean(by_step[step])) for step in points]


def trailing_mean(values: np.ndarray, window: int) -> np.ndarray:
    """`smooth`, but NaN until the window is full: a short run's first steps are not
    drawn as if they were a mean (a one-step "mean" looks like a collapse or a jump)."""
    smoothed = smooth(values, window)
    smoothed[: window - 1] = np.nan
    return smoothed


def plot_runs(run_dirs: list[str | Path], out: str | Path, labels: list[str] | None = None) -> Path:
    """Runs that share a label (the same setting with other seeds) are averaged step by
    step. Reward and held-out evaluation as trailing means (evaluation points joined),
    the precision-only KL as dots where a step had current-version tokens, resumes as
    vertical marks."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings: dict[str, list[list[dict]]] = {}
    evals: dict[str, list[list[dict]]] = {}
    for index, run_dir in enumerate(run_dirs):
        records = per_step(run_dir)
        if records:
            name = labels[index] if labels else label(run_dir)
            settings.setdefault(name, []).append(records)
            evals.setdefault(name, []).append(evaluations(run_dir))
    every = [r for runs in [*settings.values(), *evals.values()] for run in runs for r in run]
    panels = [p for p in PANELS if any(r.get(p[0]) is not None for r in every)]
    rows = (len(panels) + 1) // 2
    figure, axes = plt.subplots(rows, 2, figsize=(11, 3.2 * rows), squeeze=False)
    for name, runs in settings.items():
        steps = min(r[-1]["step"] for r in runs)
        window = max(1, steps // 10)
        x = np.arange(1, steps + 1)
        color = None
        resumes = sorted({r["step"] for run in runs for r in run if "run/resumed_from_step" in r})
        for ax, (key, title, scale) in zip(axes.flat, panels, strict=False):
            mean = _mean_over_runs([_series(r, key, steps) for r in runs])
            label_text = f"{name} ({len(runs)} run{'s' if len(runs) > 1 else ''})"
            if key == "reward/mean":
                (line,) = ax.plot(x, mean, color=color, linewidth=0.6, alpha=0.25)
                color = line.get_color()
                ax.plot(
                    x, trailing_mean(mean, window), color=color, linewidth=1.4, label=label_text
                )
            elif key in EVAL_KEYS:
                ax.plot(
                    *_eval_points(evals[name], key, steps),
                    color=color,
                    marker="o",
                    markersize=3,
                    label=label_text,
                )
            else:
                (line,) = ax.plot(
                    x, smooth(mean, window), color=color, linewidth=1.4, label=label_text
                )
                color = color or line.get_color()
            if key == "mismatch/kl_k3":
                fresh = _mean_over_runs([_series(r, "fresh/kl_k3", steps) for r in runs])
                ax.plot(x, fresh, color=color, linestyle="none", marker=".", markersize=3)
            if key in SECOND_LINE:
                other, style, factor = SECOND_LINE[key]
                values = _mean_over_runs([_series(r, other, steps) for r in runs]) * factor
                if key in EVAL_KEYS:
                    ax.plot(*_eval_points(evals[name], other, steps), color=color, linestyle=style)
                else:
                    ax.plot(x, smooth(values, window), color=color, linewidth=1.0, linestyle=style)
            for step in resumes:
                ax.axvline(step, color=color, linewidth=0.8, linestyle=":", alpha=0.7)
            ax.set_title(title, fontsize=9)
            ax.set_yscale(scale)
            ax.set_xlabel(
                "step (one policy version per step)" + ("; dotted: resumed" if resumes else "")
            )
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
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
        f"{'run':<40} {'steps':>5} {'reward start':>12} {'reward end':>10} {'KL k3':>9} "
        f"{'fresh KL (steps)':>17} {'samples/s':>9}"
    )
    for s in summaries:
        fresh = (
            f"{s['fresh_kl_k3_mean']:.2e} ({s['fresh_kl_steps']})"
            if s["fresh_kl_k3_mean"] is not None
            else f"- ({s['fresh_kl_steps']})"
        )
        print(
            f"{s['label'][:40]:<40} {s['steps']:>5} {s['reward_start']:>12.3f} {s['reward_end']:>10.3f} "
            f"{s['kl_k3_mean']:>9.2e} {fresh:>17} {s['samples_per_s']:>9.1f}"
        )
        for warning in s["warnings"]:
            print(f"  warning: {warning}")
    print(f"plot: {plot_runs(args.runs, args.out, args.labels)}")
    if args.json:
        Path(args.json).write_text(json.dumps(summaries, indent=2))


if __name__ == "__main__":
    main()
