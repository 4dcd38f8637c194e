"""Where our tuner's spend goes before it promotes a config within 98 % of a table's best: one
replayed campaign per seed, read trial by trial (the search benchmark's median, taken apart).

  python bench/search_trace.py --table bench/data/h200_megatron_vlm.jsonl --seeds 0 1 \
      --out bench/results/search_trace_h200.json

For each seed: every trial in finishing order (stage, outcome, device-seconds, the spend so far
as a fraction of the grid's, the config's share of the best), the screen that found the best, what
screening cost until it ended, the first promotion's cost, and the spend at which a config within
98 % was promoted. Warm start-up is charged where the table recorded it, as the benchmark does.
Needs Ray (a local cluster starts). Prints a line per trial, writes JSON with the contract.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import tempfile
from io import StringIO
from pathlib import Path

from rich.console import Console

from autotune.core.tables import load_table
from autotune.engine.driver import connect, run_campaign
from autotune.engine.live import LiveView
from autotune.engine.rundir import create_run_dir
from autotune.search_benchmark import REACH, Replayer, replay_campaign, run_grid, truth


def trace(table_path: Path, seeds: list[int]) -> dict:
    table = load_table(table_path)
    connect(None)
    runs = []
    with tempfile.TemporaryDirectory(prefix="search-trace-") as folder:
        first = replay_campaign(table, 0, Path(folder))
        verdict = truth(first, table)
        grid = run_grid(Replayer(first, table, verdict, 0)).spent
        for seed in seeds:
            campaign = replay_campaign(table, seed, Path(folder))
            run_dir = create_run_dir(campaign)
            with LiveView(Console(file=StringIO()), campaign.space, campaign.spec.objective) as view:
                run_campaign(campaign, run_dir, view)
            spent, trials, reached, first_promotion = 0.0, [], None, None
            best_screen, best_ratio = None, -1.0
            screening_spent = 0.0
            for entry in run_dir.trials.read():
                spent += entry.device_seconds
                ratio = verdict.ratio(entry.config)
                if entry.stage == "screen":
                    screening_spent = spent
                    if entry.outcome in ("ok", "pruned") and ratio > best_ratio:
                        best_ratio, best_screen = ratio, sum(t["stage"] == "screen" for t in trials) + 1
                elif first_promotion is None:
                    first_promotion = entry.device_seconds
                if entry.stage == "promote" and entry.outcome == "ok" and ratio >= REACH and reached is None:
                    reached = spent
                trials.append({"stage": entry.stage, "outcome": entry.outcome, "origin": entry.origin,
                               "device_seconds": entry.device_seconds, "spent_fraction": spent / grid,
                               "ratio_of_best": ratio, "config": campaign.space.describe(entry.config)})
            runs.append({
                "seed": seed, "trials": trials,
                "screens": sum(t["stage"] == "screen" for t in trials),
                "best_screened_at": best_screen,
                "screening_fraction": screening_spent / grid,
                "first_promotion_fraction": None if first_promotion is None else first_promotion / grid,
                "reached_fraction": None if reached is None else reached / grid,
            })
    return {"table": str(table_path), "grid_gpu_seconds": grid, "start_up_charged": first.replay_start,
            "runs": runs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--table", type=Path, required=True)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    result = trace(args.table, args.seeds)
    for run in result["runs"]:
        print(f"seed {run['seed']}: {run['screens']} screens ({run['screening_fraction']:.3f} of the grid), "
              f"best at screen {run['best_screened_at']}, first promotion {run['first_promotion_fraction']:.3f}, "
              f"reached {run['reached_fraction']}")
        for trial in run["trials"]:
            print(f"  {trial['stage']:8s} {trial['outcome']:13s} {trial['device_seconds']:6.1f} device-s, "
                  f"spent {trial['spent_fraction']:.3f}, {trial['ratio_of_best']:.3f} of the best: {trial['config']}")
    result["contract"] = {
        "command": f"python bench/search_trace.py --table {args.table} --seeds {' '.join(map(str, args.seeds))}",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"python": platform.python_version(), "platform": platform.platform()},
        "unit": "device-seconds as recorded in the table (a replay), warm start-up where recorded",
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
