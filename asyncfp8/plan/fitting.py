"""Fitting a calibration's efficiency factors to measured decode rates: least squares on
log throughput, a scan of each factor over four decades, then Nelder-Mead (docs/plan.md,
"Calibration"). `calibration.py` loads the sets and derives them from bench output."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from .costs import decode_ops
from .errors import PlanInputError
from .gpus import GPU
from .model import ModelFacts, load_model_facts
from .precisions import get_precision
from .step import Efficiency, price_ops

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
    Returns the efficiency, the names fitted and those no point depends on. `ceiling`: the
    largest value a rate factor (`RATE_FACTORS`) may take: on a GPU a rate is at most its
    datasheet's (1.0), else the fixed costs could explain everything. A CPU set has none
    (its small model's weights sit in cache, past the memcpy figure)."""
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
