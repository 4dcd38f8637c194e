"""Our parts in Ray Tune's roles: a Searcher that asks the Optuna study, a Scheduler that screens
each step, a Stopper for the campaign budget, and a Callback that keeps the live view.

Tune calls all of them from its controller loop in the driver process, so they share the
:class:`~autotune.engine.ledger.Ledger` without locks.
"""

from __future__ import annotations

import logging
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

import ray
from ray.tune import Callback, Stopper
from ray.tune.experiment import Trial
from ray.tune.schedulers import FIFOScheduler, TrialScheduler
from ray.tune.search import Searcher

from autotune.campaign import Campaign
from autotune.core.knobs import Config
from autotune.engine.faults import NODE_LOST, node_lost_reason
from autotune.engine.ledger import Ledger
from autotune.engine.placement import DomainPlanner
from autotune.search.proposer import Proposal, Proposer
from autotune.search.screening import screen

log = logging.getLogger(__name__)


class _DriverOnly:
    """Tune pickles its searcher, scheduler, stopper and callbacks into its experiment folder for
    ``Tuner.restore``, and asks searchers to save their state. A campaign resumes from its run
    directory instead (the study journal and trials.jsonl), and these objects hold the driver's
    live state (study, ledger, console), so what Tune keeps is only which role it was."""

    def __getstate__(self) -> dict:
        return {}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)

    def save(self, checkpoint_path: str) -> None:
        """Nothing to save: the study journal already holds the searcher's state."""

    def restore(self, checkpoint_path: str) -> None:
        """Nothing to restore: ``autotune resume`` reopens the study journal."""


class Budget:
    """A space's screening budget: ``max_trials`` and ``patience`` for the space, device-hours and
    deadline for the whole campaign."""

    def __init__(self, campaign: Campaign, ledger: Ledger, space: str) -> None:
        self.spec = campaign.spec.budget
        self.ledger, self.space = ledger, space

    def trials_left(self) -> int:
        running = [t for t in self.ledger.live.values() if t.stage == "screen" and t.space == self.space]
        return max(0, self.spec.max_trials - len(self._counted_screens()) - len(running))

    def _counted_screens(self) -> list[dict[str, Any]]:
        """The space's finished screens, in finishing order, less those that lost their node (a
        trial that lost its node is run again, and counted once)."""
        return [e for e in self.ledger.launched("screen", self.space) if not e["reason"].startswith(NODE_LOST)]

    def plateaued(self) -> str | None:
        """Why screening of the space has stopped paying (``patience`` screens in a row found
        nothing faster), or ``None``."""
        if self.spec.patience is None:
            return None
        best, since = float("-inf"), 0
        for entry in self._counted_screens():
            if entry["outcome"] == "ok" and entry.get("objective") is not None and entry["objective"] > best:
                best, since = entry["objective"], 0
            else:
                since += 1
        if since < self.spec.patience:
            return None
        return f"{since} screens in a row found nothing faster than the best (patience {self.spec.patience})"

    def exhausted(self) -> str | None:
        """Why no more screening may start (or run), or ``None``."""
        if self.spec.deadline is not None and datetime.now(timezone.utc) >= self.spec.deadline:
            return f"the deadline {self.spec.deadline.isoformat()} passed"
        if self.spec.gpu_hours is not None and self.ledger.device_seconds() >= self.spec.gpu_hours * 3600:
            return f"{self.spec.gpu_hours} device-hours are spent"
        return None

    def describe(self) -> str:
        parts = [f"{self.trials_left()} trials"]
        if self.spec.gpu_hours is not None:
            parts.append(f"{max(0.0, self.spec.gpu_hours - self.ledger.device_seconds() / 3600):.2f} device-h")
        if self.spec.deadline is not None:
            left = (self.spec.deadline - datetime.now(timezone.utc)).total_seconds()
            parts.append(f"{max(0, left) / 60:.0f} min")
        return " · ".join(parts)


class _PlacingSearcher(_DriverOnly, Searcher):
    """A searcher whose suggestions say where the trial's workers go (``placement``: each
    worker's NVLink domain, or ``None``), holding those GPUs until the trial completes."""

    def __init__(self, steps: int, planner: DomainPlanner | None, workers: int) -> None:
        super().__init__()
        self.steps, self.planner, self.workers = steps, planner, workers

    def _params(self, trial_id: str, config: Config) -> dict[str, Any]:
        placement = None
        if self.planner is not None:
            self.planner.observe(ray.nodes())
            placement = self.planner.place(trial_id, self.workers)
        return {"config": config.to_plain(), "steps": self.steps, "placement": placement}

    def _release(self, trial_id: str) -> None:
        if self.planner is not None:
            self.planner.release(trial_id)


