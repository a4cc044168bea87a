"""Calibration sets: where the planner's efficiency factors come from (the format, the
fit and the bundled sets: docs/plan.md, "Calibration"). A set is loaded (its factors fitted
to its points, `fitting.py`) or derived from the benches' JSON output:

    python -m asyncfp8.plan.calibration BENCH.json... --engine torch --name NAME --out SET.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from .errors import PlanInputError
from .fitting import Point, fit, predict_points, with_factors
from .gpus import GPU, GPUS, get_gpu
from .step import Efficiency

CALIBRATIONS = Path(__file__).parent / "data" / "calibration"
PRIORS = "gpu-priors"
#: GEMM kernels per reached expert in the torch engine's loop over the experts (a CPU): the
#: fused gate/up and down in 16 bits; gate, up and down, each quantizing its input, in 8.
TORCH_CPU_EXPERT_KERNELS = {"bf16": 2.0, "fp8": 3.0, "int8": 3.0}


@dataclass(frozen=True)
class Calibration:
    name: str
    description: str
    device: GPU | None  # what the points were measured on; None: priors for any GPU
    efficiency: Efficiency
    points: list[Point] = field(default_factory=list)
    fitted: list[str] = field(default_factory=list)  # factors fitted to the points
    unfitted: list[str] = field(default_factory=list)  # named to fit, but no point moves them
    sync: dict[str, Any] = field(default_factory=dict)
    quantize_gb_s: dict[str, float] = field(default_factory=dict)
    sources: list[str] = field(default_factory=list)
    initial: Efficiency | None = None  # the starting values the fit began from

    def refit(self, points: list[Point]) -> Efficiency:
        """The factors fitted again, from the same start, to `points` (e.g. all but one)."""
        return fit(points, self.device, self.initial, self.fitted + self.unfitted)[0]

    def delta_bytes_ratio(self, weights: str) -> float:
        """Wire bytes of a delta version over (changed fraction × full version bytes):
        what an index and a value cost per changed element, relative to a full send."""
        ratios = self.sync.get("delta_bytes_ratio", {})
        if weights in ratios:
            return ratios[weights]
        # INT8 deltas were never measured: 1-byte values like FP8's.
        return ratios.get("fp8" if weights == "int8" else "bf16", 2.0)


def efficiency_from(raw: dict[str, Any], where: str) -> Efficiency:
    known = {f.name for f in fields(Efficiency)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise PlanInputError(f"calibration {where}: unknown efficiency factors {unknown}")
    base = Efficiency()
    values: dict[str, float] = {}
    for head, value in raw.items():
        if isinstance(value, dict):
            values |= {f"{head}.{key}": float(v) for key, v in value.items()}
        else:
            values[head] = float(value)
    return with_factors(base, values)


# --- loading ------------------------------------------------------------------------


def available() -> list[str]:
    return sorted(p.stem for p in CALIBRATIONS.glob("*.json"))


def _read(name_or_path: str) -> tuple[dict[str, Any], str]:
    path = Path(name_or_path).expanduser()
    if not path.is_file():
        path = CALIBRATIONS / f"{name_or_path}.json"
    if not path.is_file():
        raise PlanInputError(
            f"plan.calibration={name_or_path}: no such calibration set or file "
            f"(bundled: {', '.join(available())})"
        )
    try:
        return json.loads(path.read_text()), str(path)
    except json.JSONDecodeError as err:
        raise PlanInputError(f"calibration {path}: not valid JSON ({err})") from None


def measured_devices() -> dict[str, GPU]:
    """Devices that bundled calibration sets were measured on (usable as gpu=<name>)."""
    devices = {}
    for name in available():
        raw, _ = _read(name)
        if raw.get("device"):
            device = get_gpu(raw["device"])
            devices[device.name] = device
    return devices


def load_calibration(name_or_path: str) -> Calibration:
    raw, where = _read(name_or_path)
    device = get_gpu(raw["device"]) if raw.get("device") else None
    start = efficiency_from(raw.get("efficiency", {}), where)
    points = [Point(**p) for p in raw.get("points", [])]
    names = list(raw.get("fit", []))
    if points and device is None:
        raise PlanInputError(f"calibration {where}: measured points need the device they ran on")
    efficiency, fitted, unfitted = (
        fit(points, device, start, names, raw.get("ceiling"))
        if points and names
        else (start, [], names)
    )
    return Calibration(
        name=raw.get("name", Path(where).stem),
        description=raw.get("description", ""),
        device=device,
        efficiency=efficiency,
        points=points,
        fitted=fitted,
        unfitted=unfitted,
        sync=raw.get("sync", {}),
        quantize_gb_s=raw.get("quantize_gb_s", {}),
        sources=raw.get("sources", []),
        initial=start,
    )


def choose_calibration(requested: str, gpu: GPU, engine: str = "vllm") -> str:
    """`auto`: the set measured on this device with this engine (`engine.kind`) if one
    exists, else the GPU priors. The engine matters: the torch engine's fixed costs on an
    H100 (4.5 ms a step) are its own, not those of the vLLM runs the published figures
    come from."""
    if requested != "auto":
        return requested
    for name in available():
        raw, _ = _read(name)
        device = raw.get("device") or {}
        if device.get("name") == gpu.name and raw.get("engine") == engine:
            return name
    return PRIORS


# --- deriving a set from bench/results ----------------------------------------------


def _model_name(path: str, given: str | None) -> str:
    if given:
        return given
    for name in ("small", "tiny"):
        if f"/{name}-" in path or path.endswith(f"/{name}"):
            return name
    raise SystemExit(f"cannot tell the model of {path!r}: pass --model (a bundled name or config)")


def _cpu_device(machine: dict[str, Any], copy_gb_s: float, link_gb_s: float) -> dict[str, Any]:
    cores = int(machine.get("cores", 1))
    # Nominal peak: 32 fp32 FLOP per cycle per core (two 256-bit FMA units) at 2.5 GHz;
    # only peak × efficiency is identified by the fit, so this sets the scale, no more.
    nominal_tflops = cores * 2.5e9 * 32 / 1e12
    return {
        "name": f"cpu-{machine.get('cpu', 'cpu').split()[-1].lower()}-{cores}core",
        "memory_gb": 16,
        "bandwidth_tb_s": copy_gb_s / 1000,
        "bf16_tflops": nominal_tflops,
        "fp8_tflops": nominal_tflops,
        "int8_tops": nominal_tflops,
        "link_gb_s": link_gb_s,
        "source": f"{machine.get('cpu')} ({cores} cores) of bench/results: bandwidth = measured "
        "memcpy, link = ZeroMQ loopback, compute = nominal 32 FLOP/cycle/core at 2.5 GHz",
    }


def derive(
    paths: list[str], engine: str, name: str, model: str | None, gpu: str | None
) -> dict[str, Any]:
    """A calibration set from `bench/rollout.py`, `bench/sync.py` and `bench/quantize.py`
    JSON outputs."""
    points, copies, links, machine, sync, quantize = _read_bench_outputs(paths, engine, model)
    if not points:
        raise SystemExit(f"no {engine} rows in {paths}")
    if not gpu and not (copies and links):
        raise SystemExit("a CPU calibration needs bench/sync.py output (memcpy and link bandwidth)")
    device = (
        {**vars(GPUS[gpu])}
        if gpu
        else _cpu_device(machine, statistics.median(copies), statistics.median(links))
    )
    fit_names, start = _fit_start({p["precision"] for p in points}, gpu, sync)
    if engine == "torch" and not gpu:  # no Triton on a CPU: the engine loops over experts
        start["expert_loop_kernels"] = dict(TORCH_CPU_EXPERT_KERNELS)
    return {
        "name": name,
        "description": f"{engine} engine on {device['name']}: {len(points)} decode rates "
        "measured by bench/rollout.py"
        + ("; weight-sync throughput by bench/sync.py" if copies and links else "")
        + ("; quantization throughput by bench/quantize.py" if quantize else ""),
        "sources": paths,
        "device": device,
        "engine": engine,
        "efficiency": start,
        "fit": fit_names,
        "ceiling": 1.0 if gpu else None,
        "points": points,
        "sync": sync,
        "quantize_gb_s": quantize,
    }


def _read_bench_outputs(
    paths: list[str], engine: str, model: str | None
) -> tuple[list[dict], list[float], list[float], dict, dict[str, Any], dict[str, float]]:
    """From the benches' JSON outputs: `engine`'s decode rates, the copy and link
    bandwidths, the machine, the weight-sync figures and the quantization throughputs."""
    points, copies, links, machine = [], [], [], {}
    sync: dict[str, Any] = {"delta_bytes_ratio": {}, "publish_to_applied_gb_s": {}}
    quantize: dict[str, float] = {}
    for path in paths:
        data = json.loads(Path(path).read_text())
        machine = machine or data.get("machine", {})
        if "rows" in data and "new_tokens" in data:  # bench/rollout.py
            model_name = _model_name(data["model"], model)
            for row in data["rows"]:
                if row["engine"] != engine:
                    continue
                # GPU rows name their prompt length; CPU rows: 16 tokens or `long_prompt`.
                prompt = row.get("prompt_tokens") or (
                    16 if row["context"] == "short" else data["long_prompt"]
                )
                points.append(
                    {
                        "model": model_name,
                        "precision": row["precision"],
                        "batch": row["batch"],
                        "prompt_tokens": prompt,
                        "new_tokens": data["new_tokens"],
                        "decode_tokens_per_s": row["decode_tokens_per_s"],
                        "label": (
                            f"{engine} {row['precision']} {row['context']} batch {row['batch']}"
                        ),
                    }
                )
        elif "versions" in data:  # bench/sync.py
            copies.append(data["memcpy_gb_per_s"])
            links.append(data["zmq_loopback_gb_per_s"])
            full = [v for v in data["versions"] if v["kind"] == "full"]
            deltas = [v for v in data["versions"] if v["kind"] == "delta"]
            weights = data["precision"]
            if full and deltas:
                changed = statistics.mean(v["changed_fraction"] for v in deltas)
                delta_bytes = statistics.mean(v["wire_bytes"] for v in deltas)
                ratio = delta_bytes / full[0]["wire_bytes"] / changed
                sync["delta_bytes_ratio"][weights] = ratio
                sync["changed_fraction"] = changed
            sync["publish_to_applied_gb_s"][weights] = statistics.median(
                v["wire_bytes"] / v["end_to_end_seconds"] / 1e9 for v in data["versions"]
            )
        elif "copy_gb_per_s" in data:  # bench/quantize.py
            copies.append(data["copy_gb_per_s"])
            for row in data["rows"]:
                if "stream" in row["workload"]:
                    quantize[row["format"]] = row["gb_per_s"]
        else:
            raise SystemExit(f"{path}: not an output of bench/rollout.py, sync.py or quantize.py")
    return points, copies, links, machine, sync, quantize


def _fit_start(
    precisions: set[str], gpu: str | None, sync: dict[str, Any]
) -> tuple[list[str], dict[str, Any]]:
    """The efficiency factors to fit for the measured precisions, and where the fit
    starts (a GPU's priors, or CPU-scale costs); on a GPU the priors' delta ratio fills
    `sync` where no bench measured one."""
    fit_names = ["step_overhead_s", "layer_overhead_s", "gemm_launch_s.bf16"]
    fit_names += ["gemm_compute.bf16", "attention_memory.bf16"]
    for weights in ("fp8", "int8"):
        if any(p.startswith(weights) for p in precisions):
            fit_names += [f"gemm_compute.{weights}", f"gemm_launch_s.{weights}"]
    if any("fp8_kv" in p for p in precisions):
        fit_names += ["attention_memory.fp8", "kv_quantize_overhead_s"]
    if gpu:
        # On a GPU the weights stream from HBM: how fast each type's GEMMs read them is
        # what the rows measure best, so those factors are fitted too, from the priors.
        priors = json.loads((CALIBRATIONS / f"{PRIORS}.json").read_text())
        start = priors["efficiency"]
        fit_names += ["gemm_memory.bf16"]
        fit_names += [
            f"gemm_memory.{w}" for w in ("fp8", "int8") if f"gemm_compute.{w}" in fit_names
        ]
        # A factor the priors set to 0 (the KV quantization, assumed fused into the
        # cache write) starts at one kernel boundary, so that the fit can move it.
        for factor in fit_names:
            head, _, key = factor.partition(".")
            table = start[head] if key else start
            if table[key or head] <= 0:
                table[key or head] = 2.5e-6
        if not sync["delta_bytes_ratio"]:  # a property of the format: the priors carry it
            sync["delta_bytes_ratio"] = priors["sync"]["delta_bytes_ratio"]
    else:
        # The fixed costs of a CPU are ~100x a GPU's and the weights of asyncfp8's small
        # model sit in cache: the streaming factors stay at 1 (they barely matter) and
        # the fixed costs start at CPU scale.
        start = {
            "memory": 1.0,
            "gemm_memory": {"bf16": 1.0, "fp8": 1.0, "int8": 1.0},
            "attention_compute": 1.0,
            "step_overhead_s": 1e-3,
            "layer_overhead_s": 2e-4,
            "gemm_launch_s": {"bf16": 3e-5, "fp8": 3e-5, "int8": 3e-5},
            "kv_quantize_overhead_s": 5e-5,
            "gemm_compute": {"bf16": 0.3, "fp8": 0.3, "int8": 0.3},
            "attention_memory": {"bf16": 0.3, "fp8": 0.3},
        }
    return fit_names, start


def main() -> None:
    parser = argparse.ArgumentParser(
        description="Derive a planner calibration set from bench JSON."
    )
    parser.add_argument("results", nargs="+", help="bench/results/*.json files")
    parser.add_argument("--engine", default="torch", help="which engine's rollout rows to use")
    parser.add_argument("--name", required=True)
    parser.add_argument(
        "--model", default=None, help="bundled model name or config.json of the rows"
    )
    parser.add_argument("--gpu", default=None, help="datasheet name of the GPU the rows ran on")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    calibration = derive(args.results, args.engine, args.name, args.model, args.gpu)
    Path(args.out).write_text(json.dumps(calibration, indent=2) + "\n")
    loaded = load_calibration(args.out)
    rows = predict_points(loaded.points, loaded.device, loaded.efficiency)
    errors = [abs(r["error"]) for r in rows]
    print(
        f"wrote {args.out}: {len(rows)} points, fitted {len(loaded.fitted)} factors, "
        f"median |error| {statistics.median(errors):.1%}, max {max(errors):.1%}"
    )
    if not math.isfinite(max(errors)):
        raise SystemExit("the fit produced a non-finite prediction")


if __name__ == "__main__":
    main()
