"""A space's configs as Optuna parameters, and back.

Every tuned knob is one categorical parameter, asked only when the knob is active, so the study's
parameters are conditional exactly as the registry says. Choices are plain values Optuna can
store: ints, bools and strings as they are, ``None`` as ``"null"``, set-valued knobs as their
text (``[attn,moe_router]``).
"""

from __future__ import annotations

from typing import Any

import optuna

from autotune.core.knobs import KNOBS, Config, Value
from autotune.space import SearchSpace


def encode(knob: str, value: Value) -> Any:
    if value is None or isinstance(value, tuple):
        return KNOBS[knob].format(value)
    return value


def suggest_config(trial: optuna.Trial, space: SearchSpace) -> Config:
    """Ask ``trial`` for every tuned knob that is active given the knobs before it."""
    resolved: dict[str, Value] = {}
    for name, knob in KNOBS.items():
        if knob.active_when is not None and not knob.active_when.test(resolved[knob.active_when.parent]):
            resolved[name] = None
        elif name in space.tuned:
            choices = space.tuned[name]
            decoded = {encode(name, value): value for value in choices}
            resolved[name] = decoded[trial.suggest_categorical(name, list(decoded))]
        else:
            resolved[name] = space.choices(name)[0]
    return Config(resolved)


def config_params(config: Config, space: SearchSpace) -> dict[str, Any]:
    """The Optuna parameters that make :func:`suggest_config` return ``config`` (for enqueueing)."""
    return {
        name: encode(name, config[name])
        for name in space.tuned
        if KNOBS[name].is_active(config)
    }
