"""Our parts in Ray Tune's roles, one job each: Searchers that propose (the Optuna study while
screening, a fixed list while promoting), a Scheduler that decides after every step whether a
screening trial goes on, stops or is pruned, a Stopper for the campaign's budget, and Callbacks that
record every result, watch for hung trials and refresh the live view.

Tune calls all of them from its controller loop in the driver process, so they share the
:class:`~autotune.engine.ledger.Ledger` without locks. For each result Tune asks the scheduler
first and tells the callbacks after, so the scheduler decides on the steps recorded so far and the
one in hand; a trial that fails is closed by its searcher before the callbacks hear of it.
"""

from __future__ import annotations

import dataclasses
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
from autotune.engine.ledger import Ledger
from autotune.engine.placement import DomainPlanner
from autotune.engine.promotion import early_promotion, is_bring_up, promotion_nodes
from autotune.engine.records import RERUN_CAUSES, Launch, TrialEntry
from autotune.engine.trial import step_objective
from autotune.search.history import Proposal
from autotune.search.proposer import Proposer
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


OPEN_ENDED_ORIGINS = frozenset({"sampler", "nearest"})
"""The proposals patience judges: the sampler's, and the untried config nearest one it repeated.
Warm starts (the space's, an earlier campaign's) run whatever the search finds, and the
memory-frontier walk ends by its own rule (:mod:`autotune.search.frontier`)."""


class Budget:
    """A space's screening budget: ``max_trials`` and ``patience`` for the space, device-hours and
    deadline for the whole campaign."""

    def __init__(self, campaign: Campaign, ledger: Ledger, space: str) -> None:
        self.spec = campaign.spec.budget
        self.ledger, self.space = ledger, space

    def trials_left(self) -> int:
        running = [t for t in self.ledger.live.values() if t.launch.stage == "screen" and t.launch.space == self.space]
        return max(0, self.spec.max_trials - len(self._counted_screens()) - len(running))

    def _counted_screens(self) -> list[TrialEntry]:
        """The space's finished screens, in finishing order, less those that lost their node (a
        trial that lost its node is run again, and counted once)."""
        return [e for e in self.ledger.launched("screen", self.space) if e.cause not in RERUN_CAUSES]

    def plateaued(self) -> str | None:
        """Why screening of the space has stopped paying (``patience`` screens in a row of the
        sampler's found nothing faster), or ``None``. Only :data:`OPEN_ENDED_ORIGINS` count: the
        frontier walk relaxes recompute level by level, each level beating the one above it yet not
        the best, and counted, those levels spent the patience before the walk reached the best: on
        the CPU demo's counted-memory table (patience 4) one seed in 10 stopped at 0.957 of the
        best, one level short, once bring-up's screen stopped sooner and the walk began at DDP."""
        if self.spec.patience is None:
            return None
        best, since = float("-inf"), 0
        for entry in self._counted_screens():
            if entry.outcome == "ok" and entry.objective is not None and entry.objective > best:
                best, since = entry.objective, 0
            elif entry.origin in OPEN_ENDED_ORIGINS:
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


@dataclasses.dataclass(frozen=True)
class EarlyPromotion:
    """``stages.promote_early``: promotion runs' steps, and the margin a new best must clear."""

    steps: int
    margin: float


