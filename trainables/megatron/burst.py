"""One burst of the megatron-core MoE VLM on one rank (CUDA): parallel groups from the config,
the model, megatron-core DDP / Megatron-FSDP / torch FSDP2, the megatron optimizer, and
``get_forward_backward_func`` on the same real-data loader as the native trainable.

``torch.distributed`` is up before :func:`run_rank` (the local launcher or a Ray Train worker
group started it); each burst runs in fresh processes (megatron-core keeps its parallel groups,
RNG trackers and CUDA-graph records in module globals).
"""

from __future__ import annotations

import gc
import importlib.util
import platform
import time
import traceback
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist

from autotune.core.contract import BurstRequest, BurstResult, Reporter, StepRecord, StepReport
from trainables.data.loader import MicroBatch, rank_loader
from trainables.flops import CONVENTION, step_flops
from trainables.stage_clock import StageClock
from trainables.step_loop import run_steps


OOM_ERRORS = (torch.OutOfMemoryError,)
SEED = 1234


def transformer_engine_version() -> str | None:
    """The installed Transformer Engine's version, or ``None`` when it cannot be imported."""
    if importlib.util.find_spec("transformer_engine") is None:
        return None
    try:
        import transformer_engine

        return getattr(transformer_engine, "__version__", "unknown")
    except Exception:  # noqa: BLE001 - a broken TE install is an absent TE
        return None


@dataclass
class MegatronRun:
    request: BurstRequest
    device: torch.device
    model: torch.nn.Module
    """The data-parallel wrapper (DDP, Megatron-FSDP or FSDP2) around the VLM."""
    vlm: torch.nn.Module
    optimizer: object
    clock: StageClock | None
    batches: Iterator[MicroBatch]
    num_microbatches: int
    layer_spec: str
    checkpoint_nodes: int = 0
    """Recompute nodes in the first step's autograd graph (before any CUDA graph hides them)."""

    def evidence(self) -> dict:
        from megatron.core import parallel_state
        from megatron.core.transformer.cuda_graphs import _CudagraphGlobalRecord

        config = self.request.config
        frozen_with_grad = None
        if config.freeze_vision_model and self.vlm.pre_process:
            frozen_with_grad = sum(p.requires_grad or getattr(p, "main_grad", None) is not None
                                   for p in self.vlm.vision_model.parameters())
        graph_units = sum(
            sum(runner.fwd_graph is not None for runner in module.cudagraph_runners)
            for module in self.vlm.modules() if hasattr(module, "cudagraph_runners")
        )
        experts = next((m for m in self.vlm.modules() if hasattr(m, "num_local_experts")), None)
        data_parallel = type(self.model).__name__
        observed = {
            "layer_spec": self.layer_spec,
            "recompute_checkpoint_nodes": self.checkpoint_nodes,
            "frozen_vision_params_with_grad": frozen_with_grad,
            "ep_group_size": parallel_state.get_expert_model_parallel_world_size(),
            "etp_group_size": parallel_state.get_expert_tensor_parallel_world_size(),
            "tp_group_size": parallel_state.get_tensor_model_parallel_world_size(),
            "pp_group_size": parallel_state.get_pipeline_model_parallel_world_size(),
            "local_experts_per_moe_layer": getattr(experts, "num_local_experts", None),
            "data_parallel": data_parallel,
            "cuda_graph_units": graph_units,
            "cuda_graphs_created": bool(_CudagraphGlobalRecord.cudagraph_created),
        }
        observed["checks"] = {
            "recompute_granularity": (self.checkpoint_nodes > 0) == (config.recompute_granularity != "none"),
            "freeze_vision_model": frozen_with_grad in (None, 0),
            "expert_model_parallel_size": observed["ep_group_size"] == config.expert_model_parallel_size,
            "tensor_model_parallel_size": observed["tp_group_size"] == config.tensor_model_parallel_size,
            "use_torch_fsdp2": (data_parallel == "TorchFullyShardedDataParallel") == bool(config.use_torch_fsdp2),
            "use_megatron_fsdp": (data_parallel == "FullyShardedDataParallel") == bool(config.use_megatron_fsdp),
            "cuda_graph_impl": (graph_units > 0) == (config.cuda_graph_impl == "local"),
        }
        return observed


