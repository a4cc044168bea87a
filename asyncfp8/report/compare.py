"""Compare finished runs: seeds grouped by setting, held-out accuracy, collapses and mismatch
KL as mean ± 95% confidence interval, and plots (from each run's config.yaml and
metrics.jsonl; the groups, their keys and the plots: docs/running.md, "Comparing runs").

    python -m asyncfp8.report runs/parity/* --out compare.png --json compare.json
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from asyncfp8 import __version__
from asyncfp8.report.group_stats import group_numbers
from asyncfp8.report.paired import add_paired_differences, paired_line
from asyncfp8.report.plots import plot_heldout, plot_runs
from asyncfp8.report.pooled import pool_tables
from asyncfp8.report.summary import MIN_FRESH_STEPS, evaluations, setting, setting_label, summarize
from asyncfp8.run.records import METRICS_FILE
from asyncfp8.run.resume import CONFIG_FILE, RESUME_KEYS, SAFE_ON_RESUME

# --- comparing settings: runs grouped by setting, their seeds the sample --------------------

# What runs must share to be compared at all: accuracy on another task (its name or any of
# its parameters: operands, split, seed of the stream, reward) or from another starting
# model measures something else.
MUST_MATCH = ("task", "model.path", "model.size", "model.seed")


def run_config(run_dir: str | Path) -> DictConfig:
    """The config the learner saved in `run_dir`, or a ValueError saying why `run_dir` is
    not a run (and, for a folder of runs, which runs it holds)."""
    path = Path(run_dir)
    if not path.exists():
        raise ValueError(f"{path}: no such directory")
    if not path.is_dir():
        raise ValueError(f"{path} is a file, not a run directory")
    if not (path / CONFIG_FILE).is_file():
        inside = sorted(p.name for p in path.iterdir() if (p / CONFIG_FILE).is_file())
        hint = ""
        if inside:
            shown = ", ".join(inside[:5]) + (", ..." if len(inside) > 5 else "")
            hint = f"; it holds {len(inside)} runs ({shown}): pass those, e.g. {path}/*"
        raise ValueError(
            f"{path} is not a run: it has no {CONFIG_FILE} (the learner writes one when a run "
            f"starts){hint}"
        )
    if not (path / METRICS_FILE).is_file():
        raise ValueError(f"{path}: a run that never wrote {METRICS_FILE} (it never started?)")
    return OmegaConf.load(path / CONFIG_FILE)


def _flatten(value: Any, prefix: str) -> dict[str, str]:
    """Dotted keys to values as JSON text (lists and None compare as text)."""
    if isinstance(value, dict):
        flat: dict[str, str] = {}
        for key, inner in value.items():
            flat |= _flatten(inner, f"{prefix}.{key}" if prefix else str(key))
        return flat
    return {prefix: json.dumps(value)}


def _flat_config(cfg: DictConfig, key: str = "") -> dict[str, str]:
    node = OmegaConf.select(cfg, key) if key else cfg
    if OmegaConf.is_config(node):
        node = OmegaConf.to_container(node, resolve=True)
    return _flatten(node, key)


def _differences(flat_by_run: dict[str, dict[str, str]]) -> list[str]:
    """'key: value in run, run; other value in run' for every key the runs disagree on."""
    keys = sorted({key for flat in flat_by_run.values() for key in flat})
    lines = []
    for key in keys:
        runs_by_value: dict[str, list[str]] = {}
        for run, flat in flat_by_run.items():
            runs_by_value.setdefault(flat.get(key, "(absent)"), []).append(run)
        if len(runs_by_value) > 1:
            lines.append(
                f"{key}: "
                + "; ".join(f"{value} in {_names(runs)}" for value, runs in runs_by_value.items())
            )
    return lines


def _names(runs: list[str], most: int = 4) -> str:
    return ", ".join(runs[:most]) + (f" and {len(runs) - most} more" if len(runs) > most else "")


def check_comparable(configs: dict[str, DictConfig]) -> None:
    """A ValueError naming the settings and the runs when the runs' task or model differ."""
    flat = {
        run: {k: v for key in MUST_MATCH for k, v in _flat_config(cfg, key).items()}
        for run, cfg in configs.items()
    }
    differences = _differences(flat)
    if differences:
        raise ValueError(
            "cannot compare these runs: their task or model differ, so their held-out "
            "accuracies measure different things:\n  "
            + "\n  ".join(differences)
            + "\nReport each task and model on its own."
        )


