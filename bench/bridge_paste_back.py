"""The paste-back check of a ``bridge`` campaign: its winner's ``autotune export`` line pasted into the
user's own Megatron-Bridge launch, timed by Bridge itself.

A winner is only worth what it keeps in the user's run. This runs the campaign's recipe as a user's
launch script does (their recipe function, their overrides, Bridge's ``pretrain()`` with Bridge's VLM
forward step under ``torchrun``; none of our code in the loop: no callback, no step records), twice
in fresh processes at the campaign's global batch: as written, and with the winner's export line
appended. Bridge logs every iteration (``logger.log_interval=1``); its own "elapsed time per
iteration" over the steady window (the campaign's warm-up skipped, the campaign's steady-state
estimator) gives the speedup the user sees, put beside the campaign's claim (winner over bring-up,
both promoted runs). Both runs draw the same samples (same recipe seed, same global batch), so the
ratio of iteration rates is the ratio of useful tokens/s.

``--with-trial-code`` adds the same two configs run by the trial's own code (``trainables.bridge.burst``:
its recipe preparation and step-recording callback) under ``torchrun`` without Ray or our launcher, Bridge
logging every iteration: Bridge's clock and the trial's records of the same steps side by side. Set
against the plain runs and the campaign's trials, it says where a gap comes from (the callback, the
timing window, or the way trials are launched).

``--winner-only --with-trial-code --repeats N`` runs the winner's sides alone, alternated, each in
N fresh processes (``--bisect`` adds the two halves of what a trial does differently: its process
group started first, its recipe without its callback): whether the pasted export runs as the trial
did, bounded by how far fresh processes of one side move (``winner_across_processes`` in the result:
the spread between processes, and the pasted sides over the trial's, as a campaign with
``stages.promote_repeats`` bounds a gain).

  python bench/bridge_paste_back.py RUN_DIR --steps 50 --out bench/results/bridge_gpu/paste_back.json
  python bench/bridge_paste_back.py RUN_DIR --winner-only --with-trial-code --bisect --repeats 2 --out …
  python bench/bridge_paste_back.py --summarise RESULT_JSON   # recompute that summary of a result file

On the GPU machine with Bridge 0.6.2, megatron-core 0.19.2 and TE on ``PYTHONPATH`` (bench/README.md).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from autotune.campaign import Campaign
from autotune.core.contract import RecipeSpec
from autotune.core.steady import SteadyEstimate, over_processes, process_spread, steady_state
from autotune.engine.promotion import gain_between
from autotune.engine.records import TrialEntry
from autotune.engine.rundir import RunDir, open_run_dir
from autotune.report.analysis import load_report

log = logging.getLogger("bridge_paste_back")

ITERATION_LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): ([\d.]+)")
"""Bridge 0.6's training log line (``training/utils/train_utils.py``, ``training_log``)."""


@dataclass(frozen=True)
class LaunchResult:
    """One plain Bridge run as its log tells it."""

    name: str
    overrides: list[str]
    returncode: int
    wall_seconds: float
    iteration_ms: list[float]
    """Bridge's "elapsed time per iteration (ms)" of iterations 1, 2, … (logged every iteration)."""
    steady_iterations_per_s: dict | None
    log_tail: str
    trial_step_seconds: list[float] | None = None
    """The trial code's own step records of the same steps (``--with-trial-code`` runs only)."""
    trial_steady_useful_tokens_per_s: dict | None = None
    trial_outcome: str | None = None


