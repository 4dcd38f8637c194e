"""One ``bridge`` burst: the user's Megatron-Bridge recipe, with the trial's knob overrides, trained by
Bridge's own ``pretrain()`` and VLM forward step for the burst's steps.

A Bridge ``Callback`` turns each training step into our :class:`StepRecord`
(:func:`trainables.steps.finish_step`, as for every trainable): the step's wall time from the end of
the previous step to this one's ``on_train_step_end`` (device synchronised), which is the iteration
as Bridge's own "elapsed time per iteration" counts it and the user's run pays it (its loop's
bookkeeping between steps and the CUDA-graph capture included), the time spent
waiting on the data iterator, the vision encoder's device time (CUDA events on the model's
``vision_model``, where it has one; Qwen3-VL's projector, its ``merger``, is inside it and not split), the
useful tokens of the batches the forward step drew (loss-bearing tokens plus the image tokens the
processor expanded), Bridge's own FLOPs count of the step, the peak memory and the loss. When the
tuner says stop, the callback ends Bridge's loop after that step by lowering ``train_iters``.

Each burst runs in a fresh process (``kept_ranks=False``): Bridge keeps its parallel groups, timers,
CUDA graphs and rerun state machine in process globals, and a fresh process is what the user's own
launch is. Its start-up (imports, model build, data loader) is charged to the trial.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch

from autotune.core.contract import (
    BurstRequest, BurstResult, Contract, DataProvenance, Evidence, Hardware, InvalidConfig, Reporter, Shapes,
    StepRecord, TimedPart,
)
from trainables.bridge.recipe import RecipeRefused, go_offline, prepare
from trainables.graph_replays import CountedGraph, count_graphs_of
from trainables.stage_clock import StageClock
from trainables.steps import BuildClock, LocalMeasures, StepCounts, finish_step, peak_memory_bytes

log = logging.getLogger(__name__)

TIMING = ("step: wall clock from the end of the previous step's on_train_step_end callback (the first step: its "
          "on_train_step_start) to this step's on_train_step_end, the device synchronised at each: the iteration as "
          "Megatron-Bridge's 'elapsed time per iteration' counts it, its loop's work between steps (logging, CUDA-graph "
          "capture) included, the callback's own not; vision: CUDA events on the model's vision_model, forward and backward, its "
          "merger (the projector) included: Qwen3-VL's merger is part of its vision model, so the projector is not "
          "split")
FLOPS_CONVENTION = ("Megatron-Bridge's num_floating_point_operations over the step's global batch, with the "
                    "sequence statistics its forward step accumulated (as its training loop counts them)")


@dataclass
class _StepCounter:
    """What the forward step drew from the data iterator since the last step ended."""

    image_token_id: int | None
    wait_seconds: float = 0.0
    counts: list[StepCounts] = field(default_factory=list)
    micro_batch_sizes: set[int] = field(default_factory=set)
    """Every micro-batch's sample count so far: the evidence that the MBS override took effect."""

    def add(self, batch: dict[str, Any]) -> None:
        loss_tokens = int(batch["loss_mask"].sum().item()) if batch.get("loss_mask") is not None else 0
        tokens = batch.get("input_ids") if batch.get("input_ids") is not None else batch.get("tokens")
        images = 0
        if tokens is not None and self.image_token_id is not None:
            images = int((tokens == self.image_token_id).sum().item())
        samples = 0 if tokens is None else int(tokens.shape[0])
        self.micro_batch_sizes.add(samples)
        self.counts.append(StepCounts(useful_tokens=loss_tokens + images, image_tokens=images,
                                      loss_tokens=loss_tokens, samples=samples))

    def take(self) -> tuple[StepCounts, float]:
        total = StepCounts(
            useful_tokens=sum(c.useful_tokens for c in self.counts), image_tokens=sum(c.image_tokens for c in self.counts),
            loss_tokens=sum(c.loss_tokens for c in self.counts), samples=sum(c.samples for c in self.counts))
        wait, self.counts, self.wait_seconds = self.wait_seconds, [], 0.0
        return total, wait


class _CountingIterator:
    """The data iterator Bridge's forward step draws from, timed and counted on the way."""

    def __init__(self, inner: Iterator[dict[str, Any]], counter: _StepCounter) -> None:
        self.inner, self.counter = inner, counter

    def __iter__(self) -> "_CountingIterator":
        return self

    def __next__(self) -> dict[str, Any]:
        start = time.perf_counter()
        batch = next(self.inner)
        self.counter.wait_seconds += time.perf_counter() - start
        self.counter.add(batch)
        return batch


