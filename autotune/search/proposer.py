"""The Optuna study behind a campaign: proposes configs of a space, learns from every outcome.

Configs the rules reject, and configs that surely need at least the memory of one that ran out of
it, never reach a device: they are told to the study at once as infeasible (Optuna's
constraints: a ``feasible`` constraint > 0 is infeasible), so the sampler
learns the region to avoid at no cost. OOM, invalid and failed runs are told the same way, with the
peak memory seen. A config proposed again (finished, rejected or in flight) is never run twice: the
repeat is told to the study as failed (``repeat_of``), which TPE leaves out of its model, so repeats
neither re-weight a config already counted nor make every later proposal slower (TPE's cost grows
with the trials it models). A repeat means the sampler has converged on what it knows: asked again
with the same model it repeats again (95-97 % of such asks over 200 trials of ``bench/overhead.py``'s
space, 3 seeds: ``bench/proposer_alone.py``), so the untried config nearest the one it proposed
(fewest knobs changed) is queued instead, and checked like any proposal: the local step TPE does
not take in a discrete space. Before the sampler proposes, the memory frontier of the incumbent
is walked (autotune/search/frontier.py): the largest micro-batch that fits, then the recompute it
no longer needs. The study lives in Optuna storage (a journal file in the output directory), so a
new :class:`Proposer` on the same file resumes it and ``optuna-dashboard`` can open it.
"""

from __future__ import annotations

import logging
import random
import warnings
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import optuna
from optuna.trial import FrozenTrial, TrialState

from autotune.core.contract import FAILED_OUTCOMES
from autotune.core.knobs import Config, Value, complete_config
from autotune.memory_model import MemoryModel
from autotune.rules import RuleContext, violations
from autotune.search import SamplerName
from autotune.search.encoding import config_params, suggest_config
from autotune.search.frontier import MemoryFrontier, Result
from autotune.search.journal import CampaignJournal
from autotune.search.memory import needs_at_least_as_much_memory
from autotune.space import SearchSpace

log = logging.getLogger(__name__)

CONSTRAINT = "feasible"
"""The one constraint every trial sets: 0 when it ran, 1 when it could not (> 0 is infeasible)."""


def make_sampler(name: SamplerName, seed: int, startup_trials: int) -> optuna.samplers.BaseSampler:
    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    with warnings.catch_warnings():  # multivariate and group are "experimental" since Optuna 2.2
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return optuna.samplers.TPESampler(
            seed=seed,
            n_startup_trials=startup_trials,
            multivariate=True,
            group=True,  # conditional knobs form groups of their own
            constant_liar=True,  # parallel trials do not all chase the same optimum
        )


def journal_storage(path: str) -> optuna.storages.JournalStorage:
    """The study's journal file (``optuna-dashboard`` opens it), written by this process alone."""
    return optuna.storages.JournalStorage(CampaignJournal(Path(path)))


@dataclass(frozen=True)
class Rejection:
    """A proposed config that never reached a device, and why."""

    number: int
    config: Config
    outcome: str
    """``invalid`` (a rule) or ``oom_predicted`` (it needs at least the memory of an OOM)."""
    reason: str


@dataclass(frozen=True)
class Proposal:
    number: int
    """The Optuna trial number (stable across resume)."""
    config: Config
    source: str
    """``warm_start:<name>`` or ``sampler``."""


