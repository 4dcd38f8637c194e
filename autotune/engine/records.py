"""The campaign's records: one :class:`TrialEntry` per finished trial or rejected proposal
(``trials.jsonl``), one :class:`StepEntry` per reported step (``steps.jsonl``), and what they add
up to (:class:`Spend`).

Entries are typed and immutable: how a trial came to run (``origin``, the warm start it is, the
screen it promotes, the trial it retries) and why it ended as it did (``cause``) are fields, never
prefixes of a string. Files written before these fields existed (``source: "warm_start:bring-up"``,
``reason: "node_lost: ..."``) still read: :func:`read_trial_entries` converts their lines.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Iterable, Iterator, Literal

from pydantic import BaseModel, ConfigDict, ValidationInfo, model_validator

from autotune.core.contract import Contract, Evidence, RanksStarted, StepRecord, TimedPart
from autotune.core.knobs import Config, ConfigField, complete_config
from autotune.core.steady import SteadyEstimate
from autotune.search.history import GateName, Origin

Stage = Literal["screen", "promote"]
EntryOutcome = Literal["ok", "oom", "invalid", "pruned", "failed", "hung", "oom_predicted"]
"""A burst's outcome, or ``invalid`` / ``oom_predicted`` for a proposal rejected before launch."""
Cause = Literal["node_lost", "not_started", "watchdog", "trial_raised", "no_outcome", "budget", GateName]
"""Why an entry ended as it did, where the outcome alone does not say: the trial's node died
(``node_lost``: it runs once more), Tune ended it before it started (``not_started``: it runs once
more), the hang watchdog killed it, the trial process raised, it ended without an outcome, the
budget ran out under it; or which gate rejected a proposal (the rules, a config that ran out of
memory with no more saving, the memory model)."""
RERUN_CAUSES = frozenset({"node_lost", "not_started"})
"""Ends that say nothing about the config: the trial runs once more, and only its rerun counts."""


@dataclass(frozen=True)
class Launch:
    """How a trial came to run: what its entry will say besides how it ended."""

    stage: Stage
    space: str
    config: Config
    origin: Origin
    number: int | None = None
    """The Optuna trial number (screening only)."""
    warm_start: str | None = None
    promoted_from: str | None = None
    retry_of: str | None = None


class OutsideSteps(BaseModel):
    """Where a launched trial's device-seconds outside its training steps went, from Tune starting it
    to its end (timed by the wall clock of its node, times its devices): what warm workers are judged by."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    trial_start: float
    """Tune starting the trial to its function running (its actor, or a process kept from an earlier
    trial: then also the wait for that process's stopped burst to end, which the stopped trial,
    closed when Tune stopped it, does not show)."""
    rank_start: float
    """To the reporting rank ready: the ranks forked from a zygote or started, their process group up."""
    build: float
    """To the first step: the trainable's set-up (model, optimizer, data loader, parallel state)."""
    between_steps: float
    """Between the first step's start and the last step's report at the driver, outside the steps'
    timers: reporting to the tuner, and what a step's timer does not cover."""
    after_steps: float
    """The last step's report at the driver to the trial's end: the ranks' teardown, the result's way back."""
    build_phases: tuple[TimedPart, ...] = ()
    """``build``, part by part, as the trainable timed its set-up on the reporting rank (device-seconds
    like the rest); what they leave of ``build`` is the rank's way from ready into the trainable."""
    after_steps_parts: tuple[TimedPart, ...] = ()
    """``after_steps``, part by part, as the launcher and its rank 0 timed the burst's end (a trial
    that ran to its end, not one stopped); what they leave is the trial's end reaching the driver."""

    def split_parts(self) -> dict[str, tuple[TimedPart, ...]]:
        """The parts timed part by part, by the part they split."""
        return {"build": self.build_phases, "after steps": self.after_steps_parts}

    def parts(self) -> dict[str, float]:
        """The five parts, which add up to the trial's seconds outside its steps."""
        return {part: getattr(self, part) for part in type(self).model_fields if part not in _SPLITS_OF_PARTS}

    @classmethod
    def median(cls, splits: list[OutsideSteps]) -> OutsideSteps:
        """Each part's median over ``splits``; each named sub-part's over the splits that have it (a
        phase such as the CUDA-graph helper exists only in some configs), in the order first seen."""
        return cls(**{part: statistics.median(split.parts()[part] for split in splits) for part in splits[0].parts()},
                   **{field: _median_parts(getattr(split, field) for split in splits) for field in _SPLITS_OF_PARTS})