@dataclass
class BridgeRun:
    """One rank's burst, as :func:`trainables.steps.finish_step` needs it."""

    request: BurstRequest
    device: torch.device
    rank: int
    world_size: int
    recipe: Any
    trial_overrides: list[str]
    counter: _StepCounter
    counts_data: bool
    computes_loss: bool
    precision: str
    """The recipe's precision as it names it (a preset, before ``pretrain()`` resolves it)."""
    build: BuildClock
    """Times the set-up: ours before ``pretrain()``, then Bridge's own to its training loop."""
    clock: StageClock | None = None
    stopped: bool = False
    """The tuner said stop, and the callback ended Bridge's loop."""
    last_step_end: float = 0.0
    """When the previous step ended, after this callback's own work (before the first: when it
    started), device synchronised."""
    model_config: Any = None
    """The built model's ``TransformerConfig``, as the layers read it (set when training starts)."""
    layers: list[Any] = field(default_factory=list)
    """Every module of the model that can hold per-layer CUDA graphs (``cuda_graphs``)."""
    graphs: list[CountedGraph] = field(default_factory=list)
    """The TE graphs Bridge's loop captured, counting their replays."""

    @property
    def build_phases(self) -> list[TimedPart]:
        return self.build.phases

    def evidence(self) -> Evidence:
        """What the run showed of its knobs; each check fails when the knob is set and did nothing as
        well as when something happened that the config does not ask for:
        the micro-batch sizes the batches had (where this rank draws data); the recompute settings
        of the model as built (what its layers read: an override that did not reach them fails); TE
        graphs captured and replayed, of the modules the config scopes."""
        config, built = self.request.config, self.model_config
        checks: dict[str, bool] = {}
        observed: dict[str, Any] = {}
        sizes = self.counter.micro_batch_sizes
        if sizes:
            checks["micro_batch_size"] = sizes == {config.micro_batch_size}
            observed["micro_batch_sizes"] = sorted(sizes)
        if built is not None:
            granularity = getattr(built, "recompute_granularity", None) or "none"
            modules = sorted(getattr(built, "recompute_modules", None) or [])
            observed |= {"model_recompute_granularity": granularity, "model_recompute_modules": modules}
            checks["recompute_granularity"] = granularity == config.recompute_granularity
            if config.recompute_granularity == "selective":
                checks["recompute_modules"] = modules == sorted(config.recompute_modules or [])
            replays = sum(graph.replays for graph in self.graphs)
            observed |= {"te_graphs_captured": len(self.graphs), "te_graph_replays": replays}
            if config.cuda_graph_impl in ("none", "transformer_engine"):
                checks["cuda_graph_impl"] = (replays > 0) == (config.cuda_graph_impl == "transformer_engine")
            if config.cuda_graph_impl == "transformer_engine":
                from megatron.bridge.utils.cuda_graph import cuda_graph_module_names

                scoped = sorted(cuda_graph_module_names(built))
                observed["model_cuda_graph_modules"] = scoped
                checks["cuda_graph_scope"] = replays > 0 and scoped == sorted(config.cuda_graph_scope or [])
        return Evidence(checks=checks, **observed)

    def contract(self) -> Contract:
        import megatron.bridge
        import megatron.core

        cfg, request = self.recipe, self.request
        model = cfg.model
        return Contract(
            trainable="bridge",
            versions={"megatron_bridge": megatron.bridge.__version__, "megatron_core": megatron.core.__version__,
                      "transformer_engine": _te_version(), "torch": torch.__version__, "cuda": torch.version.cuda},
            hardware=Hardware(device=torch.cuda.get_device_name(self.device), accelerator="cuda",
                              world_size=self.world_size),
            model={name: getattr(model, name, None) for name in (
                "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
                "num_moe_experts", "moe_router_topk", "moe_ffn_hidden_size", "vocab_size", "seq_length")}
            | {"provider": type(model).__name__,
               "vision_layers": getattr(getattr(model, "vision_config", None), "depth", None)},
            layer_spec=getattr(model, "transformer_impl", None),
            data=DataProvenance(folder=str(getattr(cfg.dataset, "path", None)), realism=dataset_realism(cfg.dataset),
                                tokenizer=str(getattr(getattr(cfg.dataset, "task_encoder", None), "hf_processor_path",
                                                      getattr(cfg.dataset, "hf_processor_path", None)))),
            precision=self.precision,
            shapes=Shapes(micro_batch_size=cfg.train.micro_batch_size, seq_length=model.seq_length,
                          data_parallel=cfg.data_parallel_size, global_batch_size=cfg.train.global_batch_size,
                          expert_parallel=model.expert_model_parallel_size,
                          num_microbatches=cfg.train.global_batch_size
                          // (cfg.train.micro_batch_size * cfg.data_parallel_size),
                          tensor_parallel=model.tensor_model_parallel_size,
                          pipeline_parallel=model.pipeline_model_parallel_size,
                          context_parallel=model.context_parallel_size,
                          expert_tensor_parallel=model.expert_tensor_parallel_size),
            timing=TIMING if self.clock is not None else TIMING.split(";")[0] + "; stages not split (the model has "
                   "no vision_model with a patch_embed)",
            flops_convention=FLOPS_CONVENTION,
            config=request.config,
            recipe=request.recipe.recipe if request.recipe else None,
            recipe_overrides=tuple(self.trial_overrides),
        )


