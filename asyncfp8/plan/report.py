"""A plan as a table, a JSON file and a PNG."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def _public(value: Any) -> Any:
    """The plan without its private parts (simulation traces), JSON-ready."""
    if isinstance(value, dict):
        return {k: _public(v) for k, v in value.items() if not str(k).startswith("_")}
    if isinstance(value, list | tuple):
        return [_public(v) for v in value]
    if hasattr(value, "item"):  # numpy scalars
        return value.item()
    return value


def write_json(plan: dict[str, Any], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_public(plan), indent=2) + "\n")
    return path


def _count(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def _times(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _num(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def table(plan: dict[str, Any]) -> str:
    model, gpu, engine, workload = plan["model"], plan["gpu"], plan["engine"], plan["workload"]
    calibration = plan["calibration"]
    lines = [
        f"model {model['name']}: {_count(model['parameters'])} parameters"
        + (f" ({_count(model['active_parameters'])} active, MoE)" if model["moe"] else "")
        + f", {model['layers']} layers, heads {model['heads']}",
        f"gpu {gpu['name']}: {gpu['memory_gb']:g} GiB, {gpu['bandwidth_tb_s']:g} TB/s, "
        f"BF16 {gpu['bf16_tflops']:g} TFLOP/s; {engine['engines']} engine(s) of tp={engine['tp']}, "
        f"{engine['sequences_per_engine']} sequences each per step",
        f"workload: {workload['prompts_per_step']} prompts x {workload['samples_per_prompt']} "
        f"samples, prompt {workload['prompt_tokens']} tokens, responses {workload['lengths']}; "
        f"mean decode context {plan['mean_decode_context_tokens']:,.0f} tokens",
        f"learner step {plan['learner_step_s']:.1f} s ({plan['learner_step_source']}); "
        f"sync {plan['sync']['mode']} over {plan['sync']['link_gb_s']:g} GB/s, "
        f"max staleness {plan['sync']['max_staleness']}; π_prox of each sample's version keeps "
        f"{plan['proximal_versions_bytes'] / 2**30:.1f} GiB of learner host memory",
        f"calibration {calibration['name']}: {calibration['description']}"
        + (f" [{calibration['warning']}]" if calibration.get("warning") else ""),
        *([f"MoE: {calibration['moe_priors']}"] if calibration.get("moe_priors") else []),
        "",
        "decode tokens/s per engine at the mean context, by running batch ('-': the KV cache "
        "cannot hold that batch)",
    ]
    batches = plan["batch_sizes"]
    w = max(11, *(len(name) + 2 for name in plan["precisions"]))  # mixed_int8@0.67 is long
    header = f"{'precision':<{w}}" + "".join(f"{b:>10}" for b in batches)
    lines += [header]
    for name, row in plan["precisions"].items():
        lines.append(f"{name:<{w}}" + "".join(f"{_num(v):>10}" for v in row["decode_tokens_per_s"]))
    lines += [
        "",
        f"{'precision':<{w}}{'weights GB':>11}{'KV tokens':>12}{'running':>9}{'rollout s':>11}"
        f"{'vs bf16':>9}{'tail':>6}{'sync GB':>9}{'step sync':>11}{'step async':>11}",
    ]
    for name, row in plan["precisions"].items():
        fits = row["fits"]
        lines.append(
            f"{name:<{w}}{row['weight_gb']:>11.3g}{row['kv_capacity_tokens']:>12,}"
            f"{row['running_sequences_at_mean_context']:>9}"
            + (
                f"{row['rollout_seconds']:>11.1f}{_times(row['rollout_speedup_vs_bf16']):>9}"
                f"{row['tail_fraction']:>6.0%}{row['weight_sync']['wire_gb']:>9.3g}"
                f"{row['step_sync_s']:>11.1f}{row['step_async_s']:>11.1f}"
                if fits
                else f"{'does not fit: the longest sequence exceeds the KV cache':>56}"
            )
        )
    lines += [
        "",
        f"recommendation: {plan['recommendation']['precision']}, {plan['recommendation']['mode']}",
    ]
    lines += [f"  - {line}" for line in plan["recommendation"]["text"]]
    return "\n".join(lines)


def plot(plan: dict[str, Any], path: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (throughput, tail) = plt.subplots(1, 2, figsize=(12, 4.5))
    batches = plan["batch_sizes"]
    styles = ["-", "--", "-.", ":"]  # INT8 and FP8 often coincide: keep both visible
    for i, (name, row) in enumerate(plan["precisions"].items()):
        style = styles[i % len(styles)]
        points = [(b, v) for b, v in zip(batches, row["decode_tokens_per_s"], strict=True) if v]
        if points:
            throughput.plot(*zip(*points, strict=True), style, marker="o", label=name)
        trace = row.get("_trace")
        if trace is not None:
            tail.step(trace.times, trace.batches, style, where="post", label=name)
    throughput.set(
        xscale="log",
        yscale="log",
        xlabel="running sequences (batch)",
        ylabel="decode tokens/s per engine",
        title=f"{plan['model']['name']} on {plan['gpu']['name']}, context "
        f"{plan['mean_decode_context_tokens']:,.0f} tokens",
    )
    throughput.grid(True, which="both", alpha=0.3)
    throughput.legend()
    tail.set(
        xlabel="seconds into the rollout of one step",
        ylabel="running sequences",
        title="one engine's rollout: the batch empties in the long tail",
    )
    tail.grid(True, alpha=0.3)
    tail.legend()
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
