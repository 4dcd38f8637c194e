"""The study's journal file, written by the campaign's one driver.

Optuna's ``JournalFileBackend`` serves any number of processes sharing a file: every storage call
re-reads the file from where that process last stopped, and every write takes the file's lock,
opens it and fsyncs it. A campaign's study has one writer, its driver (``optuna-dashboard`` only
reads it, and takes the same lock for the notes it writes), and a trial makes a dozen writes
(each parameter, each attribute, its state): that many locks and fsyncs were much of the
proposer's time (the README's overhead row), and on a cluster's shared file system an fsync costs
milliseconds.

So this backend keeps the same file, in the same format (Optuna's backend and the dashboard read
it), but reads it once, keeps the logs it appends in memory, writes the dozen logs of a proposal or
a completion together (:meth:`CampaignJournal.batch`: one lock, one write), and syncs the file to
disk when a log completes a trial (a failed one is no result: a repeated proposal, or a trial a
dead driver left running). Each write reaches the operating system before the call that made it
returns (written as the run directory's lines are, rolled back whole if the disk refuses it), so a
driver killed with SIGKILL loses at most the proposal or completion it was making; a machine that
loses power loses at most what was written since the last completed trial: trials in flight, lost
with the machine anyway, and repeats, which are no result.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from optuna.storages.journal import BaseJournalBackend, JournalFileBackend, JournalFileSymlinkLock
from optuna.trial import TrialState

from autotune.durable import append_bytes


class CampaignJournal(BaseJournalBackend):
    def __init__(self, path: Path) -> None:
        self.path = path
        self.lock = JournalFileSymlinkLock(str(path))
        self.logs: list[dict[str, Any]] = list(JournalFileBackend(str(path)).read_logs(0))
        self._held: list[dict[str, Any]] | None = None
        """Logs appended inside :meth:`batch`, not yet written."""

    def read_logs(self, log_number_from: int) -> list[dict[str, Any]]:
        return self.logs[log_number_from:]

    @contextmanager
    def batch(self) -> Iterator[None]:
        """Hold the block's logs and write them together when it ends (a driver killed inside
        loses them, as it loses the proposal or completion they make)."""
        if self._held is not None:
            yield
            return
        self._held = []
        try:
            yield
        finally:
            held, self._held = self._held, None
            if held:
                self._write(held)

    def append_logs(self, logs: list[dict[str, Any]]) -> None:
        if self._held is not None:
            self._held.extend(logs)
            self.logs.extend(logs)  # Optuna reads back what it wrote at once
            return
        self._write(logs)
        self.logs.extend(logs)

    def _write(self, logs: list[dict[str, Any]]) -> None:
        data = "".join(json.dumps(log, separators=(",", ":")) + "\n" for log in logs).encode("utf-8")
        completes = any(log.get("state") == TrialState.COMPLETE for log in logs)
        self.lock.acquire()  # waits for the dashboard's writes, if any
        try:
            append_bytes(self.path, data, sync=completes)
        finally:
            self.lock.release()