def launch(spec: RecipeSpec, overrides: list[str], steps: int, memory_cap_fraction: float | None,
           process_group_first: bool = False) -> None:
    """What the user's launch script does, in this process (run under ``torchrun``): the recipe
    function, the overrides through Bridge's own parser, ``pretrain()`` with Bridge's VLM forward step.
    The run's length, its log interval, no evaluation and no checkpoint are set on the fields; the
    campaign's memory cap, if it has one, holds here too (the GPU its trials stood in for).
    ``process_group_first``: the device set and the NCCL group made before ``pretrain()``, as the
    trial's launcher does (Bridge then keeps that group instead of making its own)."""
    import torch

    from trainables.bridge.recipe import go_offline, load_recipe_function, set_burst_length

    go_offline(spec, Path(tempfile.mkdtemp(prefix="hf-offline-")) / "hub")
    if memory_cap_fraction:
        torch.cuda.set_per_process_memory_fraction(memory_cap_fraction, int(os.environ.get("LOCAL_RANK", 0)))
    from megatron.bridge.training.pretrain import pretrain
    from megatron.bridge.training.utils.omegaconf_utils import process_config_with_overrides
    from megatron.bridge.training.vlm_step import forward_step

    recipe = load_recipe_function(spec.recipe)()
    process_config_with_overrides(recipe, cli_overrides=overrides)
    set_burst_length(recipe, steps)
    recipe.logger.log_interval = 1
    if process_group_first:
        _process_group_as_trials_make_it()
    pretrain(recipe, forward_step)


def _process_group_as_trials_make_it() -> None:
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))))
    dist.init_process_group("nccl")


def launch_trial_code(run_dir: Path, config: dict, steps: int, records_out: Path, record_steps: bool = True) -> None:
    """The campaign's trial of ``config`` run by the trial's own code in this process (under
    ``torchrun``, without Ray or our launcher), with Bridge logging every iteration; its step
    records written to ``records_out``. Without ``record_steps``: the trial's recipe preparation and
    process group, then Bridge's ``pretrain()`` with its own forward step and no callback (what the
    step recording costs, if anything)."""
    import dataclasses

    import torch
    import torch.distributed as dist

    from autotune.core.knobs import complete_config
    from trainables.bridge.burst import run_rank
    from trainables.bridge.recipe import go_offline, prepare

    campaign = open_run_dir(run_dir).load_campaign()
    request = campaign.burst_request(complete_config(config), steps)
    assert request.recipe is not None
    request = dataclasses.replace(request, recipe=dataclasses.replace(
        request.recipe, overrides=(*request.recipe.overrides, "logger.log_interval=1")))
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl")
    try:
        if not record_steps:
            import megatron.core

            go_offline(request.recipe, Path(tempfile.mkdtemp(prefix="hf-offline-")) / "hub")
            if request.memory_cap_fraction:
                torch.cuda.set_per_process_memory_fraction(request.memory_cap_fraction, device)
            from megatron.bridge.training.pretrain import pretrain
            from megatron.bridge.training.vlm_step import forward_step

            pretrain(prepare(request, megatron.core.__version__)[0], forward_step)
            return
        result = run_rank(request, device)
    finally:
        dist.destroy_process_group()
    records_out.write_text(json.dumps({"outcome": result.outcome, "error": result.error,
                                       "records": [asdict(record) for record in result.records]}))


def _torchrun(order: dict) -> tuple[int, str, float]:
    """This script's ``--launch`` with ``order`` under ``torchrun`` on one GPU, in a fresh process."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", __file__, "--launch",
               json.dumps(order)]
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return done.returncode, done.stdout + done.stderr, time.perf_counter() - started


def _bridge_clock(output: str, warmup_steps: int) -> tuple[list[float], dict | None]:
    """Bridge's "elapsed time per iteration" of each logged iteration, and their steady rate."""
    by_iteration = {int(i): float(ms) for i, ms in ITERATION_LINE.findall(output)}
    times = [by_iteration[i] for i in sorted(by_iteration)]
    estimate = steady_state([1000.0 / ms for ms in times], min_warmup=warmup_steps) if times else None
    return times, None if estimate is None else estimate.to_dict()


def run_plain(name: str, spec: RecipeSpec, overrides: list[str], steps: int, warmup_steps: int,
              memory_cap_fraction: float | None, process_group_first: bool = False) -> LaunchResult:
    """``launch`` in a fresh process; Bridge's iteration times read from its log."""
    log.info("%s: %s", name, " ".join(shlex.quote(o) for o in overrides))
    returncode, output, wall = _torchrun({"mode": "plain", "spec": asdict(spec), "overrides": overrides,
                                          "steps": steps, "memory_cap_fraction": memory_cap_fraction,
                                          "process_group_first": process_group_first})
    times, steady = _bridge_clock(output, warmup_steps)
    return LaunchResult(name=name, overrides=overrides, returncode=returncode, wall_seconds=wall,
                        iteration_ms=times, steady_iterations_per_s=steady, log_tail=output[-3000:])


