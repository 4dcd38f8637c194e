"""The memory frontier: the largest micro-batch that fits, then what its memory buys back.

VLM throughput is very sensitive to the micro-batch size (the seed), and a larger micro-batch only
costs memory, which recompute, sharding and frozen parts pay for. A sampler learns that from many
trials; a performance engineer walks it directly. So, between the warm starts and the sampler, the
search walks the frontier of the incumbent (the best config run so far), changing only the memory
knobs, with every part the space lets freeze frozen (the seed: a small real gain, and memory saved):

1. From the largest micro-batch down to the incumbent's, the config that saves the most memory
   (full recompute first); the first that runs sets the frontier's micro-batch. One that runs out
   of memory sends the walk to the next smaller micro-batch; one that cannot run for another reason
   (a rule, a crash) to the next most saving config at the same micro-batch. At the incumbent's own
   micro-batch the incumbent itself is the config that fits (saving more would only cost time).
2. At that micro-batch, recompute is relaxed a level at a time — selective sets from the largest to
   the smallest, then none — trying a level's options until one beats the best above it (then the
   next level, not its siblings: on the CPU demo's counted-memory table that saved a screen, the
   median seed's spend to 98 % of the best 0.202 of the grid before, 0.192 after, the other tables
   within 0.001), for as long as relaxing pays: recompute
   the memory no longer needs only costs time ("selective beats full once the model fits"), and
   once relaxing stops paying, relaxing further rarely does. One level slower than the best above
   it is not yet evidence of that: it is one short screen against another, and a lighter level does
   less work, so what can make it slower is memory pressure, which only grows further down. So
   relaxing stops at a level where nothing runs, at the second level in a row that does not beat
   the best above it, and at a slower level once memory runs out there or on the next level (the
   slowdown was memory pressure; that next level's other options are not tried).
   On the quiet GBS-16 CPU table, full recompute and selective ``core_attn,moe`` at MBS 8 are 1 %
   apart over long runs and their 8-step screens rank them either way: stopping at the first
   slower screen left the single-module sets and ``none`` (two of the four configs within 98 % of
   the best) unscreened in 8 of 10 seeds.
   Where memory ends the relaxing, the frontier goes on: the level that ran out is tried at the
   next smaller micro-batch, and relaxed there the same way (its own best, not the larger
   micro-batch's, is what a lighter level must beat), and so on down. The trade is the seed's —
   a larger micro-batch against the recompute it costs — and either side can win: on the CPU
   demo's counted-memory table MBS 8 fits under DDP only with full recompute (650 useful tokens/s
   per rank), and the best is MBS 4 without recompute (708), which the walk never reached when it
   stopped at MBS 8.
3. Where the frontier is set (the most saving config measured at its micro-batch), the config is
   tried with each other data-parallel sharding the space offers (FSDP against DDP): the other
   trade of memory for time. Then each sharding that runs there is walked (steps 1 and 2 from it),
   the fastest there first: it holds a different amount of memory, so its frontier and the
   recompute it can do without are its own (on the CPU table, selective ``core_attn`` beat ``none``
   under FSDP2 and lost to it under DDP, where DDP was fastest). Settling the sharding first
   matters when the campaign's screens are few: on the CPU demo's counted-memory table FSDP2
   won the warm starts, and a walk that relaxed FSDP2's recompute to the end first ran out of
   patience before DDP, where the best is, in 9 seeds of 10 (when the walk's screens counted
   toward patience; now only the sampler's do, and ``max_trials`` bounds the walk).

The walk is a function of the results so far, so a campaign that resumes walks on from where it
was, and a new incumbent (found by the sampler, or by step 3) walks from where it stands: with
nothing larger that fits, only what lies below its own recompute level is new.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from itertools import groupby
from typing import Iterable, Literal, Mapping

from autotune.core.knobs import KNOBS, Config
from autotune.search.memory import FREEZE_KNOBS, MEMORY_KNOBS, recompute_saving
from autotune.space import SearchSpace

OUT_OF_MEMORY = frozenset({"oom", "oom_predicted"})
SHARDING_KNOBS = frozenset({"use_megatron_fsdp", "data_parallel_sharding_strategy", "use_torch_fsdp2"})

Step = Config | Literal["wait", "done"]
"""The next config to run; ``wait`` while a config the walk needs is still running; ``done``."""


@dataclass(frozen=True)
class Result:
    outcome: str
    value: float | None
    """The objective (a pruned trial's partial estimate); ``None`` when nothing was measured."""

    @property
    def measured(self) -> bool:
        return self.outcome in ("ok", "pruned") and self.value is not None


class MemoryFrontier:
    """The walk over one space (see the module's docstring)."""

    def __init__(self, space: SearchSpace, grid: Iterable[Config]) -> None:
        self.batch_sizes = sorted(space.choices("micro_batch_size"), reverse=True)
        frozen = {name: True for name in FREEZE_KNOBS if True in space.choices(name)}
        families: dict[tuple, list[Config]] = defaultdict(list)
        shardings: dict[tuple, list[Config]] = defaultdict(list)
        for config in grid:
            shardings[_values(config, SHARDING_KNOBS)].append(config)
            if all(config[name] == value for name, value in frozen.items()):
                families[(_values(config, MEMORY_KNOBS), config.micro_batch_size)].append(config)
        self.shardings = dict(shardings)
        """The configs by everything but their data-parallel sharding."""
        self.families = {key: _by_saving(family) for key, family in families.items()}
        """A layout's configs at one micro-batch with their parts frozen, by recompute saving, most
        first (computed once: the walk runs before every proposal)."""

    def levels(self, anchor: Config, micro_batch_size: int) -> list[list[Config]]:
        """The anchor's layout at ``micro_batch_size`` with its parts frozen, grouped by how much
        memory the recompute saves, most first."""
        return self.families.get((_values(anchor, MEMORY_KNOBS), micro_batch_size), [])

    def next(self, anchor: Config | None, results: Mapping[Config, Result], running: set[Config]) -> Step:
        if anchor is None:
            return "wait"
        step, fit = self._fitted(anchor, results, running)
        if fit is None:
            return step
        shardings = self.shardings[_values(fit, SHARDING_KNOBS)]
        for variant in shardings:
            if variant in running:
                return "wait"
            if variant not in results:
                return variant
        for variant in sorted((v for v in shardings if results[v].measured), key=lambda v: -results[v].value):
            step = (self._walk_from(anchor, fit, results, running) if variant == fit
                    else self._walk(variant, results, running))
            if step != "done":
                return step
        return "done"

    def _fitted(self, anchor: Config, results: Mapping[Config, Result], running: set[Config]) -> tuple[Step, Config | None]:
        """Step 1 from ``anchor``: the next step, and once it is done the config that set the
        frontier (``None`` while it goes on, or when nothing fits): the most saving config measured
        at the frontier's micro-batch, so every incumbent at one frontier compares the shardings
        at the same config."""
        for micro_batch_size in self.batch_sizes:
            if micro_batch_size < anchor.micro_batch_size:
                break
            levels = self.levels(anchor, micro_batch_size)
            fitted = self._fit(levels, results, running)
            if isinstance(fitted, int):
                return "done", next(c for c in levels[fitted] if c in results and results[c].measured)
            if any(anchor in level for level in levels):
                return "done", anchor  # saving more than the incumbent would only cost time
            if fitted is not None:
                return fitted, None
        return "done", None

    def _walk(self, anchor: Config, results: Mapping[Config, Result], running: set[Config]) -> Step:
        """Steps 1 and 2 from ``anchor``: the next step, or ``done``."""
        step, fit = self._fitted(anchor, results, running)
        return step if fit is None else self._walk_from(anchor, fit, results, running)

    def _walk_from(self, anchor: Config, fit: Config, results: Mapping[Config, Result], running: set[Config]) -> Step:
        """Step 2 from ``anchor`` once step 1 found the config ``fit`` that set its frontier."""
        levels = self.levels(anchor, fit.micro_batch_size)
        # from the anchor's own level where it is at the frontier's micro-batch (what lies above it
        # is not new), else from the level that set the frontier
        start = next((i for i, level in enumerate(levels) if anchor in level),
                     next(i for i, level in enumerate(levels) if fit in level))
        return self._descend(anchor, fit.micro_batch_size, levels[start:], results, running)

    def _descend(self, anchor: Config, micro_batch_size: int, levels: list[list[Config]],
                 results: Mapping[Config, Result], running: set[Config]) -> Step:
        """Step 2 from the fitted level; where memory ends it, step 2 again at the next smaller
        micro-batch from the level that ran out (the module's step 2, last paragraph)."""
        fitted = True
        while True:
            step, ran_out = self._relax(levels, results, running, fitted)
            if step != "done" or ran_out is None:
                return step
            smaller = [size for size in self.batch_sizes if size < micro_batch_size]
            if not smaller:
                return "done"
            micro_batch_size, fitted = smaller[0], False
            levels = [level for level in self.levels(anchor, micro_batch_size) if recompute_saving(level[0]) <= ran_out]

    @staticmethod
    def _fit(levels: list[list[Config]], results: Mapping[Config, Result], running: set[Config]) -> int | Step | None:
        """The level of the most saving config that runs, the step to find it, or ``None`` when
        it ran out of memory or nothing at this micro-batch can run."""
        for index, config in ((i, c) for i, level in enumerate(levels) for c in level):
            if config in running:
                return "wait"
            if config not in results:
                return config
            if results[config].measured:
                return index
            if results[config].outcome in OUT_OF_MEMORY:
                return None
        return None

    @staticmethod
    def _relax(levels: list[list[Config]], results: Mapping[Config, Result], running: set[Config],
               fitted: bool) -> tuple[Step, tuple[int, int] | None]:
        """Walk down ``levels`` until relaxing stops paying (the module's step 2): the next step and,
        once done because memory ran out, the recompute saving of the level where it did. The first
        level is the fitted one (measured: its untried options are not run) or, ``fitted`` false,
        the first to try at a smaller micro-batch."""
        best: float | None = None
        slower = 0  # levels in a row that did not beat the best above them
        for index, level in enumerate(levels):
            out_of_memory = any(c in results and results[c].outcome in OUT_OF_MEMORY for c in level)
            if slower and out_of_memory:
                return "done", recompute_saving(level[0])  # the slower level above was memory pressure
            if not (fitted and index == 0):
                untried = [config for config in level if config not in results and config not in running]
                paid = [results[c].value for c in level if c in results and results[c].measured]
                if untried and not (paid and best is not None and max(paid) > best):
                    return untried[0], None
                if any(config in running for config in level):
                    return "wait", None
            measured = [results[c].value for c in level if c in results and results[c].measured]
            if not measured:  # nothing at this level runs: lighter levels need more memory still
                return "done", recompute_saving(level[0]) if out_of_memory else None
            if best is None or max(measured) > best:
                best, slower = max(measured), 0
                continue
            slower += 1
            if slower == 2:
                return "done", None
            if out_of_memory:
                return "done", recompute_saving(level[0])
        return "done", None


def _values(config: Config, leaving_out: frozenset[str]) -> tuple:
    """The config's values of every knob but those ``leaving_out``."""
    return tuple(config[name] for name in KNOBS if name not in leaving_out)


def _by_saving(configs: list[Config]) -> list[list[Config]]:
    ordered = sorted(configs, key=recompute_saving, reverse=True)  # stable: the space's order within a level
    return [list(level) for _, level in groupby(ordered, key=recompute_saving)]
