"""One burst of the native MoE VLM on one rank: build, parallelize, train ``steps`` steps on real
data, and report a :class:`~autotune.core.contract.StepRecord` per step (summed over ranks).

How the ranks' processes start is not this module's concern: ``launch.py`` spawns them locally;
a Ray Train worker group can call :func:`run_rank` the same way once ``torch.distributed`` is up.
"""

from __future__ import annotations

import resource
import time
import traceback
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel

from autotune.core.contract import (
    BurstRequest,
    BurstResult,
    Contract,
    Evidence,
    InvalidConfig,
    Reporter,
    Shapes,
    StepRecord,
    TimedPart,
)
from trainables.data.loader import MicroBatch, rank_loader
from trainables.measurement import measurement_contract
from trainables.native.cuda_graphs import apply_cuda_graphs
from trainables.native.device_memory import CountedDeviceMemory
from trainables.native.model import GroupedExperts, MoEVLM
from trainables.native.parallelize import (
    ParallelGroups,
    apply_data_parallel,
    apply_expert_parallel,
    make_groups,
    sync_expert_gradients,
)
from trainables.native.recompute import Checkpointed, apply_recompute
from trainables.stage_clock import StageClock
from trainables.steps import BuildClock, LocalMeasures, count_batches, finish_step, peak_memory_bytes, run_steps

OOM_ERRORS = (torch.OutOfMemoryError, MemoryError)
CPU_ALLOCATION_FAILURE = "DefaultCPUAllocator: can't allocate memory"


@dataclass
class BurstRun:
    """What every step of one rank's burst shares."""

    request: BurstRequest
    device: torch.device
    rank: int
    model: MoEVLM
    wrapped: nn.Module
    """The module to call: the model under DDP or FSDP2 (or the model itself on one rank)."""
    groups: ParallelGroups
    expert_params: list[nn.Parameter]
    checkpoints: list[Checkpointed]
    graphed: list[nn.Module]
    clock: StageClock
    batches: Iterator[MicroBatch]
    optimizer: torch.optim.Optimizer
    micro_batches: int
    """Micro-batches this replica accumulates into each optimizer step."""
    memory: CountedDeviceMemory | None = None
    """The rank's counted device memory (a CPU burst with ``cpu_device_memory_bytes``)."""
    build_phases: tuple[TimedPart, ...] = ()

    def peak_memory_bytes(self) -> int:
        return self.memory.peak_bytes if self.memory is not None else peak_memory_bytes(self.device)

    @property
    def world_size(self) -> int:
        return self.request.world_size

    def evidence(self) -> Evidence:
        """What the run observed of its knobs, and per knob whether that matches the config."""
        observed = self._observed()
        return Evidence(checks=self._checks(observed), **observed)

    def contract(self) -> Contract:
        return native_contract(self.request, self.device)

    def _checks(self, observed: dict[str, Any]) -> dict[str, bool]:
        config = self.request.config
        return {
            "recompute_granularity": (observed["recompute_calls"] > 0) == (config.recompute_granularity != "none"),
            "freeze_vision_model": observed["frozen_vision_params_with_grad"] in (None, 0),
            "expert_model_parallel_size": observed["ep_group_size"] == config.expert_model_parallel_size,
            "use_torch_fsdp2": observed["fsdp2_sharded"] == bool(config.use_torch_fsdp2 and self.world_size > 1),
            "cuda_graph_impl": (observed["cuda_graph_replays"] > 0) == (config.cuda_graph_impl != "none"),
        }

    def _observed(self) -> dict[str, Any]:
        config = self.request.config
        return {
            "recompute_wrappers": len(self.checkpoints),
            "recompute_calls": sum(c.calls for c in self.checkpoints),
            "frozen_vision_params_with_grad": sum(p.grad is not None for p in self.model.vision.parameters())
            if config.freeze_vision_model else None,
            "ep_group_size": self.groups.ep_size,
            "local_experts_per_moe_layer": next(
                m.local_count for m in self.model.modules() if isinstance(m, GroupedExperts)
            ),
            "data_parallel": type(self.wrapped).__name__,
            "fsdp2_sharded": isinstance(self.wrapped, FSDPModule),
            "cuda_graph_units": len(self.graphed),
            "cuda_graph_replays": sum(module.graph_replays for module in self.graphed),
        }