def run_trial_code(name: str, run_dir: Path, config: dict, overrides: list[str], steps: int,
                   warmup_steps: int, record_steps: bool = True) -> LaunchResult:
    """``launch_trial_code`` in a fresh process: Bridge's clock from its log, the trial's from its records."""
    log.info("%s: the trial's code on %s", name, config)
    with tempfile.TemporaryDirectory() as folder:
        records_out = Path(folder) / "records.json"
        returncode, output, wall = _torchrun({"mode": "trial", "run_dir": str(run_dir), "config": config,
                                              "steps": steps, "records_out": str(records_out),
                                              "record_steps": record_steps})
        ran = json.loads(records_out.read_text()) if records_out.is_file() else {"outcome": None, "records": []}
    times, steady = _bridge_clock(output, warmup_steps)
    records = ran["records"]
    ours = steady_state([r["useful_tokens"] / r["step_seconds"] for r in records], min_warmup=warmup_steps) \
        if records else None
    return LaunchResult(name=name, overrides=overrides, returncode=returncode, wall_seconds=wall,
                        iteration_ms=times, steady_iterations_per_s=steady,
                        log_tail=(output + (ran.get("error") or ""))[-3000:],
                        trial_step_seconds=[r["step_seconds"] for r in records],
                        trial_steady_useful_tokens_per_s=None if ours is None else ours.to_dict(),
                        trial_outcome=ran["outcome"])


def winner_across_processes(runs: list[dict], steps: int) -> dict | None:
    """What the winner's runs say together (each a fresh process, Bridge's clock): their steady
    rates by side; how far one process lands from another of the same side (the spread pooled over
    the sides, as a campaign with ``stages.promote_repeats`` pools it over configs); and the pasted
    export (plain launches) over the trial's code, each side over its processes, bounded as the
    campaign bounds a gain. A gain whose bounds hold 0 says the export runs as the trial did."""
    sides: dict[str, list[SteadyEstimate]] = {}
    for run in runs:
        if run["name"].startswith("winner") and run["steady_iterations_per_s"]:
            sides.setdefault(run["name"], []).append(SteadyEstimate(**run["steady_iterations_per_s"]))
    spread = process_spread([[e.mean for e in estimates] for estimates in sides.values()])
    if spread is None:
        return None
    plain = [e for name, estimates in sides.items() if "trial code" not in name for e in estimates]
    trial = [e for name, estimates in sides.items() if "trial code" in name for e in estimates]
    gain = None
    if plain and trial:
        gain = gain_between(over_processes(plain, spread), over_processes(trial, spread), steps)
    return {"iterations_per_s": {name: [e.mean for e in estimates] for name, estimates in sides.items()},
            "process_spread": asdict(spread),
            "within_run_relative_half_width": {name: [e.relative_half_width for e in estimates]
                                               for name, estimates in sides.items()},
            "pasted_over_trial_code": None if gain is None else asdict(replace(gain, processes=min(len(plain),
                                                                                                  len(trial))))}


def winner_claim(run_dir: RunDir, campaign: Campaign, winner: TrialEntry) -> dict:
    """The campaign's winner as it claims it: its objective's mean and interval (over its processes),
    and the useful tokens an iteration of its trials carried per device (which turn Bridge's
    iterations/s into the campaign's unit)."""
    runs = set(winner.runs or (winner.trial_id,))
    tokens = [line.record.useful_tokens for line in run_dir.steps.read() if line.trial_id in runs]
    return {"objective": campaign.spec.objective, "mean": winner.objective, "ci_low": winner.estimate.ci_low,
            "ci_high": winner.estimate.ci_high, "processes": winner.processes,
            "useful_tokens_per_step_per_device": sum(tokens) / len(tokens) / campaign.spec.hardware.gpus_per_trial}


