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

Beside that share, what bounds it and what the search needs from it:

- ``ranking``: the share of config pairs the screens put in the order their long runs do (all pairs,
  and those whose long runs differ by more than twice the tolerance), and the long run of the
  config screened best over the best long run. The search promotes by order, not by value.
- ``same_process``: each long run's own first steps screened as the scheduler would, against that
  run's steady value. Its error is the run's own warm-up drift and step noise, with no second
  process in it: a screen in a separate process cannot be expected to do better.
  Each run's own screen is listed with the share of its steps spent waiting on the data loader in
  the screened steps and in the steady window (``data_wait_share``, rows recorded with it): a run
  that starts fast and slows while its loader's wait grows is host-bound, its loader's prefetched
  batches spent during the screen, which no screen length short of that drain sees. And with the
  GPU's SM clock in both parts, and how often NVML's power or thermal reasons held it down
  (``gpu_clock``, rows recorded with it): a GPU-bound run that slows with its loader idle while its
  clock falls is the GPU reaching its power or heat limit, which a screen of seconds may not reach.
- ``between_processes`` (``--repeat``: a second set of long runs of the same configs, recorded with
  ``--ok-in LONG``): each config's two long runs against each other, the spread between fresh
  processes that no screen, however long, removes.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import platform
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from autotune.bursts import gpu_clock_summary
from autotune.campaign import load_campaign
from autotune.core.knobs import Config
from autotune.core.steady import SteadyEstimate, steady_state
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


def data_wait_share(row: RecordedBurst, steps: slice) -> float | None:
    """The share of ``steps``' time spent waiting on the data loader (``None``: not recorded)."""
    if row.data_wait_seconds is None:
        return None
    return sum(row.data_wait_seconds[steps]) / sum(row.step_seconds[steps])


def gpu_clock(row: RecordedBurst, steps: slice) -> dict | None:
    """The GPU's clock over ``steps`` (:func:`~autotune.bursts.gpu_clock_summary`)."""
    if row.sm_clock_mhz is None or row.clock_held_by is None:
        return None
    return gpu_clock_summary(zip(row.sm_clock_mhz[steps], row.clock_held_by[steps]))


def own_screen(row: RecordedBurst, screen_steps: int, warmup_steps: int, target: float, steady: SteadyEstimate) -> dict:
    """A long run's own first steps screened as the scheduler would, against its steady value, with
    the loader's share of the time and the GPU's clock in each part."""
    screened = screened_estimate(row, screen_steps, warmup_steps, target)
    steps = screened[1] if screened is not None else screen_steps
    parts = {"screened": slice(warmup_steps, steps), "steady": slice(steady.warmup_steps, None)}
    return {"screened": screened[0] if screened is not None else None, "screen_steps": steps,
            "steady": steady.mean, "steady_from_step": steady.warmup_steps,
            "relative_error": screened[0] / steady.mean - 1 if screened is not None else None,
            "data_wait_share": {part: data_wait_share(row, window) for part, window in parts.items()},
            "gpu_clock": {part: gpu_clock(row, window) for part, window in parts.items()}}


def share_within(errors: list[float | None], judged: int) -> float:
    """The share of ``judged`` configs whose relative error is within the tolerance (``None``: no
    estimate, a miss)."""
    return sum(error is not None and abs(error) <= TOLERANCE for error in errors) / judged if judged else 0.0


