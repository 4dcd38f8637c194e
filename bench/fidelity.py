"""Fidelity of screening: the estimate our scheduler would have screened for each config (its
recorded steps, stopped where the screening decision stops a trial, or at the campaign's screen
length) against the same config's steady throughput over a long run (>= 120 steps).

  python bench/fidelity.py --table bench/data/cpu_native_vlm.jsonl --long bench/data/cpu_native_vlm_long.jsonl \
      --out bench/results/fidelity_cpu.json

The long table holds long runs of configs that ran ok in the table (``bench/record_table.py --steps 120
--ok-in TABLE --limit 10``). A long run that did not end ok (out of memory at step 79 after a clean
30-step row, say: memory that grows with the data's shapes) is a screening miss: it is listed and
counted outside the tolerance. Target: within +-3 % for at least 90 % of the configs. Prints the
table, writes JSON with the contract.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from autotune.campaign import load_campaign
from autotune.core.steady import steady_state
from autotune.core.tables import RecordedBurst, TableError, load_table
from autotune.search.screening import screen

TOLERANCE = 0.03
TARGET_SHARE = 0.90
LONG_RUN_STEPS = 120
SCREEN_LENGTHS = (8, 12, 16, 24, 30)


def screened_estimate(row: RecordedBurst, screen_steps: int, warmup_steps: int, target: float) -> tuple[float, int] | None:
    """The estimate a screening trial of this row ends with, and the steps it ran (no pruning)."""
    values = row.throughput[:screen_steps]
    decision = None
    for steps in range(1, len(values) + 1):
        decision = screen(values[:steps], best=None, min_warmup=warmup_steps, target_relative_half_width=target)
        if decision.action == "stop":
            break
    if decision is None or decision.estimate is None:
        return None
    return decision.estimate.mean, steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--table", type=Path, required=True, help="the screening table")
    parser.add_argument("--long", type=Path, required=True, help="long runs of some of its configs")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    table, long = load_table(args.table), load_table(args.long)
    campaign = load_campaign(Path(next(iter(table.rows.values())).contract["campaign"]))
    stages = campaign.spec.stages
    rows, failed_later = [], []
    for config, long_row in long.rows.items():
        screened_row = table.row(config)
        if long_row.outcome != "ok":
            failed_later.append({"config": config.to_plain(), "describe": config.describe(),
                                 "screened_outcome": screened_row.outcome, "long_run_outcome": long_row.outcome,
                                 "long_run_steps_done": len(long_row.step_seconds),
                                 "screened_peak_memory_gib": screened_row.peak_memory_gib,
                                 "long_run_peak_memory_gib": long_row.peak_memory_gib})
            continue
        if len(long_row.step_seconds) < LONG_RUN_STEPS:
            raise TableError(f"{args.long}: {config.describe()} ran {len(long_row.step_seconds)} steps, "
                             f"not >= {LONG_RUN_STEPS}")
        truth = steady_state(long_row.throughput, min_warmup=stages.warmup_steps)
        screened = screened_estimate(screened_row, stages.screen_steps, stages.warmup_steps,
                                     stages.target_relative_half_width)
        if screened is None:
            continue
        estimate, steps = screened
        rows.append({"config": config.to_plain(), "describe": config.describe(), "screen_steps": steps,
                     "screened": estimate, "long_run": truth.mean, "long_run_steady_steps": truth.window,
                     "relative_error": estimate / truth.mean - 1})
    within = sum(abs(r["relative_error"]) <= TOLERANCE for r in rows)
    judged = len(rows) + len(failed_later)
    # What a longer screen would buy: the same share had the campaign screened L steps.
    by_screen_length = {}
    for length in SCREEN_LENGTHS:
        hits = 0
        for r in rows:
            config = next(c for c in long.rows if c.to_plain() == r["config"])
            longer = screened_estimate(table.row(config), length, stages.warmup_steps, stages.target_relative_half_width)
            hits += longer is not None and abs(longer[0] / r["long_run"] - 1) <= TOLERANCE
        by_screen_length[length] = hits / judged if judged else 0.0
    result = {
        "benchmark": "fidelity",
        "command": f"python bench/fidelity.py --table {args.table} --long {args.long} --out {args.out}",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"python": platform.python_version(), "platform": platform.platform()},
        "recorded_on": next(iter(long.rows.values())).contract.get("stack"),
        "screening": {"warmup_steps": stages.warmup_steps, "screen_steps": stages.screen_steps,
                      "target_relative_half_width": stages.target_relative_half_width},
        "tolerance": TOLERANCE,
        "configs": judged,
        "within_tolerance_share": within / judged if judged else 0.0,
        "target_share": TARGET_SHARE,
        "rows": rows,
        "failed_later": failed_later,
        "within_tolerance_share_by_screen_steps": by_screen_length,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    view = Table(title=f"screened vs >= {LONG_RUN_STEPS}-step steady useful tokens/s · {within}/{judged} within ±3 %")
    for column in ("config", "screen steps", "screened", "long run", "error"):
        view.add_column(column)
    for r in rows:
        view.add_row(escape(r["describe"]), str(r["screen_steps"]), f"{r['screened']:,.0f}", f"{r['long_run']:,.0f}",
                     f"{100 * r['relative_error']:+.1f}%")
    for r in failed_later:
        view.add_row(escape(r["describe"]), "", f"{r['screened_outcome']}, peak {r['screened_peak_memory_gib']:.1f} GiB",
                     f"{r['long_run_outcome']} at step {r['long_run_steps_done'] + 1}, "
                     f"peak {r['long_run_peak_memory_gib']:.1f} GiB", "missed")
    console = Console()
    console.print(view)
    console.print("within ±3 % had screens run L steps: " +
                  ", ".join(f"L={length}: {share:.0%}" for length, share in by_screen_length.items()))


if __name__ == "__main__":
    main()
