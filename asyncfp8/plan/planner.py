"""The plan: every precision priced on one model, GPU and workload, as one dict.

`make_plan(cfg)` takes the Hydra config as a plain mapping (asyncfp8/conf/plan.yaml)
and returns what `report.py` prints, plots and writes as JSON.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from . import lengths as length_dists
from .calibration import Calibration, choose_calibration, load_calibration, measured_devices
from .costs import kv_bytes_per_token, weight_bytes
from .errors import PlanInputError
from .gpus import GPU, GPUS, HOW_TO_CUSTOM, get_gpu
from .model import ModelFacts, load_model_facts
from .precisions import Precision, get_precision
from .rlstep import learner_step_seconds, proximal_versions_bytes, step_times, weight_sync
from .rollout import simulate
from .step import StepModel, decode_step, kv_capacity_tokens

# A quantized precision is recommended only if it beats BF16 by more than this: smaller
# predicted gains are inside the model's error (docs/plan.md) and cost a mismatch.
WORTH_IT = 1.05
STREAM_STEPS = 3  # an asynchronous stream is simulated over this many steps' samples
# The engine a plan prices (`engine.kind`): `auto` takes a calibration measured with it.
ENGINE_KINDS = ("vllm", "torch")


def resolve_gpu(spec: Any) -> GPU:
    if isinstance(spec, str) and spec.lower() not in GPUS:
        devices = measured_devices()
        if spec in devices:
            return devices[spec]
        path_like = spec.endswith((".json", ".yaml", ".yml"))
        if not path_like:
            known = [*GPUS, *devices]
            raise PlanInputError(
                f"unknown GPU {spec!r}; known: {', '.join(known)}. Or {HOW_TO_CUSTOM}"
            )
    return get_gpu(spec)


def _positive_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PlanInputError(f"{name} must be a positive integer, got {value!r}")
    return value


def _positive(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise PlanInputError(f"{name} must be a positive number, got {value!r}")
    return float(value)


def _lengths(response: Mapping[str, Any]) -> length_dists.Lengths:
    max_tokens = _positive_int(response.get("max_tokens"), "workload.response.max_tokens")
    kind = response.get("kind", "lognormal")
    if kind == "lognormal":
        return length_dists.lognormal(
            response.get("mean_tokens"), response.get("sigma"), max_tokens
        )
    if kind == "measured":
        if not response.get("path"):
            raise PlanInputError("workload.response.kind=measured needs workload.response.path")
        return length_dists.measured(str(response["path"]), max_tokens)
    raise PlanInputError(f"workload.response.kind must be lognormal or measured, got {kind!r}")


def _precision_plan(
    model: ModelFacts,
    precision: Precision,
    gpu: GPU,
    calibration: Calibration,
    cfg: Mapping[str, Any],
    responses: np.ndarray,
    stream: np.ndarray,
    context: float,
) -> dict[str, Any]:
    engine, workload, plan = cfg["engine"], cfg["workload"], cfg["plan"]
    tp = engine["tp"]
    eff = calibration.efficiency
    prompt = workload["prompt_tokens"]
    capacity = kv_capacity_tokens(
        model, precision, gpu, tp, engine["gpu_memory_utilization"], engine["reserved_gib"]
    )
    result: dict[str, Any] = {
        "weight_gb": weight_bytes(model, precision) / 1e9,
        "kv_bytes_per_token": kv_bytes_per_token(model, precision),
        "kv_capacity_tokens": capacity,
        "running_sequences_at_mean_context": min(
            engine["max_num_seqs"], int(capacity // context), len(responses)
        ),
        "uses_tensor_cores": gpu.has_tensor_cores_for(precision.weights),
    }
    result["decode_tokens_per_s"] = [
        b / decode_step(model, precision, gpu, eff, b, b * context, tp).seconds
        if b * context <= capacity
        else None
        for b in plan["batch_sizes"]
    ]
    typical = max(1, min(result["running_sequences_at_mean_context"], len(responses)))
    price = decode_step(model, precision, gpu, eff, typical, typical * context, tp)
    result["step_at_typical_batch"] = {
        "batch": typical,
        "seconds": price.seconds,
        "share": {k: v / price.seconds for k, v in price.by_primitive.items() if v > 0},
    }
    if prompt + int(responses.max()) > capacity:
        result["fits"] = False
        return result

    steps = StepModel(model, precision, gpu, eff, tp)
    args = (capacity, engine["max_num_seqs"], steps.seconds, steps.prefill_seconds)
    one_step = simulate(prompt, responses, *args)
    first = simulate(prompt, stream[: len(responses)], *args)
    whole = simulate(prompt, stream, *args)
    sync_cfg = cfg["sync"]
    version = weight_sync(
        model,
        precision,
        gpu,
        calibration,
        sync_cfg["mode"],
        sync_cfg["link_gb_s"],
        sync_cfg["changed_fraction"],
        tp,
    )
    result |= {
        "fits": True,
        "rollout_seconds": one_step.seconds,
        "rollout_tokens_per_s": one_step.tokens_per_s,
        "rollout_stream_seconds_per_step": (whole.seconds - first.seconds) / (STREAM_STEPS - 1),
        "tail_fraction": one_step.tail_fraction(),
        "peak_running_sequences": int(one_step.batches.max()),
        "preemptions": one_step.preemptions,
        "weight_sync": {
            "mode": version.mode,
            "wire_gb": version.wire_bytes / 1e9,
            "quantize_s": version.quantize_s,
            "transfer_s": version.transfer_s,
            "apply_s": version.apply_s,
        },
        "_trace": one_step,
        "_sync": version,
    }
    return result


def make_plan(cfg: Mapping[str, Any]) -> dict[str, Any]:
    if not cfg["model"].get("path"):
        raise PlanInputError(
            "model.path is not set: an HF model directory, a config.json or a bundled name"
        )
    model = load_model_facts(str(cfg["model"]["path"]))
    gpu = resolve_gpu(cfg["gpu"])
    engine, workload = cfg["engine"], cfg["workload"]
    tp, utilization, staleness, batch_sizes, precisions, kind = _checked_settings(cfg)
    calibration = load_calibration(choose_calibration(str(cfg["plan"]["calibration"]), gpu, kind))
    lengths = _lengths(workload["response"])
    engines = workload["rollout_gpus"] // tp
    per_engine = math.ceil(workload["prompts_per_step"] * workload["samples_per_prompt"] / engines)
    seed = int(workload.get("seed", 0))
    responses = lengths.sample(per_engine, seed)
    stream = lengths.sample(STREAM_STEPS * per_engine, seed + 1)
    # The mean context a decode step attends over, weighted by tokens: a response of
    # length R spends its R steps at the prompt plus R/2 on average.
    mean_response = float(responses.mean())
    context = workload["prompt_tokens"] + float((responses.astype(float) ** 2).sum()) / (
        2 * responses.sum()
    )

    rows = {
        p.name: _precision_plan(model, p, gpu, calibration, cfg, responses, stream, context)
        for p in precisions
    }
    if not any(row["fits"] for row in rows.values()):
        longest = workload["prompt_tokens"] + int(responses.max())
        best = max(row["kv_capacity_tokens"] for row in rows.values())
        raise PlanInputError(
            f"impossible workload: a sequence of {longest} tokens (prompt "
            f"{workload['prompt_tokens']} + longest response {int(responses.max())}) does not fit "
            f"in the KV cache of one engine at any precision (at most {best} tokens on "
            f"{tp} x {gpu.name} with gpu_memory_utilization {utilization}); raise engine.tp, "
            "lower workload.response.max_tokens, or use a GPU with more memory"
        )

    learner_s, learner_source = _learner_seconds(cfg, model, gpu, lengths, seed)
    _add_step_times(rows, learner_s, staleness)

    return {
        "model": {
            "name": model.name,
            "parameters": model.parameter_count(),
            "active_parameters": model.active_parameter_count(),
            "moe": model.is_moe,
            "layers": model.num_layers,
            "heads": f"{model.num_heads}/{model.num_kv_heads} x {model.head_dim}",
        },
        "gpu": {k: v for k, v in vars(gpu).items()},
        "engine": dict(engine) | {"engines": engines, "sequences_per_engine": per_engine},
        "workload": dict(workload) | {"lengths": lengths.description},
        "mean_response_tokens": mean_response,
        "mean_decode_context_tokens": context,
        "learner_step_s": learner_s,
        "learner_step_source": learner_source,
        # π_prox of each sample's own version: the copies the learner keeps in host memory
        "proximal_versions_bytes": proximal_versions_bytes(model, staleness),
        "sync": dict(cfg["sync"]),
        "calibration": _calibration_summary(calibration, gpu, model),
        "batch_sizes": batch_sizes,
        "precisions": rows,
        "recommendation": recommend(rows, gpu),
    }


def _add_step_times(rows: dict[str, dict[str, Any]], learner_s: float, staleness: int) -> None:
    """Each row's RL step synchronous and asynchronous, and its speed-ups over BF16's."""
    for row in rows.values():
        if not row["fits"]:
            row |= {"rollout_speedup_vs_bf16": None, "step_sync_s": None, "step_async_s": None}
            continue
        row |= step_times(
            row["rollout_seconds"],
            row["rollout_stream_seconds_per_step"],
            learner_s,
            row.pop("_sync"),
            staleness,
        )
    base = rows["bf16"]
    for row in rows.values():
        if row["fits"] and base["fits"]:
            row["rollout_speedup_vs_bf16"] = base["rollout_seconds"] / row["rollout_seconds"]
            row["step_async_speedup_vs_bf16_sync"] = base["step_sync_s"] / row["step_async_s"]
        elif row["fits"]:
            row["rollout_speedup_vs_bf16"] = None


def _checked_settings(cfg: Mapping[str, Any]) -> tuple[int, float, int, list[int], list, str]:
    """The engine's, workload's, sync's and plan's settings, each refused naming its key
    when out of range: (tp, gpu_memory_utilization, max_staleness, batch sizes, the
    precisions, the engine kind)."""
    engine, workload, plan = cfg["engine"], cfg["workload"], cfg["plan"]
    tp = _positive_int(engine["tp"], "engine.tp")
    rollout_gpus = _positive_int(workload["rollout_gpus"], "workload.rollout_gpus")
    if rollout_gpus % tp:
        raise PlanInputError(
            f"workload.rollout_gpus={rollout_gpus} is not a multiple of engine.tp={tp}"
        )
    for key in ("prompts_per_step", "samples_per_prompt", "prompt_tokens"):
        _positive_int(workload[key], f"workload.{key}")
    _positive_int(engine["max_num_seqs"], "engine.max_num_seqs")
    utilization = _positive(engine["gpu_memory_utilization"], "engine.gpu_memory_utilization")
    if utilization > 1:
        raise PlanInputError(f"engine.gpu_memory_utilization must be at most 1, got {utilization}")
    if cfg["sync"]["mode"] not in ("full", "delta"):
        raise PlanInputError(f"sync.mode must be full or delta, got {cfg['sync']['mode']!r}")
    _positive(cfg["sync"]["link_gb_s"], "sync.link_gb_s")
    if not 0 < _positive(cfg["sync"]["changed_fraction"], "sync.changed_fraction") <= 1:
        raise PlanInputError("sync.changed_fraction is a share of the weights: at most 1")
    staleness = cfg["sync"]["max_staleness"]
    if isinstance(staleness, bool) or not isinstance(staleness, int) or staleness < 0:
        raise PlanInputError(f"sync.max_staleness must be an integer >= 0, got {staleness!r}")
    if engine["reserved_gib"] < 0:
        raise PlanInputError(f"engine.reserved_gib must be >= 0, got {engine['reserved_gib']}")
    batch_sizes = [_positive_int(b, "plan.batch_sizes[]") for b in plan["batch_sizes"]]
    precisions = [get_precision(name) for name in plan["precisions"]]
    if "bf16" not in plan["precisions"]:
        raise PlanInputError("plan.precisions must include bf16: speed-ups are relative to it")

    kind = str(engine.get("kind", "vllm"))
    if kind not in ENGINE_KINDS:
        raise PlanInputError(f"engine.kind must be one of {', '.join(ENGINE_KINDS)}, got {kind}")
    return tp, utilization, staleness, batch_sizes, precisions, kind


def _learner_seconds(
    cfg: Mapping[str, Any], model: ModelFacts, gpu: GPU, lengths: length_dists.Lengths, seed: int
) -> tuple[float, str]:
    """A learner step's seconds (`learner.step_s`, or from FLOPs) and where they came from."""
    workload, learner = cfg["workload"], cfg["learner"]
    if learner.get("step_s") is not None:
        learner_s = _positive(learner["step_s"], "learner.step_s")
        learner_source = "given"
    else:
        all_lengths = workload["prompt_tokens"] + lengths.sample(
            workload["prompts_per_step"] * workload["samples_per_prompt"], seed
        )
        learner_s = learner_step_seconds(
            model,
            all_lengths,
            gpu,
            _positive_int(learner["gpus"], "learner.gpus"),
            _positive(learner["mfu"], "learner.mfu"),
            _positive(learner["passes"], "learner.passes"),
        )
        learner_source = f"from FLOPs at {learner['mfu']:.0%} MFU on {learner['gpus']} x {gpu.name}"
    return learner_s, learner_source