_SPLITS_OF_PARTS = ("build_phases", "after_steps_parts")


def _median_parts(splits: Iterable[tuple[TimedPart, ...]]) -> tuple[TimedPart, ...]:
    seconds: dict[str, list[float]] = {}
    for split in splits:
        for part in split:
            seconds.setdefault(part.name, []).append(part.seconds)
    return tuple(TimedPart(name, statistics.median(values)) for name, values in seconds.items())


def first_step_excess(step_seconds: list[float], world_size: int) -> float | None:
    """The first step's seconds beyond the median of the others, on every device of the trial
    (:attr:`TrialEntry.first_step_excess`); ``None`` with fewer than two steps."""
    if len(step_seconds) < 2:
        return None
    return round((step_seconds[0] - statistics.median(step_seconds[1:])) * world_size, 3)


class TrialEntry(BaseModel):
    """One line of ``trials.jsonl``: a launched trial as it ended, or a proposal rejected before launch."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    trial_id: str | None
    """Ray Tune's trial id; ``None`` for a proposal that never launched."""
    stage: Stage
    space: str
    number: int | None
    """The Optuna trial number (screening only)."""
    origin: Origin
    warm_start: str | None = None
    """The warm start's name (``origin: warm_start``)."""
    promoted_from: str | None = None
    """The screening trial a promotion re-runs."""
    retry_of: str | None = None
    """The trial that lost its node, which this one runs again."""
    runs: tuple[str, ...] = ()
    """A promoted config's runs in fresh processes that this entry stands for together (its
    objective and estimate are theirs over processes; its other fields are those of ``trial_id``,
    one of them). Made when a verdict is reached, never written to ``trials.jsonl``; empty for a
    single run."""
    config: ConfigField
    launched: bool
    outcome: EntryOutcome
    cause: Cause | None = None
    reason: str
    steps: int = 0
    objective: float | None = None
    """The steady estimate's mean (per device); a pruned trial's partial estimate."""
    estimate: SteadyEstimate | None = None
    model_tflops_per_s_per_gpu: float | None = None
    peak_memory_bytes: int | None = None
    wall_seconds: float = 0.0
    device_seconds: float
    """Seconds of every device the trial held (start-up included; recorded seconds for a replay)."""
    training_device_seconds: float | None = None
    """The part of ``device_seconds`` inside its training steps (their step times, on every device);
    the rest is the trial's start-up and teardown. ``None`` in runs recorded before it was kept."""
    outside_steps: OutsideSteps | None = None
    """Where the rest went, for a trial whose ranks reported a step and when they started; ``None``
    for a replay, a trial that ended before its first step, or runs recorded before it was kept."""
    first_step_excess: float | None = None
    """Device-seconds the first step took beyond the trial's median step: the warm-up a new rank
    process pays inside its steps (kernels loaded on first use, library handles and plans, the
    allocator's growth, the loader's first batch). ``None`` with fewer than two steps."""
    rank_start: RanksStarted | None = None
    """How the trial's ranks started, whatever its outcome (its contract says it only with steps):
    the burst's end says it, or, for a trial stopped before its end, its contract; ``None`` in runs
    recorded before it was kept (:attr:`ranks_started` reads their contracts)."""
    out_of_memory_parts: tuple[TimedPart, ...] = ()
    """A trial out of memory before its first step: where its burst's seconds went, part by part
    (device-seconds): the reporting rank's set-up, the part it ran out of memory in, its end, then
    the ranks' start and exit. It has no :attr:`outside_steps`: without a step, the ranks sent no
    start times."""
    benchmark_only: bool = False
    evidence: Evidence = Evidence()
    contract: Contract | None = None
    error: str | None = None
    finished_at: datetime

    @property
    def ranks_started(self) -> RanksStarted | None:
        """How its ranks started: its own word, or its contract's in runs recorded before it had one."""
        return self.rank_start or (self.contract.rank_start if self.contract is not None else None)

    @property
    def processes(self) -> int:
        """How many fresh-process runs this entry stands for (``runs``; one when it is a single run)."""
        return len(self.runs) or 1

    @property
    def screened_ok(self) -> bool:
        """A finished screen with a steady estimate: a candidate for the best and for promotion."""
        return self.launched and self.stage == "screen" and self.outcome == "ok" and self.estimate is not None

    def to_json(self) -> dict[str, Any]:
        return self.model_dump(mode="json", exclude={"contract"}) | {
            "contract": None if self.contract is None else self.contract.to_json()}

    @model_validator(mode="before")
    @classmethod
    def _from_earlier_format(cls, data: Any, info: ValidationInfo) -> Any:
        """Lines written before ``origin`` and ``cause`` existed (see :func:`read_trial_entries`)."""
        if not isinstance(data, dict) or "origin" in data or "source" not in data:
            return data
        return _converted(data, (info.context or {}).get("lost", {}))