def pasted_against_claim(runs: list[dict], claim: dict) -> dict | None:
    """Each pasted run's rate in the campaign's unit (Bridge's iterations/s times the useful tokens
    an iteration of the winner's trials carried, per device: both draw the same samples), and
    whether it falls inside the winner's claimed interval."""
    pasted = [run["steady_iterations_per_s"]["mean"] for run in runs
              if run["name"] == "winner pasted" and run["steady_iterations_per_s"]]
    if not pasted:
        return None
    rates = [rate * claim["useful_tokens_per_step_per_device"] for rate in pasted]
    return {"useful_tokens_per_s_per_device": rates,
            "inside_the_winners_interval": [claim["ci_low"] <= rate <= claim["ci_high"] for rate in rates]}


def exported_line(run_dir: Path) -> list[str]:
    """The winner's Bridge overrides exactly as ``autotune export`` prints them for the user to paste."""
    printed = subprocess.run([sys.executable, "-m", "autotune", "export", str(run_dir), "--format", "bridge"],
                             capture_output=True, text=True, check=True).stdout
    lines = [line for line in printed.splitlines() if line.strip() and not line.startswith("#")]
    if len(lines) != 1:
        raise SystemExit(f"autotune export printed {len(lines)} override lines, expected one:\n{printed}")
    return shlex.split(lines[0])


