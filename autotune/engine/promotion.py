"""Promotion: which screened configs are re-run long, and what the long runs let us conclude.

A promoted config wins only if its knobs demonstrably took effect (the trainable's runtime
evidence) and it beats the others beyond their intervals; configs whose intervals overlap the
winner's are reported as tied with it, never ranked by noise. Mock-data runs never win.
"""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict
from dataclasses import dataclass, field, replace
from typing import Callable

from pydantic import BaseModel, ConfigDict

from autotune.core.knobs import Config, ConfigField
from autotune.core.steady import ProcessSpread, SteadyEstimate, over_processes, process_spread
from autotune.engine.records import RERUN_CAUSES, EntryOutcome, Launch, TrialEntry


BRING_UP = "bring-up"
"""The warm start every gain is quoted against (the seed's FSDP-first starting point)."""


def is_bring_up(run: Launch | TrialEntry) -> bool:
    """Whether ``run`` is the space's ``bring-up`` warm start."""
    return run.origin == "warm_start" and run.warm_start == BRING_UP


def promotion_runs(entries: list[TrialEntry], space: str) -> Counter[Config]:
    """How many promotion runs each config of ``space`` has had (one that lost its node or never
    started does not count: it is run again)."""
    return Counter(e.config for e in entries
                   if e.space == space and e.launched and e.stage == "promote" and e.cause not in RERUN_CAUSES)


def promotion_candidates(entries: list[TrialEntry], top_k: int, space: str, margin: float,
                         repeats: int = 1) -> list[Launch]:
    """The ``top_k`` best distinct configs screened in ``space`` (ok outcome), best first, leaving
    out those the best screen beat beyond the intervals by ``margin`` (the screening scheduler's
    pruning rule, applied once all screens are in: a long run of a config its screen already ruled
    out would only confirm it); then the ``bring-up`` warm start, if its screen ran (ok, or pruned
    for being slower, as a baseline is), so that the gain over it is quoted between runs of the
    same length, never a long run over a short screen. Each is run ``repeats`` times in all, in
    fresh processes, round by round (every config once, then again), so that a drift of the machine
    falls on all alike; the runs a config already has count (a resumed campaign runs the rest)."""
    runs = promotion_runs(entries, space)
    entries = [e for e in entries if e.space == space]
    screened = sorted((e for e in entries if e.screened_ok), key=lambda e: -e.objective)
    chosen: list[TrialEntry] = []
    seen: set[Config] = set()
    for entry in screened:
        if entry.config in seen:
            continue
        seen.add(entry.config)
        if len(seen) > top_k:
            break
        if entry.estimate.ci_high >= screened[0].estimate.ci_low * (1 - margin):
            chosen.append(entry)
    bring_up = next((e for e in entries if e.launched and e.stage == "screen" and is_bring_up(e)
                     and e.outcome in ("ok", "pruned")), None)
    if bring_up is not None and bring_up.config not in {entry.config for entry in chosen}:
        chosen.append(bring_up)
    return [Launch(stage="promote", space=space, config=entry.config, origin="promotion",
                   promoted_from=entry.trial_id)
            for round_ in range(repeats) for entry in chosen if runs[entry.config] <= round_]


def early_promotion(entries: list[TrialEntry], space: str, margin: float) -> Launch | None:
    """The screen of ``space`` to promote while screening goes on (``stages.promote_early``), or
    ``None``: the space's best screen once a later screen has failed to beat it, unless it is
    bring-up (the baseline, promoted with the rest), already promoted, or no faster than every
    config promoted so far by more than ``margin`` (their screens compared: a config as good as one
    the user already has would cost a promotion for nothing). Why wait for one screen: where each
    screen beats the last (the memory-frontier walk relaxing recompute level by level on the CPU
    demo's memory table), promoting every new best spent a promotion per level: 0.531 of the grid
    to 98 % against 0.201 without early promotion; waiting, 0.347
    (``bench/results/search_cpu_memory_promote_early.json``)."""
    screens = [e for e in entries if e.space == space and e.launched and e.stage == "screen"]
    screened = [e for e in screens if e.screened_ok]
    if not screened:
        return None
    best = max(screened, key=lambda e: e.objective)
    if screens[-1] is best or is_bring_up(best):
        return None
    promoted = promotion_runs(entries, space)
    if best.config in promoted:
        return None
    bar = max((e.objective for e in screened if e.config in promoted), default=None)
    if bar is not None and best.objective <= bar * (1 + margin):
        return None
    return Launch(stage="promote", space=space, config=best.config, origin="promotion", promoted_from=best.trial_id)


