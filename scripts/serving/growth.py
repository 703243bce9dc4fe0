"""The soak test's rule for "grows without bound", applied to one sampled series at a time.

A series (e.g. the RSS of one process, sampled every few seconds) is judged on the second half
of the run only: the first half is warm-up (allocator pools, the prefix cache filling, lazily
opened connections and threads). The second half is cut into quarters; the first quarter is
the baseline window and the last quarter the final window. The series GROWS when both hold:

  (a) trend: the least-squares slope over the second half, times the second half's span,
      exceeds the tolerance;
  (b) shift: the median of the final window exceeds the median of the baseline window by more
      than the tolerance;

with tolerance = max(abs_tol, rel_tol * median of the baseline window). (a) alone would flag a
single late spike; (b) alone would flag noise between two windows. A steady leak meets both.
A series with fewer than `min_samples` samples in its second half is not judged (`too_short`).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Tolerance:
    """How much a series may rise over the second half before it counts as growing."""

    abs_tol: float
    rel_tol: float = 0.0

    def __post_init__(self) -> None:
        if self.abs_tol < 0 or self.rel_tol < 0:
            raise ValueError(f"tolerances must be >= 0, got {self}")

    def of(self, baseline: float) -> float:
        return max(self.abs_tol, self.rel_tol * abs(baseline))


@dataclass(frozen=True)
class Verdict:
    """What the rule concluded about one series (values in the series' own unit)."""

    samples: int  # in the second half
    baseline: float  # median of the baseline window
    final: float  # median of the final window
    peak: float  # max over the whole run
    trend: float  # fitted rise over the second half
    slope_per_hour: float
    tolerance: float
    grows: bool
    too_short: bool = False

    @property
    def shift(self) -> float:
        return self.final - self.baseline


def slope(times: Sequence[float], values: Sequence[float]) -> float:
    """Least-squares slope of values over times (0 when the times do not vary)."""
    n = len(times)
    if n < 2:
        return 0.0
    mean_t = sum(times) / n
    mean_v = sum(values) / n
    var = sum((t - mean_t) ** 2 for t in times)
    if var == 0:
        return 0.0
    return sum((t - mean_t) * (v - mean_v) for t, v in zip(times, values, strict=True)) / var


def judge(
    times: Sequence[float],
    values: Sequence[float],
    tolerance: Tolerance,
    min_samples: int = 4,
) -> Verdict:
    """Apply the rule of the module docstring to one series (times in seconds, ascending)."""
    if len(times) != len(values):
        raise ValueError(f"{len(times)} times but {len(values)} values")
    if not times:
        return Verdict(0, 0.0, 0.0, 0.0, 0.0, 0.0, tolerance.abs_tol, False, too_short=True)
    start, end = times[0], times[-1]
    middle = start + (end - start) / 2
    half = [(t, v) for t, v in zip(times, values, strict=True) if t >= middle]
    peak = max(values)
    if len(half) < min_samples:
        return Verdict(len(half), 0.0, 0.0, peak, 0.0, 0.0, tolerance.abs_tol, False, True)
    quarter = max(1, len(half) // 4)
    baseline = statistics.median(v for _, v in half[:quarter])
    final = statistics.median(v for _, v in half[-quarter:])
    rate = slope([t for t, _ in half], [v for _, v in half])
    trend = rate * (half[-1][0] - half[0][0])
    tol = tolerance.of(baseline)
    grows = trend > tol and final - baseline > tol
    return Verdict(len(half), baseline, final, peak, trend, rate * 3600, tol, grows)
