"""A config as the user pastes it: Megatron-Bridge Hydra overrides, Megatron-LM flags, YAML, JSON.

Names follow the target megatron-core version (``cuda_graph_scope`` is ``cuda_graph_modules`` from
0.19). Every format reads back to the same :class:`~autotune.core.knobs.Config` (the tests hold it so).
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any, Literal

import yaml

from autotune.core.errors import InputFileError, KnobError
from autotune.core.knobs import KNOBS, Config, complete_config
from autotune.yaml_io import load_yaml_mapping

Format = Literal["bridge", "megatron-lm", "yaml", "json"]
FORMATS: tuple[Format, ...] = ("bridge", "megatron-lm", "yaml", "json")


def bridge_overrides(config: Config, megatron_core_version: str | None) -> list[str]:
    """One Hydra override per active knob, e.g. ``model.recompute_granularity=selective``."""
    return [KNOBS[name].bridge_override(value, megatron_core_version) for name, value in config.explicit().items()]


def megatron_lm_args(config: Config, megatron_core_version: str | None) -> list[str]:
    """Megatron-LM flags for the knobs that differ from its defaults."""
    return [
        arg
        for name, value in config.explicit().items()
        if KNOBS[name].megatron_lm_flag is not None
        for arg in KNOBS[name].megatron_lm_args(value, megatron_core_version)
    ]


def document(config: Config, megatron_core_version: str | None, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The YAML/JSON form: canonical knob names, the target version, and whatever else is attached
    (the winner's measurement contract and steady estimate)."""
    return {"config": config.to_plain(), "megatron_core": megatron_core_version, **(extra or {})}


def render(config: Config, fmt: Format, megatron_core_version: str | None, extra: dict[str, Any] | None = None) -> str:
    """``config`` in ``fmt``; the flag formats also carry the workload's global batch when ``extra``
    holds one (a tuned MBS holds only under the global batch it was measured at)."""
    global_batch = ((extra or {}).get("workload") or {}).get("global_batch_size")
    if fmt == "bridge":
        overrides = bridge_overrides(config, megatron_core_version)
        overrides += [] if global_batch is None else [f"train.global_batch_size={global_batch}"]
        return " ".join(shlex.quote(o) for o in overrides)
    if fmt == "megatron-lm":
        args = megatron_lm_args(config, megatron_core_version)
        args += [] if global_batch is None else ["--global-batch-size", str(global_batch)]
        return " ".join(shlex.quote(a) for a in args)
    if fmt == "yaml":
        return yaml.safe_dump(document(config, megatron_core_version, extra), sort_keys=False)
    return json.dumps(document(config, megatron_core_version, extra), indent=2)


def load_document(path: Path) -> tuple[Config, str | None, dict[str, Any]]:
    """Read a YAML/JSON config document (``winner.yaml``): the config, its version, the rest."""
    data = load_yaml_mapping(path)
    if not isinstance(data.get("config"), dict):
        raise InputFileError(path, "config", "expected a mapping of knob names to values")
    try:
        config = complete_config(data["config"])
    except KnobError as exc:
        raise InputFileError(path, f"config.{exc.knob}", exc.message) from None
    rest = {key: value for key, value in data.items() if key not in ("config", "megatron_core")}
    return config, data.get("megatron_core"), rest
