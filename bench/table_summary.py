"""What a recorded table (``bench/record_table.py``) measured, row by row: each config's steady useful
tokens/s with its 95 % interval (the estimator the search benchmark ranks configs by), its peak
memory, its start-ups, and why a row did not run. The README quotes tables from this, so that a
figure taken from a table, even one still being recorded, comes with a command that gives it again.
A table recorded over several device sessions ran on several machines: it lists them, and how fast
the table's anchor ran again on each (``record_table.py`` runs it at the start of each later session).

  python bench/table_summary.py --table bench/data/h100_te_grid.jsonl --out bench/results/table_h100_te_grid.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table
from rich.text import Text

from autotune.core.knobs import KNOBS, Config, complete_config
from autotune.core.tables import RecordedBurst, RecordedTable, load_anchors, load_table


@dataclass(frozen=True)
class RowSummary:
    config: str
    varied: str
    """The knobs of ``config`` whose values differ between the table's rows."""
    outcome: str
    tokens_per_second: float | None
    """Steady mean of useful tokens/s per device; ``None`` for a row that did not run ok."""
    ci_low: float | None
    ci_high: float | None
    relative_half_width: float | None
    steps: int
    precision: str | None
    """As the burst's contract says it (bf16, or which GEMMs ran in FP8 with which scaling)."""
    peak_memory_gib: float | None
    startup_seconds: dict[str, float | None]
    """Cold, warm and kept start-up, as recorded (``None``: not measured)."""
    error: str | None
    """The first line of why it did not run."""
    recorded_at: str | None
    machine: str | None
    """The device's id and the host's CPU where the row records them (since 2026-12-07): rows of one
    table recorded on several machines of a kind are not alike (a host-bound config ran 42 % faster
    on one H100 machine than on another)."""


def shared_values(configs: list[Config]) -> dict[str, object]:
    """The knobs every config sets alike, with their values."""
    return {name: configs[0][name] for name in KNOBS if all(config[name] == configs[0][name] for config in configs)}


def summarise(config: Config, row: RecordedBurst, shared: dict[str, object]) -> RowSummary:
    estimate, devices = row.steady, row.world_size
    return RowSummary(
        config=config.describe(),
        varied=config.describe(shared),
        outcome=row.outcome,
        tokens_per_second=estimate.mean / devices if estimate else None,
        ci_low=estimate.ci_low / devices if estimate else None,
        ci_high=estimate.ci_high / devices if estimate else None,
        relative_half_width=estimate.relative_half_width if estimate else None,
        steps=len(row.step_seconds),
        precision=row.contract.get("precision"),
        peak_memory_gib=row.peak_memory_gib,
        startup_seconds={"cold": row.startup_seconds, "warm": row.warm_startup_seconds, "kept": row.kept_startup_seconds},
        error=row.error.strip().splitlines()[0] if row.error else None,
        recorded_at=row.contract.get("recorded_at"),
        machine=machine(row.contract.get("stack") or {}),
    )


def machine(stack: dict) -> str | None:
    if stack.get("host_cpu") is None:
        return None
    return f"{stack['device_name']} {stack['device_uuid']} on {stack['host_cpu']}" if stack.get("device_uuid") \
        else stack["host_cpu"]


@dataclass(frozen=True)
class AnchorSummary:
    """A burst of the table's anchor run again at the start of a later recording session
    (``autotune.core.tables.anchors_path``)."""
    config: str
    recorded_at: str | None
    machine: str | None
    outcome: str
    tokens_per_second: float | None
    over_its_row: float | None
    """Its steady useful tokens/s over its row's: how far this session's machine ran from the one
    the row was recorded on (``None`` where either did not run ok)."""


def anchor_summaries(table: RecordedTable) -> list[AnchorSummary]:
    summaries = []
    for anchor in load_anchors(table.path):
        config = complete_config(anchor.config)
        row = table.rows.get(config)
        rate = _steady_per_device(anchor)
        row_rate = _steady_per_device(row) if row is not None else None
        summaries.append(AnchorSummary(
            config=config.describe(), recorded_at=anchor.contract.get("recorded_at"),
            machine=machine(anchor.contract.get("stack") or {}), outcome=anchor.outcome, tokens_per_second=rate,
            over_its_row=rate / row_rate if rate is not None and row_rate is not None else None))
    return summaries


