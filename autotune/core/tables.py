"""Recorded tables: every config of a space, each run once for real, one burst per JSON line.

A table is what the replay trainable serves and what the search benchmark scores methods
against, so it must be complete: a config its space holds but the table lacks is an error, never
a guess. Each line::

    {"config": {canonical knob names -> values}, "outcome": "ok"|"oom"|"invalid"|"failed",
     "step_seconds": [every step, warm-up included], "data_wait_seconds": [each step's]|null,
     "sm_clock_mhz": [each step's]|null, "clock_held_by": [[reasons] of each step]|null,
     "useful_tokens_per_step": int,
     "peak_memory_gib": float|null, "startup_seconds": float, "warm_startup_seconds": float|null,
     "kept_startup_seconds": float|null, "kept_first_step_seconds": float|null,
     "error": str|null, "contract": {...}}

``startup_seconds`` is everything the burst cost besides its steps (launch, build, teardown):
the burst's wall time less the sum of ``step_seconds``, with its ranks started *cold* (imports
paid by the burst: a zygote started for it, or, in tables recorded before zygotes, a fresh
process). ``warm_startup_seconds`` is the same with the ranks forked from a zygote already
running, as a campaign's trials start them (``trainables/zygote.py``); ``null`` in tables recorded
before it was measured. ``kept_startup_seconds`` is the same again for a short burst of the config
run in the rank processes the row before it kept (``rank_start: kept``: their CUDA context, compiled
kernels and caches warm), as a campaign's screen after a healthy one runs, and
``kept_first_step_seconds`` that burst's first step, which a kept rank pays far less of than a new
one (on an H100 with TE, 7–8 s against 14–28 s); ``null`` where not measured or the burst's ranks
were not kept, and the first step also where the kept burst ran none. A burst costs its start-up
plus ``sum(step_seconds)`` seconds of each of its ``contract["world_size"]`` devices.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from autotune.core.contract import RankStart
from autotune.core.errors import AutotuneError, KnobError
from autotune.core.knobs import Config, complete_config
from autotune.core.steady import SteadyEstimate, steady_state

RecordedOutcome = Literal["ok", "oom", "invalid", "failed"]
ChargedStart = Literal["cold", "warm", "kept"]
"""The start-ups a row can charge: a zygote started for the burst, one already running, or the
rank processes of the burst before, kept."""


class Grid(Protocol):
    """The configs a table must hold (a search space)."""

    name: str

    def configs(self) -> Iterator[Config]: ...


class TableError(AutotuneError):
    """A table file that cannot be read, or that lacks what its user needs."""


class RecordedBurst(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    config: dict[str, Any]
    outcome: RecordedOutcome
    step_seconds: list[float] = Field(description="every step, warm-up included")
    data_wait_seconds: list[float] | None = Field(
        default=None, description="each step's wait on its data loader, within its step_seconds (the slowest "
                                  "rank's); null in rows recorded before it was kept")
    sm_clock_mhz: list[float | None] | None = Field(
        default=None, description="each step's GPU SM clock at its end, the lowest rank's (null: not read, as on "
                                  "the CPU); null in rows recorded before it was kept")
    clock_held_by: list[list[str]] | None = Field(
        default=None, description="what held each step's GPU clock down (NVML's power, thermal and slowdown "
                                  "reasons); null in rows recorded before it was kept")
    useful_tokens_per_step: int = Field(ge=0)
    peak_memory_gib: float | None = Field(ge=0)
    startup_seconds: float = Field(ge=0, description="cold: the burst paid its ranks' imports")
    warm_startup_seconds: float | None = Field(default=None, ge=0,
                                               description="ranks forked from a zygote already running")
    kept_startup_seconds: float | None = Field(default=None, ge=0,
                                               description="ranks kept from the burst before")
    kept_first_step_seconds: float | None = Field(default=None, gt=0,
                                                  description="the first step in ranks kept from the burst before")
    error: str | None
    contract: dict[str, Any]

    @property
    def throughput(self) -> list[float]:
        """Useful tokens/s of every recorded step."""
        return [self.useful_tokens_per_step / seconds for seconds in self.step_seconds]

    @property
    def steady(self) -> SteadyEstimate | None:
        """The steady estimate of its useful tokens/s, the first step taken as warm-up at least (what
        the search benchmark ranks configs by); ``None`` for a burst that did not run ok or ran too
        few steps for one."""
        return steady_state(self.throughput, min_warmup=1) if self.outcome == "ok" else None

    def startup(self, start: ChargedStart) -> float:
        """Start-up seconds with the ranks started ``start`` (see the module's docstring)."""
        if start == "cold":
            return self.startup_seconds
        recorded = self.warm_startup_seconds if start == "warm" else self.kept_startup_seconds
        if recorded is None:
            raise TableError(f"this row has no {start} start-up recorded")
        return recorded

    @property
    def cost_seconds(self) -> float:
        """Seconds of each of the burst's devices, started cold."""
        return self.startup_seconds + sum(self.step_seconds)

    @property
    def world_size(self) -> int:
        return int(self.contract["world_size"])


@dataclass(frozen=True)
class RecordedTable:
    path: Path
    rows: dict[Config, RecordedBurst]

    def row(self, config: Config) -> RecordedBurst:
        try:
            return self.rows[config]
        except KeyError:
            raise TableError(f"{self.path}: no recorded burst for {config.describe()}") from None

    def require_complete(self, space: Grid) -> None:
        """Every config of ``space`` is recorded, or a :class:`TableError` says how many are not."""
        configs = list(space.configs())
        missing = [config for config in configs if config not in self.rows]
        if missing:
            raise TableError(
                f"{self.path}: {len(missing)} of the {len(configs)} configs of space {space.name} are not "
                f"recorded, e.g. {missing[0].describe()}; record them (bench/record_table.py resumes)"
            )

    @property
    def charged_start(self) -> RankStart:
        """The start-up a replay charges: warm, as campaigns start their trials' ranks, where every
        row recorded it; cold otherwise (a table recorded before warm start-up was measured)."""
        return "warm" if all(row.warm_startup_seconds is not None for row in self.rows.values()) else "cold"

    def start_for(self, asked: RankStart) -> RankStart:
        """The start-up a replay that asks for ``asked`` is charged: cold where the table has no warm one."""
        return asked if self.charged_start == "warm" else "cold"

    @property
    def kept_recorded(self) -> bool:
        """Every row that ran ok recorded what a burst in kept ranks pays, so a replay after a healthy
        burst can charge that (a partly measured table would charge some configs less than others).
        A row that did not run ok may lack it (a failure's cost depends on how it failed; tables
        measured before 2026-12-06 kept only rows that ran ok): a replay charges it the warm start-up."""
        return all(row.kept_startup_seconds is not None for row in self.rows.values() if row.outcome == "ok")


def load_table(path: Path) -> RecordedTable:
    """Read and validate a table; errors name the file, the line and the field."""
    if not path.is_file():
        raise TableError(f"{path}: no such table file")
    rows: dict[Config, RecordedBurst] = {}
    for where, config, row in _validated_rows(path):
        if config in rows:
            raise TableError(f"{where}: {config.describe()} is recorded twice")
        rows[config] = row
    if not rows:
        raise TableError(f"{path}: the table is empty")
    return RecordedTable(path=path, rows=rows)


def anchors_path(table: Path) -> Path:
    """Where the anchor bursts of ``table`` are kept (``x.jsonl`` → ``x.anchors.jsonl``).

    A table recorded over several device sessions is recorded on several machines of one kind, and
    they differ: one config ran 42 % faster over 120 steps on one H100 machine than in its 16-step
    row on another (2026-12-07). So each session that adds rows first runs the table's anchor
    again, the first of its rows that ran ok (``bench/record_table.py``), and keeps the burst here,
    beside the rows it came before: how fast the anchor ran on each machine says how far rows of
    different sessions may be compared."""
    return table.with_suffix(".anchors.jsonl")


def load_anchors(table: Path) -> list[RecordedBurst]:
    """The anchor bursts recorded beside ``table``, oldest first; none where there is no such file."""
    path = anchors_path(table)
    return [row for _, _, row in _validated_rows(path)] if path.is_file() else []


def _validated_rows(path: Path) -> Iterator[tuple[str, Config, RecordedBurst]]:
    """Each line of a table file as a validated burst, with where it is and its complete config."""
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            row = RecordedBurst.model_validate(json.loads(line))
        except json.JSONDecodeError as exc:
            raise TableError(f"{where}: not a JSON object ({exc.msg})") from None
        except ValidationError as exc:
            first = exc.errors()[0]
            field = ".".join(str(part) for part in first["loc"]) or "line"
            raise TableError(f"{where}: {field}: {first['msg']}") from None
        try:
            config = complete_config(row.config)
        except KnobError as exc:
            raise TableError(f"{where}: config.{exc.knob}: {exc.message}") from None
        if "world_size" not in row.contract:
            raise TableError(f"{where}: contract.world_size: missing (the devices one burst ran on)")
        yield where, config, row


def append_row(path: Path, row: RecordedBurst) -> None:
    """Append one recorded burst (a recorder resumes by skipping configs already in the file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as file:
        file.write(row.model_dump_json() + "\n")
