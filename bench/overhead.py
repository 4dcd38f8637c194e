"""The tuner's own overhead under load: a replay campaign of 200 trials, 16 at a time, on a local
multi-node Ray cluster (a head that runs no trial and 4 worker nodes), with every record checked.

  python bench/overhead.py --out bench/results/overhead_cpu.json

Overhead is the wall time spent in our parts of Ray Tune's loop — the searcher (Optuna sampling,
rules, memory model, frontier walk, ledger), the scheduler (every step result), the stopper, the
watchdog and the live view — timed around each call, and the CPU time the driver's thread spent in
them (on this 2-core box 16 trial processes and five raylets compete with the driver, so a call's
wall time also counts the time it waited for a core). It is reported as a share of the campaign's wall time, and as
a share of the wall time the recorded campaign would take on its devices (the replayed
device-seconds over the concurrency): the first was dominated by Ray starting 200 trial processes
on this box until replays reused their trial processes, and is now mostly the driver's own loop;
the second is what a user's overnight campaign pays.

The rows: 200 distinct launched trials need a space larger than any recorded table, so the space
is ``cpu_demo`` with micro-batch sizes 1-12, and a config of MBS m replays the recorded row
(``bench/data/cpu_native_vlm.jsonl``) of the same config at the largest recorded MBS <= m. The
rows measure nothing about the model here; they give the tuner real step-time distributions.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import os
import platform
import tempfile
import time
from collections import Counter
from io import StringIO
from pathlib import Path

import ray
import yaml
from ray.cluster_utils import Cluster
from rich.console import Console

from autotune.campaign import load_campaign
from autotune.core.knobs import complete_config
from autotune.core.tables import append_row, load_table
from autotune.engine import tune_roles
from autotune.engine.driver import run_campaign
from autotune.engine.live import LiveView
from autotune.engine.rundir import create_run_dir

ROOT = Path(__file__).resolve().parent.parent
RECORDED = ROOT / "bench/data/cpu_native_vlm.jsonl"
TRIALS, AT_ONCE, NODES = 200, 16, 4
MBS = list(range(1, 13))
TIMED = {
    tune_roles.StudySearcher: ("suggest", "on_trial_complete"),
    tune_roles.ListSearcher: ("suggest", "on_trial_complete"),
    tune_roles.ScreeningScheduler: ("on_trial_result",),
    tune_roles.PinnedRunScheduler: ("choose_trial_to_run",),  # both stages' schedulers, every step of Tune's loop
    tune_roles.RecordingCallback: ("on_trial_start", "on_trial_result"),
    tune_roles.BudgetStopper: ("__call__", "stop_all"),
    tune_roles.HangWatchdog: ("on_step_end",),
    tune_roles.ViewCallback: ("on_trial_start", "on_trial_result", "on_trial_complete", "on_trial_error"),
}


def time_our_parts(spent: Counter, spent_cpu: Counter) -> None:
    """Wrap each of our Tune roles' entry points to add its wall time to ``spent`` and the
    calling thread's CPU time to ``spent_cpu``."""
    for cls, methods in TIMED.items():
        for name in methods:
            original = getattr(cls, name)

            @functools.wraps(original)
            def timed(self, *args, _original=original, _key=f"{cls.__name__}.{name}", **kwargs):
                started, started_cpu = time.perf_counter(), time.thread_time()
                try:
                    return _original(self, *args, **kwargs)
                finally:
                    spent[_key] += time.perf_counter() - started
                    spent_cpu[_key] += time.thread_time() - started_cpu

            setattr(cls, name, timed)