def build_run(request: BurstRequest, device: torch.device) -> MegatronRun:
    """Parallel groups, model, data-parallel wrapper and optimizer; a config megatron-core
    rejects raises :class:`InvalidConfig`."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from trainables.megatron.config_mapping import build_ddp_config, build_transformer_config, freeze_arguments
    from trainables.megatron.model import PORTABLE_FIELDS, MegatronMoEVLM

    config = request.config
    use_te = transformer_engine_version() is not None
    with _invalid_on_rejection("megatron-core rejected the config"):
        decoder_config = build_transformer_config(config, request.model, extra=PORTABLE_FIELDS)
        ddp_config = build_ddp_config(config)
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=config.tensor_model_parallel_size,
            pipeline_model_parallel_size=config.pipeline_model_parallel_size,
            virtual_pipeline_model_parallel_size=config.virtual_pipeline_model_parallel_size,
            context_parallel_size=config.context_parallel_size,
            expert_model_parallel_size=config.expert_model_parallel_size,
            expert_tensor_parallel_size=config.expert_tensor_parallel_size,
        )
    model_parallel_cuda_manual_seed(SEED, use_cudagraphable_rng=config.cuda_graph_impl == "local")
    with _invalid_on_rejection("megatron-core could not build the model for the config"):
        vlm = MegatronMoEVLM(
            decoder_config, request.model, use_te,
            pre_process=parallel_state.is_pipeline_first_stage(),
            post_process=parallel_state.is_pipeline_last_stage(),
        )
    # As Megatron-LM's get_model and Float16Module: plain torch modules (the ViT's LayerNorms)
    # start on the CPU in fp32.
    vlm.cuda(device)
    if decoder_config.bf16:
        vlm.bfloat16()
    vlm.freeze(**freeze_arguments(config))
    model = _wrap_data_parallel(vlm, decoder_config, ddp_config, config)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-4, bf16=True, clip_grad=1.0,
                        use_distributed_optimizer=ddp_config.use_distributed_optimizer),
        [model],
    )
    decoder_config.finalize_model_grads_func = finalize_model_grads
    decoder_config.grad_scale_func = optimizer.scale_loss
    if isinstance(model, DistributedDataParallel):
        decoder_config.no_sync_func = model.no_sync
    clock = None
    if vlm.pre_process:
        clock = StageClock({"vision": (vlm.vision_model, vlm.vision_model.patch_embed),
                            "projector": (vlm.vision_projection, vlm.vision_projection.encoder.linear_fc1)}, cuda=True)
    batches = rank_loader(request, parallel_state.get_data_parallel_rank(),
                               parallel_state.get_data_parallel_world_size())
    return MegatronRun(
        request=request, device=device, model=model, vlm=vlm, optimizer=optimizer, clock=clock, batches=batches,
        # A pipeline needs at least as many micro-batches as stages to fill.
        num_microbatches=config.pipeline_model_parallel_size,
        layer_spec="transformer_engine" if use_te else "local",
    )


def _wrap_data_parallel(vlm, decoder_config, ddp_config, config):
    if config.use_torch_fsdp2:
        from megatron.core.distributed import TorchFullyShardedDataParallel

        return TorchFullyShardedDataParallel(decoder_config, ddp_config, vlm)
    if config.use_megatron_fsdp:
        from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel

        return FullyShardedDataParallel(decoder_config, ddp_config, vlm)
    from megatron.core.distributed import DistributedDataParallel

    return DistributedDataParallel(decoder_config, ddp_config, vlm)


class InvalidConfig(Exception):
    """megatron-core rejected the config while building configs, groups or the model."""


class _invalid_on_rejection:
    """Turn megatron-core's own config checks (ValueError / AssertionError / TypeError) into
    :class:`InvalidConfig` with its message; OOM and anything else pass through."""

    def __init__(self, what: str) -> None:
        self.what = what

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, exc, tb) -> bool:
        if exc is not None and isinstance(exc, (ValueError, AssertionError, TypeError)):
            raise InvalidConfig(f"{self.what}: {type(exc).__name__}: {exc}") from exc
        return False


def run_rank(request: BurstRequest, device: torch.device, reporter: Reporter | None = None) -> BurstResult:
    """Run the burst on this rank; every rank returns a result, rank 0's carries the records."""
    if device.type != "cuda":
        return BurstResult(outcome="invalid", error="the megatron trainable trains only on CUDA devices")
    torch.cuda.set_device(device)
    if request.memory_cap_fraction:
        torch.cuda.set_per_process_memory_fraction(request.memory_cap_fraction, device)
    run: MegatronRun | None = None
    records: list[StepRecord] = []
    try:
        run = build_run(request, device)
        outcome = run_steps(request.steps, lambda step, run=run: _train_step(run, step, reporter), records)
        return BurstResult(outcome=outcome, records=tuple(records), contract=_contract(run), evidence=run.evidence())
    except InvalidConfig as exc:
        return BurstResult(outcome="invalid", error=str(exc))
    except OOM_ERRORS as exc:
        return BurstResult(outcome="oom", records=tuple(records), error=f"{type(exc).__name__}: {str(exc)[:500]}")
    except Exception:  # noqa: BLE001 - anything else is the outcome `failed`, with the trace
        return BurstResult(outcome="failed", records=tuple(records), error=traceback.format_exc())
    finally:
        del run
        _release()