def _calibration_summary(calibration: Calibration, gpu: GPU, model: ModelFacts) -> dict[str, Any]:
    summary = {
        "name": calibration.name,
        "description": calibration.description,
        "measured_on": calibration.device.name if calibration.device else None,
        "points": len(calibration.points),
        "fitted": calibration.fitted,
        "not_fitted": calibration.unfitted,
        "sources": calibration.sources,
    }
    if model.is_moe:
        fitted = ", ".join(calibration.fitted) if calibration.fitted else "none: all priors"
        summary["moe_priors"] = (
            "the routed experts are priced as dense linears over the experts a batch reaches "
            "when each token picks k of E uniformly, E(1 - (1 - k/E)^B) per layer (a prior: "
            "skewed routers reach fewer), with the factors fitted on dense decode steps "
            f"({fitted}); no factor was fitted to an MoE step. Measured against a CPU MoE "
            "rollout in docs/plan.md, 'An MoE on this CPU'"
        )
    if calibration.device and calibration.device.name != gpu.name:
        summary["warning"] = (
            f"measured on {calibration.device.name}, applied to {gpu.name}: its factors "
            "describe another device"
        )
    return summary


def recommend(rows: dict[str, dict[str, Any]], gpu: GPU) -> dict[str, Any]:
    feasible = {name: row for name, row in rows.items() if row["fits"]}
    lines = []
    misfits = [name for name, row in rows.items() if not row["fits"]]
    if misfits:
        lines.append(
            f"{', '.join(misfits)}: the longest sequence does not fit in the KV cache at this "
            "precision"
        )
    if "bf16" in feasible:
        best = max(feasible, key=lambda n: feasible[n]["rollout_speedup_vs_bf16"])
        gain = feasible[best]["rollout_speedup_vs_bf16"]
        choice = best if gain >= WORTH_IT else "bf16"
        if choice == "bf16":
            lines.append(
                f"stay on bf16: the best quantized precision ({best}) is predicted at only "
                f"{gain:.2f}x the BF16 rollout, inside the model's error"
            )
        else:
            lines.append(f"{best}: rollout {gain:.2f}x BF16's")
    else:
        choice = min(feasible, key=lambda n: feasible[n]["rollout_seconds"])
        lines.append(f"{choice}: BF16 cannot hold the longest sequence here")
    row = feasible[choice]
    share = row["step_at_typical_batch"]["share"]
    weights = sum(
        v for k, v in share.items() if k.endswith(("proj", "experts", "router", "lm_head"))
    )
    lines.append(
        f"at {choice}, a decode step of {row['step_at_typical_batch']['batch']} sequences is "
        f"{weights:.0%} GEMMs (weights), {share.get('attention', 0):.0%} attention (KV cache), "
        f"{sum(v for k, v in share.items() if 'overhead' in k or 'launch' in k):.0%} fixed costs; "
        f"{row['tail_fraction']:.0%} of the rollout runs under a quarter of the peak batch"
    )
    lines.append(
        f"asynchronous (bounded staleness): {row['async_speedup']:.2f}x the synchronous step "
        f"({row['step_async_s']:.1f} s vs {row['step_sync_s']:.1f} s)"
    )
    sync = row["weight_sync"]
    lines.append(
        f"weight sync per version ({sync['mode']}): {sync['wire_gb']:.3g} GB, "
        f"{sync['quantize_s'] + sync['transfer_s'] + sync['apply_s']:.3g} s"
    )
    if choice != "bf16":
        lines.append("a quantized rollout needs a mismatch correction (e.g. correction=token_tis)")
    if get_precision(choice).weights == "fp8" and not gpu.has_tensor_cores_for("fp8"):
        lines.append(f"{gpu.name} has no FP8 tensor cores: FP8 runs weight-only (W8A16)")
    return {
        "precision": choice,
        "mode": "async" if row["async_speedup"] > 1 else "sync",
        "text": lines,
    }