class StepEntry(BaseModel):
    """One line of ``steps.jsonl``: a step a running trial reported."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    trial_id: str
    stage: Stage
    space: str
    objective: float
    record: StepRecord

    def to_json(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


class RankStartMedians(BaseModel):
    """Over the launched trials whose ranks started one way."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    trials: int
    outside_steps: float
    """The median trial's device-seconds outside its training steps."""
    first_step_excess: float | None
    """The median trial's first-step warm-up; ``None`` where no trial ran two steps."""
    out_of_memory_trials: int = 0
    """How many of them ran out of memory before their first step and timed where."""
    out_of_memory_parts: tuple[TimedPart, ...] = ()
    """Each part's median over those (:attr:`TrialEntry.out_of_memory_parts`): what an out of memory
    costs in such ranks, and where (a kept rank's is meant to be its build)."""


class Spend(BaseModel):
    """Device-seconds (GPU-seconds, or CPU-slot-seconds on a CPU box) per stage and per outcome."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    unit: str = "device-seconds (GPU-seconds; CPU-slot-seconds on a CPU box)"
    total: float
    by_stage: dict[str, float]
    by_outcome: dict[str, float]
    trials: dict[Stage, int]
    """Trials launched per stage."""
    rejected_before_launch: int
    outside_steps: float | None = None
    """Device-seconds of launched trials outside their training steps (process and rank start-up,
    data loader start, model build, teardown): what warm workers save. ``None`` where no trial
    recorded its training seconds."""
    median_trial_outside_steps: float | None = None
    """The median launched trial's device-seconds outside its training steps."""
    median_outside_split: OutsideSteps | None = None
    """Each part's median over the trials that recorded where their seconds outside steps went."""
    median_first_step_excess: float | None = None
    """The median launched trial's first-step warm-up (:attr:`TrialEntry.first_step_excess`)."""
    by_rank_start: dict[str, RankStartMedians] = {}
    """The same medians per way the trials' ranks started (:attr:`TrialEntry.ranks_started`), out-of-memory
    trials included. What kept ranks save shows only here: the campaign's median mixes kept screens
    with promotions, which always start new rank processes."""