def ranking(rows: list[dict]) -> dict:
    """How well the screens order the configs: pairs ordered as their long runs order them (all
    pairs, and those whose long runs differ by more than twice the tolerance, which screens within
    the tolerance could not misorder), and what the config screened best ran at over the best."""
    pairs = list(itertools.combinations(rows, 2))
    apart = [(a, b) for a, b in pairs if abs(a["long_run"] / b["long_run"] - 1) > 2 * TOLERANCE]

    def ordered(among: list[tuple[dict, dict]]) -> int:
        return sum((a["screened"] - b["screened"]) * (a["long_run"] - b["long_run"]) > 0 for a, b in among)

    screened_best = max(rows, key=lambda r: r["screened"]) if rows else None
    return {"pairs": len(pairs), "ordered_as_long_runs": ordered(pairs),
            "pairs_apart_over_twice_tolerance": len(apart), "ordered_of_those": ordered(apart),
            "screened_best_long_run_over_best": screened_best["long_run"] / max(r["long_run"] for r in rows)
            if screened_best else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--table", type=Path, required=True, help="the screening table")
    parser.add_argument("--long", type=Path, required=True, help="long runs of some of its configs")
    parser.add_argument("--repeat", type=Path, default=None,
                        help="second long runs of the same configs (fresh processes): the spread between processes")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    table, long = load_table(args.table), load_table(args.long)
    campaign = load_campaign(Path(next(iter(table.rows.values())).contract["campaign"]))
    stages = campaign.spec.stages
    long_runs = {config: row for config, row in long.rows.items() if row.outcome == "ok"}
    for config, row in long_runs.items():
        if len(row.step_seconds) < LONG_RUN_STEPS:
            raise TableError(f"{args.long}: {config.describe()} ran {len(row.step_seconds)} steps, not >= {LONG_RUN_STEPS}")
    steady = {config: steady_state(row.throughput, min_warmup=stages.warmup_steps) for config, row in long_runs.items()}

    def error(screened_from: RecordedBurst, config: Config, length: int) -> float | None:
        """The screen cut at ``length`` steps of ``screened_from`` against the config's long run."""
        screened = screened_estimate(screened_from, length, stages.warmup_steps, stages.target_relative_half_width)
        return screened[0] / steady[config].mean - 1 if screened is not None else None

    rows, failed_later = [], []
    screened_configs: list[Config] = []
    for config, long_row in long.rows.items():
        screened_row = table.row(config)
        if long_row.outcome != "ok":
            failed_later.append({"config": config.to_plain(), "describe": config.describe(),
                                 "screened_outcome": screened_row.outcome, "long_run_outcome": long_row.outcome,
                                 "long_run_steps_done": len(long_row.step_seconds),
                                 "screened_peak_memory_gib": screened_row.peak_memory_gib,
                                 "long_run_peak_memory_gib": long_row.peak_memory_gib})
            continue
        truth = steady[config]
        screened = screened_estimate(screened_row, stages.screen_steps, stages.warmup_steps,
                                     stages.target_relative_half_width)
        if screened is None:
            continue
        estimate, steps = screened
        screened_configs.append(config)
        rows.append({"config": config.to_plain(), "describe": config.describe(), "screen_steps": steps,
                     "screened": estimate, "long_run": truth.mean, "long_run_steady_steps": truth.window,
                     "relative_error": estimate / truth.mean - 1})
    within = sum(abs(r["relative_error"]) <= TOLERANCE for r in rows)
    judged = len(rows) + len(failed_later)
    # What a longer screen would buy: the same share had the campaign screened L steps.
    by_screen_length = {length: share_within([error(table.row(config), config, length) for config in screened_configs], judged)
                        for length in SCREEN_LENGTHS}
    # The same screens cut from each long run itself: its drift and noise, one process.
    same_process = {length: share_within([error(row, config, length) for config, row in long_runs.items()], len(long_runs))
                    for length in SCREEN_LENGTHS}
    between_processes = None
    if args.repeat is not None:
        repeats = {config: row for config, row in load_table(args.repeat).rows.items() if config in long_runs}
        differences = {config: steady_state(row.throughput, min_warmup=stages.warmup_steps).mean / steady[config].mean - 1
                       if row.outcome == "ok" else None for config, row in repeats.items()}
        between_processes = {
            "configs": len(differences), "within_tolerance_share": share_within(list(differences.values()), len(differences)),
            "relative_differences": [{"describe": config.describe(), "repeat_outcome": repeats[config].outcome,
                                      "relative_difference": difference} for config, difference in differences.items()],
        }
    repeat_flag = f" --repeat {args.repeat}" if args.repeat is not None else ""
    result = {
        "benchmark": "fidelity",
        "command": f"python bench/fidelity.py --table {args.table} --long {args.long}{repeat_flag} --out {args.out}",
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
        "ranking": ranking(rows),
        "same_process": {
            "configs": len(long_runs), "within_tolerance_share_by_screen_steps": same_process,
            "runs": [{"describe": config.describe()} | own_screen(row, stages.screen_steps, stages.warmup_steps,
                                                                  stages.target_relative_half_width, steady[config])
                     for config, row in long_runs.items()],
        },
        "between_processes": between_processes,
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
    console.print("the long runs' own first L steps within ±3 % of their steady value (one process): " +
                  ", ".join(f"L={length}: {share:.0%}" for length, share in same_process.items()))
    for run in result["same_process"]["runs"]:
        wait = run["data_wait_share"]
        if run["relative_error"] is not None and wait["screened"] is not None:
            clocks = run["gpu_clock"]
            clock = "" if clocks["screened"] is None or clocks["steady"] is None else (
                f"; SM clock {clocks['screened']['sm_clock_mhz']:,.0f} MHz screened, "
                f"{clocks['steady']['sm_clock_mhz']:,.0f} steady, held down in {clocks['steady']['held_share']:.0%} "
                f"of the steady steps ({', '.join(clocks['steady']['held_by']) or 'nothing'})")
            console.print(f"  {escape(run['describe'])}: its own screen {100 * run['relative_error']:+.1f}% off its steady "
                          f"value; data wait {wait['screened']:.0%} of the screened steps, {wait['steady']:.0%} steady"
                          + clock)
    order = result["ranking"]
    console.print(f"pairs the screens order as the long runs do: {order['ordered_as_long_runs']}/{order['pairs']}; "
                  f"of those apart by more than ±{200 * TOLERANCE:.0f} %: "
                  f"{order['ordered_of_those']}/{order['pairs_apart_over_twice_tolerance']}")
    if between_processes is not None:
        console.print(f"two long runs of one config in fresh processes within ±3 % of each other: "
                      f"{between_processes['within_tolerance_share']:.0%} of {between_processes['configs']}")


if __name__ == "__main__":
    main()