def _release() -> None:
    """Free the model, graphs and parallel groups so nothing reaches the caller or a later burst."""
    from megatron.core import parallel_state
    from megatron.core.transformer.cuda_graphs import _CudagraphGlobalRecord, delete_cuda_graphs

    if _CudagraphGlobalRecord.cudagraph_created or _CudagraphGlobalRecord.cudagraph_record:
        delete_cuda_graphs()
    parallel_state.destroy_model_parallel()
    gc.collect()
    torch.cuda.empty_cache()


def _count_checkpoint_nodes(output: torch.Tensor) -> int:
    """Recompute regions in an autograd graph: megatron-core's checkpoint functions' nodes."""
    seen, stack, count = set(), [output.grad_fn], 0
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        count += "Checkpoint" in node.name()
        stack.extend(next_node for next_node, _ in node.next_functions)
    return count


def _train_step(run: MegatronRun, step: int, reporter: Reporter | None) -> tuple[StepRecord, bool]:
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    request, device = run.request, run.device
    config = request.config
    start = time.perf_counter()
    batches = [next(run.batches) for _ in range(run.num_microbatches)]
    data_wait = time.perf_counter() - start
    on_device = iter([batch.to(device) for batch in batches])

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        output = model(batch.tokens, batch.labels, batch.segment_ids, batch.position_ids, batch.patches,
                       batch.image_grids)
        if step == 0 and output.requires_grad:
            run.checkpoint_nodes += _count_checkpoint_nodes(output)
        mask = batch.loss_mask.float()

        def loss_func(per_token):
            loss = (per_token.float() * mask).sum() / mask.sum().clamp(min=1)
            return loss, {"loss": loss.detach()}

        return output, loss_func

    run.model.zero_grad_buffer()
    run.optimizer.zero_grad()
    losses = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=on_device, model=[run.model],
        num_microbatches=run.num_microbatches, seq_length=request.model.seq_length,
        micro_batch_size=config.micro_batch_size, forward_only=False,
    )
    run.optimizer.step()
    stages = run.clock.collect() if run.clock is not None else {"vision": 0.0, "projector": 0.0}
    torch.cuda.synchronize(device)
    step_seconds = time.perf_counter() - start

    flops = sum(step_flops(request.model, b.segment_ids, b.image_grids, config.freeze_vision_model,
                           config.freeze_vision_projection) for b in batches)
    reports_loss = parallel_state.is_pipeline_last_stage() and parallel_state.get_tensor_model_parallel_rank() == 0
    loss = sum(float(item["loss"]) for item in losses) / len(losses) if reports_loss and losses else 0.0
    # Every rank of one data-parallel replica saw the same batches: counts are summed over the
    # data-parallel group of a first-stage, TP-rank-0 rank, times come from the slowest rank.
    counts_here = parallel_state.is_pipeline_first_stage() and parallel_state.get_tensor_model_parallel_rank() == 0
    sums = torch.tensor(
        [sum(b.useful_tokens for b in batches), sum(b.image_tokens for b in batches),
         sum(b.loss_tokens for b in batches), sum(b.samples for b in batches), flops,
         sum(sum(b.skipped.values()) for b in batches)] if counts_here else [0.0] * 6,
        dtype=torch.float64, device=device)
    loss_sum = torch.tensor([loss, 1.0 if reports_loss else 0.0], dtype=torch.float64, device=device)
    times = torch.tensor([step_seconds, data_wait, stages["vision"], stages["projector"]], dtype=torch.float64,
                         device=device)
    peak = torch.tensor([float(torch.cuda.max_memory_allocated(device))], dtype=torch.float64, device=device)
    world = dist.get_world_size()
    if world > 1:
        gathered = [torch.empty_like(times) for _ in range(world)]
        dist.all_gather(gathered, times)
        times = max(gathered, key=lambda row: row[0].item())
        dist.all_reduce(sums)
        dist.all_reduce(loss_sum)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    step_seconds, data_wait, vision, projector = times.tolist()
    useful, image, loss_tokens, samples, flops, skipped = sums.tolist()
    record = StepRecord(
        step=step, step_seconds=step_seconds, data_wait_seconds=data_wait, vision_seconds=vision,
        projector_seconds=projector, decoder_seconds=step_seconds - data_wait - vision - projector,
        useful_tokens=int(useful), image_tokens=int(image), loss_tokens=int(loss_tokens), samples=int(samples),
        model_flops=flops, peak_memory_bytes=int(peak.item()),
        loss=loss_sum[0].item() / max(loss_sum[1].item(), 1.0), skipped_samples=int(skipped),
    )
    stop_flag = torch.zeros(1, dtype=torch.float64, device=device)
    if reporter is not None:
        report = StepReport(record, run.evidence(), _contract(run) if step == 0 else None)
        if not reporter(report) and dist.get_rank() == 0:
            stop_flag[0] = 1.0
    if world > 1:
        dist.broadcast(stop_flag, src=0)
    return record, bool(stop_flag[0].item())


