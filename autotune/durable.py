"""Appending to files that are the record: each append in the operating system's hands when it
returns (on disk too when asked), and a write the disk refuses rolled back whole, so every line
written before stays whole and a resumed campaign appends after the last one. The run directory's
line files and the study's journal both append this way."""

from __future__ import annotations

import os
from pathlib import Path

from autotune.core.errors import AutotuneError


class OutputUnwritable(AutotuneError):
    """The run directory stopped accepting writes mid-campaign."""

    def __init__(self, path: Path, cause: OSError) -> None:
        self.path = path
        super().__init__(f"cannot write {path}: {cause.strerror or cause}")


def append_bytes(path: Path, data: bytes, *, sync: bool) -> None:
    """Append ``data`` to ``path``: in the operating system's hands when this returns, and on disk
    too with ``sync``. A write the disk refuses (full, read-only, quota) leaves the file as it was,
    so a resumed campaign appends after the last whole line. Unbuffered, so no half-written line
    can be flushed after the roll-back."""
    rest = memoryview(data)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        before = os.lseek(fd, 0, os.SEEK_END)
        try:
            while rest:
                rest = rest[os.write(fd, rest):]
            if sync:
                os.fsync(fd)
        except OSError as exc:
            try:
                os.ftruncate(fd, before)
            except OSError:
                pass  # the original failure is the one to report
            raise OutputUnwritable(path, exc) from exc
    finally:
        os.close(fd)
