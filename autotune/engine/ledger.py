"""The driver's account of a campaign: what each trial reported, how it ended, what it cost.

Every step result is appended to ``steps.jsonl`` as it arrives; every trial's end (and every
proposal rejected before launch) to ``trials.jsonl`` as a :class:`~autotune.engine.records.TrialEntry`.
Both are only ever appended to, and a new ledger on the same run directory reads them back, so
``autotune resume`` continues from them. The ledger is written by the recording callback (steps), the
searchers (trials starting and ending, rejections), the scheduler (its decision on a trial) and the
watchdog (a trial it killed); Tune calls them all from one thread of the driver.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Callable

from autotune.core.contract import Contract, Evidence, SteadyWindow, TimedPart
from autotune.core.steady import SteadyEstimate, steady_state
from autotune.engine.faults import node_lost
from autotune.engine.records import (
    Cause, EntryOutcome, Launch, OutsideSteps, Spend, Stage, StepEntry, TrialEntry, first_step_excess, spend,
)
from autotune.engine.rundir import RunDir
from autotune.engine.trial import EndEvent, StepEvent, TrialStartup, read_result
from autotune.search.history import Rejection
from autotune.search.screening import ScreenDecision


@dataclass
class LiveTrial:
    trial_id: str
    launch: Launch
    started: float = field(default_factory=time.monotonic)
    started_at: float = field(default_factory=time.time)
    """``started`` by the wall clock, which the trial's ranks time their start-up by."""
    objective: list[float] = field(default_factory=list)
    model_flops: list[float] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)
    peak_memory_bytes: int = 0
    contract: Contract | None = None
    evidence: Evidence = field(default_factory=Evidence)
    end: EndEvent | None = None
    decision: ScreenDecision | None = None
    """The screening scheduler's verdict, once it stopped or pruned the trial."""
    replayed_seconds: float | None = None
    """A replayed burst's recorded seconds so far: charged instead of the wall clock."""
    last_report: float | None = None
    """When its last result arrived (``time.monotonic``)."""
    last_step_at: float | None = None
    """When its last step's result arrived (``time.time``)."""
    startup: TrialStartup | None = None
    """When its function began and its reporting rank was ready and began its first step."""
    hung: str | None = None
    """Why the watchdog killed it, once it has."""
    not_started: str | None = None
    """Why Tune ended it before its trainable ran, once it has."""
    stranded: str | None = None
    """Why it was ended before it began, its pinned nodes gone from the cluster, once it has."""
    placed: bool = True
    """``False`` once it was ended still waiting for Ray to place it: it never held a device."""
    error_text: Callable[[], str | None] = lambda: None
    """What Tune wrote of the trial's error (its ``error.txt``), once it failed."""

    def charged_seconds(self) -> float:
        """Seconds of each of the trial's devices spent so far."""
        return time.monotonic() - self.started if self.replayed_seconds is None else self.replayed_seconds


