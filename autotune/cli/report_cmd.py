"""``autotune report RUN_DIR``: the self-contained HTML report and a terminal summary;
``autotune compare RUN_A RUN_B``: two campaigns by useful tokens/s per device and workload shape."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import typer
from pydantic import BaseModel
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from autotune.engine.rundir import REPORT_FILE
from autotune.report.analysis import RunReport, load_report
from autotune.report.compare import compare


def report(
    run_dir: Path = typer.Argument(..., help="A run directory (the folder `autotune run` printed)."),
    out: Path | None = typer.Option(None, help=f"Where to write the HTML (default: RUN_DIR/{REPORT_FILE})."),
) -> None:
    """Write the campaign's HTML report and print its summary."""
    from autotune.report.page import render_html  # plotly: imported by the commands that draw only

    loaded = load_report(run_dir)
    target = out or run_dir / REPORT_FILE
    target.write_text(render_html(loaded), encoding="utf-8")
    print_summary(Console(), loaded)
    typer.echo(f"report: {target}")


def print_summary(console: Console, loaded: RunReport) -> None:
    console.print(f"[bold]{escape(loaded.campaign)}[/] · {escape(loaded.verdict.summary)}")
    for flag in loaded.flags:
        style = "bold red" if flag.severity == "warning" else "dim"
        console.print(f"[{style}]{flag.severity}:[/] {escape(flag.text)}")
    board = Table(title=f"promoted configs and baselines ({loaded.objective})")
    for column in ("", "config", "mean", "95 % interval", "steps"):
        board.add_column(column)
    for row in loaded.board.rows:
        tag = "winner" if row.winner else ("tied" if row.tied_with_winner else f"#{row.rank}")
        interval = "" if row.ci_low is None else f"{row.ci_low:,.0f}–{row.ci_high:,.0f}"
        mean = "" if row.objective is None else f"{row.objective:,.0f}"
        steps = str(row.steps) if row.processes == 1 else f"{row.processes} × {row.steps}"
        board.add_row(tag, escape(row.config.describe()), mean, interval, steps)
    for base in loaded.baselines:
        estimate = base.estimate
        board.add_row(base.warm_start, escape(base.config.describe()),
                      "" if base.objective is None else f"{base.objective:,.0f}",
                      f"{estimate.ci_low:,.0f}–{estimate.ci_high:,.0f}" if estimate else base.outcome,
                      f"{base.steps} (screen)")
    console.print(board)
    gain = loaded.gain_over_bring_up()
    if gain is not None:
        console.print(f"winner over bring-up: {gain.describe()} ({loaded.objective})")
    if (spread := loaded.verdict.spread) is not None:
        console.print(f"between fresh processes of one config, a run's mean moved ±{spread.relative_sd:.1%} "
                      f"(standard deviation, pooled over the promoted configs; {spread.degrees_of_freedom} degrees "
                      "of freedom): the intervals above hold it")
    hours = loaded.device_hours()
    split = "; ".join(", ".join(f"{key} {value:.3f}" for key, value in group.items() if value)
                      for group in (hours.by_stage, hours.by_outcome) if any(group.values()))
    console.print(f"device-hours: {hours.total:.3f}" + (f" ({split})" if split else ""))
    spent = loaded.spend
    if spent.outside_steps is not None and spent.median_trial_outside_steps is not None and spent.total:
        console.print(f"outside training steps (start-up, build, teardown): {spent.outside_steps / 3600:.3f} "
                      f"device-hours, {100 * spent.outside_steps / spent.total:.0f}% of the spend; "
                      f"{spent.median_trial_outside_steps:.1f} device-s for the median trial")
    if (parts := spent.median_outside_split) is not None:
        console.print("  medians: " + ", ".join(f"{part.replace('_', ' ')} {seconds:.1f} s"
                                                for part, seconds in parts.parts().items()))
        for what, split in parts.split_parts().items():
            if split:
                console.print(f"  {what}, medians: " + ", ".join(f"{part.name} {part.seconds:.2f} s" for part in split))
    if spent.median_first_step_excess is not None:
        console.print(f"the first step's warm-up (its time over the trial's median step): "
                      f"{spent.median_first_step_excess:.1f} device-s for the median trial, inside its steps")
    if spent.by_rank_start:
        console.print("  by how the ranks started, medians: " + "; ".join(
            f"{start} {medians.outside_steps:.1f} s outside the steps"
            + (f", first step +{medians.first_step_excess:.1f} s" if medians.first_step_excess is not None else "")
            + f" ({medians.trials} trial{'s' if medians.trials > 1 else ''})"
            for start, medians in sorted(spent.by_rank_start.items())))
        for start, medians in sorted(spent.by_rank_start.items()):
            if medians.out_of_memory_parts:
                console.print(f"  out of memory before a step in {start} ranks ({medians.out_of_memory_trials}), "
                              "medians: " + ", ".join(f"{part.name} {part.seconds:.2f} s" for part in medians.out_of_memory_parts))
    for split in loaded.stage_splits[:3]:
        parts = ", ".join(f"{part.removesuffix('_seconds')} {100 * value / split.step_seconds:.0f}%"
                          for part, value in split.parts.items() if split.step_seconds)
        console.print(f"stage split {split.trial_id}: {split.step_seconds:.3f} s/step ({parts})")


def _jsonable(value: object) -> object:
    return value.model_dump(mode="json") if isinstance(value, BaseModel) else str(value)


def compare_runs(
    run_a: Path = typer.Argument(..., help="The first run directory (the reference)."),
    run_b: Path = typer.Argument(..., help="The second run directory."),
    as_json: bool = typer.Option(False, "--json", help="Print the comparison as JSON."),
) -> None:
    """Compare two campaigns by useful tokens/s per device and workload shape."""
    result = compare(load_report(run_a), load_report(run_b))
    if as_json:
        typer.echo(json.dumps(asdict(result), indent=1, default=_jsonable))
        return
    console = Console()
    table = Table(title="by the objective per device, on the same workload")
    table.add_column("")
    for s in (result.a, result.b):
        table.add_column(escape(s.name))
    rows = [
        ("layout", result.a.layout, result.b.layout),
        ("devices per trial", str(result.a.devices_per_trial), str(result.b.devices_per_trial)),
        ("figure from", result.a.stage, result.b.stage),
        ("per device", *(f"{s.objective:,.0f}" if s.objective is not None else "–" for s in (result.a, result.b))),
        ("95 % interval", *(f"{s.ci_low:,.0f}–{s.ci_high:,.0f}" if s.ci_low is not None else "–"
                            for s in (result.a, result.b))),
        ("global batch", *(str(s.shapes.global_batch_size) if s.shapes else "–" for s in (result.a, result.b))),
        ("micro-batch", *(str(s.shapes.micro_batch_size) if s.shapes else "–" for s in (result.a, result.b))),
        *((key, str(getattr(result.a.workload, key)), str(getattr(result.b.workload, key)))
          for key in ("model", "seq_length", "data_realism")),
    ]
    for row in rows:
        table.add_row(*(escape(cell) for cell in row))
    console.print(table)
    style = "bold" if result.comparable else "bold red"
    console.print(f"[{style}]{escape(result.verdict)}[/]")