class StudySearcher(_PlacingSearcher):
    """Screening: each suggestion is the Optuna study's next runnable config. Proposals the rules
    or the OOM record reject are told to the study and written down without reaching Ray. A trial
    that lost its node runs once more and counts once against the budget (the cluster failed, not
    the config); the study hears only how the retry ended."""

    def __init__(self, proposer: Proposer, ledger: Ledger, budget: Budget, steps: int,
                 planner: DomainPlanner | None = None, workers: int = 1) -> None:
        super().__init__(steps, planner, workers)
        self.proposer, self.ledger, self.budget = proposer, ledger, budget
        self.proposals: dict[str, Proposal] = {}
        self.retries: list[tuple[Proposal, dict[str, Any]]] = []
        """Proposals whose trial lost its node, with that trial's entry, waiting to run again."""
        self.retried: set[int] = set()
        self.space_exhausted = False

    def suggest(self, trial_id: str) -> dict[str, Any] | str | None:
        if self.budget.exhausted():
            return self._finish()
        if self.retries:
            proposal, _ = self.retries.pop(0)
            return self._launch(trial_id, proposal, f"{proposal.source}, again after node_lost")
        if self.budget.trials_left() == 0 or self.space_exhausted:
            return self._finish()
        if self.budget.plateaued() is not None:
            return self._finish()
        proposal = self.proposer.propose()
        for rejection in self.proposer.take_rejections():
            self.ledger.reject(rejection, self.proposer.space.name)
        if proposal is None:
            log.warning("the sampler proposes nothing runnable any more: screening ends")
            self.space_exhausted = True
            return self._finish()
        return self._launch(trial_id, proposal, proposal.source)

    def _launch(self, trial_id: str, proposal: Proposal, source: str) -> dict[str, Any]:
        self.proposals[trial_id] = proposal
        self.ledger.start(trial_id, "screen", self.proposer.space.name, proposal.config, proposal.number, source)
        return self._params(trial_id, proposal.config)

    def _finish(self) -> str | None:
        """Finished once no trial runs (one still running may lose its node and need a retry)."""
        if self.proposals:
            return None
        for proposal, entry in self.retries:  # retries the budget no longer allows
            self._tell(proposal, entry)
        self.retries.clear()
        return Searcher.FINISHED

    def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False) -> None:
        self._release(trial_id)
        entry = self.ledger.finish(trial_id, errored=error)
        proposal = self.proposals.pop(trial_id)
        if entry["reason"].startswith(NODE_LOST) and proposal.number not in self.retried:
            self.retried.add(proposal.number)
            self.retries.append((proposal, entry))
            return
        self._tell(proposal, entry)

    def _tell(self, proposal: Proposal, entry: dict[str, Any]) -> None:
        self.proposer.complete(
            proposal, entry["outcome"], entry["objective"],
            peak_memory_bytes=entry["peak_memory_bytes"], cost_seconds=entry["device_seconds"], error=entry["error"],
        )


class ListSearcher(_PlacingSearcher):
    """Promotion: hands out a fixed list of configs, then is finished; a config whose trial lost
    its node runs once more."""

    def __init__(self, configs: list[tuple[Config, str]], ledger: Ledger, space: str, steps: int,
                 planner: DomainPlanner | None = None, workers: int = 1) -> None:
        super().__init__(steps, planner, workers)
        self.pending, self.ledger, self.space = list(configs), ledger, space
        self.running: dict[str, tuple[Config, str]] = {}
        self.retried: set[Config] = set()

    def suggest(self, trial_id: str) -> dict[str, Any] | str | None:
        if not self.pending:
            return None if self.running else Searcher.FINISHED
        config, source = self.running[trial_id] = self.pending.pop(0)
        self.ledger.start(trial_id, "promote", self.space, config, None, source)
        return self._params(trial_id, config)

    def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False) -> None:
        self._release(trial_id)
        entry = self.ledger.finish(trial_id, errored=error)
        config, source = self.running.pop(trial_id)
        if entry["reason"].startswith(NODE_LOST) and config not in self.retried:
            self.retried.add(config)
            self.pending.insert(0, (config, f"{source}, again after node_lost"))


