"""Sources: who puts the next config forward. The proposer asks them in order whenever nothing is
queued in the study, and queues the first config one offers; when none offers one, the Optuna
sampler proposes. In order:

1. :class:`WarmStarts` — the space's warm starts, then an earlier campaign's best configs, each once.
2. :class:`FrontierWalk` — the memory frontier of the incumbent (:mod:`autotune.search.frontier`).
3. :class:`NearestUntried` — after the sampler proposed a config already settled or in flight (a
   repeat: TPE has converged on what it knows, and asked again with the same model it mostly
   repeats again), the untried config with the fewest knobs changed from it: the local step TPE does
   not take in a discrete space. Offered again, from the same anchor, when a gate rejects it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from autotune.core.knobs import Config, Value
from autotune.search.frontier import MemoryFrontier
from autotune.search.history import History, Origin
from autotune.space import SearchSpace


@dataclass(frozen=True)
class Candidate:
    config: Config
    origin: Origin
    warm_start: str | None = None


class Source(Protocol):
    def next(self, history: History) -> Candidate | None:
        """The config this source puts forward now, or ``None`` to let the next source speak."""
        ...


class WarmStarts:
    """Configs known before the search starts, in the order given; one already settled or in
    flight is passed over."""

    def __init__(self) -> None:
        self.pending: list[Candidate] = []

    def add(self, candidate: Candidate) -> bool:
        """Queue ``candidate`` unless it is queued already; whether it was."""
        if any(pending.config == candidate.config for pending in self.pending):
            return False
        self.pending.append(candidate)
        return True

    def next(self, history: History) -> Candidate | None:
        taken = history.settled_or_running()
        while self.pending:
            candidate = self.pending.pop(0)
            if candidate.config not in taken:
                return candidate
        return None


class FrontierWalk:
    """The next step of the incumbent's memory-frontier walk."""

    def __init__(self, space: SearchSpace, grid: list[Config]) -> None:
        self.frontier = MemoryFrontier(space, grid)

    def next(self, history: History) -> Candidate | None:
        incumbent = history.incumbent[1] if history.incumbent is not None else None
        step = self.frontier.next(incumbent, history.results, history.running_configs())
        return Candidate(step, "frontier") if isinstance(step, Config) else None


class NearestUntried:
    """The untried config nearest the sampler's last repeat (fewest tuned knobs changed; ties drawn
    with the study's seed). Distances are computed over the grid's value codes with numpy."""

    def __init__(self, space: SearchSpace, grid: list[Config], seed: int) -> None:
        self.space, self.grid = space, grid
        self.grid_index = {config: index for index, config in enumerate(grid)}
        self.value_codes: dict[str, dict[Value, int]] = {name: {} for name in space.tuned}
        self.grid_codes = np.array(
            [[self.value_codes[name].setdefault(config[name], len(self.value_codes[name])) for name in space.tuned]
             for config in grid],
            dtype=np.int32,
        ).reshape(len(grid), len(space.tuned))
        self.rng = random.Random(seed)
        self.anchor: Config | None = None
        self.wanted = False

    def repeated(self, config: Config) -> None:
        """The sampler proposed ``config`` again: step from it next."""
        self.anchor, self.wanted = config, True

    def rejected(self, candidate: Candidate | None) -> None:
        """A proposal was rejected before launch: if it was this source's, offer the next nearest."""
        if candidate is not None and candidate.origin == "nearest":
            self.wanted = True

    def next(self, history: History) -> Candidate | None:
        if not self.wanted or self.anchor is None:
            return None
        self.wanted = False
        taken = {self.grid_index.get(config) for config in history.settled_or_running()}
        untried = [index for index in range(len(self.grid)) if index not in taken]
        if not untried:
            return None
        self.rng.shuffle(untried)
        anchor = [self.value_codes[name].get(self.anchor[name], -1) for name in self.space.tuned]
        changed = (self.grid_codes[untried] != anchor).sum(axis=1)
        return Candidate(self.grid[untried[int(np.argmin(changed))]], "nearest")  # the first of the nearest, as drawn