def build_run(request: BurstRequest, device: torch.device, build: BuildClock) -> BurstRun:
    """The model with recompute, freezing, CUDA graphs, expert and data parallelism applied.

    Raises:
        InvalidConfig: the config asks for what this trainable cannot build here (CUDA graphs
            off CUDA or with FSDP2, an EP size that does not divide the ranks or the experts, a
            vocabulary smaller than the tokenizer's, a global batch that is not a whole number
            of micro-batches).
    """
    config = request.config
    world = request.world_size
    rank = dist.get_rank() if world > 1 else 0
    micro_batches = request.micro_batches_per_step
    if config.cuda_graph_impl != "none" and device.type != "cuda":
        raise InvalidConfig(f"cuda_graph_impl={config.cuda_graph_impl} needs a CUDA device; this rank runs on "
                            f"{device.type}")
    batches = rank_loader(request, rank, world)
    build.mark("data loader")
    torch.manual_seed(request.seed)  # identical initial weights on every rank
    model = MoEVLM(request.model)
    model.freeze(config.freeze_vision_model, config.freeze_vision_projection)
    build.mark("model")
    checkpoints = apply_recompute(model, config)
    groups = make_groups(config, world, rank)
    expert_params = apply_expert_parallel(model, groups)
    model.to(device)
    build.mark("parallel groups, to device")

    def probe_forward() -> None:  # only called when graphs are captured
        batch = next(batches).to(device)
        with torch.no_grad(), _autocast(device):
            model(*batch.model_inputs())

    with _autocast(device):
        graphed = apply_cuda_graphs(model, config, probe_forward)
    if graphed:
        build.mark("cuda graphs")
    clock = StageClock({"vision": (model.vision, model.vision.patch_embed),
                        "projector": (model.projector, model.projector.norm)}, device.type == "cuda")
    wrapped = apply_data_parallel(model, config, groups, expert_params, device)
    optimizer = torch.optim.AdamW([p for p in wrapped.parameters() if p.requires_grad], lr=1e-4)
    memory = None
    if request.cpu_device_memory_bytes is not None and device.type == "cpu":
        memory = CountedDeviceMemory(request.cpu_device_memory_bytes, wrapped.parameters())
    build.mark("data parallel, optimizer")
    return BurstRun(request, device, rank, model, wrapped, groups, expert_params, checkpoints, graphed, clock,
                    batches, optimizer, micro_batches, memory, tuple(build.phases))


def run_rank(request: BurstRequest, device: torch.device, reporter: Reporter | None = None) -> BurstResult:
    """Run the burst on this rank (``torch.distributed`` already initialised when world > 1).

    Every rank returns a result; rank 0's carries the records and the contract. ``reporter`` is
    called on every rank that has one; rank 0's verdict decides for all. Only an
    :class:`InvalidConfig` while building makes the burst ``invalid``; any other error is
    ``failed`` with its traceback, so a bug is never taken for an infeasible config.
    """
    if device.type == "cuda" and request.memory_cap_fraction:
        torch.cuda.set_per_process_memory_fraction(request.memory_cap_fraction, device)
    build = BuildClock(device)
    try:
        run = build_run(request, device, build)
    except InvalidConfig as exc:
        return _release(BurstResult(outcome="invalid", error=str(exc)), device)
    except OOM_ERRORS as exc:
        return _release(BurstResult(outcome="oom", error=f"{type(exc).__name__}: {exc}",
                                    before_first_step=build.until("out of memory")), device)
    except Exception:  # noqa: BLE001 - setup failures are outcomes too, never a crash of the caller
        return _release(BurstResult(outcome="failed", error=traceback.format_exc()), device)

    records: list[StepRecord] = []

    def first_step_until_out_of_memory() -> tuple[TimedPart, ...]:
        return () if records else build.until("out of memory", "the first step")

    try:
        with _cpu_memory_cap(device, request.cpu_memory_cap_bytes):
            outcome = run_steps(device, request.steps, lambda step: _train_step(run, step, reporter), records)
    except OOM_ERRORS as exc:
        return _release(BurstResult(outcome="oom", records=tuple(records), error=f"{type(exc).__name__}: {exc}",
                                    before_first_step=first_step_until_out_of_memory()), device)
    except RuntimeError as exc:
        if CPU_ALLOCATION_FAILURE in str(exc):
            return BurstResult(outcome="oom", records=tuple(records), error=str(exc).splitlines()[0],
                               before_first_step=first_step_until_out_of_memory())
        return BurstResult(outcome="failed", records=tuple(records), error=traceback.format_exc())
    except Exception:  # noqa: BLE001 - the contract turns anything else into `failed`, with the trace
        return BurstResult(outcome="failed", records=tuple(records), error=traceback.format_exc())

    return BurstResult(outcome=outcome, records=tuple(records), contract=run.contract(), evidence=run.evidence())


