"""One burst of the megatron-core MoE VLM on one rank (CUDA): parallel groups from the config,
the model, megatron-core DDP / Megatron-FSDP / torch FSDP2, the megatron optimizer, and
``get_forward_backward_func`` on the same real-data loader as the native trainable.

``torch.distributed`` is up before :func:`run_rank` (the local launcher or a Ray Train worker
group started it). megatron-core keeps its parallel groups, microbatch calculator, rerun state
machine and CUDA-graph records in module globals: :func:`_release` destroys them all, and a burst
seeds every generator it draws from, so that a kept rank process runs the next burst as a new
one would. Until 2026-12-06 megatron-core's token dispatcher held the model and optimizer after a
burst through the last step's autograd graph (19,584 MiB after bring-up on an H200):
:func:`drop_kept_autograd_graphs` frees it, and the release also frees the libraries' GEMM
workspaces, so that an H100 with TE has nothing left allocated after a TE-graph burst
(``bench/results/h100_kept_ranks_te_20261206/``).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import random
import sys
import time
import traceback
from dataclasses import dataclass, field, replace
from typing import Any, Iterator, Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch.utils._pytree import tree_leaves

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
from autotune.core.knobs import Config
from trainables import kept_groups
from trainables.data.loader import MicroBatch, rank_loader
from trainables.graph_replays import CountedGraph, count_graphs_of
from trainables.megatron.graph_scope import GraphScopeWatch
from trainables.measurement import measurement_contract
from trainables.probe import transformer_engine_status
from trainables.stage_clock import StageClock
from trainables.steps import (
    BuildClock, LocalMeasures, StepCounts, count_batches, finish_step, peak_memory_bytes, run_steps,
)


OOM_ERRORS = (torch.OutOfMemoryError,)
SEED = 1234
log = logging.getLogger(__name__)


@contextlib.contextmanager
def _captures_in_thread_local_mode() -> Iterator[None]:
    """Make ``torch.cuda.graph`` capture in ``thread_local`` error mode while TE captures.

    Why: TE's ``make_graphed_callables`` captures in torch's default ``global`` mode, where a
    potentially unsafe CUDA call from *any* thread invalidates the capture, and the data loader's
    pin-memory thread keeps pinning decoded image batches (host-allocator event queries) during the
    seconds the layers take to capture. ``thread_local`` still forbids such calls on the capturing
    thread, which is what matters for the graph; megatron-core's own local graphs capture so."""
    graph_class = torch.cuda.graph

    class _ThreadLocalGraph(graph_class):
        def __init__(self, *args, capture_error_mode: str = "thread_local", **kwargs) -> None:
            super().__init__(*args, capture_error_mode=capture_error_mode, **kwargs)

    torch.cuda.graph = _ThreadLocalGraph
    try:
        yield
    finally:
        torch.cuda.graph = graph_class


def _train_on_the_capture_stream(device: torch.device) -> None:
    """Run the whole burst on the stream Transformer Engine captures its graphs on.

    Why: autograd's gradient-accumulation nodes of the parameters keep the stream of the eager
    steps before the capture. When that is the default stream, capturing the backward makes it wait
    on the capture and CUDA invalidates the capture ("operation would make the legacy stream depend
    on a capturing blocking stream": every scope failed so on the H200 with torch 2.11). torch 2.13
    can redirect such stale streams (``torch.autograd.graph.set_override_stale_capture_stream``);
    on any torch, eager steps that already run on the capture stream leave nothing stale. TE
    captures on ``torch.cuda.graph``'s default capture stream (it passes none), so that stream
    becomes this burst's current stream before the model exists, as megatron-core's local graphs
    move the process to a side stream of their own."""
    stream = torch.cuda.Stream(device)
    torch.cuda.graph.default_capture_stream = stream
    torch.cuda.set_stream(stream)


