"""One run's numbers from its metrics.jsonl and config.yaml: its records by step, its
summary (the launcher's summary.json: reward, held-out, mismatch KL, staleness, the
guard, whether it collapsed) and the label of its setting. The report (comparing runs),
its plots, the launcher and the W&B logger read runs through it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from omegaconf import DictConfig, OmegaConf

from asyncfp8.report.collapse import heldout_curve, late_slide, run_collapse
from asyncfp8.report.stats import binomial_se
from asyncfp8.run.files import GUARD_STOP_FILE
from asyncfp8.run.records import read_metrics
from asyncfp8.run.resume import CONFIG_FILE

TAIL = 0.2  # "final" numbers are means over the last 20% of steps
LAST_STEPS = 20  # the stream reward set beside the final held-out pass@1


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
# Warn when more than this share of groups had no reward spread: of the whole run in its
# summary, and of the last ZERO_SPREAD_WINDOW steps while it runs (the learner's log and
# the launcher's progress bar).
ZERO_SPREAD_WARN, ZERO_SPREAD_WINDOW = 0.5, 20


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
    warnings = _warnings(zero_spread, len(fresh))
    collapse = run_collapse(records, evaluated)
    slide = late_slide(heldout_curve(evaluated))
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
        # The stream's reward of (nearly) the final policy: what the last held-out
        # evaluation is compared with to see memorization.
        "reward_last_steps": _mean(records[-LAST_STEPS:], "reward/mean"),
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
        # the size of the last evaluation, and the binomial standard error it gives the
        # final greedy pass@1: the evaluation's own noise, whatever the seed
        "eval_prompts": evaluated[-1].get("eval/prompts") if evaluated else None,
        "eval_pass1_greedy_end_se": _end_se(evaluated),
        # steps the guard rolled back, resumes included (None: a run without the guard)
        "guard_rollbacks": _rollbacks(records),
        # evaluations the held-out guard undid (guard.heldout_below)
        "guard_heldout_rollbacks": _heldout_rollbacks(evaluated),
        "collapsed": collapse.collapsed,
        "collapse_signal": collapse.signal,
        "collapse_step": collapse.step,
        "collapse_reason": collapse.reason,
        "fell_and_recovered": collapse.fell_and_recovered,
        # the end more than SLIDE_DROP below the best of the last SLIDE_STEPS steps
        "late_slide": slide.slid,
        "late_slide_drop": slide.drop,
        # the guard's stop ({step, signal, detail, setting, good_step, checkpoint}), or None
        "guard_stopped": _guard_stop(run_dir),
        "warnings": warnings,
    }


def _warnings(zero_spread: float, fresh_steps: int) -> list[str]:
    """A run's warnings: most groups without reward spread, or a precision-only KL on too
    few steps to keep."""
    warnings = []
    if zero_spread > ZERO_SPREAD_WARN:
        warnings.append(
            f"{zero_spread:.0%} of groups had no reward spread (every sample scored the same) "
            "and trained nothing: the task is too hard or too easy for this model, or the "
            "reward is constant"
        )
    if fresh_steps and fresh_steps < MIN_FRESH_STEPS:
        warnings.append(
            f"the precision-only KL rests on {fresh_steps} steps with current-version tokens "
            f"(< {MIN_FRESH_STEPS}); left out (run.mode=sync measures it at every step)"
        )
    return warnings


def _heldout_rollbacks(evaluated: list[dict]) -> list[dict[str, Any]]:
    """The evaluations the held-out guard undid: the step, the undone greedy pass@1, the
    step whose weights came back and their pass@1 now."""
    return [
        {
            "step": r["step"],
            "undone": r["guard/heldout_undone_greedy"],
            "restored_step": r["guard/heldout_restored_step"],
            "restored": r["eval/pass1_greedy"],
        }
        for r in evaluated
        if r.get("guard/heldout_undone_greedy") is not None
    ]


def _guard_stop(run_dir: str | Path) -> dict[str, Any] | None:
    path = Path(run_dir) / GUARD_STOP_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def _rollbacks(records: list[dict]) -> int | None:
    guarded = [r["guard/rolled_back"] for r in records if "guard/rolled_back" in r]
    return int(sum(guarded)) if guarded else None


def _first(records: list[dict], key: str) -> float:
    return records[0][key] if records else float("nan")


def _last(records: list[dict], key: str) -> float:
    return records[-1].get(key, float("nan")) if records else float("nan")


def _end_se(evaluated: list[dict]) -> float | None:
    last = evaluated[-1] if evaluated else {}
    if last.get("eval/pass1_greedy") is None or not last.get("eval/prompts"):
        return None  # not evaluated, or by an asyncfp8 that did not record the size
    return binomial_se(last["eval/pass1_greedy"], last["eval/prompts"])


def label(run_dir: str | Path) -> str:
    config = Path(run_dir) / CONFIG_FILE
    if not config.exists():
        return Path(run_dir).name
    return setting_label(setting(OmegaConf.load(config)))


def setting(cfg: DictConfig) -> dict[str, str]:
    """What a comparison is about: the rollout precision (a user plugin by its class), the
    correction, the learner's forward (master weights or quantized like the rollouts), the
    weights the rollouts are quantized from, the learner's and the engine's compute dtypes,
    the mode, which weights π_prox is (correction.proximal) and whether the guard was on (a
    run from before the guard: off). Runs that differ only in run.seed are seeds of one setting."""
    precision = OmegaConf.select(cfg, "precision._target_") or cfg.precision.name
    return {
        "precision": str(precision),
        "correction": str(cfg.correction.name),
        "learner_forward": str(OmegaConf.select(cfg, "precision.learner_forward") or "master"),
        "quantize_from": str(OmegaConf.select(cfg, "precision.quantize_from") or "master"),
        "compute_dtype": str(OmegaConf.select(cfg, "run.compute_dtype") or "auto"),
        "engine_dtype": _engine_dtype(cfg, str(precision)),
        "mode": str(cfg.run.mode),
        # a run from before correction.proximal had π_prox of the current weights
        "proximal": str(OmegaConf.select(cfg, "correction.proximal") or "current"),
        "guard": "on" if OmegaConf.select(cfg, "guard.enabled") is True else "off",
    }


def _engine_dtype(cfg: DictConfig, precision: str) -> str:
    """precision.engine_dtype, "policy" where it is the policy's own (null, a run from
    before the key, or the policy's dtype named), so that such runs group together."""
    asked = OmegaConf.select(cfg, "precision.engine_dtype")
    if asked is None:
        return "policy"
    own = "float16" if precision.split("+")[0] == "fp16" else "bfloat16"
    return "policy" if str(asked) == own else str(asked)


PROXIMAL_NOTES = {"current": "of the current weights", "version": "of the sample's version"}


def setting_label(setting: dict[str, str]) -> str:
    precision, notes = setting["precision"], []
    if setting["learner_forward"] != "master":
        notes.append(f"{setting['learner_forward']} forward")
    if setting.get("quantize_from", "master") != "master":
        notes.append(f"quantized from {setting['quantize_from']} weights")
    if setting.get("compute_dtype", "auto") != "auto":
        notes.append(f"learner in {setting['compute_dtype']}")
    if setting.get("engine_dtype", "policy") != "policy":
        notes.append(f"engine in {setting['engine_dtype']}")
    if notes:
        precision += f" ({', '.join(notes)})"
    label = f"{precision} · {setting['correction']} · {setting['mode']}"
    proximal = setting.get("proximal", "current")
    if proximal != "auto":  # the default: unnamed, as other defaults are
        label += f" · π_prox {PROXIMAL_NOTES.get(proximal, proximal)}"
    if setting.get("guard", "on") != "on":
        label += " · guard off"
    return label
