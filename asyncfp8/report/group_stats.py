"""A group's numbers from its runs' summaries alone: held-out, mismatch KL, collapses and
late slides, each as mean ± 95% CI or a count with its Wilson interval. No config is read,
so saved tables pool through here as run directories do (compare.py, pooled.py)."""

from __future__ import annotations

import math
from typing import Any

from asyncfp8.report.stats import binomial_se, mean_ci, wilson_interval


def _values(summaries: list[dict], key: str) -> list[float]:
    return [s[key] for s in summaries if s.get(key) is not None and not math.isnan(s[key])]


def _stat(name: str, values: list[float]) -> dict[str, float | None]:
    mean, half = mean_ci(values) if values else (None, None)
    return {f"{name}_mean": mean, f"{name}_ci95": half}


def group_numbers(runs: list[str], seeds: list[int], summaries: dict[str, dict]) -> dict[str, Any]:
    """A group's numbers from its runs' summaries alone (no config: saved tables pool
    through here too, pooled.py)."""
    rows = [summaries[run] for run in runs]
    finals = _values(rows, "eval_pass1_greedy_end")
    prompts = [s["eval_prompts"] for s in rows]
    fresh = _values(rows, "fresh_kl_k3_mean")
    entry: dict[str, Any] = {
        "n": len(runs),
        "seeds": seeds,
        "runs": runs,
        "final_eval_steps": [s["eval_steps"][-1] if s["eval_steps"] else None for s in rows],
        "eval_prompts": prompts,
        **_stat("final_greedy", finals),
        **_stat("final_sampled", _values(rows, "eval_pass1_sampled_end")),
        "final_greedy_binomial_se": None,
        **_stat("start_greedy", _values(rows, "eval_pass1_greedy_start")),
        **_stat("start_sampled", _values(rows, "eval_pass1_sampled_start")),
        **_stat("kl_k3", _values(rows, "kl_k3_mean")),
        **_stat("fresh_kl_k3", fresh),
        "fresh_kl_runs": len(fresh),
        **_collapses(rows, seeds),
        "warnings": [],
    }
    known_prompts = [p for p in prompts if p]
    if finals and known_prompts:
        # one run's evaluation noise at the group's accuracy; with unequal evaluation sizes
        # the smallest (the noisiest) is the honest one
        entry["final_greedy_binomial_se"] = binomial_se(
            entry["final_greedy_mean"], min(known_prompts)
        )
    warnings = entry["warnings"]
    if len(finals) < len(runs):
        warnings.append(
            f"{len(runs) - len(finals)} of {len(runs)} runs have no held-out evaluation "
            "(eval.every=0?): the held-out numbers rest on the others"
        )
    if len({step for step in entry["final_eval_steps"] if step is not None}) > 1:
        warnings.append(
            "the runs' last evaluations are at different steps "
            f"({', '.join(str(s) for s in entry['final_eval_steps'])}): a run stopped early?"
        )
    repeated = sorted({seed for seed in seeds if seeds.count(seed) > 1})
    if repeated:
        warnings.append(
            f"seed {', '.join(map(str, repeated))} appears more than once: a repeat of a seed "
            "is not an independent sample (a deterministic run gives the same numbers)"
        )
    return entry


def _collapses(rows: list[dict], seeds: list[int]) -> dict[str, Any]:
    """How many of a group's runs collapsed, the Wilson interval of the rate, and which."""
    collapsed = [(seed, s) for seed, s in zip(seeds, rows, strict=True) if s["collapsed"]]
    return {
        "collapses": len(collapsed),
        "collapse_rate_ci95": list(wilson_interval(len(collapsed), len(rows))),
        "collapsed_runs": [
            {"seed": seed, "step": s["collapse_step"], "signal": s["collapse_signal"]}
            for seed, s in collapsed
        ],
        "fell_and_recovered": sum(bool(s["fell_and_recovered"]) for s in rows),
        # late slides (summaries written before the rule have no such key: not counted)
        **_slides(rows, seeds),
        # runs the held-out guard put back at least once (guard.heldout_below; older
        # summaries have no such key)
        "heldout_recovered": sum(bool(s.get("guard_heldout_rollbacks")) for s in rows),
        # runs the guard stopped (its rollbacks in a row exhausted): they did not finish,
        # collapsed or not
        "guard_stops": sum(bool(s["guard_stopped"]) for s in rows),
        "guard_stopped_runs": [
            {
                "seed": seed,
                "step": s["guard_stopped"]["step"],
                "signal": s["guard_stopped"]["signal"],
            }
            for seed, s in zip(seeds, rows, strict=True)
            if s["guard_stopped"]
        ],
    }


def _slides(rows: list[dict], seeds: list[int]) -> dict[str, Any]:
    """How many of a group's runs slid late, the Wilson interval of the rate, and which."""
    slid = [(seed, s) for seed, s in zip(seeds, rows, strict=True) if s.get("late_slide")]
    return {
        "late_slides": len(slid),
        "late_slide_rate_ci95": list(wilson_interval(len(slid), len(rows))),
        "late_slide_runs": [{"seed": seed, "drop": s["late_slide_drop"]} for seed, s in slid],
    }
