"""Calibration sets: where the planner's efficiency factors come from.

A set is a small JSON file under `asyncfp8/plan/data/calibration/` (or any path given as
`plan.calibration=`): the device it was measured on, starting values of the factors, the
names of the factors to fit, and measured points (decode tokens/s of a model at a
precision, batch and context; weight-sync and quantization throughput). On load, the
named factors are fitted to the points (least squares on log throughput, Nelder-Mead);
a set without points (`gpu-priors`) is used as written. A plan records which set it used
and how well that set's fit reproduces its own points.

Sets are derived from the benchmarks' JSON, e.g. the CPU one:

    python -m asyncfp8.plan.calibration bench/results/rollout-cpu.json \\
        bench/results/sync-bf16.json bench/results/sync-fp8.json bench/results/quantize-cpu.json \\
        --engine torch --name cpu-torch --out asyncfp8/plan/data/calibration/cpu-torch.json

and a GPU one the same way from `bench/rollout.py`'s GPU output (`--gpu h100` names the
device from the datasheet table instead of the machine record).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import numpy as np

from .costs import decode_ops
from .errors import PlanInputError
from .gpus import GPU, GPUS, get_gpu
from .model import ModelFacts, load_model_facts
from .precisions import get_precision
from .step import Efficiency, price_ops

CALIBRATIONS = Path(__file__).parent / "data" / "calibration"
PRIORS = "gpu-priors"
GRID = np.log(np.logspace(-2, 2, 17))  # log-shifts a factor is scanned over before the simplex


@dataclass(frozen=True)
class Point:
    """One measured decode rate: `bench/rollout.py` generates `new_tokens` tokens for
    `batch` sequences after a `prompt_tokens`-token prompt."""

    model: str
    precision: str
    batch: int
    prompt_tokens: int
    new_tokens: int
    decode_tokens_per_s: float
    label: str = ""

    @property
    def mean_context(self) -> float:
        # Decode steps 1..n-1 attend over prompt + 1 .. prompt + n - 1 tokens: the
        # price is linear in the context, so the mean step is the step at the mean.
        return self.prompt_tokens + self.new_tokens / 2


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


# --- factors by dotted name ("gemm_compute.fp8") ------------------------------------


def get_factor(eff: Efficiency, name: str) -> float:
    head, _, key = name.partition(".")
    value = getattr(eff, head)
    return value[key] if key else value


def with_factors(eff: Efficiency, values: dict[str, float]) -> Efficiency:
    changes: dict[str, Any] = {}
    for name, value in values.items():
        head, _, key = name.partition(".")
        if key:
            table = dict(changes.get(head, getattr(eff, head)))
            table[key] = value
            changes[head] = table
        else:
            changes[head] = value
    return replace(eff, **changes)


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


# --- fitting ----------------------------------------------------------------------


def nelder_mead(fn, x0: np.ndarray, step: float = 0.7, iterations: int = 4000, tol: float = 1e-12):
    """Minimize fn from x0 (the textbook simplex method; deterministic)."""
    n = len(x0)
    simplex = [x0.astype(float)] + [x0 + step * np.eye(n)[i] for i in range(n)]
    values = [fn(x) for x in simplex]
    for _ in range(iterations):
        order = np.argsort(values)
        simplex = [simplex[i] for i in order]
        values = [values[i] for i in order]
        if values[-1] - values[0] < tol:
            break
        centroid = np.mean(simplex[:-1], axis=0)
        reflected = centroid + (centroid - simplex[-1])
        f_reflected = fn(reflected)
        if f_reflected < values[0]:
            expanded = centroid + 2 * (centroid - simplex[-1])
            f_expanded = fn(expanded)
            if f_expanded < f_reflected:
                simplex[-1], values[-1] = expanded, f_expanded
            else:
                simplex[-1], values[-1] = reflected, f_reflected
        elif f_reflected < values[-2]:
            simplex[-1], values[-1] = reflected, f_reflected
        else:
            contracted = centroid + 0.5 * (simplex[-1] - centroid)
            f_contracted = fn(contracted)
            if f_contracted < values[-1]:
                simplex[-1], values[-1] = contracted, f_contracted
            else:
                simplex = [simplex[0]] + [simplex[0] + 0.5 * (x - simplex[0]) for x in simplex[1:]]
                values = [values[0]] + [fn(x) for x in simplex[1:]]
    best = int(np.argmin(values))
    return simplex[best], values[best]


class _PointModel:
    """A point with its step's primitives counted once: pricing it is then cheap."""

    def __init__(self, point: Point, model: ModelFacts, device: GPU):
        self.point = point
        self.model = model
        self.device = device
        self.precision = get_precision(point.precision)
        context = point.batch * point.mean_context
        self.ops = decode_ops(model, self.precision, point.batch, context)

    def rate(self, eff: Efficiency) -> float:
        price = price_ops(self.ops, self.model, self.precision, self.device, eff, self.point.batch)
        return self.point.batch / price.seconds


