"""Response-length distributions of a rollout workload: `lognormal` (a mean and a tail, cut
at the maximum response length) or `measured` (a JSON of lengths or of a histogram, or a
run's metrics.jsonl: its step means, a narrower tail than its samples); docs/plan.md,
"Inputs". Samples are evenly spaced quantiles (the same for every precision), shuffled
with the workload's seed so arrival order is mixed."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from statistics import NormalDist

import numpy as np

from .errors import PlanInputError

LENGTH_KEY = "response/length_mean"


@dataclass(frozen=True)
class Lengths:
    description: str
    max_tokens: int
    sigma: float | None = None  # lognormal
    mean_tokens: float | None = None  # lognormal
    measured: tuple[float, ...] = ()  # measured values (before the cut)

    def sample(self, n: int, seed: int) -> np.ndarray:
        """n response lengths in [1, max_tokens]: evenly spaced quantiles, shuffled."""
        quantiles = (np.arange(n) + 0.5) / n
        if self.measured:
            values = np.quantile(np.asarray(self.measured), quantiles, method="inverted_cdf")
        else:
            mu = math.log(self.mean_tokens) - self.sigma**2 / 2
            normal = NormalDist()
            values = np.exp(mu + self.sigma * np.array([normal.inv_cdf(q) for q in quantiles]))
        lengths = np.clip(np.rint(values), 1, self.max_tokens).astype(np.int64)
        np.random.default_rng(seed).shuffle(lengths)
        return lengths


def lognormal(mean_tokens: float, sigma: float, max_tokens: int) -> Lengths:
    if not mean_tokens or mean_tokens <= 0 or sigma is None or sigma < 0:
        raise PlanInputError(
            f"workload.response: lognormal needs mean_tokens > 0 and sigma >= 0, got "
            f"{mean_tokens} and {sigma}"
        )
    return Lengths(
        f"lognormal, mean {mean_tokens:g} tokens, sigma {sigma:g}, cut at {max_tokens}",
        max_tokens,
        sigma=sigma,
        mean_tokens=mean_tokens,
    )


def _from_metrics(path: Path) -> list[float]:
    values = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line being written, or cut short
        if isinstance(record, dict) and isinstance(record.get(LENGTH_KEY), int | float):
            values.append(float(record[LENGTH_KEY]))
    return values


def measured(path: str, max_tokens: int) -> Lengths:
    source = Path(path).expanduser()
    if source.is_dir():
        source = source / "metrics.jsonl"
    if not source.is_file():
        raise PlanInputError(f"workload.response.path={path}: no such file or run directory")
    if source.suffix == ".jsonl":
        values = _from_metrics(source)
        what = f"per-step mean lengths of {source} ({len(values)} steps; the tail is narrower)"
    else:
        try:
            data = json.loads(source.read_text())
        except json.JSONDecodeError as err:
            raise PlanInputError(f"{source}: not valid JSON ({err})") from None
        if isinstance(data, dict) and "bins" in data:
            edges, counts = data["bins"], data.get("counts", [])
            if len(edges) != len(counts) + 1:
                raise PlanInputError(
                    f"{source}: a histogram needs one more bin edge than counts "
                    f"({len(edges)} edges, {len(counts)} counts)"
                )
            values = [
                (lo + hi) / 2
                for lo, hi, count in zip(edges, edges[1:], counts, strict=False)
                for _ in range(int(count))
            ]
            what = f"histogram of {source}"
        else:
            values = data.get("lengths", []) if isinstance(data, dict) else data
            what = f"per-sample lengths of {source}"
        if not isinstance(values, list) or not all(isinstance(v, int | float) for v in values):
            raise PlanInputError(
                f"{source}: expected a list of lengths, {{'lengths': [...]}} or "
                "{'bins': [...], 'counts': [...]}"
            )
    values = [float(v) for v in values if v > 0]
    if not values:
        raise PlanInputError(f"{source}: no response lengths in it ({LENGTH_KEY} for metrics)")
    mean = sum(values) / len(values)
    return Lengths(f"measured: {what}, mean {mean:.0f} tokens", max_tokens, measured=tuple(values))
