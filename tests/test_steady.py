"""The steady-state module on recorded-style series."""

from __future__ import annotations

import random

import pytest

from autotune.core.steady import MIN_WINDOW, mser_truncation, steady_state


def noisy(level: float, count: int, noise: float, seed: int) -> list[float]:
    rng = random.Random(seed)
    return [level * (1 + rng.gauss(0, noise)) for _ in range(count)]


def test_long_warmup_is_cut_and_the_level_found() -> None:
    warmup = [1000 * (0.2 + 0.08 * i) for i in range(10)]  # allocator growth / graph capture ramp
    series = warmup + noisy(1000, 30, 0.01, seed=1)
    estimate = steady_state(series)
    assert 9 <= estimate.warmup_steps <= 12
    assert estimate.converged
    assert estimate.ci_low <= 1000 <= estimate.ci_high
    assert abs(estimate.mean - 1000) / 1000 < 0.01


def test_step_change_reports_the_new_level() -> None:
    series = noisy(100, 15, 0.01, seed=2) + noisy(80, 25, 0.01, seed=3)
    estimate = steady_state(series)
    assert estimate.warmup_steps == pytest.approx(15, abs=1)
    assert abs(estimate.mean - 80) / 80 < 0.01
    assert estimate.converged


def test_late_step_change_is_not_falsely_converged() -> None:
    series = noisy(100, 30, 0.005, seed=4) + noisy(80, 10, 0.005, seed=5)
    estimate = steady_state(series)
    assert not estimate.converged  # the window straddles two levels: keep measuring


def test_heavy_noise_does_not_converge_but_brackets_the_level() -> None:
    series = noisy(500, 20, 0.15, seed=6)
    estimate = steady_state(series, min_warmup=2)
    assert not estimate.converged
    assert estimate.relative_half_width > 0.02
    assert estimate.ci_low < 500 < estimate.ci_high


def test_single_outlier_is_dropped_not_averaged() -> None:
    series = noisy(1000, 25, 0.005, seed=7)
    series[15] = 100.0  # one 10x slow step (a GC pause)
    estimate = steady_state(series)
    assert estimate.outliers == 1
    assert estimate.converged
    assert abs(estimate.mean - 1000) / 1000 < 0.005
    assert estimate.warmup_steps <= 2  # the outlier did not drag the warm-up cut


def test_too_short_gives_none_and_declared_warmup_is_respected() -> None:
    assert steady_state([1.0, 2.0, 3.0], min_warmup=1, min_window=5) is None
    estimate = steady_state(noisy(10, 12, 0.001, seed=8), min_warmup=4)
    assert estimate.warmup_steps >= 4


def test_mser_on_a_flat_series_cuts_nothing_beyond_the_minimum() -> None:
    assert mser_truncation([5.0] * 20, minimum=2) == 2


def test_mser_never_cuts_a_short_series_below_the_minimum_window() -> None:
    # An 8-step screen after 3 warm-up steps: half the series (cut at 4) would leave 4 steps; the
    # three equal ones of them had a median deviation of 0, the fourth was dropped as an outlier
    # and the interval had no width.
    series = [500.0, 800.0, 900.0, 950.0, 1000.0, 1000.0, 1000.0, 1010.0]
    assert mser_truncation(series, minimum=3) == 3
    estimate = steady_state(series, min_warmup=3)
    assert estimate.warmup_steps == 3 and estimate.window + estimate.outliers == 5
    assert estimate.ci_low < estimate.ci_high


def test_every_short_estimate_keeps_the_minimum_window_and_long_ones_the_half_bound() -> None:
    for count in range(6, 2 * MIN_WINDOW):
        for min_warmup in (1, 2, 3):
            for seed in range(30):
                series = [1000 * (0.5 + 0.1 * i) for i in range(min_warmup)] + noisy(1000, count - min_warmup, 0.02, seed)
                estimate = steady_state(series, min_warmup=min_warmup)
                if estimate is not None:
                    assert count - estimate.warmup_steps >= MIN_WINDOW, (count, min_warmup, seed)
    # Past two windows the usual half-series bound is the one that holds.
    assert mser_truncation([float(i) for i in range(16)] + [16.0] * 4, minimum=1) == 10


def test_the_spread_between_processes_is_pooled_over_configs_relative_to_each_mean() -> None:
    from autotune.core.steady import process_spread

    spread = process_spread([[100.0, 110.0], [50.0, 45.0, 55.0], [70.0]])
    squares = 2 * (5 / 105) ** 2 + 2 * 0.1 ** 2  # a config run once adds nothing
    assert spread.degrees_of_freedom == 3 and spread.relative_sd == pytest.approx((squares / 3) ** 0.5)
    assert process_spread([[100.0], [50.0]]) is None


def test_a_config_over_processes_is_as_wide_as_the_processes_disagree_or_its_runs_are_unsure() -> None:
    from scipy.stats import t

    from autotune.core.steady import ProcessSpread, over_processes, steady_state

    tight = [steady_state([level] * 3 + noisy(level, 40, 0.005, seed), min_warmup=3) for seed, level in
             ((1, 100.0), (2, 120.0))]
    apart = over_processes(tight, ProcessSpread(relative_sd=0.1, degrees_of_freedom=4))
    half = t.ppf(0.975, 4) * 0.1 * apart.mean / 2 ** 0.5
    assert apart.mean == pytest.approx((tight[0].mean + tight[1].mean) / 2)
    assert (apart.ci_low, apart.ci_high) == (pytest.approx(apart.mean - half), pytest.approx(apart.mean + half))
    assert apart.ci_high - apart.ci_low > 10 * max(r.ci_high - r.ci_low for r in tight)
    assert apart.window == sum(r.window for r in tight)
    unsure = [steady_state([100.0] * 3 + noisy(100.0, 20, 0.2, seed), min_warmup=3) for seed in (3, 4)]
    agreeing = over_processes(unsure, ProcessSpread(relative_sd=0.0, degrees_of_freedom=1))
    within = (sum(((r.ci_high - r.ci_low) / 2) ** 2 for r in unsure)) ** 0.5 / 2
    assert agreeing.ci_high - agreeing.mean == pytest.approx(within) and within > 0
