"""What a trial pays outside its training steps: CPU demo bursts, each in a fresh process as a trial runs.

Run:  .venv/bin/python bench/burst_startup.py [--repeats 3] [--steps 8] [--out bench/results/burst_startup_cpu.json]

Each burst runs in a new Python process, as a Ray Tune trial's process starts it: import the tuner,
build the campaign's burst request, call the trainable's burst runner (two rank processes from the
launcher's forkserver, each with its DataLoader worker), end. The child times, from the burst's call,
the first step's end (as the trial's reporter sees it) and the burst's return; the parent times the
whole process. ``outside_steps_s`` is that wall less the burst's summed step times:
the start-up, build and teardown a trial pays on top of training, which issue 24 wants ≤ 2 s on the
CPU demo. Compare code versions by running this on each (``PYTHONPATH=<checkout>``).
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
import time
from pathlib import Path

from autotune.campaign import builtin_campaign_path, load_campaign
from autotune.core.knobs import complete_config
from autotune.core.registry import burst_runner
from burst_cpu import CONFIGS as BURST_CONFIGS  # bench/ is this script's sys.path[0]

CONFIGS = {name: BURST_CONFIGS[name] for name in ("bring-up (MBS 1, full recompute, vision trainable)",
                                                  "MBS 4, selective core_attn, frozen vision")}


def one_burst(name: str, steps: int) -> dict:
    """In the child: one burst of ``CONFIGS[name]`` as a trial runs it; times from this call."""
    started = time.monotonic()
    campaign = load_campaign(builtin_campaign_path("cpu_demo"))
    config = complete_config(CONFIGS[name], defaults=campaign.space.fixed)
    request = campaign.burst_request(config, steps)
    first_report: list[float] = []

    def reporter(report) -> bool:
        if not first_report:
            first_report.append(time.monotonic())
        return True

    result = burst_runner(campaign.rule_context.trainable.name)(request, reporter)
    ended = time.monotonic()
    step_seconds = [r.step_seconds for r in result.records]
    return {
        "outcome": result.outcome,
        "error": result.error,
        "world_size": request.world_size,
        "steps": len(step_seconds),
        "step_seconds": step_seconds,
        "first_step_end_s": (first_report[0] - started) if first_report else None,
        "burst_return_s": ended - started,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", type=Path, default=Path("bench/results/burst_startup_cpu.json"))
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one_burst(args.one, args.steps)))
        return
    runs = []
    for repeat in range(args.repeats):
        for name in CONFIGS:
            launched = time.monotonic()
            child = subprocess.run([sys.executable, __file__, "--one", name, "--steps", str(args.steps)],
                                   capture_output=True, text=True, check=True)
            wall = time.monotonic() - launched
            burst = json.loads(child.stdout.strip().splitlines()[-1])
            burst |= {"name": name, "repeat": repeat, "process_wall_s": wall,
                      "outside_steps_s": wall - sum(burst["step_seconds"]),
                      "load_average_after": os.getloadavg()[0]}
            runs.append(burst)
            print(f"{name} #{repeat}: {burst['outcome']}, wall {wall:.1f} s, steps {sum(burst['step_seconds']):.1f} s, "
                  f"outside steps {burst['outside_steps_s']:.1f} s (the first step ends {burst['first_step_end_s'] or float('nan'):.1f} s "
                  "after the burst's call)")
    ok = [r for r in runs if r["outcome"] == "ok"]
    report = {
        "benchmark": "burst_startup",
        "command": f"python bench/burst_startup.py --repeats {args.repeats} --steps {args.steps}",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "code": subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True,
                               cwd=Path(__file__).parent).stdout.strip(),
        "campaign": "campaigns/cpu_demo.yaml",
        "data_realism": "real",
        "median_outside_steps_s": statistics.median(r["outside_steps_s"] for r in ok) if ok else None,
        "median_process_wall_s": statistics.median(r["process_wall_s"] for r in ok) if ok else None,
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"median outside steps {report['median_outside_steps_s']:.1f} s over {len(ok)} ok bursts · wrote {args.out}")


if __name__ == "__main__":
    main()
