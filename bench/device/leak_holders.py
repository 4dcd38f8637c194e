"""On the GPU machine: what still holds device memory after one megatron burst in this process.

Runs a campaign's first warm start for a few steps in this process (as bench/reused_process.py does),
collects, then walks the garbage collector's view from the largest CUDA tensors still alive to their
holders, a few levels up, and prints each chain: the object a kept rank must not keep. Then it tries
the first suspect (2026-12-06, read in megatron-core 0.19.2, not yet run): megatron-core's DDP hooks
each parameter's gradient accumulator (C++ nodes it keeps in ``grad_accs``) with a closure over
itself, and the collector follows a node to its hooks only while the node has one owner; it clears
those lists and the config's sync functions (which reach the optimizer), collects, and prints the
memory again.
  PYTHONPATH=/tmp/te-site:/tmp/site:$PWD TORCHDYNAMO_DISABLE=1 python3 bench/device/leak_holders.py campaigns/h100_te.yaml
"""

from __future__ import annotations

import dataclasses
import gc
import sys
import types
from pathlib import Path

import torch
import torch.distributed as dist

from autotune.campaign import load_campaign
from autotune.core.registry import rank_runner
from trainables.launch import allocated_after_burst, device_for, free_port


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


def chains(target: object, depth: int, seen: set[int], ignore: set[int], prefix: str = "") -> None:
    if depth == 0:
        return
    for holder in gc.get_referrers(target)[:10]:
        if id(holder) in ignore or id(holder) in seen or isinstance(holder, types.FrameType) and holder.f_code.co_name == "chains":
            continue
        seen.add(id(holder))
        print(f"{prefix}<- {describe(holder)}")
        if isinstance(holder, types.ModuleType):
            continue
        chains(holder, depth - 1, seen, ignore, prefix + "  ")


def main() -> None:
    campaign = load_campaign(Path(sys.argv[1]))
    start = campaign.space.warm_starts[0]
    device = device_for(0)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    baseline = torch.cuda.memory_allocated(device)
    request = dataclasses.replace(campaign.burst_request(start.config, 3), world_size=1)
    result = rank_runner(campaign.spec.trainable)(request, device, None)
    print("outcome", result.outcome, "left", (allocated_after_burst(device) - baseline) / 2**20, "MiB")
    del result
    gc.collect()
    tensors = [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.is_cuda]
    print(len(tensors), "CUDA tensors alive,", sum(t.untyped_storage().nbytes() for t in tensors) / 2**20, "MiB of storage")
    print("parameters alive:", sum(isinstance(t, torch.nn.Parameter) for t in tensors))
    modules = [o for o in gc.get_objects() if isinstance(o, torch.nn.Module)]
    print("modules alive:", len(modules), sorted({type(m).__name__ for m in modules})[:20])
    largest = sorted(tensors, key=lambda t: -t.untyped_storage().nbytes())[:3]
    ignore = {id(tensors), id(modules), id(largest), id(sys._getframe())}
    for tensor in largest:
        print(f"\n{type(tensor).__name__} {tuple(tensor.shape)} {tensor.dtype} {tensor.untyped_storage().nbytes() / 2**20:.0f} MiB")
        chains(tensor, 6, set(), ignore)
    roots = [m for m in modules if type(m).__name__ in ("DistributedDataParallel", "GPTModel", "MoEVLM", "VLMModel")]
    for module in roots[:2]:
        print(f"\nmodule {type(module).__name__}")
        chains(module, 5, set(), ignore)
    for wrapper in (m for m in modules if type(m).__name__ == "DistributedDataParallel"):
        wrapper.grad_accs.clear()
        for name in ("no_sync_func", "grad_sync_func", "param_sync_func", "finalize_model_grads_func", "grad_scale_func"):
            if hasattr(wrapper.config, name):
                setattr(wrapper.config, name, None)
    tensors = modules = largest = roots = tensor = module = wrapper = None  # this frame's references go first
    print("\nafter clearing DDP's grad_accs and the config's sync functions:",
          (allocated_after_burst(device) - baseline) / 2**20, "MiB left")


if __name__ == "__main__":
    main()
