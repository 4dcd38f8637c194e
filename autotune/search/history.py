"""What the search has learnt so far: every proposal settled (run, or rejected before launch) or in
flight, the configs that ran out of memory, and the incumbent. Gates and sources read it; only the
proposer writes it, as trials are proposed and told."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from autotune.core.knobs import Config
from autotune.search.frontier import Result

Origin = Literal["warm_start", "earlier_campaign", "frontier", "sampler", "nearest", "promotion"]
"""Who put a config forward: a warm start of the space, an earlier campaign's best, the
memory-frontier walk, the Optuna sampler, the untried config nearest a repeated proposal
(:mod:`autotune.search.sources`), or — for the engine's promotion stage — a screen."""

GateName = Literal["rules", "oom_dominance", "memory_model"]
"""Which gate rejected a proposal before launch (:mod:`autotune.search.gates`)."""

REJECTED_OUTCOMES = frozenset({"invalid", "oom_predicted"})
"""Outcomes told to the study for proposals that never launched."""


@dataclass(frozen=True)
class Proposal:
    number: int
    """The Optuna trial number (stable across resume)."""
    config: Config
    origin: Origin
    warm_start: str | None = None
    """The warm start's name (``origin: warm_start``)."""


@dataclass(frozen=True)
class Rejection:
    """A proposed config that never reached a device, and why."""

    proposal: Proposal
    outcome: Literal["invalid", "oom_predicted"]
    """``invalid`` (a rule) or ``oom_predicted`` (it would run out of memory)."""
    gate: GateName
    reason: str

    @property
    def config(self) -> Config:
        return self.proposal.config


@dataclass
class History:
    finished: dict[Config, int] = field(default_factory=dict)
    """Configs that ran, with the study trial that ran them."""
    rejected: dict[Config, tuple[str, str, int]] = field(default_factory=dict)
    """Configs rejected before launch: outcome, reason and the study trial that was told so."""
    running: dict[int, Proposal] = field(default_factory=dict)
    results: dict[Config, Result] = field(default_factory=dict)
    """How each settled config ended, as the frontier walk reads it (a rejection over a run)."""
    out_of_memory: list[Config] = field(default_factory=list)
    """Configs that ran out of memory, here or in an earlier campaign warm-started from."""
    incumbent: tuple[float, Config] | None = None
    """The best measured config and its objective (the first of equals)."""

    def running_configs(self) -> set[Config]:
        return {proposal.config for proposal in self.running.values()}

    def settled_or_running(self) -> set[Config]:
        return {*self.finished, *self.rejected, *self.running_configs()}

    def earlier_number(self, config: Config) -> int | None:
        """The study trial that already holds ``config`` (finished, rejected or running), if any."""
        if config in self.finished:
            return self.finished[config]
        if config in self.rejected:
            return self.rejected[config][2]
        return next((number for number, proposal in self.running.items() if proposal.config == config), None)

    def reject(self, config: Config, outcome: str, reason: str, number: int) -> None:
        if config not in self.rejected:
            self.rejected[config] = (outcome, reason, number)
            self.results[config] = Result(outcome, None)

    def finish(self, config: Config, number: int, outcome: str, value: float | None) -> None:
        if config in self.finished:
            return
        self.finished[config] = number
        if config not in self.rejected:
            self.results[config] = Result(outcome, value)
        if outcome == "ok" and value is not None and (self.incumbent is None or value > self.incumbent[0]):
            self.incumbent = (value, config)
