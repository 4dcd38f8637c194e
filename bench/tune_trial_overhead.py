"""What a Ray Tune trial costs beyond its own work, with and without reusing trial processes.

Run:  .venv/bin/python bench/tune_trial_overhead.py [--trials 8] [--seconds 2] [--out bench/results/tune_trial_overhead_cpu.json]

Each trial sleeps ``--seconds`` after importing what a campaign's trial imports (the tuner's trial
module, with Ray Tune), one trial at a time holding two CPUs, as the CPU demo's trials do; a Tune
run of ``--trials`` such trials is timed with a new process per trial (``reuse_actors=False``) and
with reused processes (``True``: what ``local`` trials with warm rank zygotes use since issue 24).
The figure is (wall - trials x seconds) / trials: Ray's actor start, Tune's setup and teardown per
trial, and the run's own start spread over its trials.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import tempfile
import time
from pathlib import Path

import ray
from ray import tune


def sleeping_trial(config: dict) -> None:
    import autotune.engine.trial  # noqa: F401 - what a campaign's trial process imports

    time.sleep(config["seconds"])
    tune.report({"slept": config["seconds"]})


def one_run(trials: int, seconds: float, reuse: bool, storage: str) -> float:
    started = time.monotonic()
    tune.Tuner(
        tune.with_resources(sleeping_trial, {"CPU": 2}),
        param_space={"seconds": seconds},
        tune_config=tune.TuneConfig(num_samples=trials, max_concurrent_trials=1, reuse_actors=reuse),
        run_config=tune.RunConfig(storage_path=storage, verbose=0),
    ).fit()
    return (time.monotonic() - started - trials * seconds) / trials


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--out", type=Path, default=Path("bench/results/tune_trial_overhead_cpu.json"))
    args = parser.parse_args()
    os.environ["TUNE_DISABLE_AUTO_CALLBACK_LOGGERS"] = "1"
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    with tempfile.TemporaryDirectory(prefix="tune-overhead-") as storage:
        per_trial = {"new_process": one_run(args.trials, args.seconds, False, storage),
                     "reused_process": one_run(args.trials, args.seconds, True, storage)}
    ray.shutdown()
    report = {
        "benchmark": "tune_trial_overhead",
        "command": f"python bench/tune_trial_overhead.py --trials {args.trials} --seconds {args.seconds}",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "versions": {"ray": ray.__version__},
        "code": subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True,
                               cwd=Path(__file__).parent).stdout.strip(),
        "trials": args.trials, "trial_seconds": args.seconds, "cpus_per_trial": 2,
        "seconds_per_trial_beyond_its_work": per_trial,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"per trial beyond its work: new process {per_trial['new_process']:.2f} s, "
          f"reused {per_trial['reused_process']:.2f} s · wrote {args.out}")


if __name__ == "__main__":
    main()