def _precision(recipe: Any) -> str:
    """The recipe's precision: its preset name (Bridge 0.6), or its fields (a ``MixedPrecisionConfig``)."""
    precision = recipe.mixed_precision
    if precision is None or isinstance(precision, str):
        return str(precision)
    fp8 = getattr(precision, "fp8", None)
    return ("bf16" if getattr(precision, "bf16", False) else "fp16" if getattr(precision, "fp16", False) else "fp32") \
        + (f" with fp8 {fp8} ({getattr(precision, 'fp8_recipe', None)} scaling)" if fp8 else "")


def dataset_realism(dataset: Any) -> str:
    """``mock`` for Bridge's mock datasets (generated samples, no real images): benchmark-only."""
    return "mock" if "Mock" in type(dataset).__name__ else "real"


def _te_version() -> str | None:
    try:
        import transformer_engine

        return transformer_engine.__version__
    except ImportError:
        return None


def _unwrapped(module: Any) -> Any:
    """The model inside its DDP / FSDP / Float16Module wrappers."""
    while hasattr(module, "module"):
        module = module.module
    return module


def _stage_clock(model_chunks: list[Any]) -> StageClock | None:
    """CUDA events on the vision encoder (its patch embedding to its merger), where the model has one."""
    vision = getattr(_unwrapped(model_chunks[0]), "vision_model", None)
    first = getattr(vision, "patch_embed", None)
    return None if vision is None or first is None else StageClock({"vision": (vision, first)}, cuda=True)


def _make_callback(run: BridgeRun, reporter: Reporter | None, records: list[StepRecord]) -> Any:
    from megatron.bridge.training.callbacks import Callback

    class StepRecorder(Callback):
        """Each Bridge training step → our step record; the tuner's stop ends Bridge's loop."""

        def on_train_start(self, context: Any) -> None:
            from megatron.core import parallel_state

            # Which ranks count the data and the loss: known once pretrain() has built the groups.
            tensor_rank = parallel_state.get_tensor_model_parallel_rank()
            run.counts_data = tensor_rank == 0 and parallel_state.is_pipeline_first_stage() \
                and parallel_state.get_context_parallel_rank() == 0
            run.computes_loss = tensor_rank == 0 and parallel_state.is_pipeline_last_stage()
            run.clock = _stage_clock(context.model)
            run.model_config = getattr(_unwrapped(context.model[0]), "config", None)
            run.layers = [module for chunk in context.model for module in chunk.modules()
                          if hasattr(module, "cuda_graphs")]
            run.build.mark("Bridge's set-up (pretrain: model, optimizer, data)")

        def on_train_step_start(self, context: Any) -> None:
            # Bridge's loop captures its TE graphs just before this callback: count them from here on.
            run.graphs.extend(count_graphs_of(run.layers))
            if not records:
                run.build.mark("Bridge's loop to its first step")
                run.last_step_end = time.perf_counter()

        def on_train_step_end(self, context: Any) -> None:
            torch.cuda.synchronize(run.device)
            seconds = time.perf_counter() - run.last_step_end
            stages = run.clock.collect() if run.clock is not None else {}
            counts, wait = run.counter.take()
            flops = _step_flops(context.state)
            loss = None
            if run.computes_loss and context.loss_dict:
                value = next(iter(context.loss_dict.values()))
                loss = float(value.item() if isinstance(value, torch.Tensor) else value)
            if not run.counts_data:
                counts = StepCounts()
            elif run.rank == 0:
                counts = StepCounts(counts.useful_tokens, counts.image_tokens, counts.loss_tokens, counts.samples,
                                    model_flops=float(flops))
            local = LocalMeasures(step_seconds=seconds, data_wait_seconds=wait, vision_seconds=stages.get("vision", 0.0),
                                  projector_seconds=stages.get("projector", 0.0),
                                  peak_memory_bytes=peak_memory_bytes(run.device), counts=counts, loss=loss)
            record, stop = finish_step(run, len(records), local, reporter)
            records.append(record)
            if stop:
                run.stopped = True
                context.state.cfg.train.train_iters = context.state.train_state.step
            run.last_step_end = time.perf_counter()  # this callback's own work is not the next step's

    return StepRecorder()


