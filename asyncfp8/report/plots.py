"""The report's plots: per-step panels of runs grouped by label (reward, held-out, mismatch
KL, IS weights, clipping, staleness, throughput, loss; the launcher's plots.png, the
report's compare.png) and the held-out curves of groups with their 95% bands
(compare_heldout.png)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from asyncfp8.report.stats import mean_ci
from asyncfp8.report.summary import evaluations, label, per_step


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
    (
        "refit/probe_mean_abs_dlogp",
        "refit probe vs reference: mean |Δ log p| (solid), max / 10 (dashed)",
        "linear",
    ),
]
SECOND_LINE = {
    "eval/pass1_greedy": ("eval/pass1_sampled", "--", 1.0),
    "correction/weight_max": ("correction/weight_min", "--", 1.0),
    "correction/frac_clipped": ("correction/frac_masked", ":", 1.0),
    "staleness/mean": ("staleness/max", "--", 1.0),
    "throughput/samples_per_s": ("throughput/tokens_per_s", "--", 0.01),
    "refit/probe_mean_abs_dlogp": ("refit/probe_max_abs_dlogp", "--", 0.1),
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
    return _save(figure, out)


def _save(figure, out: str | Path) -> Path:
    """Lays out, writes (making its folder) and closes a figure."""
    import matplotlib.pyplot as plt

    figure.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=110)
    plt.close(figure)
    return out


def heldout_curve(runs: list[list[dict]], key: str) -> tuple[list[int], np.ndarray, np.ndarray]:
    """(steps, mean over the runs evaluated at each step, 95% CI half-width there; NaN where
    fewer than two runs were evaluated)."""
    by_step: dict[int, list[float]] = {}
    for run in runs:
        for r in run:
            if r.get(key) is not None:
                by_step.setdefault(r["step"], []).append(r[key])
    steps = sorted(by_step)
    stats = [mean_ci(by_step[step]) for step in steps]
    means = np.array([mean for mean, _ in stats])
    halves = np.array([np.nan if half is None else half for _, half in stats])
    return steps, means, halves


def plot_heldout(groups: dict[str, list[list[dict]]], out: str | Path) -> Path | None:
    """Held-out pass@1 per group (label -> each run's `evaluations`), greedy and sampled
    side by side: the mean over seeds at each evaluated step, the 95% CI as a band (none
    for a group of one run). None when no run was evaluated."""
    if not any(r for runs in groups.values() for run in runs for r in run):
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(11, 3.8), sharey=True)
    for ax, key in zip(axes, EVAL_KEYS, strict=True):
        for name, runs in groups.items():
            steps, means, halves = heldout_curve(runs, key)
            if not steps:
                continue
            (line,) = ax.plot(
                steps, means, marker="o", markersize=3, label=f"{name} (n={len(runs)})"
            )
            ax.fill_between(
                steps,
                means - halves,
                means + halves,
                color=line.get_color(),
                alpha=0.2,
                linewidth=0,
            )
        values = [r.get(key) for runs in groups.values() for run in runs for r in run]
        if all(v is None or 0 <= v <= 1 for v in values):
            # a 0/1 reward's pass rate: a band of few seeds past 0 or 1 is cut at the axis
            bottom, top = ax.get_ylim()
            ax.set_ylim(max(bottom, -0.02), min(top, 1.02))
        kind = key.removeprefix("eval/pass1_")
        ax.set_title(f"held-out pass@1, {kind}: mean over seeds, band 95% CI", fontsize=9)
        ax.set_xlabel("step (0: before training)")
    axes[0].legend(fontsize=8)
    return _save(figure, out)