def promotion_nodes(entries: list[TrialEntry], world_size: int,
                    alive: Callable[[], set[str]]) -> tuple[str, ...] | None:
    """The nodes, rank by rank, of the campaign's first promotion run of ``world_size`` ranks that
    said where its ranks ran, on nodes all still ``alive()`` (asked only once there is such a run);
    ``None`` before one has. Every later promotion run goes there, one at a time: the verdict
    compares long runs a few percent apart, and long runs of one config differed 13–47 % between
    H100s (``bench/results/fidelity_h100_te_grid.json``), so runs spread over machines would rank
    the machines. Where a node is lost (or a resumed campaign runs on a new cluster), the first run
    on live nodes sets where the rest go."""
    placed = [tuple(worker.node_id for worker in entry.contract.workers) for entry in entries
              if entry.stage == "promote" and entry.launched and entry.contract is not None
              and entry.contract.workers and len(entry.contract.workers) == world_size]
    live = alive() if placed else set()
    return next((nodes for nodes in placed if live.issuperset(nodes)), None)


def placements(runs: list[TrialEntry]) -> int | None:
    """How many different placements (each rank's node and accelerator) ``runs`` ran on; ``None``
    where a run did not say, or replayed a recorded burst (it ran here, its measurement elsewhere)."""
    seen = set()
    for run in runs:
        workers = run.contract.measured_on if run.contract is not None else None
        if workers is None:
            return None
        seen.add(tuple((worker.node_id, worker.accelerator_id) for worker in workers))
    return len(seen) or None


def over_fresh_processes(promoted: list[TrialEntry]) -> tuple[list[TrialEntry], ProcessSpread | None]:
    """One entry per promoted config of each space (a workflow may promote one config in two spaces:
    two rows, as two spaces tuned it), in the order of first runs, and the spread between processes
    that bounds them: pooled over every config that ran twice or more, it bounds every config,
    those run once included (:func:`over_processes`). A config's entry is one of its runs (one
    whose evidence fails if any does, else the one nearest their mean) carrying their estimate over
    processes; one run that did not finish ok stands for the config, which then cannot win. Where
    no config ran twice, each run is its config's entry as it ran."""
    by_config: dict[tuple[str, Config], list[TrialEntry]] = defaultdict(list)
    for entry in promoted:
        if entry.cause not in RERUN_CAUSES:  # its rerun is the run
            by_config[(entry.space, entry.config)].append(entry)
    finished = [[e.estimate.mean for e in runs] for runs in by_config.values()
                if all(e.outcome == "ok" and e.estimate is not None for e in runs)]
    spread = process_spread(finished)
    combined = []
    for runs in by_config.values():
        ids = tuple(e.trial_id for e in runs if e.trial_id is not None)
        unfinished = next((e for e in runs if e.outcome != "ok" or e.estimate is None), None)
        if unfinished is not None or spread is None:
            shown = unfinished or runs[0]
            combined.append(shown if len(runs) == 1 else shown.model_copy(update={"runs": ids}))
            continue
        estimate = over_processes([e.estimate for e in runs], spread)
        shown = next((e for e in runs if e.evidence.failed_checks()), None) or \
            min(runs, key=lambda e: abs(e.estimate.mean - estimate.mean))
        rates = [e.model_tflops_per_s_per_gpu for e in runs if e.model_tflops_per_s_per_gpu]
        peaks = [e.peak_memory_bytes for e in runs if e.peak_memory_bytes]
        combined.append(shown.model_copy(update={
            "runs": ids, "objective": estimate.mean, "estimate": estimate,
            "model_tflops_per_s_per_gpu": statistics.fmean(rates) if rates else None,
            "peak_memory_bytes": max(peaks) if peaks else None,
            "wall_seconds": sum(e.wall_seconds for e in runs), "device_seconds": sum(e.device_seconds for e in runs),
        }))
    return combined, spread


