"""The screening decision after each step of a trial: keep going, stop (steady enough), or prune.

A trial stops as soon as its steady window is tight enough (the steady-state module's target) and
is pruned as soon as the upper bound of its throughput interval falls below the best trial's lower
bound by ``prune_margin``: even its most optimistic steady value cannot reach the best's most
pessimistic one. Pruned trials keep their partial estimate.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Sequence

from autotune.core.steady import MIN_WINDOW, SteadyEstimate, steady_state

Action = Literal["continue", "stop", "prune"]


@dataclass(frozen=True)
class ScreenDecision:
    action: Action
    estimate: SteadyEstimate | None
    reason: str


def screen(
    tokens_per_second: Sequence[float],
    *,
    best: SteadyEstimate | None,
    min_warmup: int,
    min_window: int = MIN_WINDOW,
    target_relative_half_width: float = 0.02,
    prune_margin: float = 0.02,
) -> ScreenDecision:
    estimate = steady_state(
        tokens_per_second, min_warmup=min_warmup, min_window=min_window,
        target_relative_half_width=target_relative_half_width,
    )
    if estimate is None:
        return ScreenDecision("continue", None, "warming up")
    if best is not None and estimate.window >= min_window and estimate.ci_high < best.ci_low * (1 - prune_margin):
        return ScreenDecision(
            "prune", estimate,
            f"upper bound {estimate.ci_high:.0f} is below the best's lower bound {best.ci_low:.0f} "
            f"by more than {100 * prune_margin:.0f}%",
        )
    if estimate.converged:
        return ScreenDecision("stop", estimate, f"steady within ±{100 * estimate.relative_half_width:.1f}%")
    return ScreenDecision("continue", estimate, f"interval ±{100 * estimate.relative_half_width:.1f}% still too wide")
