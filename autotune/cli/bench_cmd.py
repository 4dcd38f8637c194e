"""``autotune bench search``: the search-efficiency benchmark on a recorded table."""

from __future__ import annotations

import datetime
import json
import platform
from pathlib import Path

import typer
from rich.table import Table

from autotune.cli import console

app = typer.Typer(help="Benchmarks of the tuner itself.", no_args_is_help=True)


@app.command("search")
def search(
    table: Path = typer.Option(..., "--table", help="A recorded table (bench/data/*.jsonl)."),
    seeds: int = typer.Option(10, "--seeds", help="Seeds 0 … N-1 for every method."),
    start: str = typer.Option("warm", "--start", help="Start-up to charge: warm (where the table recorded "
                              "it; campaigns fork ranks from warm zygotes) or cold."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as one JSON object."),
    out: Path | None = typer.Option(None, "--out", help="Also write the result, with its contract, here."),
) -> None:
    """Device time each search method needs to promote a config within 98 % of the table's best."""
    from autotune.core.tables import load_table
    from autotune.engine.driver import connect
    from autotune.search_benchmark import benchmark

    if start not in ("warm", "cold"):
        raise typer.BadParameter("warm or cold", param_hint="--start")
    loaded = load_table(table)
    connect(None)
    result = benchmark(loaded, seeds, start)
    if out is not None:
        first = next(iter(loaded.rows.values()))
        contract = {
            "command": f"autotune bench search --table {table} --seeds {seeds} --start {start}",
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": {"python": platform.python_version(), "platform": platform.platform()},
            "recorded_on": {key: first.contract.get(key) for key in ("stack", "hardware", "versions", "campaign")},
            "unit": "device-seconds as recorded (start-up included) times the devices one burst ran on",
        }
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result | {"contract": contract}, indent=1) + "\n")
    if as_json:
        print(json.dumps(result))
        return
    view = Table(title=f"{table} · {result['configs']} configs · grid {result['grid_gpu_seconds']:,.0f} device-s"
                       f" · {result['start_up_charged']} start-up"
                       + (" (kept ranks after a healthy burst)" if result["kept_ranks_charged"] else ""))
    for column in ("method", "fraction of grid to 98 %", "success", "best ratio at budget", "OOM/invalid waste"):
        view.add_column(column)
    for name, row in result["methods"].items():
        view.add_row(name, f"{row['median_fraction_of_grid_to_98pct']:.3f}", f"{row['success_rate']:.0%}",
                     f"{row['median_best_ratio_at_budget']:.3f}", f"{row['wasted_fraction_oom_invalid']:.1%}")
    console.print(view)