def predict_points(points: list[Point], device: GPU, eff: Efficiency) -> list[dict[str, Any]]:
    """Measured and predicted decode rate of each point, with the relative error."""
    rows = []
    for point in points:
        predicted = _PointModel(point, load_model_facts(point.model), device).rate(eff)
        measured = point.decode_tokens_per_s
        rows.append(
            {
                "label": point.label,
                "precision": point.precision,
                "batch": point.batch,
                "prompt_tokens": point.prompt_tokens,
                "measured_tokens_per_s": measured,
                "predicted_tokens_per_s": predicted,
                "error": predicted / measured - 1,
            }
        )
    return rows


# The factors that are fractions of a datasheet rate: on a GPU none can pass 1.
RATE_FACTORS = ("memory", "gemm_memory", "gemm_compute", "attention_memory", "attention_compute")


def fit(
    points: list[Point],
    device: GPU,
    start: Efficiency,
    names: list[str],
    ceiling: float | None = None,
) -> tuple[Efficiency, list[str], list[str]]:
    """Fit the factors `names` (in log space: they stay positive) to the points.
    Returns the efficiency, the names fitted and those no point depends on. `ceiling`:
    the largest value a rate factor (`RATE_FACTORS`) may take. Without one, the H100's
    rows fitted BF16 GEMMs at 1.8e7 times the datasheet bandwidth, the fixed costs
    explaining everything: on a GPU a rate is at most its datasheet's (1.0). A CPU set
    has none (its small model's weights sit in cache, past the memcpy figure)."""
    models = [_PointModel(p, load_model_facts(p.model), device) for p in points]
    measured = np.log([p.decode_tokens_per_s for p in points])

    def loss(eff: Efficiency) -> float:
        predicted = np.log([m.rate(eff) for m in models])
        return float(np.mean((predicted - measured) ** 2))

    base = loss(start)
    fitted, unfitted = [], []
    for name in names:
        if get_factor(start, name) <= 0:
            raise PlanInputError(f"calibration: factor {name} must start positive to be fitted")
        # A roofline's max() is flat on one side: try the factor far in both directions.
        moved = [loss(with_factors(start, {name: get_factor(start, name) * f})) for f in (0.1, 10)]
        (fitted if any(abs(m - base) > 1e-12 for m in moved) else unfitted).append(name)
    if not fitted:
        return start, fitted, unfitted
    x0 = np.log([get_factor(start, name) for name in fitted])

    def factors(x: np.ndarray) -> dict[str, float]:
        values = dict(zip(fitted, np.exp(x), strict=True))
        if ceiling is not None:
            for name in values:
                if name.partition(".")[0] in RATE_FACTORS:
                    values[name] = min(values[name], ceiling)
        return values

    def objective(x: np.ndarray) -> float:
        return loss(with_factors(start, factors(x)))

    # The roofline's max() leaves flat regions a simplex started in cannot leave: first
    # scan each factor over four decades around its start, then polish with Nelder-Mead.
    best = x0.copy()
    for _ in range(2):
        for i in range(len(best)):
            trials = [best.copy() for _ in GRID]
            for trial, shift in zip(trials, GRID, strict=True):
                trial[i] = x0[i] + shift
            best = min([*trials, best], key=objective)
    best, _ = nelder_mead(objective, best)
    best, _ = nelder_mead(objective, best, step=0.2)  # restart: the simplex may have collapsed
    return with_factors(start, factors(best)), fitted, unfitted


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
                        "label": f"{engine} {row['precision']} {row['context']} batch {row['batch']}",
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