def _contract(run: MegatronRun) -> dict:
    import megatron.core

    from megatron.core import parallel_state

    request, config = run.request, run.request.config
    dp = parallel_state.get_data_parallel_world_size()
    return {
        "trainable": "megatron",
        "versions": {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
                     "megatron_core": megatron.core.__version__, "transformer_engine": transformer_engine_version()},
        "hardware": {"device": torch.cuda.get_device_name(run.device), "accelerator": "cuda",
                     "world_size": dist.get_world_size()},
        "model": request.model.model_dump(),
        "layer_spec": run.layer_spec,
        "data": {"folder": request.data.folder, "realism": request.data.realism, "tokenizer": "byte-level"},
        "precision": "bf16 parameters, fp32 main parameters and loss (megatron optimizer)",
        "shapes": {
            "micro_batch_size": config.micro_batch_size,
            "seq_length": request.model.seq_length,
            "num_microbatches": run.num_microbatches,
            "data_parallel": dp,
            "global_batch_size": config.micro_batch_size * run.num_microbatches * dp,
            "tensor_parallel": config.tensor_model_parallel_size,
            "pipeline_parallel": config.pipeline_model_parallel_size,
            "context_parallel": config.context_parallel_size,
            "expert_parallel": config.expert_model_parallel_size,
            "expert_tensor_parallel": config.expert_tensor_parallel_size,
        },
        "timing": "cuda events (stages), wall clock after device synchronisation (step)",
        "flops_convention": CONVENTION,
        "config": config.to_plain(),
    }