class Proposer:
    def __init__(
        self,
        space: SearchSpace,
        context: RuleContext,
        journal: Path | None,
        study_name: str,
        *,
        sampler: SamplerName = "tpe",
        seed: int = 0,
        startup_trials: int = 4,
        use_rules: bool = True,
        use_oom_feedback: bool = True,
        memory: MemoryModel | None = None,
        memory_frontier: bool = True,
        max_asks: int = 500,
    ) -> None:
        self.space, self.context, self.memory = space, context, memory
        self.use_rules, self.use_oom_feedback, self.max_asks = use_rules, use_oom_feedback, max_asks
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        self.journal = CampaignJournal(journal) if journal is not None else None
        """The study's journal file (``None``: the study lives in memory, as in tests and benchmarks)."""
        self.study = optuna.create_study(
            study_name=study_name,
            storage=optuna.storages.JournalStorage(self.journal) if self.journal is not None else None,
            sampler=make_sampler(sampler, seed, startup_trials),
            direction="maximize",
            load_if_exists=True,
        )
        self.running: dict[int, tuple[Proposal, optuna.Trial]] = {}
        self.finished: dict[Config, FrozenTrial] = {}
        self.out_of_memory: list[Config] = []
        self.rejected: dict[Config, tuple[str, str, int]] = {}
        """Configs rejected before launch: outcome, reason and the study trial that was told so."""
        self.rejections: list[Rejection] = []
        """Rejected proposals not yet collected by :meth:`take_rejections`."""
        self.grid = list(space.configs())
        self._grid_index = {config: index for index, config in enumerate(self.grid)}
        self._value_codes: dict[str, dict[Value, int]] = {name: {} for name in space.tuned}
        self._grid_codes = np.array(
            [[self._value_codes[name].setdefault(config[name], len(self._value_codes[name])) for name in space.tuned]
             for config in self.grid],
            dtype=np.int32,
        ).reshape(len(self.grid), len(space.tuned))
        """Each grid config's tuned knobs as value codes, a row per config: distances at numpy speed."""
        self._untried_rng = random.Random(seed)
        self._near: Config | None = None
        """The config the sampler last kept repeating: untried configs are queued nearest to it."""
        self.frontier = MemoryFrontier(space, self.grid) if memory_frontier else None
        self.results: dict[Config, Result] = {}
        """How each settled config ended, as the frontier walk reads it (a rejection over a run)."""
        self._incumbent: tuple[float, Config] | None = None
        """The best measured config and its objective (the first of equals)."""
        for trial in self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
            self._remember(trial)
        # Trials left running by a driver that died are lost; their configs may be proposed again.
        for trial in self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            self.study.tell(trial.number, state=TrialState.FAIL)

    def _writes(self) -> AbstractContextManager[None]:
        """The journal's writes of one call, written together when it returns."""
        return self.journal.batch() if self.journal is not None else nullcontext()

    # -- proposing ---------------------------------------------------------------------------------
    def enqueue_warm_starts(self) -> None:
        """Queue the space's warm-start configs (those the rules accept and not yet run)."""
        queued = {
            tuple(sorted(t.params.items()))
            for t in self.study.get_trials(deepcopy=False, states=(TrialState.WAITING,))
        }
        for warm in self.space.warm_starts:
            if warm.config in self.finished or (self.use_rules and violations(warm.config, self.context)):
                continue
            params = config_params(warm.config, self.space)
            if tuple(sorted(params.items())) in queued:
                continue
            self.study.enqueue_trial(params, user_attrs={"source": f"warm_start:{warm.name}"})

    def warm_start_from(self, earlier: list[tuple[Config, str, float | None]], best: int) -> int:
        """Learn from an earlier campaign's finished trials (config, outcome, objective): queue its
        ``best`` feasible configs that this space holds to be measured here first, and avoid the
        configs that need at least the memory of one that ran out there. Returns how many were queued."""
        for config, outcome, _ in earlier:
            if outcome == "oom" and config not in self.out_of_memory:
                self.out_of_memory.append(config)
        feasible = sorted(
            ((value, config) for config, outcome, value in earlier
             if outcome == "ok" and value is not None and self.space.contains(config) and config not in self.finished),
            key=lambda item: -item[0],
        )
        queued = 0
        for _, config in feasible[:best]:
            if self.use_rules and violations(config, self.context):
                continue
            self.study.enqueue_trial(config_params(config, self.space), user_attrs={"source": "earlier_campaign"},
                                     skip_if_exists=True)
            queued += 1
        return queued

    def take_rejections(self) -> list[Rejection]:
        taken, self.rejections = self.rejections, []
        return taken

    def propose(self) -> Proposal | None:
        """The next config to run, or ``None`` when every config of the space is settled or in
        flight, or the sampler keeps proposing nothing runnable."""
        with self._writes():
            return self._next_proposal()

    def _next_proposal(self) -> Proposal | None:
        for _ in range(self.max_asks):
            if len(self._settled_or_running()) >= len(self.grid):
                return None
            if self.frontier is not None:
                self._queue_frontier_step()
            trial = self.study.ask()
            config = suggest_config(trial, self.space)
            if (earlier := self._earlier_number(config)) is not None:
                trial.set_user_attr("repeat_of", earlier)
                self.study.tell(trial, state=TrialState.FAIL)  # not a new result
                self._near = config
                self._queue_untried_near(config)
                continue
            trial.set_user_attr("config", config.to_plain())
            source = trial.user_attrs.get("source", "sampler")
            if (rejection := self._rejection(config)) is not None:
                self._infeasible(trial, config, *rejection)
                if source == "near_repeat" and self._near is not None:
                    self._queue_untried_near(self._near)  # the next nearest, without asking the sampler first
                continue
            proposal = Proposal(number=trial.number, config=config, source=source)
            self.running[trial.number] = (proposal, trial)
            return proposal
        return None

    def _queue_frontier_step(self) -> None:
        """Queue the frontier walk's next config, once the queue (warm starts, earlier steps) is empty."""
        if self.study.get_trials(deepcopy=False, states=(TrialState.WAITING,)):
            return
        incumbent = self._incumbent[1] if self._incumbent is not None else None
        step = self.frontier.next(incumbent, self.results, {p.config for p, _ in self.running.values()})
        if isinstance(step, Config):
            self.study.enqueue_trial(config_params(step, self.space), user_attrs={"source": "frontier"})

    def _settled_or_running(self) -> set[Config]:
        return {*self.finished, *self.rejected, *(p.config for p, _ in self.running.values())}

    def _earlier_number(self, config: Config) -> int | None:
        """The study trial that already holds ``config`` (finished, rejected or running), if any."""
        if config in self.finished:
            return self.finished[config].number
        if config in self.rejected:
            return self.rejected[config][2]
        return next((number for number, (p, _) in self.running.items() if p.config == config), None)

    def _queue_untried_near(self, anchor: Config) -> None:
        """Queue the untried config with the fewest knobs changed from ``anchor`` (ties drawn with
        the study's seed)."""
        taken = {self._grid_index.get(config) for config in self._settled_or_running()}
        untried = [index for index in range(len(self.grid)) if index not in taken]
        if not untried:
            return
        self._untried_rng.shuffle(untried)
        changed = (self._grid_codes[untried] != self._codes(anchor)).sum(axis=1)
        nearest = self.grid[untried[int(np.argmin(changed))]]  # the first of the nearest, as drawn
        self.study.enqueue_trial(config_params(nearest, self.space), user_attrs={"source": "near_repeat"})

    def _codes(self, config: Config) -> list[int]:
        """``config``'s tuned knobs as the grid's value codes (-1: a value no grid config has)."""
        return [self._value_codes[name].get(config[name], -1) for name in self.space.tuned]

    def _rejection(self, config: Config) -> tuple[str, str] | None:
        """Why ``config`` must not reach a device (outcome, reason), or ``None``."""
        if self.use_rules and (found := violations(config, self.context)):
            return "invalid", "; ".join(f"[{v.rule}] {v.reason}" for v in found)
        if self.use_oom_feedback and (oom := self._dominated_oom(config)) is not None:
            return "oom_predicted", f"needs at least the memory of {self.space.describe(oom)}, which ran out"
        if self.use_oom_feedback and self.memory is not None and (why := self.memory.rejection(config)):
            return "oom_predicted", why
        return None

    # -- learning ---------------------------------------------------------------------------------
    def complete(
        self,
        proposal: Proposal,
        outcome: str,
        value: float | None,
        *,
        peak_memory_bytes: int | None = None,
        cost_seconds: float = 0.0,
        error: str | None = None,
    ) -> None:
        """Tell the study how ``proposal`` ended. ``value`` is the objective (a pruned trial's
        partial estimate); infeasible outcomes are told with value 0 and a violated constraint."""
        _, trial = self.running.pop(proposal.number)
        infeasible = outcome in FAILED_OUTCOMES
        with self._writes():
            trial.set_user_attr("outcome", outcome)
            trial.set_user_attr("cost_seconds", cost_seconds)
            trial.set_user_attr("peak_memory_bytes", peak_memory_bytes)
            trial.set_constraint(CONSTRAINT, 1.0 if infeasible else 0.0)
            if error:
                trial.set_user_attr("error", error[-2000:])
            frozen = self.study.tell(trial, 0.0 if infeasible or value is None else value)
        self._remember(frozen)

    def _infeasible(self, trial: optuna.Trial, config: Config, outcome: str, reason: str) -> None:
        self.rejected[config] = (outcome, reason, trial.number)
        self.results[config] = Result(outcome, None)
        self.rejections.append(Rejection(trial.number, config, outcome, reason))
        trial.set_user_attr("outcome", outcome)
        trial.set_user_attr("reason", reason)
        trial.set_constraint(CONSTRAINT, 1.0)
        trial.set_user_attr("cost_seconds", 0.0)
        self.study.tell(trial, 0.0)

    def _remember(self, trial: FrozenTrial) -> None:
        if "config" not in trial.user_attrs:
            return
        config = complete_config(trial.user_attrs["config"])
        outcome = trial.user_attrs.get("outcome", "ok")
        if outcome in ("invalid", "oom_predicted"):
            if config not in self.rejected:
                self.rejected[config] = (outcome, trial.user_attrs.get("reason", ""), trial.number)
                self.results[config] = Result(outcome, None)
            return
        if config not in self.finished:
            self.finished[config] = trial
            if config not in self.rejected:
                self.results[config] = Result(outcome, trial.value)
            if trial.user_attrs.get("outcome") == "ok" and trial.value is not None and (
                    self._incumbent is None or trial.value > self._incumbent[0]):
                self._incumbent = (trial.value, config)
        if outcome == "oom":
            self.out_of_memory.append(config)
        elif self.memory is not None and trial.user_attrs.get("peak_memory_bytes"):
            self.memory.observe(config, trial.user_attrs["peak_memory_bytes"])

    def _dominated_oom(self, config: Config) -> Config | None:
        return next((oom for oom in self.out_of_memory if needs_at_least_as_much_memory(config, oom)), None)
