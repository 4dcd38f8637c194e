"""The study's journal file, written by the campaign's one driver.

Optuna's ``JournalFileBackend`` serves any number of processes sharing a file: every storage call
re-reads the file from where that process last stopped, and every write takes the file's lock,
opens it and fsyncs it. A campaign's study has one writer, its driver (``optuna-dashboard`` only
reads it, and takes the same lock for the notes it writes), and a trial makes a dozen writes
(each parameter, each attribute, its state): on this box the journal was a third of the
proposer's time, and on a cluster's shared file system an fsync costs milliseconds.

So this backend keeps the same file, in the same format (Optuna's backend and the dashboard read
it), but reads it once, keeps the logs it appends in memory, and syncs the file to disk when a log
finishes a trial. Each write still reaches the operating system before it returns (written as the
run directory's lines are, rolled back whole if the disk refuses it), so a driver killed with
SIGKILL loses nothing it wrote; a machine that loses power loses at most what unfinished
trials wrote since the last finished one, and those trials are lost with the machine anyway.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from optuna.storages.journal import BaseJournalBackend, JournalFileBackend, JournalFileSymlinkLock
from optuna.trial import TrialState

from autotune.engine.rundir import append_bytes


class CampaignJournal(BaseJournalBackend):
    def __init__(self, path: Path) -> None:
        self.path = path
        self.lock = JournalFileSymlinkLock(str(path))
        self.logs: list[dict[str, Any]] = list(JournalFileBackend(str(path)).read_logs(0))

    def read_logs(self, log_number_from: int) -> list[dict[str, Any]]:
        return self.logs[log_number_from:]

    def append_logs(self, logs: list[dict[str, Any]]) -> None:
        data = "".join(json.dumps(log, separators=(",", ":")) + "\n" for log in logs).encode("utf-8")
        finishes = any("state" in log and TrialState(log["state"]).is_finished() for log in logs)
        self.lock.acquire()  # waits for the dashboard's writes, if any
        try:
            append_bytes(self.path, data, sync=finishes)
        finally:
            self.lock.release()
        self.logs.extend(logs)