def _free_to_differ(key: str) -> bool:
    """Keys the seeds of one setting may differ in without a warning: the seed, and what a
    resume may change because it does not change the experiment (processes, logging,
    addresses; asyncfp8.run.resume) -- but not run.steps: the final numbers depend on it."""
    if key == "run.seed" or key.startswith(RESUME_KEYS):
        return True
    if key == "run.steps":
        return False
    return any(key == s or (s.endswith(".") and key.startswith(s)) for s in SAFE_ON_RESUME)


def group_runs(
    configs: dict[str, DictConfig], labels: list[str] | None = None
) -> dict[str, list[str]]:
    """label -> its runs, in the order given: runs of one setting (see `setting`), or runs
    sharing a label when `labels` (one per run) says how to group them."""
    groups: dict[str, list[str]] = {}
    for index, (run, cfg) in enumerate(configs.items()):
        name = labels[index] if labels else setting_label(setting(cfg))
        groups.setdefault(name, []).append(run)
    return groups


def group_summary(
    name: str, runs: list[str], configs: dict[str, DictConfig], summaries: dict[str, dict]
) -> dict[str, Any]:
    """One group's row of the comparison (the keys are listed in docs/running.md)."""
    settings = [setting(configs[run]) for run in runs]
    shared = {
        key: values[0] if len(values := sorted({s[key] for s in settings})) == 1 else values
        for key in settings[0]
    }
    seeds = [configs[run].run.seed for run in runs]
    entry = {"label": name, **shared, **group_numbers(runs, seeds, summaries)}
    if mixed := [key for key, value in shared.items() if isinstance(value, list)]:
        entry["warnings"].append(
            f"the label groups runs of different settings ({', '.join(mixed)})"
        )
    differences = _differences(
        {
            run: {k: v for k, v in _flat_config(configs[run]).items() if not _free_to_differ(k)}
            for run in runs
        }
    )
    if differences and not mixed:
        entry["warnings"].append(
            "its runs differ in more than the seed: " + " | ".join(differences)
        )
    return entry


def _collapse_line(g: dict[str, Any]) -> str:
    low, high = g["collapse_rate_ci95"]
    which = ", ".join(
        f"seed {c['seed']} at step {c['step']} ({c['signal']})" for c in g["collapsed_runs"]
    )
    dips = g["fell_and_recovered"]
    stops = ", ".join(
        f"seed {c['seed']} at step {c['step']} ({c['signal']})" for c in g["guard_stopped_runs"]
    )
    return (
        f"  {'collapsed':<17} {g['collapses']} of {g['n']} (rate 95% CI {low:.2f}-{high:.2f}, "
        f"Wilson)"
        + (f": {which}" if which else "")
        + (f"; {dips} more fell below half their best held-out and recovered" if dips else "")
        + (
            f"; the held-out guard put back {g['heldout_recovered']} (guard.heldout_below)"
            if g["heldout_recovered"]
            else ""
        )
        + (f"\n  {'guard stopped':<17} {g['guard_stops']} of {g['n']}: {stops}" if stops else "")
        + _slide_line(g)
    )


def _slide_line(g: dict[str, Any]) -> str:
    low, high = g["late_slide_rate_ci95"]
    which = ", ".join(f"seed {r['seed']} (-{r['drop']:.3f})" for r in g["late_slide_runs"])
    return (
        f"\n  {'slid late':<17} {g['late_slides']} of {g['n']} (rate 95% CI {low:.2f}-{high:.2f}, "
        f"Wilson)" + (f": {which}" if which else "")
    )


def _pm(mean: float | None, half: float | None, spec: str) -> str:
    if mean is None:
        return "-"
    return f"{mean:{spec}}" + (f" ± {half:{spec}}" if half is not None else "")


