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
import time
import traceback
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.distributed as dist

from autotune.core.contract import (
    BurstRequest,
    BurstResult,
    Contract,
    Evidence,
    InvalidConfig,
    Reporter,
    Shapes,
    StepRecord,
)
from trainables.data.loader import MicroBatch, rank_loader
from trainables.measurement import measurement_contract
from trainables.stage_clock import StageClock
from trainables.steps import LocalMeasures, StepCounts, count_batches, finish_step, peak_memory_bytes, run_steps


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
    """What every step of one rank's burst shares."""

    request: BurstRequest
    device: torch.device
    rank: int
    world_size: int
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

    def evidence(self) -> Evidence:
        """What the run observed of its knobs, and per knob whether that matches the config."""
        observed = self._observed()
        return Evidence(checks=self._checks(observed), **observed)

    def contract(self) -> Contract:
        return megatron_contract(self)

    def _checks(self, observed: dict[str, Any]) -> dict[str, bool]:
        config = self.request.config
        data_parallel = observed["data_parallel"]
        return {
            "recompute_granularity": (observed["recompute_checkpoint_nodes"] > 0) == (config.recompute_granularity != "none"),
            "freeze_vision_model": observed["frozen_vision_params_with_grad"] in (None, 0),
            "expert_model_parallel_size": observed["ep_group_size"] == config.expert_model_parallel_size,
            "tensor_model_parallel_size": observed["tp_group_size"] == config.tensor_model_parallel_size,
            "use_torch_fsdp2": (data_parallel == "TorchFullyShardedDataParallel") == bool(config.use_torch_fsdp2),
            "use_megatron_fsdp": (data_parallel == "FullyShardedDataParallel") == bool(config.use_megatron_fsdp),
            "cuda_graph_impl": (observed["cuda_graph_units"] > 0) == (config.cuda_graph_impl == "local"),
        }

    def _observed(self) -> dict[str, Any]:
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
        return {
            "layer_spec": self.layer_spec,
            "recompute_checkpoint_nodes": self.checkpoint_nodes,
            "frozen_vision_params_with_grad": frozen_with_grad,
            "ep_group_size": parallel_state.get_expert_model_parallel_world_size(),
            "etp_group_size": parallel_state.get_expert_tensor_parallel_world_size(),
            "tp_group_size": parallel_state.get_tensor_model_parallel_world_size(),
            "pp_group_size": parallel_state.get_pipeline_model_parallel_world_size(),
            "local_experts_per_moe_layer": getattr(experts, "num_local_experts", None),
            "data_parallel": type(self.model).__name__,
            "cuda_graph_units": graph_units,
            "cuda_graphs_created": bool(_CudagraphGlobalRecord.cudagraph_created),
        }


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
        request=request, device=device, rank=dist.get_rank(), world_size=dist.get_world_size(),
        model=model, vlm=vlm, optimizer=optimizer, clock=clock, batches=batches,
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
        return BurstResult(outcome=outcome, records=tuple(records), contract=run.contract(), evidence=run.evidence())
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
    return finish_step(run, step, _local_measures(run, batches, losses, stages, step_seconds, data_wait), reporter)


def _local_measures(run: MegatronRun, batches: list[MicroBatch], losses: list[dict], stages: dict[str, float],
                    step_seconds: float, data_wait: float) -> LocalMeasures:
    """This rank's share of the step. Every rank of one data-parallel replica saw the same batches,
    so only a first-stage, TP-rank-0 rank counts them (summed over the data-parallel replicas);
    the loss exists only on the last stage, reported once per replica by its TP-rank-0 rank."""
    from megatron.core import parallel_state

    tp_rank_zero = parallel_state.get_tensor_model_parallel_rank() == 0
    counts = StepCounts()
    if parallel_state.is_pipeline_first_stage() and tp_rank_zero:
        counts = count_batches(batches, run.request)
    loss = None
    if parallel_state.is_pipeline_last_stage() and tp_rank_zero:
        loss = sum(float(item["loss"]) for item in losses) / len(losses) if losses else 0.0
    return LocalMeasures(
        step_seconds=step_seconds, data_wait_seconds=data_wait, vision_seconds=stages["vision"],
        projector_seconds=stages["projector"], peak_memory_bytes=peak_memory_bytes(run.device), counts=counts,
        loss=loss,
    )


def megatron_contract(run: MegatronRun) -> Contract:
    """The measurement contract of a megatron burst: its layer specs, megatron-core's and TE's
    versions, and the full parallel shape (a global batch of every micro-batch of every replica)."""
    import megatron.core
    from megatron.core import parallel_state

    request, config = run.request, run.request.config
    dp = parallel_state.get_data_parallel_world_size()
    shapes = Shapes(
        micro_batch_size=config.micro_batch_size,
        seq_length=request.model.seq_length,
        num_microbatches=run.num_microbatches,
        data_parallel=dp,
        global_batch_size=config.micro_batch_size * run.num_microbatches * dp,
        tensor_parallel=config.tensor_model_parallel_size,
        pipeline_parallel=config.pipeline_model_parallel_size,
        context_parallel=config.context_parallel_size,
        expert_parallel=config.expert_model_parallel_size,
        expert_tensor_parallel=config.expert_tensor_parallel_size,
    )
    return measurement_contract(
        "megatron", request, run.device,
        world_size=run.world_size,
        shapes=shapes,
        precision="bf16 parameters, fp32 main parameters and loss (megatron optimizer)",
        timing="cuda events (stages), wall clock after device synchronisation (step)",
        versions={"cuda": torch.version.cuda, "megatron_core": megatron.core.__version__,
                  "transformer_engine": transformer_engine_version()},
        layer_spec=run.layer_spec,
    )
