"""The proposer alone, without Ray: how many times it asks the Optuna study, and how much CPU it
spends, to launch 200 configs of ``bench/overhead.py``'s space (``cpu_demo`` with micro-batch sizes
1-12, the recorded CPU rows mapped onto it), 16 in flight, each completed with its recorded outcome
and steady throughput in launch order. It separates the proposer's cost from Ray's, and counts the
sampler's repeats: how often an ask that came right after a repeat repeated again.

  python bench/proposer_alone.py --seeds 3 --out bench/results/proposer_alone_cpu.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import optuna

from autotune.campaign import load_campaign
from autotune.core.tables import load_table
from autotune.search.proposer import Proposer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead import AT_ONCE, TRIALS, write_inputs  # noqa: E402  (the same space and rows)


def run_seed(seed: int) -> dict:
    folder = Path(tempfile.mkdtemp(prefix="proposer-alone-"))
    campaign = load_campaign(write_inputs(folder))
    table = load_table(folder / "table.jsonl")
    spec = campaign.spec
    proposer = Proposer(
        campaign.space, campaign.rule_context, folder / "study.journal", "alone",
        sampler=spec.search.sampler, seed=seed, startup_trials=spec.search.startup_trials,
        memory=campaign.memory_model(None) if spec.search.memory_model else None,
        memory_frontier=spec.search.memory_frontier,
    )
    proposer.enqueue_warm_starts()
    running, launched = [], 0
    started = time.process_time()
    while launched < TRIALS:
        while len(running) < AT_ONCE and launched < TRIALS and (proposal := proposer.propose()) is not None:
            running.append(proposal)
            launched += 1
        if not running:
            break
        proposal = running.pop(0)
        row = table.row(proposal.config)
        value = statistics.mean(row.throughput[2:]) if row.outcome == "ok" and row.throughput else None
        proposer.complete(proposal, row.outcome, value, cost_seconds=row.cost_seconds,
                          peak_memory_bytes=int(row.peak_memory_gib * 2**30) if row.peak_memory_gib else None)
    cpu = time.process_time() - started
    trials = proposer.study.get_trials(deepcopy=False)

    def repeat(trial: optuna.trial.FrozenTrial) -> bool:
        return "repeat_of" in trial.user_attrs

    def sampled(trial: optuna.trial.FrozenTrial) -> bool:
        return "origin" not in trial.user_attrs

    after_repeat = [later for earlier, later in zip(trials, trials[1:]) if repeat(earlier) and sampled(later)]
    return {
        "seed": seed, "launched": launched, "asks": len(trials), "sampler_asks": sum(map(sampled, trials)),
        "repeats": sum(map(repeat, trials)), "sampler_asks_right_after_a_repeat": len(after_repeat),
        "of_which_repeats": sum(map(repeat, after_repeat)), "cpu_seconds": cpu,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    seeds = [run_seed(seed) for seed in range(args.seeds)]
    result = {
        "seeds": seeds,
        "median_asks": statistics.median(s["asks"] for s in seeds),
        "median_cpu_seconds": statistics.median(s["cpu_seconds"] for s in seeds),
        "contract": {
            "what": "the Proposer alone (Optuna TPE, rules, memory model, frontier walk, journal on disk), no Ray; "
                    "completions in launch order with the recorded outcome and mean throughput after 2 steps",
            "space": "bench/overhead.py's: cpu_demo with MBS 1-12, rows of bench/data/cpu_native_vlm.jsonl mapped onto it",
            "trials": TRIALS, "in_flight": AT_ONCE,
            "machine": {"platform": platform.platform()},
            "versions": {"python": platform.python_version(), "optuna": optuna.__version__},
            "measured_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "contract"}, indent=2))


if __name__ == "__main__":
    main()
