"""On the GPU machine: what still holds device memory after a megatron burst in this process, and
whether ``drop_kept_autograd_graphs`` (trainables/megatron/burst.py) frees it.

Three measurements in one process, each of a campaign's first warm start (or the one a third
argument picks: ``1`` is the TE warm start of the TE campaigns) for a few steps (as
bench/reused_process.py runs it), with the bytes a burst leaves allocated after the collector ran:
1. the burst with ``drop_kept_autograd_graphs`` turned off (its release before 2026-12-06, which
   left 19,584 MiB after bring-up on an H200), then the tensors still alive that carry an autograd
   graph, with their holders, and the referrer chains of the largest CUDA tensors still alive, a
   few levels up (a tensor with no Python referrer is held from C++: an autograd node or a hook);
2. ``drop_kept_autograd_graphs`` applied afterwards to every module still alive;
3. a second burst with the release as it ships (what holds what is left, if the kept check would
   refuse it: with each memory pool's bytes, since a CUDA graph's private pool holds no tensor the
   collector sees).
  PYTHONPATH=/tmp/te-site:/tmp/site:$PWD TORCHDYNAMO_DISABLE=1 python3 bench/device/leak_holders.py \\
    campaigns/h100_te.yaml $OUT/leak_holders.json [WARM_START_INDEX]
"""

from __future__ import annotations

import dataclasses
import gc
import json
import sys
import types
from datetime import datetime, timezone
from pathlib import Path

import megatron.core
import torch
import torch.distributed as dist

from autotune.campaign import load_campaign
from autotune.core.registry import rank_runner
from trainables.launch import KEPT_ALLOCATED_SLACK_BYTES, allocated_after_burst, device_for
from trainables.megatron import burst
from trainables.probe import transformer_engine_status

FAN_OUT = 4
"""Referrers followed per object: enough to name a holder, few enough that six levels stay short."""


def describe(obj: object) -> str:
    if isinstance(obj, dict):
        return f"dict({len(obj)} keys: {list(obj)[:6]})"
    if isinstance(obj, (list, tuple)):
        return f"{type(obj).__name__}[{len(obj)}]"
    if isinstance(obj, types.ModuleType):
        return f"module {obj.__name__}"
    if isinstance(obj, types.FrameType):
        return f"frame {obj.f_code.co_filename}:{obj.f_lineno} {obj.f_code.co_name}"
    if isinstance(obj, types.FunctionType):
        return f"function {obj.__module__}.{obj.__qualname__}"
    if isinstance(obj, types.CellType):
        return "cell"
    if isinstance(obj, types.MethodType):
        return f"bound method {obj.__func__.__qualname__}"
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def chains(target: object, depth: int, seen: set[int], ignore: set[int], lines: list[str], prefix: str = "") -> None:
    if depth == 0:
        return
    holders = [h for h in gc.get_referrers(target) if id(h) not in ignore
               and not (isinstance(h, types.FrameType) and h.f_code.co_name == "chains")]
    ignore.add(id(holders))  # this walk's own lists are not holders
    if not holders:
        lines.append(f"{prefix}(no Python referrer: held from C++)")
    for holder in holders[:FAN_OUT]:
        if id(holder) in seen:
            continue
        seen.add(id(holder))
        lines.append(f"{prefix}<- {describe(holder)}")
        if not isinstance(holder, types.ModuleType):
            chains(holder, depth - 1, seen, ignore, lines, prefix + "  ")


def left_mib(device: torch.device, baseline: int) -> float:
    """What the process holds over ``baseline`` once collected, in MiB (as the kept check measures it)."""
    return round((allocated_after_burst(device) - baseline) / 2**20, 1)


def run_burst(campaign, start, device, baseline: int) -> dict:
    request = dataclasses.replace(campaign.burst_request(start.config, 3), world_size=1)
    result = rank_runner(campaign.spec.trainable)(request, device, None)
    left = left_mib(device, baseline)
    print("outcome", result.outcome, "left", left, "MiB", flush=True)
    return {"outcome": result.outcome, "error": (result.error or "")[:2000], "left_mib": left}