def _steady_per_device(row: RecordedBurst) -> float | None:
    """The row's steady useful tokens/s per device, as the rows' summaries give it."""
    estimate = row.steady
    return estimate.mean / row.world_size if estimate is not None else None


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}×"


def summaries(table: RecordedTable) -> tuple[str, list[RowSummary]]:
    """The knobs every row sets alike (those off Megatron's defaults), and the rows: those that ran,
    fastest first, then the others by outcome."""
    configs = list(table.rows)
    shared = shared_values(configs)
    rows = [summarise(config, row, shared) for config, row in table.rows.items()]
    alike = " ".join(part for part in configs[0].describe().split(" ") if part.split("=")[0] in shared)
    return alike, sorted(rows, key=lambda row: (row.tokens_per_second is None, -(row.tokens_per_second or 0.0),
                                                row.outcome))


ERROR_SHOWN = 90
"""Characters of a row's error the console shows (the JSON keeps its whole first line): enough for
an out of memory's size, or the rule megatron-core asserted."""


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def show(rows: list[RowSummary], shared: str, console: Console) -> None:
    table = Table(title="useful tokens/s per device, steady mean (95 % interval)", caption=Text(f"every row: {shared}"))
    for column in ("tokens/s", "±", "peak GiB", "start-up cold / warm / kept s", "outcome", "config"):
        table.add_column(column, overflow="fold")
    for row in rows:
        table.add_row(*map(Text, (
            "-" if row.tokens_per_second is None else f"{row.tokens_per_second:,.0f}",
            "-" if row.relative_half_width is None else f"{100 * row.relative_half_width:.1f} %",
            "-" if row.peak_memory_gib is None else f"{row.peak_memory_gib:.1f}",
            " / ".join(_seconds(row.startup_seconds[start]) for start in ("cold", "warm", "kept")),
            row.outcome if row.error is None else f"{row.outcome}: {row.error[:ERROR_SHOWN]}",
            row.varied,
        )))
    console.print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--table", type=Path, required=True)
    parser.add_argument("--out", type=Path, default=None, help="also write the rows and their contract as JSON")
    args = parser.parse_args()
    table = load_table(args.table)
    alike, rows = summaries(table)
    console = Console()
    show(rows, alike, console)
    machines = sorted({row.machine for row in rows if row.machine is not None})
    if len(machines) > 1:
        console.print(f"recorded on {len(machines)} machines: rows of different ones are not alike")
    anchors = anchor_summaries(table)
    for anchor in anchors:
        console.print(f"anchor {anchor.config} run again {anchor.recorded_at} on {anchor.machine or 'a machine not recorded'}: "
                      f"{anchor.outcome}, {_ratio(anchor.over_its_row)} its row's useful tokens/s", markup=False)
    if args.out is None:
        return
    first = next(iter(table.rows.values()))
    outcomes = sorted({row.outcome for row in rows})
    result = {
        "benchmark": "table_summary",
        "command": f"python bench/table_summary.py --table {args.table} --out {args.out}",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"python": platform.python_version(), "platform": platform.platform()},
        "table": str(args.table),
        "estimator": "steady_state(useful tokens/s per step, min_warmup=1): MSER cut, isolated outliers dropped, "
                     "Student-t 95 % interval; per device",
        "recorded_on": first.contract.get("stack"),
        "campaign": first.contract.get("campaign"),
        "model": first.contract.get("model_preset"),
        "global_batch_size": (first.contract.get("shapes") or {}).get("global_batch_size"),
        "memory_cap_fraction": first.contract.get("memory_cap_fraction"),
        "data_realism": first.contract.get("data_realism"),
        "timing": first.contract.get("timing"),
        "rows": len(rows),
        "every_row": alike,
        "outcomes": {outcome: sum(row.outcome == outcome for row in rows) for outcome in outcomes},
        "machines": machines,
        "rows_without_machine": sum(row.machine is None for row in rows),
        "summaries": [vars(row) for row in rows],
        "anchors": [vars(anchor) for anchor in anchors],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
