"""Was each rollback of the guard needed? Twins answer it: the same setting and seed run
with the guard on and off (`scripts/stability_runs.sh`, e.g. `bf16` and `bf16_noguard`)
are the same run, bit for bit, up to the guard's first rollback. A rollback is

- **needed** when the twin without the guard collapsed (asyncfp8/report/collapse.py's rule) at
  or after the rollback's step (a collapse long after it may have other causes: the
  step and the collapse's step are printed),
- **false** when the twin did not: the step the guard undid did not break the run,
- **not judged** when the twins had already parted before it: after an earlier rollback
  (the guarded run's weights are no longer the twin's, even while the batches, sampled
  by versions from before it, still read the same), or where the batches differ.

It also prints how many far tokens (|log ρ| beyond `guard.log_ratio_bound`, the guard's
`guard/far_tokens`) each batch of the guarded runs had: the count a fatal step must
exceed and a clean step must stay under, which `guard.far_tokens` is set from.

    python scripts/guard_twins.py runs/stability bf16:bf16_noguard fp8:fp8_noguard \
        --json docs/figures/guard_twins.json
"""

from __future__ import annotations

import argparse
import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

from asyncfp8.report.compare import run_config
from asyncfp8.report.summary import per_step, summarize
from asyncfp8.train.guard import GuardSettings

# The key the twins must agree on at every step before a rollback: the batch's mean
# reward is what the learner trained on, and two runs that part differ there first.
SAME_RUN_KEY = "reward/mean"


def parted_before(guarded: list[dict], twin: list[dict], step: int) -> bool:
    """Whether the two runs' records differ at any step before `step`."""
    theirs = {r["step"]: r.get(SAME_RUN_KEY) for r in twin}
    return any(theirs.get(r["step"]) != r.get(SAME_RUN_KEY) for r in guarded if r["step"] < step)


def signal_of(record: dict, settings: GuardSettings) -> str:
    """Which of the guard's rules failed the batch (asyncfp8/train/guard.py checks them in this
    order; the metrics keep the evidence, the learner's log the verdict)."""
    if record.get("guard/far_tokens", 0) >= settings.far_tokens:
        return "far_tokens"
    if record.get("guard/far_fraction", 0.0) > settings.far_fraction:
        return "far_fraction"
    return "dead_reward"


def judge_pair(guarded_dir: Path, twin_dir: Path) -> dict[str, Any]:
    """Each rollback of the guarded run, judged against its twin; the far-token counts of
    the guarded run's batches."""
    guarded, twin = per_step(guarded_dir), per_step(twin_dir)
    settings = GuardSettings.from_config(run_config(guarded_dir).guard)
    twin_summary, guarded_summary = summarize(twin_dir), summarize(guarded_dir)
    rollbacks = []
    for record in guarded:
        if not record.get("guard/rolled_back"):
            continue
        step = record["step"]
        if rollbacks or parted_before(guarded, twin, step):
            verdict = "not judged"
        else:
            collapsed_after = twin_summary["collapsed"] and twin_summary["collapse_step"] >= step
            verdict = "needed" if collapsed_after else "false"
        rollbacks.append(
            {
                "step": step,
                "signal": signal_of(record, settings),
                "far_tokens": int(record.get("guard/far_tokens", 0)),
                "far_fraction": record.get("guard/far_fraction", 0.0),
                "reward_frac": record.get("guard/reward_frac"),
                "verdict": verdict,
            }
        )
    far = Counter(int(r.get("guard/far_tokens", 0)) for r in guarded if "guard/far_tokens" in r)
    return {
        "guarded": str(guarded_dir),
        "twin": str(twin_dir),
        "heldout_guarded": guarded_summary["eval_pass1_greedy_end"],
        "heldout_twin": twin_summary["eval_pass1_greedy_end"],
        "twin_collapsed": twin_summary["collapsed"],
        "twin_collapse_step": twin_summary["collapse_step"],
        "guarded_collapsed": guarded_summary["collapsed"],
        "rollbacks": rollbacks,
        "far_token_batches": {str(k): v for k, v in sorted(far.items())},
    }


def seeds_of(root: Path, setting: str) -> dict[int, Path]:
    """The finished runs `<root>/<setting>_seed<N>` (summary.json written), by seed."""
    found = {}
    for path in root.glob(f"{setting}_seed*"):
        match = re.fullmatch(rf"{re.escape(setting)}_seed(\d+)", path.name)
        if match and (path / "summary.json").exists():
            found[int(match.group(1))] = path
    return found


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("root", type=Path, help="the study's directory of runs")
    parser.add_argument(
        "pairs", nargs="+", help="GUARDED:TWIN setting names, e.g. bf16:bf16_noguard"
    )
    parser.add_argument("--json", type=Path, help="write the table here too")
    args = parser.parse_args(argv)
    table: dict[str, Any] = {}
    for pair in args.pairs:
        guarded_name, _, twin_name = pair.partition(":")
        if not twin_name:
            parser.error(f"{pair!r}: give GUARDED:TWIN, e.g. bf16:bf16_noguard")
        guarded, twins = seeds_of(args.root, guarded_name), seeds_of(args.root, twin_name)
        seeds = sorted(set(guarded) & set(twins))
        if not seeds:
            parser.error(f"{pair}: no seed finished under both names in {args.root}")
        rows = {seed: judge_pair(guarded[seed], twins[seed]) for seed in seeds}
        table[pair] = rows
        print(f"{pair}: seeds {' '.join(map(str, seeds))}")
        print(
            "  seed  held-out on/off  twin collapsed at  "
            "rollbacks (step: signal, far tokens, verdict)"
        )
        for seed, row in rows.items():
            listed = ", ".join(
                f"{r['step']}: {r['signal']}, {r['far_tokens']}, {r['verdict']}"
                for r in row["rollbacks"]
            )
            print(
                f"  {seed:4d}  {row['heldout_guarded']:.3f} / {row['heldout_twin']:.3f}"
                f"   {row['twin_collapse_step'] if row['twin_collapsed'] else '-':>17}"
                f"  {listed or '-'}"
            )
        verdicts = Counter(r["verdict"] for row in rows.values() for r in row["rollbacks"])
        far = Counter()
        for row in rows.values():
            far.update({int(k): v for k, v in row["far_token_batches"].items()})
        print(
            f"  rollbacks: {verdicts['needed']} needed, {verdicts['false']} false, "
            f"{verdicts['not judged']} not judged"
        )
        print(
            "  guarded batches by far tokens: "
            + ", ".join(f"{k}: {v}" for k, v in sorted(far.items()))
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(table, indent=1, default=str) + "\n")
    return table


if __name__ == "__main__":
    main()