@dataclass(frozen=True)
class Gain:
    """The winner over a baseline, both run for the same steps: ``value`` is the ratio of their
    means less one; ``low`` and ``high`` bound it from the two intervals (the winner's low over the
    baseline's high, and the other way), so a gain whose bounds hold 0 is a tie."""

    value: float
    low: float
    high: float
    steps: int
    processes: int = 1
    """Fresh-process runs of each side (the fewer of the two): above one, the intervals hold the
    spread between processes."""

    @property
    def tie(self) -> bool:
        return self.low <= 0.0 <= self.high

    def describe(self) -> str:
        interval = f"{self.low:+.1%} to {self.high:+.1%}"
        runs = f"{self.steps}-step runs" if self.processes == 1 else \
            f"{self.processes} fresh-process {self.steps}-step runs of each"
        if self.tie:
            return f"{self.value:+.1%} ({interval}): a tie, the intervals overlap ({runs})"
        return f"{self.value:+.1%} ({interval}, {runs}{' of both' if self.processes == 1 else ''})"


def gain_at_equal_fidelity(winner: TrialEntry, baseline: TrialEntry) -> Gain | None:
    """The winner's gain over ``baseline`` when both are finished long runs of the same length."""
    if winner.estimate is None or baseline.estimate is None or baseline.outcome != "ok" or winner.steps != baseline.steps:
        return None
    gain = gain_between(winner.estimate, baseline.estimate, winner.steps)
    processes = min(winner.processes, baseline.processes)
    return gain if gain is None or processes == 1 else replace(gain, processes=processes)


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
    promoted: list[TrialEntry] = field(default_factory=list)
    """One entry per promoted config (:func:`over_fresh_processes`), as the verdict weighed them."""
    spread: ProcessSpread | None = None
    """The spread between fresh processes of one config, where a config ran more than once."""
    placements: int | None = None
    """How many different placements the promotion runs ran on (:func:`placements`)."""


def decide(promoted_runs: list[TrialEntry]) -> Verdict:
    """The winner among promoted configs (each over its runs in fresh processes), the configs tied
    with it, and those ruled out (and why)."""
    promoted, spread = over_fresh_processes(promoted_runs)
    placed = placements([e for e in promoted_runs if e.cause not in RERUN_CAUSES and e.steps])
    # Said where it bears on the verdict: machines differ by more than its gaps.
    elsewhere = (f"; its runs ran on {placed} different sets of nodes and devices, so the machines' differences "
                 f"are in its gaps" if placed is not None and placed > 1 else "")
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
        return Verdict(None, [], disqualified, "no promoted config is eligible to win", promoted, spread, placed)
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
    return Verdict(winner, tied, disqualified, summary + elsewhere, promoted, spread, placed)


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
    processes: int = 1
    """Fresh-process runs of the config that the row stands for (``trial_id`` is one of them)."""
    steady_steps: int | None
    """Steady steps of its runs, all together."""
    screen_objective: float | None
    """The config's best screening estimate."""
    winner: bool
    tied_with_winner: bool
    ruled_out: str | None


class Leaderboard(BaseModel):
    """``leaderboard.json``: the promoted configs best first (each over its runs in fresh processes),
    with their screening estimate beside them, and the verdict."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    verdict: str
    rows: list[LeaderboardRow]


def leaderboard(entries: list[TrialEntry], verdict: Verdict) -> Leaderboard:
    screened: dict[Config, float] = {}
    for entry in entries:
        if entry.launched and entry.stage == "screen" and entry.objective is not None:
            screened[entry.config] = max(screened.get(entry.config, 0.0), entry.objective)
    promoted = sorted(verdict.promoted, key=lambda e: -(e.objective or 0.0))
    tied_ids = {e.trial_id for e in verdict.tied}
    ruled_out = {e.trial_id: why for e, why in verdict.disqualified}
    rows = [
        LeaderboardRow(
            rank=rank, trial_id=entry.trial_id, config=entry.config, outcome=entry.outcome, objective=entry.objective,
            ci_low=entry.estimate.ci_low if entry.estimate else None,
            ci_high=entry.estimate.ci_high if entry.estimate else None,
            space=entry.space, steps=entry.steps, processes=entry.processes,
            steady_steps=entry.estimate.window if entry.estimate else None,
            screen_objective=screened.get(entry.config),
            winner=verdict.winner is not None and entry.trial_id == verdict.winner.trial_id,
            tied_with_winner=entry.trial_id in tied_ids, ruled_out=ruled_out.get(entry.trial_id),
        )
        for rank, entry in enumerate(promoted, 1)
    ]
    return Leaderboard(verdict=verdict.summary, rows=rows)