def holders_of_what_is_left() -> list[str]:
    gc.collect()
    tensors = [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.is_cuda]
    modules = [o for o in gc.get_objects() if isinstance(o, torch.nn.Module)]
    lines = [f"{len(tensors)} CUDA tensors alive (those the collector tracks), "
             f"{sum(t.untyped_storage().nbytes() for t in tensors) / 2**20:.0f} MiB of storage; "
             f"{sum(isinstance(t, torch.nn.Parameter) for t in tensors)} parameters; "
             f"{len(modules)} modules: {sorted({type(m).__name__ for m in modules})[:20]}"]
    largest = sorted(tensors, key=lambda t: -t.untyped_storage().nbytes())[:3]
    with_graph = [t for t in tensors if t.grad_fn is not None]
    ignore = {id(tensors), id(modules), id(largest), id(with_graph), id(sys._getframe())}
    lines.append(f"{len(with_graph)} tensors alive carry an autograd graph; the first five's holders:")
    for tensor in with_graph[:5]:
        lines.append(f"  {type(tensor.grad_fn).__name__} {tuple(tensor.shape)}")
        chains(tensor, 2, set(), ignore, lines, "    ")
    for tensor in largest:
        lines.append(f"{type(tensor).__name__} {tuple(tensor.shape)} {tensor.dtype} "
                     f"{tensor.untyped_storage().nbytes() / 2**20:.0f} MiB")
        chains(tensor, 6, set(), ignore, lines, "  ")
    for module in [m for m in modules if type(m).__name__ == "DistributedDataParallel"][:1]:
        lines.append(f"module {type(module).__name__}")
        chains(module, 5, set(), ignore, lines, "  ")
    pools: dict[str, int] = {}
    for segment in torch.cuda.memory_snapshot():  # a CUDA graph's private pool is not a tensor the collector sees
        pool = str(segment.get("segment_pool_id"))
        pools[pool] = pools.get(pool, 0) + segment["allocated_size"]
    lines.append("allocated by memory pool (MiB): " + ", ".join(
        f"{pool} {size / 2**20:.0f}" for pool, size in sorted(pools.items(), key=lambda item: -item[1]) if size))
    print("\n".join(lines), flush=True)
    return lines


def main() -> None:
    campaign = load_campaign(Path(sys.argv[1]))
    out = Path(sys.argv[2])
    start = campaign.space.warm_starts[int(sys.argv[3]) if len(sys.argv) > 3 else 0]
    device = device_for(0)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    baseline = torch.cuda.memory_allocated(device)
    shipped = burst.drop_kept_autograd_graphs
    burst.drop_kept_autograd_graphs = lambda model: None
    report: dict = {"campaign": sys.argv[1], "config": start.name, "steps": 3,
                    "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                    "device": torch.cuda.get_device_name(device), "torch": torch.__version__,
                    "megatron_core": megatron.core.__version__, "transformer_engine": transformer_engine_status()[0]}
    report["without_release"] = run_burst(campaign, start, device, baseline)
    report["holders"] = holders_of_what_is_left()
    for module in [o for o in gc.get_objects() if isinstance(o, torch.nn.Module)]:
        shipped(module)
    module = None
    report["released_afterwards_left_mib"] = left_mib(device, baseline)
    print("released afterwards: left", report["released_afterwards_left_mib"], "MiB", flush=True)
    burst.drop_kept_autograd_graphs = shipped
    report["with_release"] = run_burst(campaign, start, device, baseline)
    if report["with_release"]["left_mib"] * 2**20 > KEPT_ALLOCATED_SLACK_BYTES:  # what the kept check would refuse
        report["holders_with_release"] = holders_of_what_is_left()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
