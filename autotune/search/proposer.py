"""The Optuna study behind a campaign: proposes configs of a space, learns from every outcome.

A proposal is made in three parts (each in its own module): the :class:`~autotune.search.history.History`
of what is settled or in flight; the sources (:mod:`autotune.search.sources`), asked in order for a
config to queue in the study — warm starts, the memory-frontier walk, the untried config nearest a
repeat — before the Optuna sampler proposes; and the gates (:mod:`autotune.search.gates`) — rules,
out-of-memory dominance, the memory model — that stop a proposal before it reaches a device. A
rejected proposal is told to the study at once as infeasible (Optuna's constraints: a ``feasible``
constraint > 0 is infeasible), so the sampler learns the region to avoid at no cost; OOM, invalid
and failed runs are told the same way, with the peak memory seen. A config proposed again (settled
or in flight) is never run twice: the repeat is told to the study as failed (``repeat_of``), which
TPE leaves out of its model, so repeats neither re-weight a config already counted nor make every
later proposal slower (TPE's cost grows with the trials it models).

Every proposal, queued or sampled, is an Optuna trial: the study lives in Optuna storage (a journal
file in the run directory), so a new :class:`Proposer` on the same file resumes it and
``optuna-dashboard`` can open it.
"""

from __future__ import annotations

import logging
import warnings
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

import optuna
from optuna.trial import FrozenTrial, TrialState

