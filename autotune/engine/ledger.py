"""The driver's account of a campaign: what each trial reported, how it ended, what it cost.

Every step result is appended to ``steps.jsonl`` as it arrives; every trial's end (and every
proposal rejected before launch) to ``trials.jsonl``. Both are only ever appended to, and a new
ledger on the same run directory reads them back, so ``autotune resume`` continues from them.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Literal

from autotune.core.knobs import Config
from autotune.core.steady import SteadyEstimate, steady_state
from autotune.engine.faults import node_lost_reason
from autotune.engine.rundir import RunDir, spend
from autotune.engine.trial import read_result
from autotune.search.proposer import Rejection
from autotune.search.screening import ScreenDecision


Stage = Literal["screen", "promote"]


@dataclass
class LiveTrial:
    trial_id: str
    stage: Stage
    space: str
    config: Config
    number: int | None
    """The Optuna trial number (screening only)."""
    source: str
    started: float = field(default_factory=time.monotonic)
    objective: list[float] = field(default_factory=list)
    model_flops: list[float] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)
    peak_memory_bytes: int = 0
    contract: dict | None = None
    evidence: dict = field(default_factory=dict)
    end: dict | None = None
    decision: ScreenDecision | None = None
    replayed_seconds: float | None = None
    """A replayed burst's recorded seconds so far: charged instead of the wall clock."""
    last_report: float | None = None
    """When its last result arrived (``time.monotonic``)."""
    hung: str | None = None
    """Why the watchdog killed it, once it has."""
    lost: str | None = None
    """``node_lost: ...`` when Tune reported its actor dead with its node."""

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
        self.entries: list[dict[str, Any]] = []
        self._finished_device_seconds = 0.0
        self._best_screen: dict[str, Any] | None = None
        """Kept as entries are added: the scheduler asks for the best at every step result."""
        for entry in run_dir.trials.read():
            self._add(entry)
        self.stopped_by_budget = False

    # -- trials as they run ------------------------------------------------------------------------
    def start(self, trial_id: str, stage: Stage, space: str, config: Config, number: int | None, source: str) -> None:
        self.live[trial_id] = LiveTrial(trial_id, stage, space, config, number, source)

    def record(self, trial_id: str, result: dict[str, Any]) -> LiveTrial:
        """Take one result of a running trial (a step or its end) and append steps to ``steps.jsonl``."""
        trial = self.live[trial_id]
        trial.last_report = time.monotonic()
        event, payload = read_result(result)
        if event == "step":
            record = payload["record"]
            trial.objective.append(result["objective"])
            trial.model_flops.append(record["model_flops"])
            trial.step_seconds.append(record["step_seconds"])
            trial.peak_memory_bytes = max(trial.peak_memory_bytes, record["peak_memory_bytes"])
            self.run_dir.steps.append(
                {"trial_id": trial_id, "stage": trial.stage, "space": trial.space, "objective": result["objective"],
                 "record": record},
                sync=False,  # synced with the trial's entry
            )
        elif event == "end":
            trial.end = payload
        trial.evidence = payload.get("evidence") or trial.evidence
        trial.contract = payload.get("contract") or trial.contract
        if payload.get("elapsed_seconds") is not None:
            trial.replayed_seconds = payload["elapsed_seconds"]
        return trial

    def finish(self, trial_id: str, *, errored: bool) -> dict[str, Any]:
        """Close a trial: its outcome, estimate and cost, appended to ``trials.jsonl``."""
        trial = self.live.pop(trial_id)
        outcome, reason = self._outcome(trial, errored)
        estimate = None
        if outcome in ("ok", "pruned"):
            estimate = (
                trial.decision.estimate
                if trial.decision is not None and trial.decision.estimate is not None
                else steady_state(trial.objective, min_warmup=self.warmup_steps, target_relative_half_width=self.target)
            )
        window = slice(estimate.warmup_steps, None) if estimate is not None else slice(0, 0)
        seconds = sum(trial.step_seconds[window])
        entry = {
            "trial_id": trial.trial_id,
            "stage": trial.stage,
            "space": trial.space,
            "number": trial.number,
            "source": trial.source,
            "config": trial.config.to_plain(),
            "launched": True,
            "outcome": outcome,
            "reason": reason,
            "steps": len(trial.objective),
            "objective": None if estimate is None else estimate.mean,
            "estimate": None if estimate is None else estimate.to_dict(),
            "model_tflops_per_s_per_gpu": sum(trial.model_flops[window]) / seconds / self.world_size / 1e12
            if seconds > 0 else None,
            "peak_memory_bytes": trial.peak_memory_bytes or None,
            "wall_seconds": time.monotonic() - trial.started,
            "device_seconds": trial.charged_seconds() * self.world_size,
            "benchmark_only": self.benchmark_only,
            "evidence": trial.evidence,
            "contract": None if trial.contract is None else trial.contract | {
                "steady_window": None if estimate is None else {
                    "first_step": estimate.warmup_steps, "steps": len(trial.objective) - estimate.warmup_steps,
                },
            },
            "error": None if trial.end is None else trial.end.get("error"),
            "finished_at": datetime.now(timezone.utc).isoformat(),
        }
        self.run_dir.steps.sync()
        self.run_dir.trials.append(entry)
        self._add(entry)
        return entry

    def _outcome(self, trial: LiveTrial, errored: bool) -> tuple[str, str]:
        if trial.hung is not None:
            return "hung", trial.hung
        lost = trial.lost or node_lost_reason(None if trial.end is None else trial.end.get("error"))
        if lost is not None:
            return "failed", lost
        if errored:
            return "failed", f"the trial process raised; its error.txt is under {self.run_dir.ray_storage}"
        if trial.decision is not None and trial.decision.action == "prune":
            return "pruned", trial.decision.reason
        if trial.decision is not None and trial.decision.action == "stop":
            return "ok", f"stopped early: {trial.decision.reason}"
        if trial.end is not None:
            error = (trial.end.get("error") or "").strip()
            return trial.end["outcome"], error.splitlines()[-1][:300] if error else "ran every step"
        if self.stopped_by_budget:
            return "pruned", "stopped when the campaign's budget ran out"
        return "failed", "the trial ended without reporting an outcome"

    def reject(self, rejection: Rejection, space: str) -> None:
        """A proposal that never reached a device (a rule, or a predicted OOM): cost zero, kept on record."""
        entry = {
            "trial_id": None,
            "stage": "screen",
            "space": space,
            "number": rejection.number,
            "source": "sampler",
            "config": rejection.config.to_plain(),
            "launched": False,
            "outcome": rejection.outcome,
            "reason": rejection.reason,
            "device_seconds": 0.0,
            "finished_at": datetime.now(timezone.utc).isoformat(),
        }
        self.run_dir.trials.append(entry)
        self._add(entry)

    def _add(self, entry: dict[str, Any]) -> None:
        self.entries.append(entry)
        self._finished_device_seconds += entry["device_seconds"]
        if (entry["launched"] and entry["stage"] == "screen" and entry["outcome"] == "ok"
                and entry.get("objective") is not None
                and (self._best_screen is None or entry["objective"] > self._best_screen["objective"])):
            self._best_screen = entry

    # -- views -------------------------------------------------------------------------------------
    def launched(self, stage: Stage, space: str | None = None) -> list[dict[str, Any]]:
        return [e for e in self.entries if e["launched"] and e["stage"] == stage and space in (None, e["space"])]

    def best_screen_estimate(self) -> SteadyEstimate | None:
        """The best finished screening estimate: what a running trial must be able to reach."""
        best = self.best_entry()
        return None if best is None else SteadyEstimate(**best["estimate"])

    def best_entry(self) -> dict[str, Any] | None:
        """The finished screening trial with the best steady objective (an objective comes with its
        estimate; the first of equals)."""
        return self._best_screen

    def device_seconds(self) -> float:
        running = sum(t.charged_seconds() for t in self.live.values()) * self.world_size
        return self._finished_device_seconds + running

    def counts(self) -> Counter:
        return Counter(e["outcome"] for e in self.entries if e["stage"] == "screen")

    def spend(self) -> dict[str, Any]:
        return spend(self.entries)
