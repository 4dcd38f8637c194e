"""What a trial pays outside its training steps: CPU demo bursts, each in a fresh process as a trial runs.

Run:  .venv/bin/python bench/burst_startup.py [--warm] [--repeats 3] [--steps 8] [--out FILE]

Each burst runs in a new Python process, as a Ray Tune trial's process starts it: import the tuner,
build the campaign's burst request, call the trainable's burst runner (two rank processes, each with
its DataLoader worker), end. The ranks fork from a zygote the child starts for itself (a cold start),
or with ``--warm`` from one this script started before the first burst and keeps, as a campaign
keeps one per node across its trials (``autotune/engine/warm_ranks.py``); that zygote keeps each burst's
healthy rank processes for the next burst (``rank_start: kept``). The child times, from the burst's call,
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
import tempfile
import time
from pathlib import Path

from autotune.campaign import builtin_campaign_path, load_campaign
from autotune.core.knobs import complete_config
from autotune.core.registry import burst_runner
from trainables import zygote
from burst_cpu import CONFIGS as BURST_CONFIGS  # bench/ is this script's sys.path[0]

CONFIGS = {name: BURST_CONFIGS[name] for name in ("bring-up (MBS 1, full recompute, vision trainable)",
                                                  "MBS 4, selective core_attn, frozen vision")}


def one_burst(name: str, steps: int, warm_ranks: str | None) -> dict:
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

    result = burst_runner(campaign.rule_context.trainable.name, warm_ranks)(request, reporter)
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
        "rank_start": None if result.contract is None else result.contract.rank_start,
        "teardown_s": {part.name: part.seconds for part in result.teardown},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warm", action="store_true", help="fork the ranks from one zygote kept across the bursts")
    parser.add_argument("--out", type=Path, help="default: bench/results/burst_startup_cpu[_warm].json")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--warm-ranks", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one_burst(args.one, args.steps, args.warm_ranks)))
        return
    out = args.out or Path(f"bench/results/burst_startup_cpu{'_warm' if args.warm else ''}.json")
    warm_ranks: list[str] = []
    if args.warm:
        folder = tempfile.mkdtemp(prefix="bench-ranks-")
        zygote.start(f"{folder}/zygote")  # ends with this process
        warm_ranks = ["--warm-ranks", f"{folder}/zygote"]
    runs = []
    for repeat in range(args.repeats):
        for name in CONFIGS:
            launched = time.monotonic()
            child = subprocess.run([sys.executable, __file__, "--one", name, "--steps", str(args.steps), *warm_ranks],
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
        "command": f"python bench/burst_startup.py{' --warm' if args.warm else ''} --repeats {args.repeats} --steps {args.steps}",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "code": subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True,
                               cwd=Path(__file__).parent).stdout.strip(),
        "campaign": "campaigns/cpu_demo.yaml",
        "data_realism": "real",
        "median_outside_steps_s": statistics.median(r["outside_steps_s"] for r in ok) if ok else None,
        "median_process_wall_s": statistics.median(r["process_wall_s"] for r in ok) if ok else None,
        # With --warm, the first burst's ranks fork from the zygote (warm) and the later ones run in
        # the rank processes it kept (kept): what each way of starting costs.
        "median_outside_steps_s_by_rank_start": {
            start: statistics.median(r["outside_steps_s"] for r in ok if r["rank_start"] == start)
            for start in sorted({r["rank_start"] for r in ok})},
        "runs": runs,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"median outside steps {report['median_outside_steps_s']:.1f} s over {len(ok)} ok bursts · wrote {out}")


if __name__ == "__main__":
    main()