def format_groups(entries: list[dict[str, Any]]) -> str:
    """The comparison as text: a block per group."""
    lines = [
        f"{len(entries)} setting{'s' if len(entries) != 1 else ''}: mean over seeds ± the "
        "half-width of its 95% confidence interval (Student t, n-1 degrees of freedom)"
    ]
    for g in entries:
        seeds = " ".join(str(s) for s in g["seeds"])
        runs = f"{g['n']} run{'s' if g['n'] != 1 else ''}"
        lines.append(
            f"\n{g['label']}: {runs}, seed{'s' if g['n'] != 1 else ''} {seeds}"
            + (" (n=1, no CI)" if g["n"] == 1 else "")
        )
        steps = sorted({s for s in g["final_eval_steps"] if s is not None})
        final = f"final (step {', '.join(map(str, steps))})" if steps else "final"
        lines.append(f"  {'held-out pass@1':<17} {final:<19} start")
        for kind in ("greedy", "sampled"):
            lines.append(
                f"  {kind:<17} "
                f"{_pm(g[f'final_{kind}_mean'], g[f'final_{kind}_ci95'], '.3f'):<19} "
                f"{_pm(g[f'start_{kind}_mean'], g[f'start_{kind}_ci95'], '.3f')}"
            )
        lines.append(_collapse_line(g))
        prompts = sorted({p for p in g["eval_prompts"] if p})
        if prompts and g["final_greedy_binomial_se"] is not None:
            size = str(prompts[0]) if len(prompts) == 1 else f"{prompts[0]} to {prompts[-1]}"
            lines.append(
                f"  evaluation: {size} prompts a run; one run's final greedy pass@1 has a "
                f"binomial SE of {g['final_greedy_binomial_se']:.3f}"
            )
        fresh = (
            f"{_pm(g['fresh_kl_k3_mean'], g['fresh_kl_k3_ci95'], '.2e')} "
            f"({g['fresh_kl_runs']} of {g['n']} runs)"
            if g["fresh_kl_runs"]
            else f"- (no run has {MIN_FRESH_STEPS} steps with current-version tokens)"
        )
        lines.append(
            f"  mismatch KL k3 (a run's mean over steps): "
            f"{_pm(g['kl_k3_mean'], g['kl_k3_ci95'], '.2e')}; precision-only: {fresh}"
        )
        if paired := paired_line(g):
            lines.append(paired)
        lines.extend(f"  warning: {w}" for w in g["warnings"])
    return "\n".join(lines)


