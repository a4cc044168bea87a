"""The planner (asyncfp8.plan) against what was measured: the published FP8/INT8 rollout
speed-ups and KV capacities, and asyncfp8's own CPU decode table.

    python bench/plan_check.py [--out bench/results/plan-check.json]

Published cases are run with the setups their sources state (model, GPU, GPUs per
engine, batch, lengths, memory utilization); what a source leaves out is filled from the
same authors' published recipes or the planner's defaults, and every filled value is
listed in the output beside the case. The mean response length of an RL run is never
stated (it grows during training), so each case is also swept over a range of means.
CPU cells are predicted with the calibration fitted to all of them (in sample) and, for
each cell, with one fitted to all the others (leave-one-out): the second is the honest
error. docs/plan.md reports these numbers.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from omegaconf import OmegaConf

from asyncfp8.plan.calibration import load_calibration
from asyncfp8.plan.costs import kv_bytes_per_token, weight_bytes
from asyncfp8.plan.fitting import get_factor, predict_points
from asyncfp8.plan.gpus import GPUS
from asyncfp8.plan.model import load_model_facts
from asyncfp8.plan.planner import make_plan
from asyncfp8.plan.precisions import get_precision
from asyncfp8.plan.step import kv_capacity_tokens
from bench.common import write_json

CONFIG = Path(__file__).resolve().parent.parent / "asyncfp8" / "conf" / "plan.yaml"
MEAN_SWEEP = (1000, 2000, 4000, 8000)  # mean response tokens when a source states none

VERL_FP8 = "veRL docs/advance/fp8.md (FP8-RL report, arXiv 2601.18150)"
VERL_MOE_RECIPE = "veRL recipe/dapo/run_dapo_qwen3_moe_30b_vllm_fp8_rollout.sh"
NEMO_1212 = "NeMo-RL PR 1212 (KV cache quantization in FP8 rollout), results of 2025-12-02"
VERL_4435 = "veRL PR 4435 (FP8 KV cache), configuration"
FLASHRL = "FlashRL blog (fengyao.notion.site/flash-rl) and README"
DAPO_32B = "veRL recipe/dapo/run_dapo_qwen2.5_32b.sh (the DAPO-32B run FlashRL patches)"
VERL_QUICKSTART = "veRL quickstart (Qwen2.5-0.5B-Instruct on GSM8K, one GPU)"

# Each case: the planner settings, where each came from, and the published speed-ups
# (precision -> (low, high) over BF16 unless `over` says otherwise).
CASES: list[dict[str, Any]] = [
    {
        "name": "Qwen3-8B dense, FP8 W8A8 (veRL)",
        "source": VERL_FP8,
        "settings": {
            "model.path": "qwen3-8b",
            "gpu": "h100",
            "workload.rollout_gpus": 8,
            "workload.prompts_per_step": 96,
            "workload.samples_per_prompt": 16,
            "workload.response.max_tokens": 20480,
        },
        "filled": {
            "engine.tp": (1, VERL_MOE_RECIPE + " (same authors): gen_tp=1"),
            "engine.gpu_memory_utilization": (0.9, VERL_MOE_RECIPE),
            "engine.max_num_seqs": (256, VERL_MOE_RECIPE),
            "workload.prompt_tokens": (1024, VERL_MOE_RECIPE + ": max_prompt_length"),
        },
        "published": {"fp8": (1.12, 1.18)},
        "note": "~12% with CUDA 12.6 + DeepGEMM, up to ~18% with CUDA 12.9",
    },
    {
        "name": "Qwen3-30B-A3B MoE, FP8 W8A8 (veRL)",
        "source": VERL_FP8 + "; " + VERL_MOE_RECIPE,
        "settings": {
            "model.path": "qwen3-30b-a3b",
            "gpu": "h100",
            "workload.rollout_gpus": 16,
            "workload.prompts_per_step": 96,
            "workload.samples_per_prompt": 16,
            "workload.prompt_tokens": 1024,
            "workload.response.max_tokens": 20480,
            "engine.tp": 1,
            "engine.gpu_memory_utilization": 0.9,
            "engine.max_num_seqs": 256,
        },
        "filled": {},
        "published": {"fp8": (1.35, 1.35)},
        "note": "'over 35%': a lower bound",
    },
    {
        "name": "Qwen3-8B dense, FP8 W8A8 + FP8 KV cache (NeMo-RL)",
        "source": NEMO_1212 + "; " + VERL_4435,
        "settings": {
            "model.path": "qwen3-8b",
            "gpu": "h100",
            "workload.rollout_gpus": 8,
            "workload.prompts_per_step": 96,
            "workload.samples_per_prompt": 16,
            "workload.response.max_tokens": 20480,
        },
        "filled": {
            "engine.tp": (1, "assumed as in the veRL cases"),
            "engine.max_num_seqs": (256, "assumed as in the veRL cases"),
            "workload.prompt_tokens": (1024, "assumed as in the veRL cases"),
            "engine.gpu_memory_utilization": (
                None,
                "solved from the published BF16 KV capacity (249,952 tokens)",
            ),
        },
        "published": {"fp8+fp8_kv": (1.48, 1.48)},
        "published_over_fp8": {"fp8+fp8_kv": (1.30, 1.30)},
        "note": "'~30% over FP8 linear only, ~48% total vs BF16'",
    },
    {
        "name": "Qwen2.5-32B dense, 8-bit rollout (FlashRL, DAPO-32B)",
        "source": FLASHRL + "; " + DAPO_32B,
        "settings": {
            "model.path": "qwen2.5-32b",
            "gpu": "h100",
            "engine.tp": 4,
            "engine.gpu_memory_utilization": 0.8,
            "workload.rollout_gpus": 128,
            "workload.prompts_per_step": 1536,
            "workload.samples_per_prompt": 16,
            "workload.prompt_tokens": 2048,
            "workload.response.max_tokens": 20480,
        },
        "filled": {"engine.max_num_seqs": (1024, "veRL's rollout default")},
        "published": {"int8": (1.7, 1.7), "fp8": (1.7, 1.7)},
        "up_to": True,
        # FlashRL does not say how many GPUs an engine had; the recipe's tp=4 is one choice.
        "what_if": {"engine.tp": 2},
        "note": (
            "'up to ~1.7x', over 'various response lengths'; FP8 on H100, INT8 on H100 and A100"
        ),
    },
    {
        "name": "Qwen2.5-0.5B, 8-bit rollout (FlashRL, GSM8K)",
        "source": FLASHRL + "; " + VERL_QUICKSTART,
        "settings": {
            "model.path": "qwen2.5-0.5b",
            "gpu": "h100",
            "engine.tp": 1,
            "engine.gpu_memory_utilization": 0.4,
            "workload.rollout_gpus": 1,
            "workload.prompts_per_step": 256,
            "workload.response.max_tokens": 512,
        },
        "filled": {
            "workload.samples_per_prompt": (5, "veRL's GSM8K GRPO examples: n=5"),
            "workload.prompt_tokens": (150, "a GSM8K question with its instruction"),
            "engine.max_num_seqs": (1024, "veRL's rollout default"),
            "workload.response.sigma": (0.5, "assumed: short answers have a short tail"),
        },
        "published": {"int8": (1.1, 1.2), "fp8": (1.1, 1.2)},
        "sweep": (150, 250, 400),
        "note": "'small models gain only 1.1-1.2x'",
    },
]


def base_config() -> dict[str, Any]:
    cfg = OmegaConf.load(CONFIG)
    for key in ("defaults", "hydra"):
        cfg.pop(key)
    return OmegaConf.to_container(cfg)


def configure(settings: dict[str, Any]) -> dict[str, Any]:
    cfg = OmegaConf.create(base_config())
    for key, value in settings.items():
        OmegaConf.update(cfg, key, value)
    return OmegaConf.to_container(cfg)


def memory_utilization_for(model_name: str, capacity: int, reserved_gib: float) -> float:
    """The gpu_memory_utilization at which a BF16 engine on an H100 holds `capacity`."""
    model = load_model_facts(model_name)
    bf16 = get_precision("bf16")
    needed = capacity * kv_bytes_per_token(model, bf16) + weight_bytes(model, bf16)
    return (needed + reserved_gib * 2**30) / GPUS["h100"].memory_bytes


def error(predicted: float, low: float, high: float) -> float:
    """Relative error against a published value or range (0 inside the range)."""
    if predicted < low:
        return predicted / low - 1
    if predicted > high:
        return predicted / high - 1
    return 0.0


def gain_error(predicted: float, low: float, high: float) -> float:
    """The same on the gain (speed-up - 1): +12% predicted as +6% is a -50% error."""
    return error(predicted - 1, low - 1, high - 1)


def run_case(case: dict[str, Any]) -> dict[str, Any]:
    settings = dict(case["settings"])
    filled = dict(case["filled"])
    reserved = base_config()["engine"]["reserved_gib"]
    if (
        "engine.gpu_memory_utilization" in filled
        and filled["engine.gpu_memory_utilization"][0] is None
    ):
        util = memory_utilization_for(settings["model.path"], 249_952, reserved)
        filled["engine.gpu_memory_utilization"] = (util, filled["engine.gpu_memory_utilization"][1])
    settings |= {key: value for key, (value, _) in filled.items()}
    means = case.get("sweep", MEAN_SWEEP)
    sweep = []
    for mean in means:
        plan = make_plan(configure(settings | {"workload.response.mean_tokens": mean}))
        rows = plan["precisions"]
        sweep.append(
            {
                "mean_response_tokens": mean,
                "speedup_vs_bf16": {n: r["rollout_speedup_vs_bf16"] for n, r in rows.items()},
                "kv_capacity_tokens": {n: r["kv_capacity_tokens"] for n, r in rows.items()},
                "peak_running": {n: r.get("peak_running_sequences") for n, r in rows.items()},
                "tail_fraction": {n: r.get("tail_fraction") for n, r in rows.items()},
                "bf16_step_share": rows["bf16"]["step_at_typical_batch"]["share"],
                "calibration": plan["calibration"]["name"],
            }
        )
    default_mean = 4000 if 4000 in means else means[len(means) // 2]
    central = next(s for s in sweep if s["mean_response_tokens"] == default_mean)
    comparisons = []
    for name, (low, high) in case["published"].items():
        values = [s["speedup_vs_bf16"][name] for s in sweep]
        predicted = max(values) if case.get("up_to") else central["speedup_vs_bf16"][name]
        comparisons.append(
            {
                "what": f"{name} vs bf16",
                "published": [low, high],
                "predicted": predicted,
                "predicted_range_over_lengths": [min(values), max(values)],
                "error": error(predicted, low, high),
                "gain_error": gain_error(predicted, low, high),
            }
        )
    for name, (low, high) in case.get("published_over_fp8", {}).items():
        values = [s["speedup_vs_bf16"][name] / s["speedup_vs_bf16"]["fp8"] for s in sweep]
        predicted = central["speedup_vs_bf16"][name] / central["speedup_vs_bf16"]["fp8"]
        comparisons.append(
            {
                "what": f"{name} vs fp8",
                "published": [low, high],
                "predicted": predicted,
                "predicted_range_over_lengths": [min(values), max(values)],
                "error": error(predicted, low, high),
                "gain_error": gain_error(predicted, low, high),
            }
        )
    what_if = None
    if case.get("what_if"):
        changed = settings | case["what_if"] | {"workload.response.mean_tokens": default_mean}
        rows = make_plan(configure(changed))["precisions"]
        what_if = {
            "settings": case["what_if"],
            "speedup_vs_bf16": {n: r["rollout_speedup_vs_bf16"] for n, r in rows.items()},
        }
    return {
        "name": case["name"],
        "source": case["source"],
        "settings": settings,
        "filled": {key: {"value": v, "why": why} for key, (v, why) in filled.items()},
        "note": case["note"],
        "compared_at_mean_response_tokens": "max over the sweep"
        if case.get("up_to")
        else default_mean,
        "comparisons": comparisons,
        "what_if": what_if,
        "sweep": sweep,
    }


def rankings(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The orderings the sources publish, checked on the predictions (at the compared
    mean length): within each case, and between cases."""
    by_name = {case["name"]: case for case in cases}

    def speedup(case_name: str, precision: str) -> float:
        return next(
            c["predicted"]
            for c in by_name[case_name]["comparisons"]
            if c["what"] == f"{precision} vs bf16"
        )

    dense, moe, nemo, big, small = (case["name"] for case in CASES)
    nemo_central = next(s for s in by_name[nemo]["sweep"] if s["mean_response_tokens"] == 4000)
    checks = [
        (f"{dense}: fp8 > bf16", speedup(dense, "fp8") > 1),
        (f"{moe}: fp8 > bf16", speedup(moe, "fp8") > 1),
        (
            f"{nemo}: fp8+fp8_kv > fp8 > bf16",
            nemo_central["speedup_vs_bf16"]["fp8+fp8_kv"]
            > nemo_central["speedup_vs_bf16"]["fp8"]
            > 1,
        ),
        (f"{big}: int8 > bf16 and fp8 > bf16", min(speedup(big, "int8"), speedup(big, "fp8")) > 1),
        (
            f"{small}: int8 > bf16 and fp8 > bf16",
            min(speedup(small, "int8"), speedup(small, "fp8")) > 1,
        ),
        (
            "FP8 gains more on the MoE 30B-A3B than on the dense 8B",
            speedup(moe, "fp8") > speedup(dense, "fp8"),
        ),
        (
            "8-bit gains more on the 32B than on the 0.5B",
            speedup(big, "int8") > speedup(small, "int8"),
        ),
    ]
    return [{"ordering": what, "right": bool(right)} for what, right in checks]


