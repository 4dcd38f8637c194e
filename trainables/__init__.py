"""Burst runners: each trains a MoE VLM for a few steps with one configuration.

Trainables know torch and Megatron, never Optuna or Ray Tune. The tuner reads what each one can
honour through :func:`trainable_support`, which imports only plain data modules (no torch).
"""

from __future__ import annotations

import importlib

from autotune.contract import TrainableSupport
from autotune.errors import AutotuneError

_SUPPORT_MODULES = {
    "native": "trainables.native.capabilities",
    "megatron": "trainables.megatron.capabilities",
}
TRAINABLES = tuple(_SUPPORT_MODULES)


def trainable_support(name: str) -> TrainableSupport:
    """What the trainable ``name`` honours; an unknown name is a clear error."""
    if name not in _SUPPORT_MODULES:
        raise AutotuneError(f"unknown trainable {name!r}; known trainables: {', '.join(_SUPPORT_MODULES)}")
    return importlib.import_module(_SUPPORT_MODULES[name]).SUPPORT
