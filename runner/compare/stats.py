"""The statistics of a comparison: a typical seed's figure, per-round ratios, and the confidence
intervals the verdicts read: a paired t interval on per-seed differences where the jobs pair by
seed, Welch's where they do not, and intervals on logarithms that add every source of spread
measured (seeds, timing rounds) with Welch–Satterthwaite's degrees of freedom. Student's t
quantile is computed here (no scipy). Each takes its confidence `level`: 95%, or higher for a
sweep that added seeds until its verdicts were decided (runner/compare/seeds.py)."""

from __future__ import annotations

import functools
import math
import statistics
from collections.abc import Sequence

CONFIDENCE = 0.95  # of every interval of a comparison of fixed seeds


def as_float(value) -> float:
    """A figure from a summary or a row: NaN where it is missing."""
    return float(value) if value is not None else math.nan


def percent(level: float) -> str:
    """A share as the verdicts print it, to 4 digits: 95%, 98.75%, 0.6%."""
    return f"{level * 100:.4g}%"


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


@functools.lru_cache(maxsize=4096)
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


def _half(level: float, se: float, df: float) -> float:
    """Half the width of a t interval: a point where the spread is exactly zero."""
    return t_quantile(0.5 + level / 2, df) * se if se else 0.0


def welch(ours: list[float], theirs: list[float], level: float = CONFIDENCE) -> tuple:
    """The difference of the means and its interval (Welch's t: unequal variances), all
    relative to |theirs' mean|: (gap, low, high). For jobs that do not pair by seed."""
    m1, m2 = statistics.fmean(ours), statistics.fmean(theirs)
    v1, v2 = statistics.variance(ours) / len(ours), statistics.variance(theirs) / len(theirs)
    half = _half(
        level, math.sqrt(v1 + v2), satterthwaite([(v1, len(ours) - 1), (v2, len(theirs) - 1)])
    )
    scale = abs(m2) or 1.0
    return (m1 - m2) / scale, (m1 - m2 - half) / scale, (m1 - m2 + half) / scale


def paired(ours: list[float], theirs: list[float], level: float = CONFIDENCE) -> tuple:
    """The mean of per-seed differences (ours[i] − theirs[i], the same seed: same weights and
    data order, so the seed's own luck cancels) and its t interval on n − 1 degrees of freedom,
    all relative to |theirs' mean|: (gap, low, high)."""
    d = [a - b for a, b in zip(ours, theirs, strict=True)]
    mean, scale = statistics.fmean(d), abs(statistics.fmean(theirs)) or 1.0
    half = _half(level, statistics.stdev(d) / math.sqrt(len(d)), len(d) - 1)
    return mean / scale, (mean - half) / scale, (mean + half) / scale


def satterthwaite(parts: list[tuple[float, int]]) -> float:
    """Welch–Satterthwaite's degrees of freedom of a sum of variance estimates, each
    (variance, its degrees of freedom); ∞ where the sum is zero."""
    total = sum(v for v, _ in parts)
    denominator = sum(v**2 / df for v, df in parts if v)
    return total**2 / denominator if denominator else math.inf


def mean_ci(values, level: float = CONFIDENCE) -> tuple[float, float, float]:
    """The mean over seeds and its interval (Student's t, n-1 degrees of freedom):
    (mean, low, high); the interval NaN under two values, a point where they agree exactly."""
    values = finite(values)
    if not values:
        return math.nan, math.nan, math.nan
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, math.nan, math.nan
    half = _half(level, statistics.stdev(values) / math.sqrt(len(values)), len(values) - 1)
    return mean, mean - half, mean + half


def spread(logs) -> tuple[float, int]:
    """The variance of the mean of `logs` and its degrees of freedom: (NaN, 0) under two."""
    logs = finite(logs)
    if len(logs) < 2:
        return math.nan, 0
    return statistics.variance(logs) / len(logs), len(logs) - 1


def log_interval(
    center: float, parts: list[tuple[float, int]], level: float = CONFIDENCE
) -> tuple[float, float, float]:
    """exp(center) and its interval on the log scale, whose variance adds every part (the
    variance of a mean of logarithms and its degrees of freedom: seeds, timing rounds), with
    Welch–Satterthwaite's degrees of freedom; the interval NaN where a part is unmeasured."""
    if not math.isfinite(center):
        return math.nan, math.nan, math.nan
    if not parts or any(not math.isfinite(v) for v, _ in parts):
        return math.exp(center), math.nan, math.nan
    se = math.sqrt(sum(v for v, _ in parts))
    half = _half(level, se, satterthwaite(parts)) if se else 0.0
    return math.exp(center), math.exp(center - half), math.exp(center + half)


def ratio_ci(ratios, level: float = CONFIDENCE, times: float = 1.0, timing=()) -> tuple:
    """Per-seed ratios (a row's against its baseline's job of the same seed) summed up: their
    geometric mean and its interval, a t interval on their logarithms, so that a/b and b/a are
    each other's inverses and speed ÷ steps stays one figure. `times`: a factor measured apart
    (the interleaved timing's step speedup), the logarithms of whose rounds (`timing`) the
    interval carries too: the variances of the two means add."""
    logs = [math.log(r) for r in finite(ratios) if r > 0]
    if not logs or not times > 0:
        return math.nan, math.nan, math.nan
    parts = [spread(logs)] + ([spread(timing)] if len(timing) else [])
    return log_interval(statistics.fmean(logs) + math.log(times), parts, level)
