"""Confidence intervals over a handful of seeds, for `asyncfp8.report` (docs/running.md,
"Comparing runs"): `mean_ci` (Student t, n - 1 degrees of freedom: seeds are few),
`binomial_se` (one evaluation's own noise) and `wilson_interval` (a rate of k in n, inside
[0, 1]). No scipy: for whole degrees of freedom the t distribution's CDF has a closed form
(Abramowitz & Stegun 26.7.3-4), inverted here by bisection."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from statistics import NormalDist

# Above this many degrees of freedom the closed form's series (df / 2 terms, at each of
# ~100 bisection steps) is slow, and the Cornish-Fisher expansion in 1/df agrees with it
# to ~1e-12 (checked in tests/test_report.py).
_SERIES_MAX_DF = 1000


def t_two_sided_probability(t: float, df: int) -> float:
    """P(|T| <= t) for Student's T with `df` (a whole number >= 1) degrees of freedom:
    A(t|df) of Abramowitz & Stegun 26.7.3 (odd df) and 26.7.4 (even df)."""
    theta = math.atan(t / math.sqrt(df))
    cos2 = math.cos(theta) ** 2
    total = 0.0
    if df % 2:
        # (2/pi) [theta + sin(theta) (cos + 2/3 cos^3 + 2*4/(3*5) cos^5 + ... cos^(df-2))]
        term = math.cos(theta)
        for k in range(1, (df - 1) // 2 + 1):
            total += term
            term *= cos2 * (2 * k) / (2 * k + 1)
        return 2 / math.pi * (theta + math.sin(theta) * total)
    # sin(theta) [1 + 1/2 cos^2 + 1*3/(2*4) cos^4 + ... cos^(df-2)]
    term = 1.0
    for k in range(1, df // 2 + 1):
        total += term
        term *= cos2 * (2 * k - 1) / (2 * k)
    return math.sin(theta) * total


def t_quantile(probability: float, df: int) -> float:
    """The `probability` quantile of Student's t with `df` degrees of freedom, for
    probability in (0.5, 1): t_{0.975, 4} = 2.776445105..."""
    if not 0.5 < probability < 1:
        raise ValueError(f"t_quantile: probability must be in (0.5, 1), got {probability}")
    if df < 1 or int(df) != df:
        raise ValueError(f"t_quantile: df must be a whole number >= 1, got {df}")
    df = int(df)
    two_sided = 2 * probability - 1
    if df > _SERIES_MAX_DF:
        return _cornish_fisher(probability, df)
    low, high = 0.0, 2.0
    while t_two_sided_probability(high, df) < two_sided:
        low, high = high, 2 * high
    for _ in range(200):  # bisection to the last bit of a double
        middle = (low + high) / 2
        if middle in (low, high):
            break
        if t_two_sided_probability(middle, df) < two_sided:
            low = middle
        else:
            high = middle
    return (low + high) / 2


def _cornish_fisher(probability: float, df: int) -> float:
    """Abramowitz & Stegun 26.7.5: the t quantile as the normal one plus terms in 1/df."""
    x = NormalDist().inv_cdf(probability)
    g1 = (x**3 + x) / 4
    g2 = (5 * x**5 + 16 * x**3 + 3 * x) / 96
    g3 = (3 * x**7 + 19 * x**5 + 17 * x**3 - 15 * x) / 384
    g4 = (79 * x**9 + 776 * x**7 + 1482 * x**5 - 1920 * x**3 - 945 * x) / 92160
    return x + g1 / df + g2 / df**2 + g3 / df**3 + g4 / df**4


def mean_ci(values: Sequence[float], level: float = 0.95) -> tuple[float, float | None]:
    """(mean, half-width of its `level` confidence interval): t_{(1+level)/2, n-1} * sd /
    sqrt(n), sd with n - 1 in the denominator. One value has no spread to measure: the
    half-width is None (say "n=1, no CI", never 0)."""
    values = [float(v) for v in values]
    if not values:
        raise ValueError("mean_ci: no values")
    mean = statistics.fmean(values)
    if len(values) == 1:
        return mean, None
    sd = statistics.stdev(values)
    return mean, t_quantile((1 + level) / 2, len(values) - 1) * sd / math.sqrt(len(values))


def binomial_se(p: float, prompts: int) -> float:
    """Standard error of a pass rate p measured on `prompts` independent 0/1 outcomes:
    sqrt(p (1 - p) / prompts)."""
    return math.sqrt(p * (1 - p) / prompts)


def wilson_interval(events: int, trials: int, level: float = 0.95) -> tuple[float, float]:
    """The Wilson score interval of a binomial rate, `events` of `trials`: the p for which
    |events/trials - p| <= z sqrt(p (1 - p) / trials), z the normal `level` quantile
    (Wilson 1927; Newcombe 1998, method 3). With 0 of 5 it is (0, 0.434): five clean
    seeds do not show a rate below 43%."""
    if trials < 1 or not 0 <= events <= trials or int(events) != events:
        raise ValueError(f"wilson_interval: need 0 <= events <= trials >= 1, got {events}/{trials}")
    z = NormalDist().inv_cdf((1 + level) / 2)
    rate = events / trials
    centre = (rate + z * z / (2 * trials)) / (1 + z * z / trials)
    half = z * math.sqrt(rate * (1 - rate) / trials + z * z / (4 * trials * trials))
    half /= 1 + z * z / trials
    # at 0 (n) events the lower (upper) end is exactly 0 (1); the formula's rounding
    # leaves a hair either side of it
    low = 0.0 if events == 0 else max(0.0, centre - half)
    high = 1.0 if events == trials else min(1.0, centre + half)
    return low, high
