"""`asyncfp8.report --paired-with LABEL`: each group's final greedy held-out against one
baseline group's, seed by seed. Runs that share a seed share their prompt stream and
held-out set, so the per-seed difference cancels what the seed decides (docs/running.md,
"Comparing runs")."""

from __future__ import annotations

from typing import Any

from .stats import mean_ci

KEY = "eval_pass1_greedy_end"


def add_paired_differences(
    entries: list[dict[str, Any]], summaries: dict[str, dict], baseline: str
) -> None:
    """Adds `paired_with`, `paired_seeds`, `paired_greedy_diff_mean` and `_ci95` to every
    group but the baseline (the seeds both have a final held-out for). ValueError naming
    the labels there are when `baseline` is none of them."""
    by_label = {entry["label"]: entry for entry in entries}
    if baseline not in by_label:
        known = "; ".join(repr(label) for label in by_label)
        raise ValueError(f"--paired-with {baseline!r} is not a group here; the groups: {known}")
    base = _finals(by_label[baseline], summaries)
    for entry in entries:
        if entry["label"] == baseline:
            continue
        finals = _finals(entry, summaries)
        seeds = sorted(set(finals) & set(base))
        mean, half = mean_ci([finals[s] - base[s] for s in seeds]) if seeds else (None, None)
        entry |= {
            "paired_with": baseline,
            "paired_seeds": seeds,
            "paired_greedy_diff_mean": mean,
            "paired_greedy_diff_ci95": half,
        }


def _finals(entry: dict[str, Any], summaries: dict[str, dict]) -> dict[int, float]:
    """seed -> final greedy held-out of the group's runs (a repeated seed: its first run)."""
    finals: dict[int, float] = {}
    for seed, run in zip(entry["seeds"], entry["runs"], strict=True):
        value = summaries[run].get(KEY)
        if value is not None and seed not in finals:
            finals[seed] = value
    return finals


def paired_line(entry: dict[str, Any]) -> str | None:
    """The group's paired line for the printed comparison, or None without a baseline."""
    if "paired_with" not in entry:
        return None
    seeds = entry["paired_seeds"]
    if not seeds:
        return f"  against {entry['paired_with']}: no seed in common"
    mean, half = entry["paired_greedy_diff_mean"], entry["paired_greedy_diff_ci95"]
    shown = f"{mean:+.3f}" + (f" ± {half:.3f}" if half is not None else " (one seed, no CI)")
    return (
        f"  against {entry['paired_with']}: greedy {shown}, paired over "
        f"{len(seeds)} seed{'s' if len(seeds) != 1 else ''} ({' '.join(map(str, seeds))})"
    )
