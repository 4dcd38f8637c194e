"""The run directory: the user's record of a campaign, written as things happen and never rewritten.

Layout::

    campaign.yaml    the campaign as it ran (space and data paths made absolute), for resume
    space.yaml       a copy of the space file (then_space.yaml: the workflow's second space)
    study.journal    the Optuna study (optuna-dashboard opens it)
    steps.jsonl      every step record of every trial, appended as it arrives
    trials.jsonl     one line per finished trial or rejected proposal, appended as it ends
    leaderboard.json the promoted configs with intervals, and the verdict (rewritten at the end)
    winner.yaml      the winning config by canonical knob names, with its contract
    spend.json       device-seconds per stage and per outcome, and outside training steps
    report.html      the campaign report (``autotune report`` rebuilds it from the files above)
    ray/             Ray Tune's own experiment folders

Each line reaches the operating system before its append returns, so a driver killed with SIGKILL
loses at most the trials it had in flight; a trial's steps and its entry reach the disk (fsync)
when the trial ends, not step by step (on a cluster's shared file system an fsync costs
milliseconds, and 16 trials report several steps a second).
"""

from __future__ import annotations

import json
import os
import shutil
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Generic, Iterable, Iterator, Protocol, TypeVar

import yaml

from autotune.campaign import Campaign, load_campaign
from autotune.core.errors import AutotuneError
from autotune.core.model import HF_SIZE_FILES
from autotune.durable import OutputUnwritable, append_bytes
from autotune.engine.records import StepEntry, read_trial_entries


class _Record(Protocol):
    def to_json(self) -> dict[str, Any]: ...


Line = TypeVar("Line", bound=_Record)

CAMPAIGN_FILE = "campaign.yaml"
SPACE_FILE = "space.yaml"
THEN_SPACE_FILE = "then_space.yaml"
STUDY_FILE = "study.journal"
STEPS_FILE = "steps.jsonl"
TRIALS_FILE = "trials.jsonl"
LEADERBOARD_FILE = "leaderboard.json"
WINNER_FILE = "winner.yaml"
SPEND_FILE = "spend.json"
PROBE_FILE = "probe.json"
CHECKPOINT_SIZES_DIR = "checkpoint"
"""Where a ``model.hf_checkpoint`` campaign's size files (:data:`~autotune.core.model.HF_SIZE_FILES`) are
copied, under the checkpoint directory's own name."""
REPORT_FILE = "report.html"


class JsonLines(Generic[Line]):
    """An append-only JSON Lines file of typed records."""

    def __init__(self, path: Path, parse: Callable[[Iterable[dict[str, Any]]], Iterator[Line]]) -> None:
        self.path = path
        self.parse = parse
        """Turns the file's lines, in order, into records."""

    def append(self, line: Line, *, sync: bool = True) -> None:
        """Append one record (see :func:`~autotune.durable.append_bytes`)."""
        data = json.dumps(line.to_json(), allow_nan=False) + "\n"
        append_bytes(self.path, data.encode("utf-8"), sync=sync)

    def sync(self) -> None:
        """Put every line appended so far on disk."""
        if not self.path.exists():
            return
        fd = os.open(self.path, os.O_RDONLY)
        try:
            os.fsync(fd)
        except OSError as exc:
            raise OutputUnwritable(self.path, exc) from exc
        finally:
            os.close(fd)

    def read(self) -> Iterator[Line]:
        """Every complete line; a last line cut short by a crash is skipped."""
        if not self.path.exists():
            return
        with self.path.open(encoding="utf-8") as handle:
            yield from self.parse(json.loads(line) for line in handle if line.endswith("\n"))


def _steps(lines: Iterable[dict[str, Any]]) -> Iterator[StepEntry]:
    return (StepEntry.model_validate(line) for line in lines)


class RunDir:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.steps = JsonLines(path / STEPS_FILE, _steps)
        self.trials = JsonLines(path / TRIALS_FILE, read_trial_entries)

    @property
    def study_path(self) -> Path:
        return self.path / STUDY_FILE

    @property
    def ray_storage(self) -> Path:
        return (self.path / "ray").resolve()

    def write_json(self, name: str, data: Any) -> None:
        self.write_text(name, json.dumps(data, indent=2, default=str, allow_nan=False) + "\n")

    def write_text(self, name: str, text: str) -> None:
        """Write a derived view (leaderboard, spend, winner) atomically: readers never see half a file."""
        temporary = self.path / f".{name}.tmp"
        try:
            temporary.write_text(text, encoding="utf-8")
            temporary.replace(self.path / name)
        except OSError as exc:
            temporary.unlink(missing_ok=True)
            raise OutputUnwritable(self.path / name, exc) from exc

    def load_campaign(self, check_inputs: bool = True) -> Campaign:
        """The campaign as it ran; ``check_inputs=False`` to read it where its trials' inputs are not
        (:func:`~autotune.campaign.load_campaign`)."""
        return load_campaign(self.path / CAMPAIGN_FILE, check_inputs=check_inputs)


def create_run_dir(campaign: Campaign, output_dir: Path | None = None) -> RunDir:
    """A new, timestamped run directory under the campaign's ``output_dir`` holding a
    self-contained copy of the campaign; fails before any trial if it cannot be written."""
    root = output_dir or campaign.output_dir
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    path = root / f"{campaign.spec.name}-{stamp}"
    suffix = 1
    while path.exists():
        suffix += 1
        path = root / f"{campaign.spec.name}-{stamp}-{suffix}"
    try:
        path.mkdir(parents=True)
        shutil.copyfile(campaign.space.path, path / SPACE_FILE)
        spec = campaign.spec_with_absolute_paths()
        spec["space"] = SPACE_FILE
        if spec["model"]["hf_checkpoint"] is not None:
            # The sizes the rules and the memory model read, kept with the run (a report reads them
            # where the checkpoint directory is not).
            source = Path(spec["model"]["hf_checkpoint"])
            sizes = Path(CHECKPOINT_SIZES_DIR) / source.name  # its name names the model
            (path / sizes).mkdir(parents=True)
            for name in HF_SIZE_FILES:
                shutil.copyfile(source / name, path / sizes / name)
            spec["model"]["hf_checkpoint"] = str(sizes)
        if campaign.next_space is not None:
            shutil.copyfile(campaign.next_space.path, path / THEN_SPACE_FILE)
            spec["workflow"]["then_space"] = THEN_SPACE_FILE
        (path / CAMPAIGN_FILE).write_text(
            f"# {campaign.path.resolve()} as it ran on {stamp}\n" + yaml.safe_dump(spec, sort_keys=False),
            encoding="utf-8",
        )
    except OSError as exc:
        raise AutotuneError(f"cannot write the run directory {path}: {exc.strerror or exc}") from None
    return RunDir(path)


def open_run_dir(path: Path) -> RunDir:
    if not (path / CAMPAIGN_FILE).is_file():
        raise AutotuneError(f"{path} is not a run directory (no {CAMPAIGN_FILE}); pass the folder `autotune run` printed")
    return RunDir(path)