@dataclass
class TransformerEngineGraphs:
    """megatron-core's ``TECudaGraphHelper`` driven as Megatron-LM's and Megatron-Bridge's training
    loops drive it: ``cuda_graph_warmup_steps`` eager steps, then the graphs are captured before the
    next step's forward-backward and replayed from then on. Without this a config that sets
    ``cuda_graph_impl: transformer_engine`` runs every layer eagerly (the layers only replay graphs
    the helper made), so a trial would measure no graphs under a graph knob."""

    helper: Any
    capture_step: int
    overlap_param_gather: bool
    decoder_layers: Sequence[Any]
    """This rank's decoder layers, whose parts ``scope`` watches once the graphs are captured."""
    graphs: list[CountedGraph] = field(default_factory=list)
    capture_seconds: float | None = None
    scope: GraphScopeWatch | None = None

    def before_step(self, step: int) -> None:
        if step != self.capture_step or self.helper.capture_finished():
            return
        start = time.perf_counter()
        with _captures_in_thread_local_mode():
            self.helper.create_cudagraphs()
        if self.overlap_param_gather:
            # DDP's parameter all-gather hook runs before each graphed module's replay.
            self.helper.cuda_graph_set_manual_hooks()
        self.capture_seconds = time.perf_counter() - start
        self.graphs.extend(count_graphs_of(self.helper.flattened_callables))
        self.scope = GraphScopeWatch.of(self.decoder_layers)
        log.info("captured %d TE graphs in %.1f s", len(self.graphs), self.capture_seconds)

    @property
    def replays(self) -> int:
        return sum(graph.replays for graph in self.graphs)

    def scope_taken(self, scope: Sequence[str]) -> bool:
        """Graphs replayed, and they hold exactly the parts the config's scope names."""
        return self.scope is not None and self.replays > 0 and self.scope.graphed() == self.scope.expected(scope)

    def observed(self) -> dict[str, Any]:
        return {
            "te_graphs_captured": len(self.graphs),
            "te_graph_replays": self.replays,
            "te_graph_capture_step": self.capture_step,
            "te_graph_capture_seconds": self.capture_seconds,
            "te_graphed_scope": self.scope.graphed() if self.scope is not None else None,
        }

    def delete(self) -> None:
        if self.scope is not None:
            self.scope.close()
        if self.helper.graphs_created():
            self.helper.delete_cuda_graphs()


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
    kernels: dict[str, bool]
    """The decoder's fused kernels no knob owns (see ``decoder_kernel_fields``)."""
    te_graphs: TransformerEngineGraphs | None = None
    checkpoint_nodes: int = 0
    """Recompute nodes in the first step's autograd graph (before any CUDA graph hides them)."""
    fp8_observed: dict[str, Any] | None = None
    """What Transformer Engine's FP8 state was inside the first decoder layer on step 0."""
    build_phases: tuple[TimedPart, ...] = ()

    def evidence(self) -> Evidence:
        """What the run observed of its knobs, and per knob whether that matches the config."""
        observed = self._observed()
        return Evidence(checks=self._checks(observed), **observed)

    def contract(self) -> Contract:
        return megatron_contract(self)

    def _checks(self, observed: dict[str, Any]) -> dict[str, bool]:
        """Each check compares an observation with the config both ways, so it fails when the knob
        is set and did nothing as well as when it is unset and something happened anyway."""
        config = self.request.config
        data_parallel = observed["data_parallel"]
        checks = {
            "recompute_granularity": (observed["recompute_checkpoint_nodes"] > 0) == (config.recompute_granularity != "none"),
            "expert_model_parallel_size": observed["ep_group_size"] == config.expert_model_parallel_size,
            "tensor_model_parallel_size": observed["tp_group_size"] == config.tensor_model_parallel_size,
            "use_torch_fsdp2": (data_parallel == "TorchFullyShardedDataParallel") == bool(config.use_torch_fsdp2),
            "use_megatron_fsdp": (data_parallel == "FullyShardedDataParallel") == bool(config.use_megatron_fsdp),
            "cuda_graph_impl": {
                "none": observed["cuda_graph_units"] == 0 and observed.get("te_graphs_captured", 0) == 0,
                "local": observed["cuda_graph_units"] > 0,
                "transformer_engine": observed.get("te_graph_replays", 0) > 0,
            }.get(config.cuda_graph_impl, False),
            "moe_grouped_gemm": ("Grouped" in str(observed["experts_module"])) == bool(config.moe_grouped_gemm),
        }
        if config.cuda_graph_impl == "transformer_engine":
            checks["cuda_graph_scope"] = (self.te_graphs is not None
                                          and self.te_graphs.scope_taken(config.cuda_graph_scope or ()))
        if observed["frozen_vision_params_with_grad"] is not None:
            frozen = observed["frozen_vision_params_with_grad"] == 0
            checks["freeze_vision_model"] = frozen == bool(config.freeze_vision_model)
        if self.fp8_observed is not None:
            checks["fp8"] = self.fp8_observed["enabled"] == (config.fp8 != "none")
        return checks

    def _observed(self) -> dict[str, Any]:
        from megatron.core import parallel_state
        from megatron.core.transformer.cuda_graphs import _CudagraphGlobalRecord

        frozen_with_grad = None
        if self.vlm.pre_process:
            frozen_with_grad = sum(p.requires_grad or getattr(p, "main_grad", None) is not None
                                   for p in self.vlm.vision_model.parameters())
        graph_units = sum(
            sum(runner.fwd_graph is not None for runner in module.cudagraph_runners)
            for module in self.vlm.modules() if hasattr(module, "cudagraph_runners")
        )
        moe_layer = next((m for m in self.vlm.modules() if hasattr(m, "experts") and hasattr(m, "router")), None)
        experts = moe_layer.experts if moe_layer is not None else None
        return {
            "layer_spec": self.layer_spec,
            "recompute_checkpoint_nodes": self.checkpoint_nodes,
            "frozen_vision_params_with_grad": frozen_with_grad,
            "ep_group_size": parallel_state.get_expert_model_parallel_world_size(),
            "etp_group_size": parallel_state.get_expert_tensor_parallel_world_size(),
            "tp_group_size": parallel_state.get_tensor_model_parallel_world_size(),
            "pp_group_size": parallel_state.get_pipeline_model_parallel_world_size(),
            "local_experts_per_moe_layer": getattr(experts, "num_local_experts", None),
            "experts_module": type(experts).__name__ if experts is not None else None,
            "data_parallel": type(self.model).__name__,
            "cuda_graph_units": graph_units,
            "cuda_graphs_created": bool(_CudagraphGlobalRecord.cudagraph_created),
            **(self.te_graphs.observed() if self.te_graphs is not None else {}),
            **({"fp8": self.fp8_observed} if self.fp8_observed is not None else {}),
        }