def nemo_capacities() -> dict[str, Any]:
    """KV capacity of Qwen3-8B per precision on one H100: the memory budget solved from
    the published BF16 figure, the others predicted."""
    published = {"bf16": 249_952, "fp8": 299_344, "fp8+fp8_kv": 598_672}
    reserved = base_config()["engine"]["reserved_gib"]
    util = memory_utilization_for("qwen3-8b", published["bf16"], reserved)
    model = load_model_facts("qwen3-8b")
    rows = []
    for name, value in published.items():
        predicted = kv_capacity_tokens(model, get_precision(name), GPUS["h100"], 1, util, reserved)
        rows.append(
            {
                "precision": name,
                "published": value,
                "predicted": predicted,
                "error": predicted / value - 1,
                "role": "solves the memory budget" if name == "bf16" else "prediction",
            }
        )
    return {"source": NEMO_1212, "gpu_memory_utilization_solved": util, "rows": rows}


def cpu_cells(name: str) -> dict[str, Any]:
    """Each cell of bench/results/rollout-cpu.json predicted by the calibration fitted to
    all cells, and by one fitted to all the others."""
    calibration = load_calibration(name)
    device, points = calibration.device, calibration.points
    cells = predict_points(points, device, calibration.efficiency)
    for i, cell in enumerate(cells):
        others = points[:i] + points[i + 1 :]
        held_out = predict_points([points[i]], device, calibration.refit(others))[0]
        cell["held_out_predicted_tokens_per_s"] = held_out["predicted_tokens_per_s"]
        cell["held_out_error"] = held_out["error"]
    bf16 = {(c["prompt_tokens"], c["batch"]): c for c in cells if c["precision"] == "bf16"}
    ratios = []
    for cell in cells:
        base = bf16[(cell["prompt_tokens"], cell["batch"])]
        if cell is base:
            continue
        measured = cell["measured_tokens_per_s"] / base["measured_tokens_per_s"]
        predicted = (
            cell["held_out_predicted_tokens_per_s"] / base["held_out_predicted_tokens_per_s"]
        )
        ratios.append(
            {
                "label": cell["label"],
                "measured_vs_bf16": measured,
                "predicted_vs_bf16": predicted,
                "error": predicted / measured - 1,
                "same_side_of_1": bool((measured > 1) == (predicted > 1)),
            }
        )
    return {
        "calibration": name,
        "fitted": {k: get_factor(calibration.efficiency, k) for k in calibration.fitted},
        "cells": cells,
        "median_abs_error_in_sample": statistics.median(abs(c["error"]) for c in cells),
        "median_abs_error_held_out": statistics.median(abs(c["held_out_error"]) for c in cells),
        "ratios_vs_bf16_held_out": ratios,
        "median_abs_ratio_error_held_out": statistics.median(abs(r["error"]) for r in ratios),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench/results/plan-check.json")
    args = parser.parse_args()
    cases = [run_case(case) for case in CASES]
    errors = [abs(c["error"]) for case in cases for c in case["comparisons"]]
    gain_errors = [abs(c["gain_error"]) for case in cases for c in case["comparisons"]]
    orderings = rankings(cases)
    capacities = nemo_capacities()
    cpu = [cpu_cells("cpu-torch"), cpu_cells("cpu-vllm")]
    for case in cases:
        print(case["name"])
        for c in case["comparisons"]:
            low, high = c["published"]
            pub = f"{low:.2f}" if low == high else f"{low:.2f}-{high:.2f}"
            lo, hi = c["predicted_range_over_lengths"]
            print(
                f"  {c['what']:<22} published {pub:<10} predicted {c['predicted']:.2f} "
                f"(lengths: {lo:.2f}-{hi:.2f})  error {c['error']:+.0%}, on the gain "
                f"{c['gain_error']:+.0%}"
            )
        if case["what_if"]:
            speedups = case["what_if"]["speedup_vs_bf16"]
            shown = ", ".join(f"{n} {v:.2f}" for n, v in speedups.items() if v is not None)
            print(f"  what if {case['what_if']['settings']}: {shown}")
    print(
        f"median |error| over {len(errors)} published speed-ups: {statistics.median(errors):.1%}"
        f" (on the gains: {statistics.median(gain_errors):.0%})"
    )
    for check in orderings:
        print(f"ranking {'right' if check['right'] else 'WRONG'}: {check['ordering']}")
    for row in capacities["rows"]:
        print(
            f"KV capacity {row['precision']:<11} published {row['published']:>8,} "
            f"predicted {row['predicted']:>8,} ({row['error']:+.1%}, {row['role']})"
        )
    for table in cpu:
        print(
            f"CPU {table['calibration']}: median |error| in sample "
            f"{table['median_abs_error_in_sample']:.1%}, "
            f"held out {table['median_abs_error_held_out']:.1%}; ratio to bf16 held out "
            f"{table['median_abs_ratio_error_held_out']:.1%}"
        )
        for row in table["cells"]:
            print(
                f"  {row['label']:<34} measured {row['measured_tokens_per_s']:>8.0f} "
                f"fitted {row['predicted_tokens_per_s']:>8.0f} "
                f"({row['error']:+.0%}) held out "
                f"{row['held_out_predicted_tokens_per_s']:>8.0f} ({row['held_out_error']:+.0%})"
            )
    path = write_json(
        args.out,
        {
            "published": cases,
            "median_abs_error_published": statistics.median(errors),
            "median_abs_gain_error_published": statistics.median(gain_errors),
            "rankings": orderings,
            "kv_capacity": capacities,
            "cpu": cpu,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