def bridge_timed_gain(as_written: LaunchResult, pasted: LaunchResult, steps: int) -> dict | None:
    """The pasted run over the recipe as written, by Bridge's timer: its steady iteration rate over
    the other's, bounded as the campaign bounds its own gain (:func:`gain_between`)."""
    if as_written.steady_iterations_per_s is None or pasted.steady_iterations_per_s is None:
        return None
    gain = gain_between(SteadyEstimate(**pasted.steady_iterations_per_s),
                        SteadyEstimate(**as_written.steady_iterations_per_s), steps)
    return None if gain is None else asdict(gain)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path, nargs="?")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--repeats", type=int, default=1, help="run every side this many times, alternated")
    parser.add_argument("--with-trial-code", action="store_true",
                        help="also run both configs with the trial's own code (module docstring)")
    parser.add_argument("--winner-only", action="store_true",
                        help="run the winner's sides only (no as-written run, no gain): does the pasted export "
                             "run as fast as the trial's code, alternated in the same call")
    parser.add_argument("--bisect", action="store_true",
                        help="also run the winner pasted with the process group made first, as trials make it, "
                             "and the trial's code without its step-recording callback")
    parser.add_argument("--summarise", type=Path, metavar="RESULT_JSON",
                        help="recompute the summaries of an earlier result file in place (its RUN_DIR: the one it names)")
    parser.add_argument("--launch", help=argparse.SUPPRESS)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.launch:
        order = json.loads(args.launch)
        if order["mode"] == "trial":
            launch_trial_code(Path(order["run_dir"]), order["config"], order["steps"], Path(order["records_out"]),
                              order["record_steps"])
            return
        spec = order["spec"]
        launch(RecipeSpec(recipe=spec["recipe"], overrides=tuple(spec["overrides"]), tuned=tuple(spec["tuned"]),
                          hf_checkpoints=tuple(tuple(pair) for pair in spec["hf_checkpoints"])),
               order["overrides"], order["steps"], order["memory_cap_fraction"], order["process_group_first"])
        return
    if args.summarise:
        earlier = json.loads(args.summarise.read_text())
        earlier["winner_across_processes"] = winner_across_processes(earlier["runs"], earlier["steps"])
        path = args.run_dir or Path(earlier["run_dir"])
        run_dir, winner = open_run_dir(path), load_report(path).winner
        if winner is None:
            raise SystemExit(f"{path} has no winner")
        earlier["winner_claim"] = claim = winner_claim(run_dir, run_dir.load_campaign(check_inputs=False), winner)
        earlier["pasted_against_claim"] = pasted_against_claim(earlier["runs"], claim)
        args.summarise.write_text(json.dumps(earlier, indent=1, default=str))
        print(json.dumps({key: earlier[key] for key in ("winner_across_processes", "winner_claim",
                                                        "pasted_against_claim")}, indent=1))
        return
    if args.run_dir is None or args.out is None:
        parser.error("RUN_DIR and --out are required")

    run_dir = open_run_dir(args.run_dir)
    campaign = run_dir.load_campaign()
    spec, report = campaign.recipe, load_report(args.run_dir)
    if spec is None or report.winner is None:
        raise SystemExit(f"{args.run_dir} is not a finished bridge campaign (no recipe or no winner)")
    users_launch = [f"dataset.path={campaign.burst_request(report.winner.config, 1).data.folder}", *spec.overrides,
                    f"train.global_batch_size={campaign.spec.workload.global_batch_size}"]
    warmup, cap = campaign.spec.stages.warmup_steps, campaign.spec.hardware.memory_cap_fraction
    winner_line = exported_line(args.run_dir)
    bring_up = report.bring_up.config.to_plain() if report.bring_up is not None else None
    claimed, claim = report.gain_over_bring_up(), winner_claim(run_dir, campaign, report.winner)
    result = {
        "run_dir": str(args.run_dir), "recipe": spec.recipe, "steps": args.steps, "warmup_steps": warmup,
        "memory_cap_fraction": cap,
        "winner": report.winner.config.describe(), "export_line": winner_line,
        "claimed_gain": None if claimed is None else asdict(claimed), "winner_claim": claim,
        "contract": None if report.winner.contract is None else report.winner.contract.to_json(),
        "bridge_timed_gains": [], "runs": [], "date": time.strftime("%Y-%m-%d"),
    }
    runs: list[LaunchResult] = []

    def keep(run: LaunchResult) -> LaunchResult:
        """Every finished run is written out at once: a machine lost mid-way keeps the runs it finished."""
        runs.append(run)
        result["runs"].append(asdict(run))
        log.info("%s: rc %d, %d iterations logged, Bridge's steady %s it/s, the trial's records %s tokens/s",
                 run.name, run.returncode, len(run.iteration_ms), (run.steady_iterations_per_s or {}).get("mean"),
                 (run.trial_steady_useful_tokens_per_s or {}).get("mean"))
        args.out.write_text(json.dumps(result, indent=1, default=str))
        return run

    args.out.parent.mkdir(parents=True, exist_ok=True)
    pasted_line, winner = [*users_launch, *winner_line], report.winner.config.to_plain()
    for _ in range(args.repeats):  # alternated, so a drift of the machine falls on both sides
        as_written = None if args.winner_only else \
            keep(run_plain("as written", spec, users_launch, args.steps, warmup, cap))
        if args.with_trial_code and bring_up is not None and not args.winner_only:
            keep(run_trial_code("bring-up, trial code", args.run_dir, bring_up, users_launch, args.steps, warmup))
        pasted = keep(run_plain("winner pasted", spec, pasted_line, args.steps, warmup, cap))
        if args.with_trial_code:
            keep(run_trial_code("winner, trial code", args.run_dir, winner, pasted_line, args.steps, warmup))
        if args.bisect:
            keep(run_plain("winner pasted, process group first", spec, pasted_line, args.steps, warmup, cap,
                           process_group_first=True))
            keep(run_trial_code("winner, trial code without its callback", args.run_dir, winner, pasted_line,
                                args.steps, warmup, record_steps=False))
        if as_written is not None:
            result["bridge_timed_gains"].append(bridge_timed_gain(as_written, pasted, args.steps))
        result["winner_across_processes"] = winner_across_processes(result["runs"], args.steps)
        result["pasted_against_claim"] = pasted_against_claim(result["runs"], claim)
        args.out.write_text(json.dumps(result, indent=1, default=str))
    for run in runs:
        ours = "" if run.trial_outcome is None else \
            f"; the trial's records: {run.trial_outcome}, {(run.trial_steady_useful_tokens_per_s or {}).get('mean')} tokens/s"
        print(f"{run.name}: rc {run.returncode}, {len(run.iteration_ms)} iterations logged, steady "
              f"{(run.steady_iterations_per_s or {}).get('mean')} it/s{ours}; "
              f"{run.log_tail[-800:] if run.returncode else ''}")
    print(f"gains by Bridge's timer {result['bridge_timed_gains']}; the campaign's claim {result['claimed_gain']}")
    print(f"the winner pasted, in the campaign's unit: {result['pasted_against_claim']}; its claim {claim}")


if __name__ == "__main__":
    main()
