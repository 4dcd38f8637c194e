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

  python bench/bridge_paste_back.py RUN_DIR --steps 50 --out bench/results/bridge_gpu/paste_back.json

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
from dataclasses import asdict, dataclass
from pathlib import Path

from autotune.core.contract import RecipeSpec
from autotune.core.steady import SteadyEstimate, steady_state
from autotune.engine.promotion import gain_between
from autotune.engine.rundir import open_run_dir
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


def launch(spec: RecipeSpec, overrides: list[str], steps: int, memory_cap_fraction: float | None) -> None:
    """What the user's launch script does, in this process (run under ``torchrun``): the recipe
    function, the overrides through Bridge's own parser, ``pretrain()`` with Bridge's VLM forward step.
    The run's length, its log interval, no evaluation and no checkpoint are set on the fields; the
    campaign's memory cap, if it has one, holds here too (the GPU its trials stood in for)."""
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
    pretrain(recipe, forward_step)


def launch_trial_code(run_dir: Path, config: dict, steps: int, records_out: Path) -> None:
    """The campaign's trial of ``config`` run by the trial's own code in this process (under
    ``torchrun``, without Ray or our launcher), with Bridge logging every iteration; its step
    records written to ``records_out``."""
    import dataclasses

    import torch
    import torch.distributed as dist

    from autotune.core.knobs import complete_config
    from trainables.bridge.burst import run_rank

    campaign = open_run_dir(run_dir).load_campaign()
    request = campaign.burst_request(complete_config(config), steps)
    assert request.recipe is not None
    request = dataclasses.replace(request, recipe=dataclasses.replace(
        request.recipe, overrides=(*request.recipe.overrides, "logger.log_interval=1")))
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl")
    try:
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
              memory_cap_fraction: float | None) -> LaunchResult:
    """``launch`` in a fresh process; Bridge's iteration times read from its log."""
    log.info("%s: %s", name, " ".join(shlex.quote(o) for o in overrides))
    returncode, output, wall = _torchrun({"mode": "plain", "spec": asdict(spec), "overrides": overrides,
                                          "steps": steps, "memory_cap_fraction": memory_cap_fraction})
    times, steady = _bridge_clock(output, warmup_steps)
    return LaunchResult(name=name, overrides=overrides, returncode=returncode, wall_seconds=wall,
                        iteration_ms=times, steady_iterations_per_s=steady, log_tail=output[-3000:])


def run_trial_code(name: str, run_dir: Path, config: dict, overrides: list[str], steps: int,
                   warmup_steps: int) -> LaunchResult:
    """``launch_trial_code`` in a fresh process: Bridge's clock from its log, the trial's from its records."""
    log.info("%s: the trial's code on %s", name, config)
    with tempfile.TemporaryDirectory() as folder:
        records_out = Path(folder) / "records.json"
        returncode, output, wall = _torchrun({"mode": "trial", "run_dir": str(run_dir), "config": config,
                                              "steps": steps, "records_out": str(records_out)})
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
    parser.add_argument("--launch", help=argparse.SUPPRESS)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.launch:
        order = json.loads(args.launch)
        if order["mode"] == "trial":
            launch_trial_code(Path(order["run_dir"]), order["config"], order["steps"], Path(order["records_out"]))
            return
        spec = order["spec"]
        launch(RecipeSpec(recipe=spec["recipe"], overrides=tuple(spec["overrides"]), tuned=tuple(spec["tuned"]),
                          hf_checkpoints=tuple(tuple(pair) for pair in spec["hf_checkpoints"])),
               order["overrides"], order["steps"], order["memory_cap_fraction"])
        return
    if args.run_dir is None or args.out is None:
        parser.error("RUN_DIR and --out are required")

    campaign = open_run_dir(args.run_dir).load_campaign()
    spec, report = campaign.recipe, load_report(args.run_dir)
    if spec is None or report.winner is None:
        raise SystemExit(f"{args.run_dir} is not a finished bridge campaign (no recipe or no winner)")
    users_launch = [f"dataset.path={campaign.burst_request(report.winner.config, 1).data.folder}", *spec.overrides,
                    f"train.global_batch_size={campaign.spec.workload.global_batch_size}"]
    warmup, cap = campaign.spec.stages.warmup_steps, campaign.spec.hardware.memory_cap_fraction
    winner_line = exported_line(args.run_dir)
    bring_up = report.bring_up.config.to_plain() if report.bring_up is not None else None
    claimed = report.gain_over_bring_up()
    result = {
        "run_dir": str(args.run_dir), "recipe": spec.recipe, "steps": args.steps, "warmup_steps": warmup,
        "memory_cap_fraction": cap,
        "winner": report.winner.config.describe(), "export_line": winner_line,
        "claimed_gain": None if claimed is None else asdict(claimed),
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
    for _ in range(args.repeats):  # alternated, so a drift of the machine falls on both sides
        as_written = keep(run_plain("as written", spec, users_launch, args.steps, warmup, cap))
        if args.with_trial_code and bring_up is not None:
            keep(run_trial_code("bring-up, trial code", args.run_dir, bring_up, users_launch, args.steps, warmup))
        pasted = keep(run_plain("winner pasted", spec, [*users_launch, *winner_line], args.steps, warmup, cap))
        if args.with_trial_code:
            keep(run_trial_code("winner, trial code", args.run_dir, report.winner.config.to_plain(),
                                [*users_launch, *winner_line], args.steps, warmup))
        result["bridge_timed_gains"].append(bridge_timed_gain(as_written, pasted, args.steps))
        args.out.write_text(json.dumps(result, indent=1, default=str))
    for run in runs:
        ours = "" if run.trial_outcome is None else \
            f"; the trial's records: {run.trial_outcome}, {(run.trial_steady_useful_tokens_per_s or {}).get('mean')} tokens/s"
        print(f"{run.name}: rc {run.returncode}, {len(run.iteration_ms)} iterations logged, steady "
              f"{(run.steady_iterations_per_s or {}).get('mean')} it/s{ours}; "
              f"{run.log_tail[-800:] if run.returncode else ''}")
    print(f"gains by Bridge's timer {result['bridge_timed_gains']}; the campaign's claim {result['claimed_gain']}")


if __name__ == "__main__":
    main()