class Ledger:
    def __init__(self, run_dir: RunDir, *, world_size: int, warmup_steps: int, target_relative_half_width: float,
                 benchmark_only: bool) -> None:
        self.run_dir = run_dir
        self.world_size = world_size
        self.warmup_steps = warmup_steps
        self.target = target_relative_half_width
        self.benchmark_only = benchmark_only
        self.live: dict[str, LiveTrial] = {}
        self.entries: list[TrialEntry] = []
        self._finished_device_seconds = 0.0
        self._best_screen: TrialEntry | None = None
        """Kept as entries are added: the scheduler asks for the best at every step result."""
        for entry in run_dir.trials.read():
            self._add(entry)
        self.stopped_by_budget = False

    # -- trials as they run ------------------------------------------------------------------------
    def start(self, trial_id: str, launch: Launch) -> None:
        self.live[trial_id] = LiveTrial(trial_id, launch)

    def record(self, trial_id: str, result: dict) -> None:
        """Take one result of a running trial (a step or its end); steps go to ``steps.jsonl``."""
        trial = self.live[trial_id]
        trial.last_report = time.monotonic()
        event = read_result(result)
        if event is None:  # one of Tune's own results
            return
        if isinstance(event, StepEvent):
            trial.last_step_at = time.time()
            trial.startup = event.startup or trial.startup
            record = event.record
            trial.objective.append(event.objective)
            trial.model_flops.append(record.model_flops)
            trial.step_seconds.append(record.step_seconds)
            trial.peak_memory_bytes = max(trial.peak_memory_bytes, record.peak_memory_bytes)
            self.run_dir.steps.append(
                StepEntry(trial_id=trial_id, stage=trial.launch.stage, space=trial.launch.space,
                          objective=event.objective, record=record),
                sync=False,  # synced with the trial's entry
            )
        else:
            trial.end = event
        if not event.evidence.is_empty():  # an end that observed nothing keeps what the steps saw
            trial.evidence = event.evidence
        trial.contract = event.contract or trial.contract
        if event.elapsed_seconds is not None:
            trial.replayed_seconds = event.elapsed_seconds

    def finish(self, trial_id: str, *, errored: bool) -> TrialEntry:
        """Close a trial: its outcome, estimate and cost, appended to ``trials.jsonl``."""
        trial = self.live.pop(trial_id)
        outcome, cause, reason = self._outcome(trial, errored)
        estimate = None
        if outcome in ("ok", "pruned"):
            estimate = (
                trial.decision.estimate
                if trial.decision is not None and trial.decision.estimate is not None
                else steady_state(trial.objective, min_warmup=self.warmup_steps, target_relative_half_width=self.target)
            )
        window = slice(estimate.warmup_steps, None) if estimate is not None else slice(0, 0)
        seconds = sum(trial.step_seconds[window])
        launch = trial.launch
        entry = TrialEntry(
            trial_id=trial.trial_id, stage=launch.stage, space=launch.space, number=launch.number,
            origin=launch.origin, warm_start=launch.warm_start, promoted_from=launch.promoted_from,
            retry_of=launch.retry_of, config=launch.config, launched=True, outcome=outcome, cause=cause,
            reason=reason, steps=len(trial.objective),
            objective=None if estimate is None else estimate.mean,
            estimate=estimate,
            model_tflops_per_s_per_gpu=sum(trial.model_flops[window]) / seconds / self.world_size / 1e12
            if seconds > 0 else None,
            peak_memory_bytes=trial.peak_memory_bytes or None,
            wall_seconds=time.monotonic() - trial.started,
            device_seconds=trial.charged_seconds() * self.world_size if trial.placed else 0.0,
            training_device_seconds=sum(trial.step_seconds) * self.world_size,
            outside_steps=self._outside_steps(trial),
            first_step_excess=first_step_excess(trial.step_seconds, self.world_size),
            rank_start=trial.end.rank_start if trial.end is not None and trial.end.rank_start is not None
            else (trial.contract.rank_start if trial.contract is not None else None),
            out_of_memory_parts=self._device_seconds((*trial.end.before_first_step, *trial.end.teardown)
                                                     if trial.end is not None and trial.end.before_first_step else ()),
            benchmark_only=self.benchmark_only,
            evidence=trial.evidence,
            contract=None if trial.contract is None else trial.contract.model_copy(update={
                "steady_window": None if estimate is None else SteadyWindow(
                    first_step=estimate.warmup_steps, steps=len(trial.objective) - estimate.warmup_steps),
            }),
            error=None if trial.end is None else trial.end.error,
            finished_at=datetime.now(timezone.utc),
        )
        self.run_dir.steps.sync()
        self.run_dir.trials.append(entry)
        self._add(entry)
        return entry

    def _outside_steps(self, trial: LiveTrial) -> OutsideSteps | None:
        """Where the trial's device-seconds outside its steps went, by the times its function and
        reporting rank sent with the first step (``None`` without them: a replay, no step)."""
        startup = trial.startup
        if startup is None or trial.last_step_at is None or trial.replayed_seconds is not None:
            return None
        seconds = {
            "trial_start": startup.trial_began_at - trial.started_at,
            "rank_start": startup.ranks_ready_at - startup.trial_began_at,
            "build": startup.first_step_at - startup.ranks_ready_at,
            "between_steps": trial.last_step_at - startup.first_step_at - sum(trial.step_seconds),
            "after_steps": time.time() - trial.last_step_at,
        }
        return OutsideSteps(**{part: round(value * self.world_size, 3) for part, value in seconds.items()},
                            build_phases=self._device_seconds(startup.build_phases),
                            after_steps_parts=self._device_seconds(trial.end.teardown if trial.end is not None else ()))

    def _device_seconds(self, parts: tuple[TimedPart, ...]) -> tuple[TimedPart, ...]:
        """The reporting rank's wall seconds of each part, on every device of the trial."""
        return tuple(TimedPart(part.name, round(part.seconds * self.world_size, 3)) for part in parts)

    def _outcome(self, trial: LiveTrial, errored: bool) -> tuple[EntryOutcome, Cause | None, str]:
        if trial.hung is not None:
            return "hung", "watchdog", trial.hung
        if trial.not_started is not None:
            return "failed", "not_started", trial.not_started
        if trial.stranded is not None:
            return "failed", "node_lost", trial.stranded
        lost = node_lost(trial.end.error if trial.end is not None else None) or \
            (node_lost(trial.error_text()) if errored else None)
        if lost is not None:
            return "failed", "node_lost", lost
        if errored:
            return "failed", "trial_raised", f"the trial process raised; its error.txt is under {self.run_dir.ray_storage}"
        if trial.decision is not None and trial.decision.action == "prune":
            return "pruned", None, trial.decision.reason
        if trial.decision is not None and trial.decision.action == "stop":
            return "ok", None, f"stopped early: {trial.decision.reason}"
        if trial.end is not None:
            error = (trial.end.error or "").strip()
            return trial.end.outcome, None, error.splitlines()[-1][:300] if error else "ran every step"
        if self.stopped_by_budget:
            return "pruned", "budget", "stopped when the campaign's budget ran out"
        return "failed", "no_outcome", "the trial ended without reporting an outcome"

    def reject(self, rejection: Rejection, space: str) -> None:
        """A proposal that never reached a device (a gate stopped it): cost zero, kept on record."""
        proposal = rejection.proposal
        entry = TrialEntry(
            trial_id=None, stage="screen", space=space, number=proposal.number, origin=proposal.origin,
            warm_start=proposal.warm_start, config=proposal.config, launched=False, outcome=rejection.outcome,
            cause=rejection.gate, reason=rejection.reason, device_seconds=0.0, finished_at=datetime.now(timezone.utc),
        )
        self.run_dir.trials.append(entry)
        self._add(entry)

    def _add(self, entry: TrialEntry) -> None:
        self.entries.append(entry)
        self._finished_device_seconds += entry.device_seconds
        if entry.screened_ok and (self._best_screen is None or entry.objective > self._best_screen.objective):
            self._best_screen = entry

    # -- views -------------------------------------------------------------------------------------
    def launched(self, stage: Stage, space: str | None = None) -> list[TrialEntry]:
        return [e for e in self.entries if e.launched and e.stage == stage and space in (None, e.space)]

    def best_screen_estimate(self) -> SteadyEstimate | None:
        """The best finished screening estimate: what a running trial must be able to reach."""
        return None if self._best_screen is None else self._best_screen.estimate

    def best_entry(self) -> TrialEntry | None:
        """The finished screening trial with the best steady objective (the first of equals)."""
        return self._best_screen

    def device_seconds(self) -> float:
        running = sum(t.charged_seconds() for t in self.live.values()) * self.world_size
        return self._finished_device_seconds + running

    def counts(self) -> Counter:
        return Counter(e.outcome for e in self.entries if e.stage == "screen")

    def spend(self) -> Spend:
        return spend(self.entries)