class ScreeningScheduler(_DriverOnly, FIFOScheduler):
    """Reads every step result into the ledger and, when screening, decides after each step:
    stop once the steady interval is tight enough, prune once its upper bound falls below the
    best finished trial's lower bound by the margin (see :func:`autotune.search.screening.screen`)."""

    def __init__(self, ledger: Ledger, campaign: Campaign, screening: bool) -> None:
        super().__init__()
        self.ledger, self.screening = ledger, screening
        self.stages = campaign.spec.stages

    def on_trial_error(self, tune_controller, trial: Trial) -> None:
        """Tune lost the trial's actor: note whether its node died with it (Tune tells the
        searcher next, which closes the trial in the ledger). Tune has just written the error's
        text to the trial's ``error.txt``."""
        live = self.ledger.live.get(trial.trial_id)
        if live is not None and trial.error_file and Path(trial.error_file).is_file():
            live.lost = node_lost_reason(Path(trial.error_file).read_text(errors="replace"))

    def on_trial_result(self, tune_controller, trial: Trial, result: dict) -> str:
        live = self.ledger.record(trial.trial_id, result)
        if not self.screening or result.get("event") != "step":
            return TrialScheduler.CONTINUE
        decision = screen(
            live.objective,
            best=self.ledger.best_screen_estimate(),
            min_warmup=self.stages.warmup_steps,
            target_relative_half_width=self.stages.target_relative_half_width,
            prune_margin=self.stages.prune_margin,
        )
        if decision.action == "continue":
            return TrialScheduler.CONTINUE
        live.decision = decision
        log.info("trial %s: %s (%s)", trial.trial_id, decision.action, decision.reason)
        return TrialScheduler.STOP


class BudgetStopper(_DriverOnly, Stopper):
    """Stops the whole screening stage once the deadline passes or the device-hours are spent."""

    def __init__(self, budget: Budget, ledger: Ledger) -> None:
        self.budget, self.ledger = budget, ledger

    def __call__(self, trial_id: str, result: dict) -> bool:
        return False

    def stop_all(self) -> bool:
        if self.budget.exhausted() is None:
            return False
        self.ledger.stopped_by_budget = True
        return True


WATCHDOG_PERIOD_S = 1.0
"""How often the hang watchdog looks at the running trials (hang timeouts are minutes)."""


class HangWatchdog(_DriverOnly, Callback):
    """Kills a running trial that has reported nothing for ``timeout_s`` (a collective stuck on a
    lost peer, a wedged data loader): its actor goes, and with it the ranks it started (they die
    with their parent) or the Ray Train worker group it owns, so its slots come back. The ledger
    records it ``hung``. Tune calls this after every step of its loop, many times a second, with
    every trial of the stage: it looks at most once every ``WATCHDOG_PERIOD_S``."""

    def __init__(self, ledger: Ledger, timeout_s: float) -> None:
        self.ledger, self.timeout_s = ledger, timeout_s
        self.running_since: dict[str, float] = {}
        self.looked_at = 0.0

    def on_step_end(self, iteration: int, trials: list[Trial], **info) -> None:
        now = time.monotonic()
        if now - self.looked_at < WATCHDOG_PERIOD_S:
            return
        self.looked_at = now
        for trial in trials:
            live = self.ledger.live.get(trial.trial_id)
            if trial.status != Trial.RUNNING or live is None or live.hung is not None:
                continue
            quiet_since = live.last_report or self.running_since.setdefault(trial.trial_id, now)
            if now - quiet_since > self.timeout_s and trial.temporary_state.ray_actor is not None:
                live.hung = f"no step for {self.timeout_s:g} s: killed by the campaign's watchdog"
                log.warning("trial %s: %s", trial.trial_id, live.hung)
                ray.kill(trial.temporary_state.ray_actor, no_restart=True)

    def on_trial_complete(self, iteration: int, trials: list[Trial], trial: Trial, **info) -> None:
        self.running_since.pop(trial.trial_id, None)

    def on_trial_error(self, iteration: int, trials: list[Trial], trial: Trial, **info) -> None:
        self.running_since.pop(trial.trial_id, None)


class ViewCallback(_DriverOnly, Callback):
    """Refreshes the live view whenever a trial starts, reports or ends."""

    def __init__(self, refresh: Callable[[], None]) -> None:
        self.refresh = refresh

    def on_trial_start(self, iteration: int, trials: list[Trial], trial: Trial, **info) -> None:
        self.refresh()

    def on_trial_result(self, iteration: int, trials: list[Trial], trial: Trial, result: dict, **info) -> None:
        self.refresh()

    def on_trial_complete(self, iteration: int, trials: list[Trial], trial: Trial, **info) -> None:
        self.refresh()

    def on_trial_error(self, iteration: int, trials: list[Trial], trial: Trial, **info) -> None:
        self.refresh()