class _StageSearcher(_DriverOnly, Searcher):
    """What both stages' searchers share: each suggestion says where the trial's workers go
    (``placement``: each worker's NVLink domain, or ``None``), holding those GPUs until the trial
    completes, and for a promotion run, which node each rank must run on (``nodes``: those of the
    campaign's first promotion run on live nodes, :func:`~autotune.engine.promotion.promotion_nodes`);
    a trial that lost its node (the cluster failed, not the config) runs once more,
    and only how the retry ended counts."""

    def __init__(self, ledger: Ledger, steps: int, planner: DomainPlanner | None, workers: int) -> None:
        super().__init__()
        self.ledger, self.steps, self.planner, self.workers = ledger, steps, planner, workers
        self.running: dict[str, Launch] = {}
        self.retries: list[tuple[Launch, TrialEntry]] = []
        """Trials that lost their node: the launch that runs them again, and the lost trial's entry."""

    def _launch(self, trial_id: str, launch: Launch, steps: int | None = None) -> dict[str, Any]:
        self.running[trial_id] = launch
        self.ledger.start(trial_id, launch)
        nodes = self._promotion_nodes() if launch.stage == "promote" else None
        placement = None
        if self.planner is not None:
            self.planner.observe(ray.nodes())
            placement = self.planner.hold(trial_id, nodes) if nodes else self.planner.place(trial_id, self.workers)
        # A promotion run starts new rank processes, as the user's launch will (screens may run in kept ones).
        return {"config": launch.config.to_plain(), "steps": steps or self.steps, "placement": placement,
                "nodes": None if nodes is None else list(nodes), "new_rank_processes": launch.stage == "promote"}

    def _promotion_nodes(self) -> tuple[str, ...] | None:
        return promotion_nodes(self.ledger.entries, self.workers, _alive_nodes)

    def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False) -> None:
        if self.planner is not None:
            self.planner.release(trial_id)
        entry = self.ledger.finish(trial_id, errored=error)
        launch = self.running.pop(trial_id)
        if entry.cause in RERUN_CAUSES and launch.retry_of is None:
            self.retries.append((dataclasses.replace(launch, retry_of=trial_id), entry))
        else:
            self._ended(launch, entry)

    def _ended(self, launch: Launch, entry: TrialEntry) -> None:
        """The config's trial ended for good (a lost trial's retry included)."""


class StudySearcher(_StageSearcher):
    """Screening: each suggestion is the Optuna study's next runnable config. Proposals a gate
    rejects are told to the study and written down without reaching Ray; the study hears how each
    launched config ended (a retry's end, for a trial that lost its node). With ``early`` (the
    campaign's ``stages.promote_early``) the best screen, once a later one failed to beat it, is
    promoted before the next proposal (:func:`autotune.engine.promotion.early_promotion`)."""

    def __init__(self, proposer: Proposer, ledger: Ledger, budget: Budget, steps: int,
                 planner: DomainPlanner | None = None, workers: int = 1, early: EarlyPromotion | None = None) -> None:
        super().__init__(ledger, steps, planner, workers)
        self.proposer, self.budget, self.early = proposer, budget, early
        self.proposals: dict[int, Proposal] = {}
        self.space_exhausted = False

    def suggest(self, trial_id: str) -> dict[str, Any] | str | None:
        if self.budget.exhausted():
            return self._finish()
        if self.retries:
            return self._launch(trial_id, self.retries.pop(0)[0])
        if self.budget.trials_left() == 0 or self.space_exhausted or self.budget.plateaued() is not None:
            return self._finish()
        if self.early is not None and (promotion := self._early_promotion()) is not None:
            log.info("promoting %s now: the best screen, which a later one did not beat", promotion.config.describe())
            return self._launch(trial_id, promotion, self.early.steps)
        proposal = self.proposer.propose()
        for rejection in self.proposer.take_rejections():
            self.ledger.reject(rejection, self.proposer.space.name)
        if proposal is None:
            log.warning("the sampler proposes nothing runnable any more: screening ends")
            self.space_exhausted = True
            return self._finish()
        self.proposals[proposal.number] = proposal
        return self._launch(trial_id, Launch(stage="screen", space=self.proposer.space.name, config=proposal.config,
                                             origin=proposal.origin, number=proposal.number,
                                             warm_start=proposal.warm_start))

    def _finish(self) -> str | None:
        """Finished once no trial runs (one still running may lose its node and need a retry)."""
        if self.running:
            return None
        for launch, lost in self.retries:  # retries the budget no longer allows: the study hears the loss
            self._ended(launch, lost)
        self.retries.clear()
        return Searcher.FINISHED

    def _early_promotion(self) -> Launch | None:
        launch = early_promotion(self.ledger.entries, self.proposer.space.name, self.early.margin)
        if launch is None or any(r.stage == "promote" and r.config == launch.config for r in self.running.values()):
            return None
        return launch

    def _ended(self, launch: Launch, entry: TrialEntry) -> None:
        if launch.stage == "promote":
            return  # not the study's: it heard the config's screen
        self.proposer.complete(
            self.proposals.pop(launch.number), entry.outcome, entry.objective,
            peak_memory_bytes=entry.peak_memory_bytes, cost_seconds=entry.device_seconds, error=entry.error,
        )


