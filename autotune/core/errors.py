"""The exception tree every user-facing error comes from.

The CLI turns any :class:`AutotuneError` into one readable message and exit code 2; anything else
is a bug and keeps its traceback. User mistakes are never asserts.
"""

from __future__ import annotations

from pathlib import Path


class AutotuneError(Exception):
    """Base of every error caused by user input or the environment, not by a bug."""


class InputFileError(AutotuneError, ValueError):
    """A campaign, space or data file is malformed.

    The message always names the file, the field (a dotted path, ``-`` for the whole file) and
    what was expected, so the user can fix it without reading our code.
    """

    def __init__(self, path: Path | str, field: str, message: str) -> None:
        self.path = Path(path)
        self.field = field
        self.message = message
        super().__init__(f"{self.path}: {field}: {message}")


class KnobError(AutotuneError, ValueError):
    """An unknown knob name, or a value outside a knob's domain."""

    def __init__(self, knob: str, message: str) -> None:
        self.knob = knob
        self.message = message
        super().__init__(f"{knob}: {message}")