def spend(entries: Iterable[TrialEntry]) -> Spend:
    by_stage: dict[str, float] = defaultdict(float)
    by_outcome: dict[str, float] = defaultdict(float)
    launched = {"screen": 0, "promote": 0}
    rejected = 0
    outside: list[float] = []
    splits: list[OutsideSteps] = []
    first_step: list[float] = []
    outside_by_start: dict[str, list[float]] = defaultdict(list)
    first_step_by_start: dict[str, list[float]] = defaultdict(list)
    out_of_memory_by_start: dict[str, list[tuple[TimedPart, ...]]] = defaultdict(list)
    for entry in entries:
        by_stage[entry.stage] += entry.device_seconds
        by_outcome[entry.outcome] += entry.device_seconds
        if entry.launched:
            launched[entry.stage] += 1
            if entry.training_device_seconds is not None:
                outside.append(max(0.0, entry.device_seconds - entry.training_device_seconds))
                if (start := entry.ranks_started) is not None:
                    outside_by_start[start].append(outside[-1])
                    if entry.first_step_excess is not None:
                        first_step_by_start[start].append(entry.first_step_excess)
                    if entry.out_of_memory_parts:
                        out_of_memory_by_start[start].append(entry.out_of_memory_parts)
            if entry.outside_steps is not None:
                splits.append(entry.outside_steps)
            if entry.first_step_excess is not None:
                first_step.append(entry.first_step_excess)
        else:
            rejected += 1
    return Spend(total=sum(by_stage.values()), by_stage=dict(by_stage), by_outcome=dict(by_outcome),
                 trials=launched, rejected_before_launch=rejected,
                 outside_steps=sum(outside) if outside else None,
                 median_trial_outside_steps=statistics.median(outside) if outside else None,
                 median_outside_split=OutsideSteps.median(splits) if splits else None,
                 median_first_step_excess=statistics.median(first_step) if first_step else None,
                 by_rank_start={start: RankStartMedians(
                     trials=len(seconds), outside_steps=statistics.median(seconds),
                     first_step_excess=statistics.median(first_step_by_start[start]) if first_step_by_start[start]
                     else None, out_of_memory_trials=len(out_of_memory_by_start[start]),
                     out_of_memory_parts=_median_parts(out_of_memory_by_start[start]))
                     for start, seconds in outside_by_start.items()})


def read_trial_entries(lines: Iterable[dict[str, Any]]) -> Iterator[TrialEntry]:
    """Entries from ``trials.jsonl``'s lines in order; lines of the earlier format are converted
    (a retry there names only its source, so the trial it retries is the last one of the same
    config that lost its node)."""
    lost: dict[tuple, str] = {}
    for line in lines:
        entry = TrialEntry.model_validate(line, context={"lost": lost})
        if entry.cause == "node_lost" and entry.trial_id is not None:
            lost[(entry.stage, entry.space, entry.config)] = entry.trial_id
        yield entry


# -- the earlier format ------------------------------------------------------------------------------

_RETRY_SUFFIX = ", again after node_lost"
_EARLIER_CAUSES = (("node_lost", "node_lost"), ("the trial process raised", "trial_raised"),
                   ("stopped when the campaign's budget ran out", "budget"),
                   ("the trial ended without reporting an outcome", "no_outcome"))
"""How the earlier format said why a launched trial ended: the start of its reason."""


def _converted(line: dict[str, Any], lost: dict[tuple, str]) -> dict[str, Any]:
    data = dict(line)
    source: str = data.pop("source")
    if source.endswith(_RETRY_SUFFIX):
        source = source.removesuffix(_RETRY_SUFFIX)
        data["retry_of"] = lost.get((data["stage"], data["space"], complete_config(data["config"])))
    kind, _, detail = source.partition(":")
    data["origin"] = {"near_repeat": "nearest", "screen": "promotion"}.get(kind, kind)
    if kind == "warm_start":
        data["warm_start"] = detail
    elif kind == "screen":
        data["promoted_from"] = detail
    reason = data.get("reason") or ""
    outcome = data["outcome"]
    if outcome == "hung":
        data["cause"] = "watchdog"
    elif not data["launched"]:
        data["cause"] = "rules" if outcome == "invalid" else \
            "oom_dominance" if reason.startswith("needs at least the memory of") else "memory_model"
    else:
        data["cause"] = next((cause for prefix, cause in _EARLIER_CAUSES if reason.startswith(prefix)), None)
    contract = data.get("contract")
    if contract and "replayed_from" in contract:
        added = ("replayed_from", "steady_window", "workers")  # what the tuner added to the recorded contract
        data["contract"] = {"trainable": "replay", "recorded": {k: v for k, v in contract.items() if k not in added},
                            **{key: contract[key] for key in added if key in contract}}
    return data