def _json_safe(value: Any) -> Any:
    """JSON has no NaN: written as null, as in metrics.jsonl."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m asyncfp8.report",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Groups, their keys and the plots: docs/running.md, 'Comparing runs'.",
    )
    parser.add_argument("--version", action="version", version=f"asyncfp8 {__version__}")
    parser.add_argument(
        "runs", nargs="*", help="run directories (each with config.yaml, metrics.jsonl)"
    )
    parser.add_argument(
        "--tables",
        nargs="+",
        metavar="JSON",
        help="instead of run directories: tables earlier reports wrote (--json), pooled by "
        "group label (a study run in parts; no plots, the tables hold no curves)",
    )
    parser.add_argument(
        "--out",
        default="compare.png",
        help="the multi-panel PNG of every metric per step (default: %(default)s)",
    )
    parser.add_argument(
        "--curves",
        help="the PNG of held-out pass@1 per group with 95%% confidence bands "
        "(default: --out's name with _heldout, e.g. compare_heldout.png)",
    )
    parser.add_argument(
        "--labels",
        nargs="*",
        help="one label per run; runs sharing one form a group "
        "(default: grouped by setting, from config.yaml)",
    )
    parser.add_argument(
        "--paired-with",
        metavar="LABEL",
        help="a group's label (as printed, e.g. 'bf16 · token_tis · async'): every other "
        "group's final greedy held-out against it, seed by seed, mean ± 95%% CI",
    )
    parser.add_argument(
        "--json", help='also write {"runs": [per-run summaries], "groups": [per-group rows]} here'
    )
    return parser


def _read_runs(runs: list[str]) -> tuple[dict[str, DictConfig], dict[str, dict], list[str]]:
    """Each run's config and summary, and every problem with the input at once, before
    anything is summarized or drawn."""
    configs, problems = {}, []
    for run in runs:
        try:
            configs[run] = run_config(run)
        except ValueError as error:
            problems.append(str(error))
    if not problems:
        try:
            check_comparable(configs)
        except ValueError as error:
            problems.append(str(error))
    summaries = {}
    for run in configs if not problems else []:
        try:
            summaries[run] = summarize(run)
        except ValueError as error:
            problems.append(str(error))
    return configs, summaries, problems


def _print_runs(runs: list[str], seeds: dict[str, int], summaries: dict[str, dict]):
    """The per-run table, each run's warnings under its row."""
    names = {run: f"{summaries[run]['label']} s{seeds[run]}" for run in runs}
    width = max(40, *map(len, names.values()))
    print(
        f"{'run':<{width}} {'steps':>5} {'reward start':>12} {'reward end':>10} {'KL k3':>9} "
        f"{'fresh KL (steps)':>17} {'samples/s':>9}"
    )
    for run in runs:
        s = summaries[run]
        fresh = (
            f"{s['fresh_kl_k3_mean']:.2e} ({s['fresh_kl_steps']})"
            if s["fresh_kl_k3_mean"] is not None
            else f"- ({s['fresh_kl_steps']})"
        )
        print(
            f"{names[run]:<{width}} {s['steps']:>5} {s['reward_start']:>12.3f} "
            f"{s['reward_end']:>10.3f} {s['kl_k3_mean']:>9.2e} {fresh:>17} "
            f"{s['samples_per_s']:>9.1f}"
        )
        for warning in s["warnings"]:
            print(f"  warning: {warning}")


def main(argv: list[str] | None = None) -> None:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.labels and len(args.labels) != len(args.runs):
        parser.error(f"{len(args.labels)} labels for {len(args.runs)} runs")
    if repeated := sorted({run for run in args.runs if args.runs.count(run) > 1}):
        parser.error(f"{', '.join(repeated)} given more than once")
    if bool(args.runs) == bool(args.tables):
        parser.error("give run directories or --tables, one of the two")
    if args.tables:
        try:
            entries, summaries = pool_tables(args.tables)
        except ValueError as error:
            parser.exit(2, f"asyncfp8.report: {error}\n")
        if args.labels:
            parser.error("--labels groups run directories; tables keep their groups")
        runs, groups = list(summaries), None
        seeds = {
            run: seed for g in entries for run, seed in zip(g["runs"], g["seeds"], strict=True)
        }
    else:
        configs, summaries, problems = _read_runs(args.runs)
        if problems:
            parser.exit(2, "asyncfp8.report: " + "\n".join(problems) + "\n")
        runs, groups = args.runs, group_runs(configs, args.labels)
        entries = [group_summary(name, rs, configs, summaries) for name, rs in groups.items()]
        seeds = {run: configs[run].run.seed for run in runs}
    _print_runs(runs, seeds, summaries)
    if args.paired_with is not None:
        try:
            add_paired_differences(entries, summaries, args.paired_with)
        except ValueError as error:
            parser.exit(2, f"asyncfp8.report: {error}\n")
    print()
    print(format_groups(entries))
    print()
    if groups is not None:
        _plot(args, groups)
    if args.json:
        table = {"runs": [summaries[run] for run in runs], "groups": entries}
        Path(args.json).write_text(json.dumps(_json_safe(table), indent=2))


def _plot(args: argparse.Namespace, groups: dict[str, list[str]]) -> None:
    print(f"plot: {plot_runs(args.runs, args.out, args.labels)}")
    out = Path(args.out)
    curves_out = args.curves or out.with_name(f"{out.stem}_heldout{out.suffix or '.png'}")
    curves = plot_heldout(
        {name: [evaluations(run) for run in runs] for name, runs in groups.items()}, curves_out
    )
    print(f"held-out curves: {curves}" if curves else "held-out curves: none (no run evaluated)")
