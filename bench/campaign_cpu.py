"""The embedded CPU demo campaign end to end: wall time, trials by outcome, the winner against the
bring-up config (both promoted for the same steps), and the device-seconds it took.

Run:  .venv/bin/python bench/campaign_cpu.py [--out bench/results/campaign_cpu.json]
Runs ``autotune run`` (the built-in ``cpu_demo`` campaign, a fresh local Ray cluster) into a
temporary output directory and writes one JSON with the figures and the winner's contract.

      .venv/bin/python bench/campaign_cpu.py --run-dir RUN_DIR --out FILE
reads the same figures from a campaign that ran elsewhere (a GPU campaign's run directory brought
back from the device), with the stack its nodes probed in place of this machine's; its wall time is
not in the run directory, so it is left out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

from autotune.engine.records import TrialEntry, first_step_excess
from autotune.engine.rundir import PROBE_FILE, RunDir
from autotune.report.analysis import load_report


def outside_steps(run_dir: Path, entries: list[TrialEntry], world_size: int) -> list[float]:
    """Each launched trial's device-seconds less its steps' (``step_seconds`` on each of its devices)."""
    training: dict[str, float] = defaultdict(float)
    for step in RunDir(run_dir).steps.read():
        training[step.trial_id] += step.record.step_seconds * world_size
    return [entry.device_seconds - training[entry.trial_id] for entry in entries if entry.launched]


def first_step_excesses(run_dir: Path, world_size: int) -> list[float]:
    """Each trial's first-step warm-up (the ledger's ``first_step_excess``), from ``steps.jsonl``:
    the same figure for runs recorded before the ledger kept it."""
    steps: dict[str, dict[int, float]] = defaultdict(dict)
    for step in RunDir(run_dir).steps.read():
        steps[step.trial_id][step.record.step] = step.record.step_seconds
    excesses = (first_step_excess([seconds[step] for step in sorted(seconds)], world_size)
                for seconds in steps.values() if 0 in seconds)
    return [excess for excess in excesses if excess is not None]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("bench/results/campaign_cpu.json"))
    parser.add_argument("--run-dir", type=Path, help="a campaign's run directory: read it, run nothing")
    args = parser.parse_args()
    if args.run_dir is not None:
        probes = json.loads((args.run_dir / PROBE_FILE).read_text())
        report = summarise(args.run_dir, wall=None, machine={"probed_nodes": probes},
                           command=f"python bench/campaign_cpu.py --run-dir {args.run_dir}")
    else:
        with tempfile.TemporaryDirectory(prefix="campaign-cpu-") as output:
            started = time.monotonic()
            subprocess.run([sys.executable, "-m", "autotune", "run", "--output-dir", output], check=True,
                           env={**os.environ, "RAY_ADDRESS": ""})
            wall = time.monotonic() - started
            (run_dir,) = Path(output).iterdir()
            machine = {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()}
            report = summarise(run_dir, wall, machine, command="python bench/campaign_cpu.py")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2, default=str) + "\n")
    gain = report["gain_over_bring_up"]
    print((f"{report['wall_seconds']:.0f} s · " if report["wall_seconds"] is not None else "")
          + f"median trial {report['median_trial_outside_steps']:.1f} device-s outside its steps"
          + (" (" + ", ".join(f"{part} {seconds:.1f}" for part, seconds in split.items() if not isinstance(seconds, list))
             + "".join(f"; {what}: " + ", ".join(f"{part['name']} {part['seconds']:.2f}" for part in split[field])
                       for what, field in (("build", "build_phases"), ("after steps", "after_steps_parts")) if split[field])
             + ")" if (split := report["spend"].get("median_outside_split")) else "")
          + f" · screening {dict(report['screening']['outcomes'])} · {report['verdict']}"
          + (f" · winner over bring-up {gain['value']:+.1%} [{gain['low']:+.1%}, {gain['high']:+.1%}]"
             if gain is not None else ""))


def summarise(run_dir: Path, wall: float | None, machine: dict, command: str) -> dict:
    """The figures of one campaign's run directory: finished, or cut short (its trials so far)."""
    run = load_report(run_dir)  # what `autotune report` reads: the verdict, bring-up, the gain, the spend
    outside = outside_steps(run_dir, run.entries, run.world_size)
    warm_up = first_step_excesses(run_dir, run.world_size)
    screened = [e for e in run.entries if e.stage == "screen"]
    bring_up, bring_up_long, winner, gain = run.bring_up, run.bring_up_promoted, run.winner, run.gain_over_bring_up()
    return {
        "benchmark": "campaign_cpu" if wall is not None else "campaign_run_dir",
        "command": command,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine,
        "wall_seconds": wall,
        "screening": {"launched": sum(e.launched for e in screened), "outcomes": Counter(e.outcome for e in screened)},
        "promoted": len([e for e in run.entries if e.stage == "promote"]),
        "verdict": run.board.verdict,
        "spend": run.spend.model_dump(mode="json"),
        # every launched trial's device-seconds outside its training steps (start-up, build,
        # teardown), from steps.jsonl: the same figure for a run whose trials predate the spend's
        "outside_steps_per_trial": outside,
        "median_trial_outside_steps": statistics.median(outside) if outside else None,
        # where they went (Tune's trial start, the ranks' start, the build, between steps, after the last)
        "outside_split_per_trial": [e.outside_steps.model_dump() for e in run.entries if e.outside_steps is not None],
        # the first step's time over the trial's median step: a new rank process's warm-up, inside the steps
        "first_step_excess_per_trial": warm_up,
        "median_first_step_excess": statistics.median(warm_up) if warm_up else None,
        # how each launched trial's ranks started: forked from the node's warm zygote, or cold
        "rank_start": Counter(e.contract.rank_start for e in run.entries if e.launched and e.contract is not None),
        # what each launched trial's ranks were given from the fabric under them (and started with)
        "environment": Counter(json.dumps(e.contract.environment, sort_keys=True)
                               for e in run.entries if e.launched and e.contract is not None),
        "objective": "useful_tokens_per_s_per_gpu",
        "bring_up_screen": None if bring_up is None else {"objective": bring_up.objective, "outcome": bring_up.outcome},
        "bring_up_promoted": None if bring_up_long is None else bring_up_long.to_json(),
        "winner": None if winner is None else winner.to_json(),
        # both runs as long as each other: the ratio of their means less one, bounded by their intervals
        "gain_over_bring_up": None if gain is None else {"value": gain.value, "low": gain.low, "high": gain.high,
                                                         "steps": gain.steps, "tie": gain.tie},
    }


if __name__ == "__main__":
    main()
