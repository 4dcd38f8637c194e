"""The screening decision after each step of a trial: keep going, stop (steady enough), or prune.

A trial stops as soon as its steady window is tight enough (the steady-state module's target) and
is pruned as soon as the upper bound of its throughput interval falls below the best trial's lower
bound by ``prune_margin``: even its most optimistic steady value cannot reach the best's most
pessimistic one. Pruned trials keep their partial estimate.

A steady interval needs ``min_window`` steps after the warm-up, and a config running at a third of
the best's speed pays them all at a third of its speed: on the H100 TE table such screens cost
17–32 device-s each. So a trial is pruned sooner, :data:`CLEAR_LOSER_STEPS` steps after its
warm-up, where even its fastest step so far is under half the prune threshold (the best's lower
bound less the margin): too few steps to pin a mean, enough to show it runs at less than half the
speed it would need. A config near the best is pruned this way only if its first steps after the
warm-up all ran at under half its steady speed: slowness the warm-up is there to absorb.

A baseline (bring-up, whose long run every gain is quoted against) stops as soon, with that same
partial estimate, and is never pruned: promotion runs it for ``promote_steps`` whatever its screen
says, so its screen only has to show that the model runs and give the search a first incumbent. Bring-up is the
slowest config a campaign runs on purpose (the seed's FSDP-first start, full recompute): its full
screen was 66 device-s of the H100 TE table's 833 (0.08 of the grid) and 127 s of the H200 TE
campaign's screening.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Sequence

from autotune.core.steady import MIN_WINDOW, SteadyEstimate, steady_state

Action = Literal["continue", "stop", "prune"]

CLEAR_LOSER_STEPS = 2
"""Steps after the warm-up before a trial far below the best can be pruned without a steady window,
and after which a baseline's screen stops."""


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
    baseline: bool = False,
) -> ScreenDecision:
    """The decision after the steps so far (useful tokens/s of each); ``baseline``: the trial is
    bring-up, whose promotion measures it (the module's last paragraph)."""
    estimate = steady_state(
        tokens_per_second, min_warmup=min_warmup, min_window=min_window,
        target_relative_half_width=target_relative_half_width,
    )
    threshold = best.ci_low * (1 - prune_margin) if best is not None else None
    if estimate is None:
        after_warmup = tokens_per_second[min_warmup:]
        if len(after_warmup) < CLEAR_LOSER_STEPS:
            return ScreenDecision("continue", None, "warming up")
        partial = steady_state(tokens_per_second, min_warmup=min_warmup, min_window=len(after_warmup))
        if baseline:  # never pruned: its promotion runs whatever its screen says
            return ScreenDecision("stop", partial, "the baseline runs; its promotion measures it")
        fastest = max(after_warmup)
        if threshold is not None and fastest < threshold / 2:
            return ScreenDecision(
                "prune", partial,
                f"its fastest step after the warm-up, {fastest:.0f}, is under half of {threshold:.0f}, "
                f"the best's lower bound less {100 * prune_margin:.0f}%",
            )
        return ScreenDecision("continue", None, "warming up")
    if threshold is not None and estimate.window >= min_window and estimate.ci_high < threshold:
        return ScreenDecision(
            "prune", estimate,
            f"upper bound {estimate.ci_high:.0f} is below the best's lower bound {best.ci_low:.0f} "
            f"by more than {100 * prune_margin:.0f}%",
        )
    if estimate.converged:
        return ScreenDecision("stop", estimate, f"steady within ±{100 * estimate.relative_half_width:.1f}%")
    return ScreenDecision("continue", estimate, f"interval ±{100 * estimate.relative_half_width:.1f}% still too wide")