def _step_flops(state: Any) -> float:
    """The step's model FLOPs as Bridge counts them after the step (its loop does so after the
    step-end callbacks): its formula over the sequence statistics its forward step accumulated."""
    from megatron.bridge.training.utils import flop_utils
    from megatron.core import parallel_state

    cfg = state.cfg
    stats = flop_utils.resolve_global_flops_runtime_stats(
        state, data_parallel_size=cfg.data_parallel_size, vp_size=cfg.model.virtual_pipeline_model_parallel_size,
        dp_group=parallel_state.get_data_parallel_group(),
        include_cross_attention_stats=hasattr(cfg.model, "_get_num_floating_point_operations_with_runtime_stats"))
    seqlen_sum, seqlen_squared_sum, vision_patches, cross_seqlen_sum, cross_product_sum = stats
    return float(flop_utils.num_floating_point_operations(
        cfg, batch_size=cfg.train.global_batch_size, seqlen_sum=seqlen_sum, seqlen_squared_sum=seqlen_squared_sum,
        num_vision_patches=vision_patches, cross_seqlen_sum=cross_seqlen_sum,
        cross_seqlen_product_sum=cross_product_sum))


def _counting_forward_step(counter: _StepCounter) -> Any:
    from megatron.bridge.training.state import GlobalState
    from megatron.bridge.training.vlm_step import forward_step

    def counted_forward_step(state: GlobalState, data_iterator: Any, model: Any,
                             return_schedule_plan: bool = False) -> Any:
        return forward_step(state, _CountingIterator(data_iterator, counter), model, return_schedule_plan)

    return counted_forward_step


def run_rank(request: BurstRequest, device: torch.device, reporter: Reporter | None = None) -> BurstResult:
    """Run the burst on this rank (``torch.distributed`` is up); rank 0's result carries the records."""
    if device.type != "cuda":
        return BurstResult(outcome="invalid", error="the bridge trainable trains only on CUDA devices")
    if request.recipe is None:
        return BurstResult(outcome="failed", error="the bridge trainable needs the campaign's bridge.recipe")
    records: list[StepRecord] = []
    run: BridgeRun | None = None
    build = BuildClock(device)
    try:
        go_offline(request.recipe, Path(tempfile.mkdtemp(prefix="hf-offline-")) / "hub")
        os.environ.setdefault("LOCAL_RANK", str(device.index or 0))
        torch.cuda.set_device(device)
        if request.memory_cap_fraction:
            torch.cuda.set_per_process_memory_fraction(request.memory_cap_fraction, device)
        import megatron.core
        from megatron.bridge.training.pretrain import pretrain

        build.mark("imports, device")
        recipe, trial = prepare(request, megatron.core.__version__)
        build.mark("recipe: loaded, overridden, validated")
        counter = _StepCounter(image_token_id=getattr(recipe.model, "image_token_id", None))
        run = BridgeRun(request=request, device=device, rank=torch.distributed.get_rank(),
                        world_size=torch.distributed.get_world_size(), recipe=recipe, trial_overrides=trial,
                        counter=counter, counts_data=False, computes_loss=False, precision=_precision(recipe),
                        build=build)
        pretrain(recipe, _counting_forward_step(counter), callbacks=[_make_callback(run, reporter, records)])
        if run.stopped:
            return BurstResult(outcome="pruned", records=tuple(records), contract=run.contract(),
                               evidence=run.evidence())
        if len(records) < request.steps:  # Bridge's loop ended early by itself (its exit conditions)
            return BurstResult(outcome="failed", records=tuple(records), contract=run.contract(),
                               error=f"Megatron-Bridge's training loop ended after {len(records)} of "
                                     f"{request.steps} steps without being told to stop")
        return BurstResult(outcome="ok", records=tuple(records), contract=run.contract(), evidence=run.evidence())
    except InvalidConfig as exc:
        return BurstResult(outcome="invalid", error=str(exc))
    except RecipeRefused as exc:
        return BurstResult(outcome="failed", error=str(exc))
    except torch.OutOfMemoryError as exc:
        # Bridge's pretrain() builds and trains in one call: the part after the last one timed.
        return BurstResult(outcome="oom", records=tuple(records), error=f"{type(exc).__name__}: {str(exc)[:500]}",
                           before_first_step=() if records else build.until("out of memory"))
    except Exception:  # noqa: BLE001 - anything else is the outcome `failed`, with the trace
        return BurstResult(outcome="failed", records=tuple(records), error=traceback.format_exc())