@contextmanager
def _cpu_memory_cap(device: torch.device, cap_bytes: int | None):
    """Let this process's address space grow by at most ``cap_bytes`` (CPU only), then restore."""
    if cap_bytes is None or device.type != "cpu":
        yield
        return
    # Start the intra-op thread pool first: a thread started under the cap needs stack space it
    # may not be able to map, and OpenMP aborts the process instead of raising.
    torch.mm(torch.ones(512, 512), torch.ones(512, 512))
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    current = _address_space_bytes()
    limit = current + cap_bytes
    resource.setrlimit(resource.RLIMIT_AS, (limit if hard == resource.RLIM_INFINITY else min(limit, hard), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def _address_space_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status: the CPU memory cap needs Linux")


def _train_step(run: BurstRun, step: int, reporter: Reporter | None) -> tuple[StepRecord, bool]:
    """One optimizer step: the step's micro-batches accumulated (each loss scaled by their number,
    gradients reduced across replicas on the last only, as Megatron's schedules do), then one
    expert-gradient reduction and one optimizer update."""
    request, device = run.request, run.device
    start = time.perf_counter()
    data_wait = 0.0
    batches: list[MicroBatch] = []
    losses: list[torch.Tensor] = []
    run.optimizer.zero_grad(set_to_none=True)
    for index in range(run.micro_batches):
        fetch = time.perf_counter()
        batch = next(run.batches)
        data_wait += time.perf_counter() - fetch
        batch = batch.to(device)
        with _gradient_sync(run.wrapped, index == run.micro_batches - 1), _counted(run.memory) as forward_done:
            with _autocast(device):
                out = run.wrapped(*batch.model_inputs())
            forward_done()
            (out.loss / run.micro_batches).backward()
        batches.append(batch)
        losses.append(out.loss.detach())
    sync_expert_gradients(run.expert_params, run.groups)
    run.optimizer.step()
    stages = run.clock.collect()  # synchronises the device
    step_seconds = time.perf_counter() - start
    # Every rank trains on its own batches: each counts them and reports its mean loss.
    local = LocalMeasures(
        step_seconds=step_seconds, data_wait_seconds=data_wait, vision_seconds=stages["vision"],
        projector_seconds=stages["projector"], peak_memory_bytes=run.peak_memory_bytes(),
        counts=count_batches(batches, request), loss=torch.stack(losses).mean().item(),
    )
    return finish_step(run, step, local, reporter)


def _counted(memory: CountedDeviceMemory | None):
    """Count what a micro-batch saves for backward where the rank's device memory is counted."""
    return memory.micro_batch() if memory is not None else nullcontext(lambda: None)


@contextmanager
def _gradient_sync(wrapped: nn.Module, sync: bool):
    """Reduce gradients across replicas in this backward only when ``sync``: accumulating
    micro-batches keep theirs local until the step's last (DDP's ``no_sync``, FSDP2's switch)."""
    if isinstance(wrapped, FSDPModule):
        wrapped.set_requires_gradient_sync(sync)
        yield
    elif isinstance(wrapped, DistributedDataParallel) and not sync:
        with wrapped.no_sync():
            yield
    else:
        yield


@contextmanager
def _autocast(device: torch.device):
    # Caching off: CUDA-graph capture requires it, and every config runs the same way.
    if device.type == "cuda":
        with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
            yield
    else:
        yield


def _release(result: BurstResult, device: torch.device) -> BurstResult:
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def native_contract(request: BurstRequest, device: torch.device) -> Contract:
    """The measurement contract of a native burst: one data-parallel replica per rank, bf16
    autocast on CUDA and fp32 on the CPU, with each rank's intra-op CPU threads."""
    config = request.config
    cuda = device.type == "cuda"
    dp = request.world_size
    micro_batches = request.micro_batches_per_step
    shapes = Shapes(
        micro_batch_size=config.micro_batch_size,
        seq_length=request.model.seq_length,
        num_microbatches=micro_batches,
        data_parallel=dp,
        global_batch_size=config.micro_batch_size * micro_batches * dp,
        expert_parallel=config.expert_model_parallel_size,
    )
    return measurement_contract(
        "native", request, device,
        world_size=request.world_size,
        shapes=shapes,
        precision="bf16 autocast" if cuda else "fp32",
        timing="cuda events (stages), wall clock (step)" if cuda else "wall clock",
        cpu_threads_per_rank=torch.get_num_threads(),
        counted_memory_bytes=None if cuda else request.cpu_device_memory_bytes,
    )
