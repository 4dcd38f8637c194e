"""What a rank process kept across trials saves, and whether it may be kept: bursts run one after
another in one process.

A rank forked new for a trial pays a new process's first step: on an H100 with TE, 11.6-48.9 s
against 0.9-8 s for a steady step (bench/results/h100_outside_steps_20261205/); a campaign keeps a
healthy burst's ranks for its next one (``rank_start: kept``). Here one process (one rank, its
process group up once) runs the campaign's first warm start (A, bring-up), its second (B), then A
again: A's second first step against its first is what a kept process saves at each trial; A's two
loss curves (same seed, same data) and throughputs say whether B left anything behind; the device
memory still allocated after each burst is what a kept rank's check must find back at its baseline.

  python bench/reused_process.py --campaign campaigns/cpu_demo.yaml --out bench/results/reused_process_cpu.json
  python bench/reused_process.py --campaign campaigns/h100_te.yaml --out /tmp/xout/reused_process_h100.json

On a GPU, kernels that accumulate with atomics make losses differ between two new processes too:
``--first-only`` runs A alone (a new process's reference), and ``--cold-reference`` that run's
report puts the difference between new processes beside A's difference after B.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import statistics
from pathlib import Path

import torch
import torch.distributed as dist

from autotune.campaign import load_campaign
from autotune.core.contract import BurstRequest, StepReport
from autotune.core.registry import rank_runner
from autotune.core.steady import steady_state
from trainables.launch import KEPT_ALLOCATED_SLACK_BYTES, allocated_after_burst, device_for

COMPILE_ENVIRONMENT = ("TORCHDYNAMO_DISABLE", "TORCHINDUCTOR_CACHE_DIR", "TORCHINDUCTOR_FX_GRAPH_CACHE",
                       "CUDA_MODULE_LOADING")


def burst(trainable: str, request: BurstRequest, device: torch.device, label: str) -> dict:
    """One burst in this process, what it measured, and the device memory it left allocated."""
    first: list[StepReport] = []

    def reporter(report: StepReport) -> bool:
        if not first:
            first.append(report)
        return True

    result = rank_runner(trainable)(request, device, reporter)
    steps = [record.step_seconds for record in result.records]
    rates = steady_state([record.tokens_per_second for record in result.records], min_warmup=2)
    left = allocated_after_burst(device)  # what a kept rank's check measures
    print(f"{label}: {result.outcome}, first step {steps[0] if steps else float('nan'):.2f} s, "
          f"median {statistics.median(steps[1:]) if len(steps) > 1 else float('nan'):.2f} s"
          + (f", {rates.mean:,.0f} useful tokens/s" if rates is not None else "")
          + (f", {left / 2**20:.0f} MiB left allocated" if left is not None else ""), flush=True)
    return {
        "label": label,
        "config": request.config.describe(),
        "outcome": result.outcome,
        "error": None if result.error is None else result.error[-1500:],
        "step_seconds": steps,
        "data_wait_seconds": [record.data_wait_seconds for record in result.records],
        "first_step_seconds": steps[0] if steps else None,
        "median_step_seconds": statistics.median(steps[1:]) if len(steps) > 1 else None,
        "useful_tokens_per_s": None if rates is None else {"mean": rates.mean, "ci_low": rates.ci_low,
                                                           "ci_high": rates.ci_high},
        "losses": [record.loss for record in result.records],
        "build_phases": [dataclasses.asdict(part) for part in first[0].build_phases] if first else [],
        "memory_allocated_after_bytes": left,
        "contract": None if result.contract is None else result.contract.to_json(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--campaign", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=12, help="steps per burst")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--cold-reference", type=Path, default=None,
                        help="a --first-only run's report: how much A's losses differ between new processes")
    parser.add_argument("--first-only", action="store_true", help="run A alone (a new process's reference)")
    args = parser.parse_args()

    campaign = load_campaign(args.campaign)
    starts = campaign.space.warm_starts
    if not starts:
        raise SystemExit(f"{args.campaign}: its space {campaign.space.name} has no warm start to run")
    a, b = starts[0], starts[1 if len(starts) > 1 else 0]
    device = device_for(0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method="tcp://127.0.0.1:0",
                            rank=0, world_size=1)
    trainable = campaign.spec.trainable
    baseline = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
    runs = []
    order = ((f"A ({a.name}), first in the process", a),) if args.first_only else (
        (f"A ({a.name}), first in the process", a), (f"B ({b.name})", b), (f"A ({a.name}) again, after B", a))
    for label, start in order:
        # One rank here: the campaign's trial size may be larger (the CPU demo's two), the global batch stays.
        request = dataclasses.replace(campaign.burst_request(start.config, args.steps), world_size=1)
        runs.append(burst(trainable, request, device, label))
    dist.destroy_process_group()
    command = f"python bench/reused_process.py --campaign {args.campaign} --steps {args.steps} --out {args.out}"
    if args.first_only:
        command += " --first-only"
    if args.cold_reference is not None:
        command += f" --cold-reference {args.cold_reference}"
    report = {
        "benchmark": "reused_process",
        "command": command,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "python": platform.python_version(),
                    "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"},
        # what decides a first step's warm-up besides the process: megatron-core compiles its fused
        # functions with torch.compile (TORCHDYNAMO_DISABLE=1 runs them eagerly, to see its share)
        "environment": {name: os.environ.get(name) for name in COMPILE_ENVIRONMENT},
        "campaign": str(args.campaign),
        "trainable": trainable,
        "memory_allocated_baseline_bytes": baseline,
        "runs": runs,
        # what a kept rank's check asks after each burst (trainables.launch): the memory back at its start
        "memory_back_after_each_burst": None if baseline is None else [
            run["memory_allocated_after_bytes"] - baseline <= KEPT_ALLOCATED_SLACK_BYTES for run in runs],
    }
    if not args.first_only:
        report.update(compare_again(runs[0], runs[2], args.cold_reference))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"device memory back after each burst: {report['memory_back_after_each_burst']}"
          + ("" if args.first_only else f"; first step {runs[0]['first_step_seconds']} s first in the process, "
             f"{runs[2]['first_step_seconds']} s again after B; the same losses: {report['same_losses']} "
             f"(largest difference {report['largest_loss_difference']}, between new processes "
             f"{report['largest_loss_difference_between_new_processes']})") + f" → {args.out}")


def largest_difference(losses: list[float], others: list[float]) -> float | None:
    """The largest difference between two loss curves, step by step."""
    return max((abs(x - y) for x, y in zip(losses, others)), default=None)


def compare_again(first: dict, again: dict, cold_reference: Path | None) -> dict:
    """What a kept process saves on A's first step, and whether B changed A's run: on a GPU, kernels
    that accumulate with atomics make losses differ between new processes too, so A's difference
    after B is set beside the difference between its first run and a new process's (``cold_reference``)."""
    cold = None if cold_reference is None else json.loads(cold_reference.read_text())["runs"][0]
    return {
        "first_step_saved_seconds": None if first["first_step_seconds"] is None or again["first_step_seconds"] is None
        else first["first_step_seconds"] - again["first_step_seconds"],
        "same_losses": first["losses"] == again["losses"],
        "largest_loss_difference": largest_difference(first["losses"], again["losses"]),
        "largest_loss_difference_between_new_processes": None if cold is None
        else largest_difference(first["losses"], cold["losses"]),
    }


if __name__ == "__main__":
    main()