def write_inputs(folder: Path) -> Path:
    """The load campaign, its space and its table, in ``folder``; returns the campaign path."""
    space = yaml.safe_load((ROOT / "search_spaces/cpu_demo.yaml").read_text())
    space["name"] = "cpu_demo_load"
    space["tune"]["micro_batch_size"] = MBS
    (folder / "space.yaml").write_text(yaml.safe_dump(space))
    campaign = yaml.safe_load((ROOT / "campaigns/cpu_demo.yaml").read_text())
    campaign.update(name="overhead", space="space.yaml", output_dir=str(folder / "runs"))
    campaign["hardware"].update(gpus_per_node=AT_ONCE * 2 // NODES, nodes=NODES, gpus_per_trial=2)
    campaign["budget"] = {"max_trials": TRIALS}
    # The space must keep more than 200 runnable configs, which the demo's workload and memory
    # budget leave too few of: no global batch (one micro-batch a replica a step, so every MBS of
    # 1-12 runs), freezing tuned, and no counted memory budget (the rows mapped onto MBS above 8
    # carry MBS 8's peaks, which the memory model would reject).
    campaign["workload"] = {"tunable_freezing": True}
    campaign["hardware"].pop("cpu_device_memory_gib", None)
    path = folder / "campaign.yaml"
    path.write_text(yaml.safe_dump(campaign))
    recorded = load_table(RECORDED)
    loaded = load_campaign(path)
    for config in loaded.space.configs():
        source_mbs = max(m for m in (1, 2, 4, 8) if m <= config.micro_batch_size)
        row = recorded.row(complete_config({**config.to_plain(), "micro_batch_size": source_mbs}))
        append_row(folder / "table.jsonl", row.model_copy(update={
            "config": config.to_plain(),
            "contract": row.contract | {"campaign": str(path), "replayed_from_mbs": source_mbs},
        }))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    spent: Counter = Counter()
    spent_cpu: Counter = Counter()
    time_our_parts(spent, spent_cpu)
    with tempfile.TemporaryDirectory(prefix="overhead-") as scratch:
        folder = Path(scratch)
        campaign = load_campaign(write_inputs(folder))
        campaign = dataclasses.replace(campaign, replay_table=folder / "table.jsonl")
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
        for _ in range(NODES):
            cluster.add_node(num_cpus=AT_ONCE // NODES)
        ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
        try:
            run_dir = create_run_dir(campaign)
            started = time.perf_counter()
            with LiveView(Console(file=StringIO()), campaign.space, campaign.spec.objective) as view:
                run_campaign(campaign, run_dir, view)
            wall = time.perf_counter() - started
        finally:
            ray.shutdown()
            cluster.shutdown()
        entries = list(run_dir.trials.read())
        steps = list(run_dir.steps.read())
    launched = [e for e in entries if e.launched]
    screened = [e for e in launched if e.stage == "screen"]
    missing = [e.trial_id for e in launched if e.steps and sum(1 for s in steps if s.trial_id == e.trial_id) != e.steps]
    if len(screened) != TRIALS or missing:
        raise SystemExit(f"records missing: {len(screened)} of {TRIALS} screening trials, steps short for {missing}")
    overhead, overhead_cpu = sum(spent.values()), sum(spent_cpu.values())
    device_seconds = sum(e.device_seconds for e in launched)
    recorded_wall = device_seconds / 2 / AT_ONCE  # 2 devices a trial, 16 trials at a time
    result = {
        "trials_launched": len(launched), "screening_trials": len(screened), "rejected_before_launch": len(entries) - len(launched),
        "concurrency": AT_ONCE, "outcomes": Counter(e.outcome for e in launched),
        "wall_seconds": wall, "tuner_overhead_seconds": overhead,
        "tuner_overhead_share_of_wall": overhead / wall,
        "tuner_overhead_ms_per_trial": 1000 * overhead / len(launched),
        "recorded_campaign_wall_seconds": recorded_wall,
        "tuner_overhead_share_of_recorded_wall": overhead / recorded_wall,
        "tuner_cpu_seconds": overhead_cpu,
        "tuner_cpu_share_of_wall": overhead_cpu / wall,
        "tuner_cpu_ms_per_trial": 1000 * overhead_cpu / len(launched),
        "overhead_by_part_seconds": dict(spent.most_common()),
        "cpu_by_part_seconds": dict(spent_cpu.most_common()),
        "every_record_present": True,
        "contract": {
            "what": "replay campaign on a local multi-node Ray cluster; bursts replay recorded rows, charging the "
                    "recorded seconds without waiting them",
            "cluster": f"1 head (0 CPUs) + {NODES} nodes x {AT_ONCE // NODES} CPUs on one machine",
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
            "versions": {"python": platform.python_version(), "ray": ray.__version__},
            "table": f"{RECORDED} rows mapped onto cpu_demo with MBS {MBS} (a config replays the same config "
                     "at the largest recorded MBS not above its own)",
            "measured_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(json.dumps({k: v for k, v in result.items()
                      if k not in ("contract", "overhead_by_part_seconds", "cpu_by_part_seconds")},
                     indent=2, default=str))


if __name__ == "__main__":
    main()
