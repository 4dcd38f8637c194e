"""Turning names in a campaign or space file into the objects they name, with errors that point
at the file and field the name came from."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import ValidationError

from autotune.core.contract import TrainableSupport
from autotune.core.errors import AutotuneError, InputFileError
from autotune.core.model import ModelSpec, hf_checkpoint_model, model_preset
from autotune.core.registry import trainable_support
from autotune.yaml_io import input_error


def resolve_model(
    path: Path, preset_field: str, preset: str, overrides_field: str, overrides: dict[str, Any]
) -> ModelSpec:
    """The model preset named at ``preset_field`` with the overrides found at ``overrides_field``."""
    try:
        return model_preset(preset, overrides)
    except ValidationError as exc:
        raise input_error(path, exc, prefix=overrides_field) from None
    except AutotuneError as exc:
        raise InputFileError(path, preset_field, str(exc)) from None


def resolve_checkpoint_model(path: Path, field: str, directory: str, overrides_field: str,
                             overrides: dict[str, Any]) -> ModelSpec:
    """The sizes of the checkpoint directory at ``field`` (relative to ``path``'s folder), with overrides."""
    try:
        return hf_checkpoint_model(path.parent / directory, overrides)
    except ValidationError as exc:
        raise input_error(path, exc, prefix=overrides_field) from None
    except AutotuneError as exc:
        raise InputFileError(path, field, str(exc)) from None


def resolve_trainable(path: Path, field: str, name: str) -> TrainableSupport:
    try:
        return trainable_support(name)
    except AutotuneError as exc:
        raise InputFileError(path, field, str(exc)) from None
