"""Promotion: which screened configs are re-run long, and what the long runs let us conclude.

A promoted config wins only if its knobs demonstrably took effect (the trainable's runtime
evidence) and it beats the others beyond their intervals; configs whose intervals overlap the
winner's are reported as tied with it, never ranked by noise. Mock-data runs never win.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict

from autotune.core.knobs import Config, ConfigField
from autotune.core.steady import SteadyEstimate
from autotune.engine.records import EntryOutcome, Launch, TrialEntry


BRING_UP = "bring-up"
"""The warm start every gain is quoted against (the seed's FSDP-first starting point)."""


def promotion_candidates(entries: list[TrialEntry], top_k: int, space: str, margin: float) -> list[Launch]:
    """The ``top_k`` best distinct configs screened in ``space`` (ok outcome), best first, not yet
    promoted, leaving out those the best screen beat beyond the intervals by ``margin`` (the
    screening scheduler's pruning rule, applied once all screens are in: a long run of a config
    its screen already ruled out would only confirm it); then the ``bring-up`` warm start, if its
    screen ran (ok, or pruned for being slower, as a baseline is), so that the gain over it is
    quoted between two runs of the same length, never a long run over a short screen."""
    entries = [e for e in entries if e.space == space]
    promoted = {e.config for e in entries if e.launched and e.stage == "promote"}
    screened = sorted((e for e in entries if e.screened_ok), key=lambda e: -e.objective)
    chosen: list[Launch] = []
    seen: set[Config] = set()
    for entry in screened:
        if entry.config in seen:
            continue
        seen.add(entry.config)
        if len(seen) > top_k:
            break
        if entry.estimate.ci_high < screened[0].estimate.ci_low * (1 - margin):
            continue
        if entry.config not in promoted:
            chosen.append(Launch(stage="promote", space=space, config=entry.config, origin="promotion",
                                 promoted_from=entry.trial_id))
    bring_up = next((e for e in entries if e.launched and e.stage == "screen" and e.origin == "warm_start"
                     and e.warm_start == BRING_UP and e.outcome in ("ok", "pruned")), None)
    if bring_up is not None and bring_up.config not in promoted | {launch.config for launch in chosen}:
        chosen.append(Launch(stage="promote", space=space, config=bring_up.config, origin="promotion",
                             promoted_from=bring_up.trial_id))
    return chosen


@dataclass(frozen=True)
class Gain:
    """The winner over a baseline, both run for the same steps: ``value`` is the ratio of their
    means less one; ``low`` and ``high`` bound it from the two intervals (the winner's low over the
    baseline's high, and the other way), so a gain whose bounds hold 0 is a tie."""

    value: float
    low: float
    high: float
    steps: int

    @property
    def tie(self) -> bool:
        return self.low <= 0.0 <= self.high

    def describe(self) -> str:
        interval = f"{self.low:+.1%} to {self.high:+.1%}"
        if self.tie:
            return f"{self.value:+.1%} ({interval}): a tie, the intervals overlap ({self.steps}-step runs)"
        return f"{self.value:+.1%} ({interval}, {self.steps}-step runs of both)"


def gain_at_equal_fidelity(winner: TrialEntry, baseline: TrialEntry) -> Gain | None:
    """The winner's gain over ``baseline`` when both are finished long runs of the same length."""
    if winner.estimate is None or baseline.estimate is None or baseline.outcome != "ok" or winner.steps != baseline.steps:
        return None
    return gain_between(winner.estimate, baseline.estimate, winner.steps)


def gain_between(winner: SteadyEstimate, baseline: SteadyEstimate, steps: int) -> Gain | None:
    """One steady estimate over another, both of ``steps``-step runs (``None`` when the baseline's
    interval reaches 0, which bounds no ratio)."""
    w, b = winner, baseline
    if b.mean <= 0 or b.ci_low <= 0:
        return None
    return Gain(value=w.mean / b.mean - 1, low=w.ci_low / b.ci_high - 1, high=w.ci_high / b.ci_low - 1, steps=steps)


def projected_headroom(promoted: list[TrialEntry], reachable_tflops_per_gpu: float) -> float | None:
    """What the next space could gain over the best promoted config of this one, in model TFLOP/s
    per GPU (``reachable / best - 1``); ``None`` when nothing was promoted with a FLOP rate."""
    rates = [e.model_tflops_per_s_per_gpu for e in promoted if e.outcome == "ok" and e.model_tflops_per_s_per_gpu]
    return reachable_tflops_per_gpu / max(rates) - 1 if rates else None


@dataclass
class Verdict:
    winner: TrialEntry | None
    tied: list[TrialEntry] = field(default_factory=list)
    """Promoted configs whose interval overlaps the winner's."""
    disqualified: list[tuple[TrialEntry, str]] = field(default_factory=list)
    summary: str = ""


def decide(promoted: list[TrialEntry]) -> Verdict:
    """The winner among promoted runs, the configs tied with it, and those ruled out (and why)."""
    eligible, disqualified = [], []
    for entry in promoted:
        if entry.outcome != "ok" or entry.estimate is None:
            disqualified.append((entry, f"promotion run ended {entry.outcome}: {entry.reason}"))
        elif entry.benchmark_only:
            disqualified.append((entry, "mock (image-free) data: benchmark-only, never a throughput result"))
        elif failed := entry.evidence.failed_checks():
            disqualified.append((entry, f"runtime evidence contradicts the config for {', '.join(failed)}"))
        else:
            eligible.append(entry)
    if not eligible:
        return Verdict(None, [], disqualified, "no promoted config is eligible to win")
    eligible.sort(key=lambda e: -e.objective)
    winner, others = eligible[0], eligible[1:]
    tied = [e for e in others if e.estimate.ci_high >= winner.estimate.ci_low]
    if not others:
        summary = "the only eligible promoted config"
    elif tied:
        summary = f"tied with {len(tied)} other promoted config(s): their intervals overlap the winner's"
    else:
        runner_up = others[0]
        gain = winner.objective / runner_up.objective - 1 if runner_up.objective else float("inf")
        summary = f"beats every other promoted config beyond their intervals (+{100 * gain:.1f}% over the next)"
    return Verdict(winner, tied, disqualified, summary)


class LeaderboardRow(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    rank: int
    trial_id: str
    config: ConfigField
    outcome: EntryOutcome
    objective: float | None
    ci_low: float | None
    ci_high: float | None
    space: str
    steps: int
    steady_steps: int | None
    screen_objective: float | None
    """The config's best screening estimate."""
    winner: bool
    tied_with_winner: bool
    ruled_out: str | None


class Leaderboard(BaseModel):
    """``leaderboard.json``: the promoted runs best first, with their screening estimate beside
    them, and the verdict."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    verdict: str
    rows: list[LeaderboardRow]


def leaderboard(entries: list[TrialEntry], verdict: Verdict) -> Leaderboard:
    screened: dict[Config, float] = {}
    for entry in entries:
        if entry.launched and entry.stage == "screen" and entry.objective is not None:
            screened[entry.config] = max(screened.get(entry.config, 0.0), entry.objective)
    promoted = sorted((e for e in entries if e.launched and e.stage == "promote"), key=lambda e: -(e.objective or 0.0))
    tied_ids = {e.trial_id for e in verdict.tied}
    ruled_out = {e.trial_id: why for e, why in verdict.disqualified}
    rows = [
        LeaderboardRow(
            rank=rank, trial_id=entry.trial_id, config=entry.config, outcome=entry.outcome, objective=entry.objective,
            ci_low=entry.estimate.ci_low if entry.estimate else None,
            ci_high=entry.estimate.ci_high if entry.estimate else None,
            space=entry.space, steps=entry.steps, steady_steps=entry.estimate.window if entry.estimate else None,
            screen_objective=screened.get(entry.config),
            winner=verdict.winner is not None and entry.trial_id == verdict.winner.trial_id,
            tied_with_winner=entry.trial_id in tied_ids, ruled_out=ruled_out.get(entry.trial_id),
        )
        for rank, entry in enumerate(promoted, 1)
    ]
    return Leaderboard(verdict=verdict.summary, rows=rows)