def build_run(request: BurstRequest, device: torch.device, build: BuildClock) -> MegatronRun:
    """Parallel groups, model, data-parallel wrapper, optimizer and (for TE graphs) the graph
    helper, each part timed on ``build``; a config megatron-core rejects raises :class:`InvalidConfig`."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from trainables.megatron.config_mapping import (
        build_ddp_config,
        build_transformer_config,
        freeze_arguments,
        init_micro_batch_calculator,
    )
    from trainables.megatron.model import MegatronMoEVLM, decoder_kernel_fields

    config = request.config
    use_te = transformer_engine_status()[0] is not None
    kernels = decoder_kernel_fields(use_te)
    with _invalid_on_rejection("megatron-core rejected the config"):
        decoder_config = build_transformer_config(config, request.model, extra=kernels)
        ddp_config = build_ddp_config(config)
        build.mark(parallel_groups(config))
    # As Megatron-LM: with any CUDA graphs, TE's RNG tracker where TE is installed (its graphs
    # register only its own generators), megatron-core's graph-safe one otherwise.
    graphs = config.cuda_graph_impl != "none"
    _seed_every_generator(SEED)
    # A new tracker each burst: a kept rank's was made for the last burst's config (an H200,
    # 2026-12-06: TE graphs after a burst without them found megatron's tracker and its tensor
    # states, and TE's attention after them rejected TE's tracker).
    model_parallel_cuda_manual_seed(SEED, te_rng_tracker=graphs and use_te, use_cudagraphable_rng=graphs,
                                    force_reset_rng=True)
    # GBS / (MBS × DP) per step (one per pipeline stage where the workload declares no global batch).
    dp = parallel_state.get_data_parallel_world_size()
    num_microbatches = init_micro_batch_calculator(request, dp, dist.get_rank())
    with _invalid_on_rejection("megatron-core could not build the model for the config"):
        vlm = MegatronMoEVLM(
            decoder_config, request.model, use_te,
            pre_process=parallel_state.is_pipeline_first_stage(),
            post_process=parallel_state.is_pipeline_last_stage(),
        )
    build.mark("model")
    # As Megatron-LM's get_model and Float16Module: plain torch modules (the ViT's LayerNorms)
    # start on the CPU in fp32.
    vlm.cuda(device)
    if decoder_config.bf16:
        vlm.bfloat16()
    vlm.freeze(**freeze_arguments(config))
    build.mark("to device")
    model = _wrap_data_parallel(vlm, decoder_config, ddp_config, config)
    build.mark("data parallel")
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-4, bf16=True, clip_grad=1.0,
                        use_distributed_optimizer=ddp_config.use_distributed_optimizer),
        [model],
    )
    build.mark("optimizer")
    decoder_config.finalize_model_grads_func = finalize_model_grads
    decoder_config.grad_scale_func = optimizer.scale_loss
    if isinstance(model, DistributedDataParallel):
        decoder_config.no_sync_func = model.no_sync
    te_graphs = None
    if config.cuda_graph_impl == "transformer_engine":
        from megatron.core.transformer.cuda_graphs import TECudaGraphHelper

        with _invalid_on_rejection("megatron-core's TE graph helper rejected the config"):
            helper = TECudaGraphHelper(model=[model], config=decoder_config, seq_length=request.model.seq_length,
                                       micro_batch_size=config.micro_batch_size, optimizers=[optimizer])
        te_graphs = TransformerEngineGraphs(helper, capture_step=decoder_config.cuda_graph_warmup_steps,
                                            overlap_param_gather=ddp_config.overlap_param_gather,
                                            decoder_layers=list(vlm.language_model.decoder.layers))
        build.mark("graph helper")
    clock = None
    if vlm.pre_process:
        clock = StageClock({"vision": (vlm.vision_model, vlm.vision_model.patch_embed),
                            "projector": (vlm.vision_projection, vlm.vision_projection.encoder.linear_fc1)}, cuda=True)
    batches = rank_loader(request, parallel_state.get_data_parallel_rank(), dp)
    build.mark("data loader")
    run = MegatronRun(
        request=request, device=device, rank=dist.get_rank(), world_size=dist.get_world_size(),
        model=model, vlm=vlm, optimizer=optimizer, clock=clock, batches=batches,
        num_microbatches=num_microbatches, layer_spec="transformer_engine" if use_te else "local",
        kernels=kernels, te_graphs=te_graphs, build_phases=tuple(build.phases),
    )
    if use_te:
        _observe_fp8_on_first_step(run)
    return run


PARALLEL_GROUP_SIZES = ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                        "virtual_pipeline_model_parallel_size", "context_parallel_size",
                        "expert_model_parallel_size", "expert_tensor_parallel_size")
"""The knobs megatron-core's parallel groups are made from (``initialize_model_parallel``'s
arguments of the same names): the layout kept groups serve."""


def parallel_groups(config: Config) -> str:
    """megatron-core's parallel groups for the burst: those the last burst of this process made,
    where it kept them for the same layout (:mod:`trainables.kept_groups`: its world was kept, so
    every rank of it ran that burst too), else made now and kept for the next burst. Returns what
    was done, for the build's part."""
    from megatron.core import parallel_state

    sizes = {name: getattr(config, name) for name in PARALLEL_GROUP_SIZES}
    layout = tuple(sizes.values())
    if kept_groups.kept_for(layout) and parallel_state.model_parallel_is_initialized():
        return "parallel groups, kept from the last burst"
    if parallel_state.model_parallel_is_initialized():  # another layout's, or its groups went with an earlier world
        parallel_state.destroy_model_parallel()
    for group in kept_groups.kept() & set(dist.distributed_c10d._world.pg_map):  # another layout's
        dist.destroy_process_group(group)
    kept_groups.forget()
    made_before = set(dist.distributed_c10d._world.pg_map)
    parallel_state.initialize_model_parallel(**sizes)
    kept_groups.keep(set(dist.distributed_c10d._world.pg_map) - made_before, layout)
    return "parallel groups"