from autotune.core.contract import FAILED_OUTCOMES
from autotune.core.knobs import Config, complete_config
from autotune.memory_model import MemoryModel
from autotune.rules import RuleContext
from autotune.search import SamplerName
from autotune.search.encoding import config_params, suggest_config
from autotune.search.gates import Gate, MemoryModelGate, OutOfMemoryGate, RulesGate
from autotune.search.history import REJECTED_OUTCOMES, History, Proposal, Rejection
from autotune.search.journal import CampaignJournal
from autotune.search.sources import Candidate, FrontierWalk, NearestUntried, Source, WarmStarts
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
        memory: MemoryModel | None = None,
        memory_frontier: bool = True,
        max_asks: int = 500,
    ) -> None:
        self.space, self.max_asks = space, max_asks
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
        self.grid = list(space.configs())
        self.history = History()
        self.rules = RulesGate(context)
        self.gates: list[Gate] = [self.rules, OutOfMemoryGate(space)] + ([MemoryModelGate(memory)] if memory else [])
        self.warm_starts = WarmStarts()
        self.nearest = NearestUntried(space, self.grid, seed)
        self.sources: list[Source] = [self.warm_starts, *([FrontierWalk(space, self.grid)] if memory_frontier else []),
                                      self.nearest]
        self.rejections: list[Rejection] = []
        """Rejected proposals not yet collected by :meth:`take_rejections`."""
        self._asked: dict[int, optuna.Trial] = {}
        """The study trials of the proposals in flight, to tell when they end."""
        for trial in self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
            self._remember(trial)
        # Trials a driver that died left queued or running are no result (the sources put forward
        # again what is still untried).
        with self._writes():
            for trial in self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
                self.study.tell(trial.number, state=TrialState.FAIL)
            while self.study.get_trials(deepcopy=False, states=(TrialState.WAITING,)):
                self.study.tell(self.study.ask(), state=TrialState.FAIL)

    def _writes(self) -> AbstractContextManager[None]:
        """The journal's writes of one call, written together when it returns."""
        return self.journal.batch() if self.journal is not None else nullcontext()

    # -- warm starts ---------------------------------------------------------------------------------
    def enqueue_warm_starts(self) -> None:
        """Put the space's warm starts first (those the rules accept and not yet run)."""
        for warm in self.space.warm_starts:
            if warm.config not in self.history.finished and self.rules.reason(warm.config, self.history) is None:
                self.warm_starts.add(Candidate(warm.config, "warm_start", warm.name))

    def warm_start_from(self, earlier: list[tuple[Config, str, float | None]], best: int) -> int:
        """Learn from an earlier campaign's finished trials (config, outcome, objective): put its
        ``best`` feasible configs that this space holds forward, after the space's warm starts, and
        avoid the configs that need at least the memory of one that ran out there. Returns how many
        were put forward."""
        for config, outcome, _ in earlier:
            if outcome == "oom" and config not in self.history.out_of_memory:
                self.history.out_of_memory.append(config)
        feasible = sorted(
            ((value, config) for config, outcome, value in earlier
             if outcome == "ok" and value is not None and self.space.contains(config)
             and config not in self.history.finished),
            key=lambda item: -item[0],
        )
        return sum(self.warm_starts.add(Candidate(config, "earlier_campaign")) for _, config in feasible[:best]
                   if self.rules.reason(config, self.history) is None)

    # -- proposing -----------------------------------------------------------------------------------
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
            if len(self.history.settled_or_running()) >= len(self.grid):
                return None
            candidate = self._queue_next()
            trial = self.study.ask()  # the queued candidate, else the sampler's proposal
            config = suggest_config(trial, self.space)
            if (earlier := self.history.earlier_number(config)) is not None:
                trial.set_user_attr("repeat_of", earlier)
                self.study.tell(trial, state=TrialState.FAIL)  # not a new result
                self.nearest.repeated(config)
                continue
            trial.set_user_attr("config", config.to_plain())
            proposal = Proposal(trial.number, config, *((candidate.origin, candidate.warm_start) if candidate
                                                          else ("sampler", None)))
            if (rejection := self._gate(proposal)) is not None:
                self._tell_rejected(trial, rejection)
                self.nearest.rejected(candidate)
                continue
            self.history.running[trial.number] = proposal
            self._asked[trial.number] = trial
            return proposal
        return None

    def _queue_next(self) -> Candidate | None:
        """Queue in the study the first config a source puts forward; ``None`` leaves it to the sampler."""
        for source in self.sources:
            if (candidate := source.next(self.history)) is not None:
                attrs = {"origin": candidate.origin} | ({"warm_start": candidate.warm_start} if candidate.warm_start
                                                       else {})
                self.study.enqueue_trial(config_params(candidate.config, self.space), user_attrs=attrs)
                return candidate
        return None

    def _gate(self, proposal: Proposal) -> Rejection | None:
        for gate in self.gates:
            if (reason := gate.reason(proposal.config, self.history)) is not None:
                return Rejection(proposal, gate.outcome, gate.name, reason)
        return None

    # -- learning ------------------------------------------------------------------------------------
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
        del self.history.running[proposal.number]
        trial = self._asked.pop(proposal.number)
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

    def _tell_rejected(self, trial: optuna.Trial, rejection: Rejection) -> None:
        self.history.reject(rejection.config, rejection.outcome, rejection.reason, trial.number)
        self.rejections.append(rejection)
        trial.set_user_attr("outcome", rejection.outcome)
        trial.set_user_attr("gate", rejection.gate)
        trial.set_user_attr("reason", rejection.reason)
        trial.set_constraint(CONSTRAINT, 1.0)
        trial.set_user_attr("cost_seconds", 0.0)
        self.study.tell(trial, 0.0)

    def _remember(self, trial: FrozenTrial) -> None:
        """Take in a completed study trial (at start-up, every one the journal holds)."""
        if "config" not in trial.user_attrs:
            return
        config = complete_config(trial.user_attrs["config"])
        outcome = trial.user_attrs.get("outcome", "ok")
        if outcome in REJECTED_OUTCOMES:
            self.history.reject(config, outcome, trial.user_attrs.get("reason", ""), trial.number)
            return
        self.history.finish(config, trial.number, trial.user_attrs.get("outcome"), trial.value)
        if outcome == "oom":
            self.history.out_of_memory.append(config)
        for gate in self.gates:
            gate.learn(config, outcome, trial.user_attrs.get("peak_memory_bytes"))
