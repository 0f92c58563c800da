"""The statistics of a comparison: a typical seed's figure, per-round ratios, and Welch's
confidence interval for the difference of two means (with Student's t quantile computed here:
no scipy)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

CONFIDENCE = 0.95  # of the interval for the difference of mean losses over seeds


def as_float(value) -> float:
    """A figure from a summary or a row: NaN where it is missing."""
    return float(value) if value is not None else math.nan


def known(value) -> bool:
    """A figure that is there: neither missing nor NaN."""
    return value is not None and not (isinstance(value, float) and math.isnan(value))


def finite(values) -> list:
    return [v for v in values if v is not None and math.isfinite(v)]


def median(values) -> float:
    """A typical seed's figure (a count stays one of the counts); NaN where none is known."""
    values = finite(values)
    if not values:
        return math.nan
    if all(isinstance(v, int) for v in values):
        return statistics.median_low(values)
    return statistics.median(values)


def quartiles(values) -> tuple[float, float]:
    """The first and third quartiles (linear interpolation, as numpy's default and the run's own
    samples_per_s_iqr); NaN under two values."""
    values = finite(values)
    if len(values) < 2:
        return math.nan, math.nan
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q3


def median_ratio(a: Sequence[float], b: Sequence[float]) -> float:
    """The median of the per-round ratios a/b."""
    return statistics.median(x / y for x, y in zip(a, b, strict=True))


def mean_std(values) -> tuple[float, float]:
    values = finite(values)
    mean = statistics.fmean(values) if values else math.nan
    return mean, statistics.stdev(values) if len(values) > 1 else math.nan


def t_quantile(p: float, df: float) -> float:
    """Student's t distribution's quantile at `p` (> 0.5) for `df` degrees of freedom (any real
    df ≥ 1): bisection on its CDF, the density integrated by Simpson's rule."""
    c = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)

    def cdf(x: float, n: int = 512) -> float:
        h = x / n
        weights = (1 if i in (0, n) else 4 if i % 2 else 2 for i in range(n + 1))
        total = sum(w * (1 + (i * h) ** 2 / df) ** (-(df + 1) / 2) for i, w in enumerate(weights))
        return 0.5 + c * total * h / 3

    low, high = 0.0, 64.0  # t(0.975, df=1) is 12.7
    for _ in range(50):
        mid = (low + high) / 2
        low, high = (mid, high) if cdf(mid) < p else (low, mid)
    return (low + high) / 2


def welch(ours: list[float], theirs: list[float]) -> tuple[float, float, float]:
    """The difference of the means and its CONFIDENCE interval (Welch's t: unequal variances),
    all relative to |theirs' mean|: (gap, low, high). Seeds that agree exactly give a point."""
    m1, m2 = statistics.fmean(ours), statistics.fmean(theirs)
    v1, v2 = statistics.variance(ours) / len(ours), statistics.variance(theirs) / len(theirs)
    se = math.sqrt(v1 + v2)
    if se == 0:
        half = 0.0
    else:
        df = (v1 + v2) ** 2 / (v1**2 / (len(ours) - 1) + v2**2 / (len(theirs) - 1))
        half = t_quantile(0.5 + CONFIDENCE / 2, df) * se
    scale = abs(m2) or 1.0
    return (m1 - m2) / scale, (m1 - m2 - half) / scale, (m1 - m2 + half) / scale


def mean_ci(values) -> tuple[float, float, float]:
    """The mean over seeds and its CONFIDENCE interval (Student's t, n-1 degrees of freedom):
    (mean, low, high); the interval NaN under two values, a point where they agree exactly."""
    values = finite(values)
    if not values:
        return math.nan, math.nan, math.nan
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, math.nan, math.nan
    se = statistics.stdev(values) / math.sqrt(len(values))
    half = t_quantile(0.5 + CONFIDENCE / 2, len(values) - 1) * se if se else 0.0
    return mean, mean - half, mean + half


def ratio_ci(ratios) -> tuple[float, float, float]:
    """Per-seed ratios (a row's against its baseline's job of the same seed) summed up: their
    geometric mean and its CONFIDENCE interval, a t interval on their logarithms, so that
    a/b and b/a are each other's inverses and speed ÷ steps stays one figure."""
    logs = [math.log(r) for r in finite(ratios) if r > 0]
    mean, low, high = mean_ci(logs)
    return tuple(math.exp(v) if math.isfinite(v) else math.nan for v in (mean, low, high))