class ListSearcher(_StageSearcher):
    """Promotion: hands out a fixed list of launches, then is finished."""

    def __init__(self, launches: list[Launch], ledger: Ledger, steps: int, planner: DomainPlanner | None = None,
                 workers: int = 1) -> None:
        super().__init__(ledger, steps, planner, workers)
        self.pending = list(launches)

    def suggest(self, trial_id: str) -> dict[str, Any] | str | None:
        if self.retries:
            return self._launch(trial_id, self.retries.pop(0)[0])
        if not self.pending:
            return None if self.running else Searcher.FINISHED
        return self._launch(trial_id, self.pending.pop(0))

    def _ended(self, launch: Launch, entry: TrialEntry) -> None:
        """A promotion run that did not finish ok rules its config out (the verdict reads it so):
        the config's runs still to come in other fresh processes are dropped, not spent."""
        if entry.outcome == "ok":
            return
        kept = [p for p in self.pending if (p.space, p.config) != (launch.space, launch.config)]
        if len(kept) < len(self.pending):
            log.info("promotion: %d more run(s) of %s dropped: one ended %s", len(self.pending) - len(kept),
                     launch.config.describe(), entry.outcome)
            self.pending = kept


def _alive_nodes() -> set[str]:
    """The ids of the cluster's live nodes, as Ray says now."""
    return {node["NodeID"] for node in ray.nodes() if node.get("Alive")}


PINNED_CHECK_PERIOD_S = 5.0
"""How often a stage asks Ray which nodes are alive while a pinned run waits to start."""


class PinnedRunScheduler(_DriverOnly, FIFOScheduler):
    """Runs trials first come, first served, and ends a promotion run that has not begun on nodes
    that have left the cluster (lost between the searcher's check and Ray's placement, or while the
    run waited for their slots): still pending, Ray would wait for them for ever, its placement
    group infeasible, and the stage with it; running without a step, a Ray Train worker group
    pinned to them starts again every 60 s for ever (Ray 2.60 retries a worker group's start
    timeout without limit), until the hang watchdog kills the run as ``hung``, which would rule the
    config out. The run is recorded ``failed`` with the cause ``node_lost`` and runs once more
    on the nodes then alive; one still pending is charged nothing (it never held a device).
    Promotion's own scheduler; screening's extends it (an early promotion is pinned too)."""

    def __init__(self, ledger: Ledger) -> None:
        super().__init__()
        self.ledger = ledger
        self.looked_at = 0.0

    def choose_trial_to_run(self, tune_controller) -> Trial | None:
        self._end_stranded(tune_controller)
        return super().choose_trial_to_run(tune_controller)

    def _not_begun(self, trial: Trial) -> bool:
        if trial.status == Trial.PENDING:
            return True
        live = self.ledger.live.get(trial.trial_id)
        return trial.status == Trial.RUNNING and live is not None and live.last_report is None

    def _end_stranded(self, tune_controller) -> None:
        # Tune asks at every step of its loop: the trials are looked at once a period, Ray only then
        # and only while a pinned run waits.
        if time.monotonic() - self.looked_at < PINNED_CHECK_PERIOD_S:
            return
        self.looked_at = time.monotonic()
        waiting = [trial for trial in tune_controller.get_trials()
                   if trial.config.get("nodes") and self._not_begun(trial)]
        alive = _alive_nodes() if waiting else set()
        for trial in waiting:
            if gone := [node for node in trial.config["nodes"] if node not in alive]:
                reason = f"node {', '.join(gone)} left the cluster before the run pinned to it began"
                log.warning("trial %s: %s; it runs once more", trial.trial_id, reason)
                if (live := self.ledger.live.get(trial.trial_id)) is not None:
                    live.stranded = reason
                    live.placed = trial.status != Trial.PENDING
                trial.init_local_path()  # Tune names a trial's folder when it first places it; its results need one
                tune_controller.stop_trial(trial)


