"""The statistics of a comparison: a typical seed's figure, ratios of interleaved timing
rounds, and the confidence intervals the verdicts read, all on logarithms, where a ratio's
seed-to-seed spread is closest to normal (per-seed loss ratios and steps ratios, which a
multiplicative effect makes lognormal): a paired t interval on the per-seed log ratios where the
jobs pair by seed, Welch's on the log losses where they do not, and intervals that add every
source of spread measured (seeds, timing rounds) with Welch–Satterthwaite's degrees of freedom.
Student's t quantile is computed here, exactly (no scipy). Each takes its confidence `level`:
95%, or higher for a sweep that added seeds until its verdicts were decided
(runner/compare/seeds.py). And what clean seeds cannot rule out: `clean_bound`."""

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


def mean_std(values) -> tuple[float, float]:
    values = finite(values)
    mean = statistics.fmean(values) if values else math.nan
    return mean, statistics.stdev(values) if len(values) > 1 else math.nan


def _continued_fraction(a: float, b: float, x: float) -> float:
    """The continued fraction of the regularized incomplete beta function (modified Lentz)."""
    tiny = 1e-300

    def clamp(v: float) -> float:
        return v if abs(v) > tiny else tiny

    c, d = 1.0, 1 / clamp(1 - (a + b) * x / (a + 1))
    h = d
    for m in range(1, 100_000):
        for aa in (
            m * (b - m) * x / ((a - 1 + 2 * m) * (a + 2 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 1 + 2 * m)),
        ):
            d, c = 1 / clamp(1 + aa * d), clamp(1 + aa / c)
            h *= d * c
        if abs(d * c - 1) < 1e-15:
            break
    return h


def incomplete_beta(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b), to about 1e-14."""
    if x <= 0 or x >= 1:
        return 0.0 if x <= 0 else 1.0
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b)
    front = math.exp(log_front + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1) / (a + b + 2):
        return front * _continued_fraction(a, b, x) / a
    return 1 - front * _continued_fraction(b, a, 1 - x) / b


def t_tail(t: float, df: float) -> float:
    """P(T > t) for t ≥ 0, Student's t with `df` (> 0, real) degrees of freedom: exact, as
    half the regularized incomplete beta function I_{df/(df+t²)}(df/2, 1/2)."""
    return 0.5 * incomplete_beta(df / 2, 0.5, df / (df + t * t))


@functools.lru_cache(maxsize=4096)
def t_quantile(p: float, df: float) -> float:
    """Student's t distribution's quantile at `p` (0.5 < p < 1) for `df` degrees of freedom (any
    real df > 0; the normal's where df is infinite): bisection on the exact tail `t_tail` to a
    relative 1e-13, with no upper limit (df = 1 at 99.95% is 636.6)."""
    if math.isinf(df):
        return statistics.NormalDist().inv_cdf(p)
    low, high = 0.0, 1.0
    while t_tail(high, df) > 1 - p:
        low, high = high, 2 * high
    while high - low > 1e-13 * high:
        mid = (low + high) / 2
        low, high = (mid, high) if t_tail(mid, df) > 1 - p else (low, mid)
    return (low + high) / 2


def _half(level: float, se: float, df: float) -> float:
    """Half the width of a t interval: a point where the spread is exactly zero."""
    return t_quantile(0.5 + level / 2, df) * se if se else 0.0


def welch(ours: list[float], theirs: list[float], level: float = CONFIDENCE) -> tuple:
    """For losses that do not pair by seed: the ratio of the geometric means less 1 and its
    interval, Welch's t (unequal variances) on the logarithms of the losses: (gap, low, high)."""
    a, b = [math.log(v) for v in ours], [math.log(v) for v in theirs]
    parts = [spread(a), spread(b)]
    _, low, high = log_interval(statistics.fmean(a) - statistics.fmean(b), parts, level)
    return math.exp(statistics.fmean(a) - statistics.fmean(b)) - 1, low - 1, high - 1


def paired(ours: list[float], theirs: list[float], level: float = CONFIDENCE) -> tuple:
    """Per-seed loss ratios ours[i] / theirs[i] (the same seed: same weights and data order, so
    the seed's own luck cancels) summed up: their geometric mean less 1 and its t interval on
    their logarithms (n − 1 degrees of freedom): (gap, low, high)."""
    gap, low, high = ratio_ci([a / b for a, b in zip(ours, theirs, strict=True)], level)
    return gap - 1, low - 1, high - 1


def clean_bound(seeds: int, level: float = CONFIDENCE) -> float:
    """The largest per-seed failure rate that `seeds` seeds, none failed, do not rule out at
    `level` (one-sided, exact: (1 − p)^n = 1 − level): 63% for 3 seeds at 95%."""
    return 1 - (1 - level) ** (1 / seeds)


def seeds_to_rule_out(rate: float, level: float = CONFIDENCE) -> int:
    """The clean seeds (none failed) that would rule out a per-seed failure rate of `rate` at
    `level`: 29 for 10% at 95%."""
    return math.ceil(math.log(1 - level) / math.log(1 - rate) - 1e-9)


def round_ratio(a: Sequence[float], b: Sequence[float]) -> float:
    """The ratio a/b of two variants timed in alternating rounds (runner/compare/interleave.py's
    `alternate`: one order on even rounds, the other on odd ones): the geometric mean of the two
    orders' geometric means of per-round ratios, each order weighted alike, so that drift that
    favours whichever runs first (or second) cancels with any count of rounds, odd included."""
    logs = [math.log(x / y) for x, y in zip(a, b, strict=True)]
    orders = [statistics.fmean(logs[start::2]) for start in (0, 1) if logs[start::2]]
    return math.exp(statistics.fmean(orders))


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


def spread(logs, alternating: bool = False) -> tuple[float, int]:
    """The variance of the mean of `logs` and its degrees of freedom: (NaN, 0) under two.
    `alternating`: logs of alternating rounds, averaged as `round_ratio` averages them (each
    order's mean weighted alike): with n₀ and n₁ rounds of each order, its variance is
    σ²(1/n₀ + 1/n₁)/4, σ²/n for an even count, 0.375σ² at 3 rounds (not σ²/3)."""
    logs = finite(logs)
    if len(logs) < 2:
        return math.nan, 0
    n = len(logs)
    share = (1 / ((n + 1) // 2) + 1 / (n // 2)) / 4 if alternating else 1 / n
    return statistics.variance(logs) * share, n - 1


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
    parts = [spread(logs)] + ([spread(timing, alternating=True)] if len(timing) else [])
    return log_interval(statistics.fmean(logs) + math.log(times), parts, level)
