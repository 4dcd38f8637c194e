"""Reading user YAML safely, and turning validation failures into errors that name file and field."""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from autotune.core.errors import InputFileError


def load_yaml_mapping(path: Path) -> dict[str, Any]:
    """The top-level mapping of a YAML file, read with ``yaml.safe_load`` only."""
    if not path.is_file():
        raise InputFileError(path, "-", "file not found" if not path.exists() else "not a regular file")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "-"
        problem = getattr(exc, "problem", None) or str(exc)
        raise InputFileError(path, where, f"invalid YAML: {problem}") from None
    except UnicodeDecodeError as exc:
        raise InputFileError(path, "-", f"not UTF-8 text ({exc.reason})") from None
    if not isinstance(data, dict):
        raise InputFileError(path, "-", f"expected a mapping of fields at the top level, got {type(data).__name__}")
    bad_keys = [key for key in data if not isinstance(key, str)]
    if bad_keys:
        raise InputFileError(path, "-", f"field names must be text, got {bad_keys!r}")
    return data


def field_path(location: tuple[Any, ...], prefix: str = "") -> str:
    """``("tune", "micro_batch_size", 2)`` → ``tune.micro_batch_size[2]``."""
    text = prefix
    for part in location:
        if isinstance(part, int):
            text += f"[{part}]"
        else:
            text += f".{part}" if text else str(part)
    return text or "-"


def input_error(path: Path, exc: ValidationError, prefix: str = "") -> InputFileError:
    """One :class:`InputFileError` listing every problem pydantic found, each with its field."""
    problems = []
    for error in exc.errors(include_url=False):
        where = field_path(tuple(error["loc"]), prefix)
        message = error["msg"].removeprefix("Value error, ")
        if error["type"] == "extra_forbidden":
            message = "unknown field"
        elif error["type"] != "missing" and "input" in error and not isinstance(error["input"], dict):
            message += f" (got {error['input']!r})"
        problems.append((where, message))
    first_field, first_message = problems[0]
    rest = "".join(f"\n  {where}: {message}" for where, message in problems[1:])
    return InputFileError(path, first_field, first_message + rest)


Model = TypeVar("Model", bound=BaseModel)


def load_file(path: Path, schema: type[Model]) -> Model:
    """Read ``path`` with :func:`load_yaml_mapping` and validate it against ``schema``."""
    raw = load_yaml_mapping(path)
    try:
        return schema.model_validate(raw)
    except ValidationError as exc:
        raise input_error(path, exc) from None