def _seed_every_generator(seed: int) -> None:
    """Python's, NumPy's and torch's CPU generators, as Megatron-LM's ``_set_random_seed`` does
    before megatron-core seeds CUDA's: the modules built on the CPU (the ViT's patch embedding and
    norms) draw their initial weights there. Unseeded, a process's second burst of a config started
    from other weights than its first (an H100, 2026-12-05: a loss of 1.327 against 1.331 at step 0,
    ``bench/results/h100_startup_20261205/reused_process_eager.json``); a fresh process hid it."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _observe_fp8_on_first_step(run: MegatronRun) -> None:
    """Record, inside the first decoder layer's attention on step 0, whether Transformer Engine
    runs in FP8 and with which recipe (megatron-core enters FP8 inside ``TransformerBlock``)."""
    from transformer_engine.pytorch.fp8 import FP8GlobalStateManager

    layers = run.vlm.language_model.decoder.layers
    if len(layers) == 0:
        return

    def record(module, args) -> None:
        enabled = FP8GlobalStateManager.is_fp8_enabled()
        run.fp8_observed = {"enabled": enabled,
                            "recipe": type(FP8GlobalStateManager.get_fp8_recipe()).__name__ if enabled else None}
        handle.remove()

    handle = layers[0].self_attention.register_forward_pre_hook(record)


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
    build = BuildClock(device)
    te_problem = transformer_engine_status()[1]
    if te_problem is not None:
        # megatron-core imports TE where it is installed; a TE that cannot load breaks it there.
        return BurstResult(outcome="failed", error=te_problem)
    torch.cuda.set_device(device)
    if request.config.cuda_graph_impl == "transformer_engine":
        _train_on_the_capture_stream(device)
    if request.memory_cap_fraction:
        torch.cuda.set_per_process_memory_fraction(request.memory_cap_fraction, device)
    build.mark("stack check, device")
    built: list[MegatronRun] = []
    try:
        result = _trained(request, device, build, reporter, built)
    finally:
        release = BuildClock(device, synchronize=False)
        try:
            _release(built[0] if built else None, release)
        except Exception:  # noqa: BLE001 - see below
            # A device-side assert poisons the CUDA context, and the release fails in turn; the
            # burst's own error is the one to report (its process is not reused).
            log.warning("releasing the burst's model and groups failed", exc_info=True)
        # The model, its data-parallel wrapper and the optimizer hold each other (gradient hooks,
        # the config's sync functions): only the cycle collector frees them, and only once nothing
        # here holds the run. Collected before, they stayed allocated (19.6 GiB after bring-up on
        # an H100) and the next burst in the process ran out of memory at its build.
        built.clear()
        gc.collect()
        release.mark("objects collected")
        torch.cuda.empty_cache()
        release.mark("allocator cache emptied")
    return replace(result, release=tuple(release.phases))


def _trained(request: BurstRequest, device: torch.device, build: BuildClock, reporter: Reporter | None,
             built: list[MegatronRun]) -> BurstResult:
    """Build and train; the run goes into ``built`` as soon as it exists, for the caller to release
    whatever the outcome."""
    records: list[StepRecord] = []
    try:
        built.append(build_run(request, device, build))
        outcome = run_steps(device, request.steps, lambda step: _train_step(built[0], step, reporter), records)
        return BurstResult(outcome=outcome, records=tuple(records), contract=built[0].contract(),
                           evidence=built[0].evidence())
    except InvalidConfig as exc:
        return BurstResult(outcome="invalid", error=str(exc))
    except OOM_ERRORS as exc:
        return BurstResult(outcome="oom", records=tuple(records), error=f"{type(exc).__name__}: {str(exc)[:500]}",
                           before_first_step=() if records else build.until(
                               "out of memory", "the first step" if built else None))
    except Exception:  # noqa: BLE001 - anything else is the outcome `failed`, with the trace
        return BurstResult(outcome="failed", records=tuple(records), error=traceback.format_exc())


def _release(run: MegatronRun | None, clock: BuildClock) -> None:
    """Free the model, graphs and parallel groups so nothing reaches the caller or a later burst;
    each part timed on ``clock``."""
    from megatron.core import parallel_state
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.num_microbatches_calculator import destroy_num_microbatches_calculator
    from megatron.core.rerun_state_machine import destroy_rerun_state_machine
    from megatron.core.transformer.cuda_graphs import _CudagraphGlobalRecord, delete_cuda_graphs
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    if run is not None:
        # The loader's workers end here, timed, rather than whenever the collector reaches the
        # iterator (what its own ``__del__`` calls; an iterator without workers has none).
        end_workers = getattr(run.batches, "_shutdown_workers", None)
        if end_workers is not None:
            end_workers()
        clock.mark("data loader's workers ended")
        if run.te_graphs is not None:
            run.te_graphs.delete()
        drop_kept_autograd_graphs(run.model)
    if _CudagraphGlobalRecord.cudagraph_created or _CudagraphGlobalRecord.cudagraph_record:
        delete_cuda_graphs()
    clock.mark("graphs dropped")
    destroy_num_microbatches_calculator()
    destroy_rerun_state_machine()  # the forward-backward function makes one on first use; it counts iterations
    if not kept_groups.kept():
        parallel_state.destroy_model_parallel()
    else:  # kept, they stay megatron-core's for the next burst, but not what its layers cached beside them
        _empty_global_memory_buffer()
    # Module-level state that outlives a model: the rotary table's cache keys on the module (and
    # holds its CUDA tables), the MoE metrics tracker on the layers' metrics, the auxiliary loss's
    # backward scale is a CUDA tensor, and TE's FP8 state holds its amax buffers and process group.
    RotaryEmbedding.forward.cache_clear()
    MoEAuxLossAutoScaler.main_loss_backward_scale = None
    moe_logging = sys.modules.get("megatron.core.transformer.moe.moe_logging")  # where this megatron-core has it (0.19.2)
    if moe_logging is not None:
        moe_logging.destroy_moe_metrics_tracker()
    quantization = sys.modules.get("transformer_engine.pytorch.quantization")
    if quantization is not None:
        quantization.FP8GlobalStateManager.reset()
    # The GEMM workspaces both libraries keep per device and stream (TE's in an lru_cache, torch's
    # cuBLAS ones in C++): 290 MiB after a TE-graph burst on an H100, which a kept rank's check
    # could not tell from a leak. The next burst allocates its own.
    gemm = sys.modules.get("transformer_engine.pytorch.cpp_extensions.gemm")
    if gemm is not None:
        gemm.get_cublas_workspace.cache_clear()
    if torch.cuda.is_initialized():
        torch._C._cuda_clearCublasWorkspaces()
    # Back on the default stream, as a new process starts (TE graphs move the burst to their
    # capture stream, megatron-core's local graphs to a side stream).
    torch.cuda.graph.default_capture_stream = None
    if torch.cuda.is_initialized():
        torch.cuda.set_stream(torch.cuda.default_stream())
    clock.mark("megatron-core and TE state reset")


def _empty_global_memory_buffer() -> None:
    """A new, empty global memory buffer for megatron-core's layers, as ``destroy_model_parallel``
    and ``initialize_model_parallel`` leave it. Its tensors (attention's matmul input, the
    all-gather buffers) grow to the largest shape a burst asked for and outlive it. Once the groups
    were kept and ``destroy_model_parallel`` no longer ran, a kept rank's check found 190 MiB still
    allocated after bring-up and 698 MiB after a TE-graph burst on an H100 (2026-12-06) and
    replaced the rank; the buffer is the device memory that call freed besides the groups."""
    from megatron.core import parallel_state

    parallel_state.destroy_global_memory_buffer()
    parallel_state._set_global_memory_buffer()


def drop_kept_autograd_graphs(model: torch.nn.Module) -> None:
    """Drop the tensors a forward left on the model's modules, and on their helper objects, that
    still carry that step's autograd graph, so that the cycle collector can free the model.

    megatron-core's all-to-all token dispatcher keeps each MoE layer's last router probabilities
    (``self.probs``). Their graph, though already run backward, keeps its edges to every
    parameter's gradient accumulator before that layer, and megatron-core's DDP hooks each
    accumulator with a closure over itself: DDP, model, buffers and optimizer are then held from
    C++, where the collector cannot see the cycle (an H200, 2026-12-06: 19,584 MiB left after
    bring-up's burst; ``bench/results/h200_kept_ranks_20261206/``). Its local CUDA graphs
    (``cuda_graph_impl: local``) do the same from each layer's graph runners, modules its
    ``CudaGraphManager`` keeps in a plain list (out of ``model.modules()``' reach), with the
    forward outputs they recorded and captured in tuples (``outputs``, ``fwd_graph_outputs``): on
    an H200 without TE (2026-12-07) every local-graph burst that ended ok left 18.6–21.0 GiB
    allocated, and its kept rank was replaced. Public for ``bench/device/leak_holders.py``."""
    for module in model.modules():
        for holder in (module, *_helpers(module)):
            for name, value in list(vars(holder).items()):
                if _carries_autograd_graph(value):
                    setattr(holder, name, None)


def _helpers(module: torch.nn.Module) -> Iterator[Any]:
    """The objects a module keeps beside its submodules: plain objects, and the modules it keeps
    in lists or tuples (not submodules, so ``model.modules()`` does not reach them)."""
    for value in vars(module).values():
        if isinstance(value, (list, tuple)):
            yield from (item for item in value if isinstance(item, torch.nn.Module))
        elif hasattr(value, "__dict__") and not isinstance(value, (torch.nn.Module, torch.Tensor, type)):
            yield value


def _carries_autograd_graph(value: Any) -> bool:
    """Whether ``value`` is, or holds in lists, tuples or dicts, a tensor with an autograd graph."""
    return any(isinstance(leaf, torch.Tensor) and leaf.grad_fn is not None for leaf in tree_leaves(value))


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
    batches: list[MicroBatch] = []
    data_wait = 0.0

    def next_on_device() -> Iterator[MicroBatch]:
        # One micro-batch at a time, as Megatron-LM's get_batch: a step of many micro-batches
        # never holds them all on the device.
        nonlocal data_wait
        while True:
            fetch = time.perf_counter()
            batch = next(run.batches)
            data_wait += time.perf_counter() - fetch
            batches.append(batch)
            yield batch.to(device)

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

    if run.te_graphs is not None:
        run.te_graphs.before_step(step)
    run.model.zero_grad_buffer()
    run.optimizer.zero_grad()
    losses = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=next_on_device(), model=[run.model],
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
        precision=precision(config),
        timing="cuda events (stages), wall clock after device synchronisation (step)",
        versions={"cuda": torch.version.cuda, "megatron_core": megatron.core.__version__,
                  "transformer_engine": transformer_engine_status()[0]},
        layer_spec=run.layer_spec,
        kernels=run.kernels,
    )


def precision(config: Config) -> str:
    """The burst's numerics in words: runs in bf16 and in fp8 are different measurements."""
    base = "bf16 parameters, fp32 main parameters and loss (megatron optimizer)"
    if config.fp8 == "none":
        return base
    return f"{base}; fp8 {config.fp8} GEMMs with {config.fp8_recipe} scaling in Transformer Engine's decoder layers"
