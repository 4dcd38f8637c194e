"""Steady state from a per-step series: where warm-up ends, the steady estimate, how sure we are.

Warm-up end: the Marginal Standard Error Rule (MSER; White 1997), which picks the truncation
point that minimises the squared standard error of the remaining mean, searched over the first
half of the series (its usual bound, which keeps it from trimming to a few lucky last steps) and
never so far that fewer than the minimum window remain (in a series shorter than two windows, such
as an 8-step screen, half the series is fewer steps than an estimate is made from).
Isolated slow steps (a GC pause, a checkpoint, a straggler) are not warm-up: before MSER they
are clipped, and from the steady window they are dropped as outliers when they sit more than
``outlier_mads`` robust deviations from the window's median *and* their neighbours do not. A run
of such steps is a change of regime, never an outlier, so a late slowdown keeps the interval wide. The estimate is the window's mean
with a Student-t confidence interval; it is *converged* when the interval's relative half-width
is at most the target (2 % by default), which is when a screening burst can stop.
"""

from __future__ import annotations

import functools
import math
import statistics
from dataclasses import dataclass
from typing import Sequence

MIN_WINDOW = 5
"""Fewest steady steps an estimate is made from."""

MAD_TO_SIGMA = 1.4826
"""Scales a median absolute deviation to a standard deviation for normal noise."""


@dataclass(frozen=True, slots=True)
class SteadyEstimate:
    warmup_steps: int
    """Leading steps treated as warm-up (at least the declared minimum)."""
    window: int
    """Steps in the steady window after outliers were dropped."""
    outliers: int
    mean: float
    median: float
    ci_low: float
    ci_high: float
    confidence: float
    relative_half_width: float
    converged: bool

    def to_dict(self) -> dict:
        return {name: getattr(self, name) for name in self.__slots__}


def mser_truncation(values: Sequence[float], minimum: int = 0, min_window: int = MIN_WINDOW) -> int:
    """Index where the steady part starts, by MSER over the first half of the series, leaving at
    least ``min_window`` steps (``minimum`` itself when the series has no more than that)."""
    n = len(values)
    best_index, best_score = minimum, math.inf
    for index in range(minimum, max(minimum, min(n // 2, n - min_window)) + 1):
        tail = values[index:]
        if len(tail) < 2:
            break
        mean = sum(tail) / len(tail)
        score = sum((x - mean) ** 2 for x in tail) / len(tail) ** 2
        if score < best_score - 1e-15:
            best_index, best_score = index, score
    return best_index


def isolated_outliers(values: Sequence[float], mads: float) -> set[int]:
    """Indices of single steps far from the median whose neighbours are not; at most 10 % of
    the series (more than that is noise, not outliers)."""
    median = statistics.median(values)
    mad = statistics.median(abs(x - median) for x in values) * MAD_TO_SIGMA
    spread = max(mad, abs(median) * 1e-6)
    far = [abs(x - median) > mads * spread for x in values]
    isolated = {
        i for i, flag in enumerate(far)
        if flag and not (i > 0 and far[i - 1]) and not (i + 1 < len(far) and far[i + 1])
    }
    return isolated if len(isolated) <= max(1, len(values) // 10) else set()


def steady_state(
    values: Sequence[float],
    *,
    min_warmup: int = 1,
    min_window: int = MIN_WINDOW,
    target_relative_half_width: float = 0.02,
    confidence: float = 0.95,
    outlier_mads: float = 5.0,
) -> SteadyEstimate | None:
    """The steady estimate of ``values`` (e.g. useful tokens/s per step), or ``None`` while there
    are fewer than ``min_warmup + min_window`` steps."""
    n = len(values)
    if n < min_warmup + min_window:
        return None
    # Replace isolated spikes by the median before MSER, so one slow step cannot move the cut.
    spikes = isolated_outliers(values, outlier_mads)
    median_all = statistics.median(values)
    smoothed = [median_all if i in spikes else x for i, x in enumerate(values)]
    start = mser_truncation(smoothed, minimum=min_warmup, min_window=min_window)
    window = list(values[start:])
    dropped = isolated_outliers(window, outlier_mads)
    kept = [x for i, x in enumerate(window) if i not in dropped]
    mean = sum(kept) / len(kept)
    median = statistics.median(kept)
    sd = statistics.stdev(kept) if len(kept) > 1 else 0.0
    half_width = _student_t_quantile(0.5 + confidence / 2, len(kept) - 1) * sd / math.sqrt(len(kept))
    relative = half_width / abs(mean) if mean else math.inf
    return SteadyEstimate(
        warmup_steps=start,
        window=len(kept),
        outliers=len(window) - len(kept),
        mean=mean,
        median=median,
        ci_low=mean - half_width,
        ci_high=mean + half_width,
        confidence=confidence,
        relative_half_width=relative,
        converged=bool(len(kept) >= min_window and relative <= target_relative_half_width),
    )


@dataclass(frozen=True, slots=True)
class ProcessSpread:
    """How much the steady mean of one run moves between fresh processes of the same config: the
    relative standard deviation of run means about their config's mean, pooled over configs (the
    same relative noise assumed for all, as one machine and one workload give it), with its degrees
    of freedom (runs less configs)."""

    relative_sd: float
    degrees_of_freedom: int


def process_spread(run_means: Sequence[Sequence[float]]) -> ProcessSpread | None:
    """The pooled spread of ``run_means`` (one sequence per config, a mean per fresh-process run);
    ``None`` when no config ran twice."""
    squares, freedom = 0.0, 0
    for means in run_means:
        if len(means) < 2:
            continue
        centre = sum(means) / len(means)
        squares += sum((m / centre - 1) ** 2 for m in means)
        freedom += len(means) - 1
    return ProcessSpread(math.sqrt(squares / freedom), freedom) if freedom else None


def over_processes(runs: Sequence[SteadyEstimate], spread: ProcessSpread) -> SteadyEstimate:
    """One config's estimate from its runs in fresh processes: the mean of their means, bounded by
    the spread between processes (a Student-t interval on ``spread``'s degrees of freedom) or by
    the runs' own intervals, whichever is wider. One run's interval says how well its own steps
    pin its mean; it does not say where the next process lands, and on a host-bound loop that moves
    far more (bench/results/h200_bridge_campaign/paste_back_ab.json)."""
    means = [run.mean for run in runs]
    mean = sum(means) / len(means)
    confidence = runs[0].confidence
    between = _student_t_quantile(0.5 + confidence / 2, spread.degrees_of_freedom) * spread.relative_sd * mean \
        / math.sqrt(len(runs))
    within = math.sqrt(sum(((run.ci_high - run.ci_low) / 2) ** 2 for run in runs)) / len(runs)
    half_width = max(between, within)
    return SteadyEstimate(
        warmup_steps=max(run.warmup_steps for run in runs),
        window=sum(run.window for run in runs),
        outliers=sum(run.outliers for run in runs),
        mean=mean,
        median=statistics.median(means),
        ci_low=mean - half_width,
        ci_high=mean + half_width,
        confidence=confidence,
        relative_half_width=half_width / abs(mean) if mean else math.inf,
        converged=all(run.converged for run in runs),
    )


@functools.lru_cache(maxsize=None)
def _student_t_quantile(probability: float, degrees_of_freedom: int) -> float:
    """scipy.stats is imported on first use: it takes most of a second, and every command and
    trial process imports this module."""
    from scipy.stats import t

    return float(t.ppf(probability, degrees_of_freedom))
