"""Burst runners: each trains a MoE VLM for a few steps with one configuration.

Trainables know torch and Megatron, never Optuna or Ray Tune. The tuner reads what each one can
honour through :func:`trainable_support`, which imports only plain data modules (no torch).
"""

from __future__ import annotations

import functools
import importlib

from typing import TYPE_CHECKING, Callable

from autotune.contract import BurstRequest, BurstResult, Reporter, TrainableSupport
from autotune.errors import AutotuneError

if TYPE_CHECKING:
    import torch

REPLAY = "replay"
"""The replay trainable: serves a recorded table (``request.replay_table``) on no device; what it
honours is what the recorded trainable honoured."""


_SUPPORT_MODULES = {
    "native": "trainables.native.capabilities",
    "megatron": "trainables.megatron.capabilities",
}
_RANK_RUNNERS = {
    "native": "trainables.native.burst:run_rank",
    "megatron": "trainables.megatron.burst:run_rank",
    REPLAY: "trainables.replay.burst:run_replay_rank",
}
TRAINABLES = tuple(_SUPPORT_MODULES)


def trainable_support(name: str) -> TrainableSupport:
    """What the trainable ``name`` honours; an unknown name is a clear error."""
    if name not in _SUPPORT_MODULES:
        raise AutotuneError(f"unknown trainable {name!r}; known trainables: {', '.join(_SUPPORT_MODULES)}")
    return importlib.import_module(_SUPPORT_MODULES[name]).SUPPORT


def burst_runner(name: str) -> Callable[..., BurstResult]:
    """The function that runs one burst of the trainable ``name`` on this machine's devices:
    ``runner(request, reporter=None)``."""
    if name == REPLAY:
        from trainables.replay.burst import run_replay

        return run_replay
    trainable_support(name)  # an unknown name is a clear error here
    from trainables.launch import run_local

    return functools.partial(run_local, trainable=name)


def rank_runner(name: str) -> Callable[[BurstRequest, "torch.device", Reporter | None], BurstResult]:
    """The function that runs one rank of a burst of ``name`` once ``torch.distributed`` is up
    (a Ray Train worker group starts the ranks and sets the process group up)."""
    if name not in _RANK_RUNNERS:
        raise AutotuneError(f"the {name} trainable has no rank runner in this version (runners: {', '.join(_RANK_RUNNERS)})")
    return _load(_RANK_RUNNERS[name])


def _load(reference: str) -> Callable:
    module, _, function = reference.partition(":")
    return getattr(importlib.import_module(module), function)
