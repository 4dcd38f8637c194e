"""The trainables by name: what each honours and how to run it.

Each is found by its import path, so the tuner imports a trainable's modules only to run it, and
reads what it honours from a plain-data module (no torch, no Megatron). The replay trainable serves a
recorded table (``request.replay_table``) on no device; what it honours is what the recorded
trainable honoured, so it declares nothing here.
"""

from __future__ import annotations

import functools
import importlib
import os
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable

from autotune.core.contract import BurstRequest, BurstResult, RankStartup, Reporter, StepReport, TrainableSupport
from autotune.core.errors import AutotuneError

if TYPE_CHECKING:
    import subprocess

    import torch

REPLAY = "replay"


@dataclass(frozen=True)
class TrainableEntry:
    support: str | None
    """``module:attribute`` of its :class:`TrainableSupport` (``None``: the replay trainable)."""
    rank_runner: str
    """``module:function`` that runs one rank of a burst once ``torch.distributed`` is up."""


TRAINABLES: dict[str, TrainableEntry] = {
    "native": TrainableEntry("trainables.native.capabilities:SUPPORT", "trainables.native.burst:run_rank"),
    "megatron": TrainableEntry("trainables.megatron.capabilities:SUPPORT", "trainables.megatron.burst:run_rank"),
    "bridge": TrainableEntry("trainables.bridge.capabilities:SUPPORT", "trainables.bridge.burst:run_rank"),
    REPLAY: TrainableEntry(None, "trainables.replay.burst:run_replay_rank"),
}


def trainable_support(name: str) -> TrainableSupport:
    """What the trainable ``name`` honours; an unknown name is a clear error."""
    entry = TRAINABLES.get(name)
    if entry is None or entry.support is None:
        known = ", ".join(n for n, e in TRAINABLES.items() if e.support is not None)
        raise AutotuneError(f"unknown trainable {name!r}; known trainables: {known}")
    return _load(entry.support)


def burst_runner(name: str, warm_ranks: str | None = None) -> Callable[[BurstRequest, Reporter | None], BurstResult]:
    """The function that runs one burst of the trainable ``name`` on this machine's devices:
    ``runner(request, reporter=None)``. Rank processes fork from the zygote listening at
    ``warm_ranks`` where one does (see :mod:`trainables.zygote`)."""
    if name == REPLAY:
        return _load("trainables.replay.burst:run_replay")
    trainable_support(name)  # an unknown name is a clear error here
    return functools.partial(_load("trainables.launch:run_local"), trainable=name, warm_ranks=warm_ranks)


def rank_runner(name: str) -> Callable[[BurstRequest, "torch.device", Reporter | None], BurstResult]:
    """The function that runs one rank of a burst of ``name`` once ``torch.distributed`` is up
    (the local launcher or a Ray Train worker group starts the ranks and sets the process group up).

    A rank whose process lacks the environment planned for it (``request.environment``: the
    fabric settings its contract records) fails with what it lacks instead of training: those
    settings are read once, when CUDA and the communication libraries start, so a rank without
    them would measure another configuration than the one recorded.

    The reporting rank's first report carries when it was ready and began that step
    (:class:`RankStartup`): the tuner splits a trial's start-up by them."""
    if name not in TRAINABLES:
        raise AutotuneError(f"unknown trainable {name!r}; known trainables: {', '.join(TRAINABLES)}")
    runner = _load(TRAINABLES[name].rank_runner)

    def run_rank(request: BurstRequest, device: "torch.device", reporter: Reporter | None) -> BurstResult:
        lacking = {key: value for key, value in request.environment.items() if os.environ.get(key) != value}
        if lacking:
            seen = ", ".join(f"{key}={os.environ.get(key)!r}" for key in lacking)
            return BurstResult(outcome="failed", error=f"this rank started without the environment planned for it: "
                                                       f"{lacking} (it has {seen})")
        return runner(request, device, reporter if reporter is None else _StartupReporter(reporter))

    return run_rank


class _StartupReporter:
    """Passes reports on, the first with when this rank was ready and when it began its first step
    (as the trainable's step loop timed it)."""

    def __init__(self, reporter: Reporter) -> None:
        self.reporter = reporter
        self.ready_at: float | None = time.time()

    def __call__(self, report: StepReport) -> bool:
        if self.ready_at is not None and report.began_at is not None:
            report = replace(report, startup=RankStartup(self.ready_at, report.began_at))
        self.ready_at = None
        return self.reporter(report)


def start_rank_zygote(address: str, trainable: str) -> "subprocess.Popen":
    """Start a process that holds torch's, the trainables' and ``trainable``'s stack's imports and
    forks burst ranks on request, listening at ``address``; it ends with the calling process
    (``trainables.zygote``)."""
    imports = trainable_support(trainable).rank_imports if trainable != REPLAY else ()
    return _load("trainables.zygote:start")(address, where_installed=imports)


def _load(reference: str):
    module, _, attribute = reference.partition(":")
    return getattr(importlib.import_module(module), attribute)