class ScreeningScheduler(PinnedRunScheduler):
    """Decides after each step of a screening trial: stop once the steady interval is tight
    enough (bring-up once it shows it runs: its promotion is its measure), prune once its upper
    bound falls below the best finished trial's lower bound by the margin
    (:func:`autotune.search.screening.screen`); the trial's entry reports the decision."""

    def __init__(self, ledger: Ledger, campaign: Campaign) -> None:
        super().__init__(ledger)
        self.stages = campaign.spec.stages

    def on_trial_result(self, tune_controller, trial: Trial, result: dict) -> str:
        live = self.ledger.live.get(trial.trial_id)
        value = step_objective(result)
        if live is None or value is None or live.launch.stage == "promote":  # an early promotion runs every step
            return TrialScheduler.CONTINUE
        decision = screen(
            [*live.objective, value],  # the recording callback records this step after the decision
            best=self.ledger.best_screen_estimate(),
            min_warmup=self.stages.warmup_steps,
            target_relative_half_width=self.stages.target_relative_half_width,
            prune_margin=self.stages.prune_margin,
            baseline=is_bring_up(live.launch),
        )
        if decision.action == "continue":
            return TrialScheduler.CONTINUE
        live.decision = decision
        log.info("trial %s: %s (%s)", trial.trial_id, decision.action, decision.reason)
        return TrialScheduler.STOP


class BudgetStopper(_DriverOnly, Stopper):
    """Stops the whole screening stage once the deadline passes or the device-hours are spent;
    the trials it stops are recorded ``pruned`` by the budget."""

    def __init__(self, budget: Budget, ledger: Ledger) -> None:
        self.budget, self.ledger = budget, ledger

    def __call__(self, trial_id: str, result: dict) -> bool:
        return False  # the budget is the campaign's, never one trial's

    def stop_all(self) -> bool:
        # An early promotion runs to its end (its run is one the verdict compares); the searcher
        # starts nothing more once the budget is spent.
        if self.budget.exhausted() is None or any(t.launch.stage == "promote" for t in self.ledger.live.values()):
            return False
        self.ledger.stopped_by_budget = True
        return True


class RecordingCallback(_DriverOnly, Callback):
    """Records every result of every trial in the ledger (``steps.jsonl``), whatever the scheduler
    or stopper decided about it, and tells the ledger where Tune writes a trial's error."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger

    def on_trial_start(self, iteration: int, trials: list[Trial], trial: Trial, **info) -> None:
        if (live := self.ledger.live.get(trial.trial_id)) is not None:
            live.error_text = lambda: _read_error(trial.error_file)

    def on_trial_result(self, iteration: int, trials: list[Trial], trial: Trial, result: dict, **info) -> None:
        if trial.trial_id in self.ledger.live:
            self.ledger.record(trial.trial_id, result)


def _read_error(path: str | None) -> str | None:
    return Path(path).read_text(errors="replace") if path and Path(path).is_file() else None


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


class NotStartedGuard(_DriverOnly, Callback):
    """Tells the searcher of a trial that Tune ended before it started, which Tune itself never
    does. With actor reuse, Tune hands a finished trial's process to the next trial only once the
    finished trial's thread has ended (``TUNE_FUNCTION_THREAD_TIMEOUT_S``, which a trial sets to
    ``REUSE_WAIT_S``); if it has not, Tune marks the next trial ERROR and stops it without a word to
    the searcher (Ray 2.60, ``TuneController._on_trial_reset``), which would then wait for it
    forever. Here it is recorded ``failed`` with the cause ``not_started`` and runs once more;
    ``search_alg`` is what Tune was given (the concurrency limiter around the searcher), so the
    trial's slot comes back too."""

    def __init__(self, searcher: _StageSearcher, search_alg: Searcher) -> None:
        self.searcher, self.search_alg = searcher, search_alg

    def on_step_end(self, iteration: int, trials: list[Trial], **info) -> None:
        for trial in trials:
            live = self.searcher.ledger.live.get(trial.trial_id)
            # Tune tells the searcher of every other error before it marks the trial ERROR.
            if trial.status == Trial.ERROR and live is not None and trial.trial_id in self.searcher.running:
                live.not_started = "Tune could not hand it the process of a trial whose burst was still ending"
                log.warning("trial %s: %s; it runs once more", trial.trial_id, live.not_started)
                self.search_alg.on_trial_complete(trial.trial_id, error=True)


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
