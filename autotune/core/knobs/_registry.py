"""Every knob the tuner knows, defined once.

Sources: megatron-core 0.16.1 and 0.19.2 ``TransformerConfig`` / ``DistributedDataParallelConfig``
(field names and defaults), Megatron-LM ``megatron/training/arguments.py`` (flags are field names
with dashes; ``--num-virtual-stages-per-pipeline-rank`` for VPP, ``--freeze-ViT`` and
``--freeze-vision-projection`` from ``examples/multimodal``), Megatron-Bridge's ``ConfigContainer``
(``model.*`` is the model provider, a ``TransformerConfig`` subclass; ``ddp.*``, ``dist.*``,
``train.*``). Parents are declared before the knobs that depend on them.
"""

from __future__ import annotations

from autotune.core.knobs._base import Condition, Knob
from autotune.core.knobs._domains import BoolDomain, ChoiceDomain, IntDomain, SubsetDomain

RECOMPUTE_MODULES = ("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts")
CUDA_GRAPH_SCOPES = ("attn", "mlp", "moe", "moe_router", "moe_preprocess", "mamba")
PER_LAYER_GRAPH_IMPLS = ("local", "transformer_engine")


def _model_parallel(name: str, flag: str, doc: str) -> Knob:
    return Knob(
        name=name,
        domain=IntDomain(minimum=1),
        default=1,
        doc=doc,
        megatron_target="transformer",
        megatron_field=name,
        bridge_key=f"model.{name}",
        megatron_lm_flag=flag,
    )


_KNOBS: tuple[Knob, ...] = (
    Knob(
        name="micro_batch_size",
        domain=IntDomain(minimum=1),
        default=1,
        doc="Samples per micro-batch on each data-parallel rank; VLMs are very sensitive to it.",
        megatron_target="training",
        megatron_field=None,
        bridge_key="train.micro_batch_size",
        megatron_lm_flag="--micro-batch-size",
    ),
    Knob(
        name="recompute_granularity",
        domain=ChoiceDomain(("none", "selective", "full")),
        default="none",
        none_alias="none",
        doc="Activation recompute: none, selective (listed modules) or full (whole layers).",
        megatron_target="transformer",
        megatron_field="recompute_granularity",
        bridge_key="model.recompute_granularity",
        megatron_lm_flag="--recompute-granularity",
    ),
    Knob(
        name="recompute_method",
        domain=ChoiceDomain(("uniform", "block"), optional=True),
        default="uniform",
        doc="How full recompute picks layers: uniform chunks or the first N per pipeline stage.",
        megatron_target="transformer",
        megatron_field="recompute_method",
        bridge_key="model.recompute_method",
        megatron_lm_flag="--recompute-method",
        active_when=Condition("recompute_granularity", lambda v: v == "full", "recompute_granularity=full"),
    ),
    Knob(
        name="recompute_num_layers",
        domain=IntDomain(minimum=1, optional=True),
        default=1,
        doc="Layers per recompute chunk (uniform) or recomputed layers per stage (block).",
        megatron_target="transformer",
        megatron_field="recompute_num_layers",
        bridge_key="model.recompute_num_layers",
        megatron_lm_flag="--recompute-num-layers",
        active_when=Condition("recompute_granularity", lambda v: v == "full", "recompute_granularity=full"),
    ),
    Knob(
        name="recompute_modules",
        domain=SubsetDomain(RECOMPUTE_MODULES),
        default=("core_attn",),
        doc="Submodules recomputed by selective recompute (Megatron's None means [core_attn]).",
        megatron_target="transformer",
        megatron_field="recompute_modules",
        bridge_key="model.recompute_modules",
        megatron_lm_flag="--recompute-modules",
        active_when=Condition(
            "recompute_granularity", lambda v: v == "selective", "recompute_granularity=selective"
        ),
    ),
    Knob(
        name="cuda_graph_impl",
        domain=ChoiceDomain(("none", "local", "transformer_engine", "full_iteration")),
        default="none",
        doc="CUDA-graph implementation: per-layer local or TE graphs, or one full-iteration graph.",
        megatron_target="transformer",
        megatron_field="cuda_graph_impl",
        bridge_key="model.cuda_graph_impl",
        megatron_lm_flag="--cuda-graph-impl",
    ),
    Knob(
        name="cuda_graph_scope",
        domain=SubsetDomain(CUDA_GRAPH_SCOPES, empty_means="the whole layer"),
        default=(),
        doc="Modules captured by per-layer graphs; empty captures the whole layer.",
        megatron_target="transformer",
        megatron_field="cuda_graph_scope",
        renamed=(("0.18.0", "cuda_graph_modules"),),
        bridge_key="model.cuda_graph_scope",
        megatron_lm_flag="--cuda-graph-scope",
        active_when=Condition(
            "cuda_graph_impl", lambda v: v in PER_LAYER_GRAPH_IMPLS, "cuda_graph_impl in local, transformer_engine"
        ),
    ),
    _model_parallel(
        "tensor_model_parallel_size", "--tensor-model-parallel-size", "Tensor parallel (TP) size."
    ),
    _model_parallel(
        "pipeline_model_parallel_size", "--pipeline-model-parallel-size", "Pipeline parallel (PP) size."
    ),
    Knob(
        name="virtual_pipeline_model_parallel_size",
        domain=IntDomain(minimum=2, optional=True),
        default=None,
        doc="Virtual pipeline stages per PP rank (interleaved schedule); null means off.",
        megatron_target="transformer",
        megatron_field="virtual_pipeline_model_parallel_size",
        bridge_key="model.virtual_pipeline_model_parallel_size",
        megatron_lm_flag="--num-virtual-stages-per-pipeline-rank",
        active_when=Condition("pipeline_model_parallel_size", lambda v: v > 1, "pipeline_model_parallel_size>1"),
    ),
    _model_parallel("context_parallel_size", "--context-parallel-size", "Context parallel (CP) size."),
    _model_parallel(
        "expert_model_parallel_size", "--expert-model-parallel-size", "Expert parallel (EP) size."
    ),
    Knob(
        name="expert_tensor_parallel_size",
        domain=IntDomain(minimum=1, optional=True),
        default=None,
        doc="Expert tensor parallel (ETP) size; null means the same as TP. Use only when EP alone is not enough.",
        megatron_target="transformer",
        megatron_field="expert_tensor_parallel_size",
        bridge_key="model.expert_tensor_parallel_size",
        megatron_lm_flag="--expert-tensor-parallel-size",
    ),
    Knob(
        name="sequence_parallel",
        domain=BoolDomain(),
        default=False,
        doc="Sequence parallel (needs TP > 1; required for MoE with TP > 1).",
        megatron_target="transformer",
        megatron_field="sequence_parallel",
        bridge_key="model.sequence_parallel",
        megatron_lm_flag="--sequence-parallel",
    ),
    Knob(
        name="moe_token_dispatcher_type",
        domain=ChoiceDomain(("allgather", "alltoall", "flex")),
        default="allgather",
        doc="MoE token dispatcher; flex uses the DeepEP or HybridEP backend.",
        megatron_target="transformer",
        megatron_field="moe_token_dispatcher_type",
        bridge_key="model.moe_token_dispatcher_type",
        megatron_lm_flag="--moe-token-dispatcher-type",
    ),
    Knob(
        name="moe_flex_dispatcher_backend",
        domain=ChoiceDomain(("deepep", "hybridep")),
        default="deepep",
        doc="Backend of the flex dispatcher (HybridEP is the usual choice on GB200).",
        megatron_target="transformer",
        megatron_field="moe_flex_dispatcher_backend",
        bridge_key="model.moe_flex_dispatcher_backend",
        megatron_lm_flag="--moe-flex-dispatcher-backend",
        active_when=Condition("moe_token_dispatcher_type", lambda v: v == "flex", "moe_token_dispatcher_type=flex"),
    ),
    Knob(
        name="moe_grouped_gemm",
        domain=BoolDomain(),
        default=False,
        doc="Grouped GEMM for the experts (Transformer Engine's grouped linear).",
        megatron_target="transformer",
        megatron_field="moe_grouped_gemm",
        bridge_key="model.moe_grouped_gemm",
        megatron_lm_flag="--moe-grouped-gemm",
    ),
    Knob(
        name="moe_permute_fusion",
        domain=BoolDomain(),
        default=False,
        doc="Fused token permute/unpermute around the experts (Transformer Engine's kernels).",
        megatron_target="transformer",
        megatron_field="moe_permute_fusion",
        bridge_key="model.moe_permute_fusion",
        megatron_lm_flag="--moe-permute-fusion",
    ),
    Knob(
        name="moe_router_fusion",
        domain=BoolDomain(),
        default=False,
        doc="Fused router top-k, softmax and aux-loss scores (Transformer Engine's kernels).",
        megatron_target="transformer",
        megatron_field="moe_router_fusion",
        bridge_key="model.moe_router_fusion",
        megatron_lm_flag="--moe-router-fusion",
    ),
    Knob(
        name="cross_entropy_loss_fusion",
        domain=BoolDomain(),
        default=False,
        doc="Fused vocab-parallel cross entropy: fewer passes over the logits, less memory at the output layer.",
        megatron_target="transformer",
        megatron_field="cross_entropy_loss_fusion",
        bridge_key="model.cross_entropy_loss_fusion",
        megatron_lm_flag="--cross-entropy-loss-fusion",
    ),
    Knob(
        name="fp8",
        domain=ChoiceDomain(("none", "e4m3", "hybrid")),
        default="none",
        none_alias="none",
        doc="FP8 GEMMs in Transformer Engine's layers: e4m3 throughout, or hybrid (e5m2 gradients); none keeps bf16.",
        megatron_target="transformer",
        megatron_field="fp8",
        # Bridge copies its mixed_precision settings onto the model before validating: a model.fp8
        # override would be reset by the recipe's bf16 precision config.
        bridge_key="mixed_precision.fp8",
        megatron_lm_flag="--fp8-format",
    ),
    Knob(
        name="fp8_recipe",
        domain=ChoiceDomain(("delayed", "tensorwise", "blockwise", "mxfp8"), optional=True),
        default="delayed",
        doc="How FP8 scales are chosen: delayed (amax history), tensorwise (current scaling), blockwise "
        "(128-wide blocks), mxfp8 (32-element blocks, Blackwell only).",
        megatron_target="transformer",
        megatron_field="fp8_recipe",
        bridge_key="mixed_precision.fp8_recipe",
        megatron_lm_flag="--fp8-recipe",
        active_when=Condition("fp8", lambda v: v != "none", "fp8 in e4m3, hybrid"),
    ),
    Knob(
        name="use_megatron_fsdp",
        domain=BoolDomain(),
        default=False,
        doc="Megatron-FSDP data parallelism (forces the distributed optimizer).",
        megatron_target="ddp",
        megatron_field="use_megatron_fsdp",
        bridge_key="ddp.use_megatron_fsdp",
        megatron_lm_flag="--use-megatron-fsdp",
    ),
    Knob(
        name="data_parallel_sharding_strategy",
        domain=ChoiceDomain(("no_shard", "optim", "optim_grads", "optim_grads_params")),
        default="no_shard",
        doc="What Megatron-FSDP shards: nothing, optimizer states, +gradients, +parameters.",
        megatron_target="ddp",
        megatron_field="data_parallel_sharding_strategy",
        bridge_key="ddp.data_parallel_sharding_strategy",
        megatron_lm_flag="--data-parallel-sharding-strategy",
        active_when=Condition("use_megatron_fsdp", lambda v: v is True, "use_megatron_fsdp=true"),
    ),
    Knob(
        name="use_torch_fsdp2",
        domain=BoolDomain(),
        default=False,
        doc="PyTorch FSDP2 (fully_shard) data parallelism instead of DDP (Megatron: PP=1, EP=1 only).",
        megatron_target="training",
        megatron_field=None,
        bridge_key="dist.use_torch_fsdp2",
        megatron_lm_flag="--use-torch-fsdp2",
    ),
    Knob(
        name="freeze_vision_model",
        domain=BoolDomain(),
        default=False,
        doc="Freeze the vision encoder: forward only, no gradients; a small real gain and less memory.",
        megatron_target="llava_freeze",
        megatron_field="freeze_vision_model",
        bridge_key="model.freeze_vision_model",
        megatron_lm_flag="--freeze-ViT",
    ),
    Knob(
        name="freeze_vision_projection",
        domain=BoolDomain(),
        default=False,
        doc="Freeze the vision projector (the MLP between encoder and decoder).",
        megatron_target="llava_freeze",
        megatron_field="freeze_vision_projection",
        bridge_key="model.freeze_vision_projection",
        megatron_lm_flag=None,  # pretrain_vlm.py freezes only the LM and the ViT (--freeze-LM, --freeze-ViT)
    ),
)


def _check_order(knobs: tuple[Knob, ...]) -> None:
    seen: set[str] = set()
    for knob in knobs:
        if knob.active_when is not None and knob.active_when.parent not in seen:
            raise RuntimeError(f"knob {knob.name} is declared before its parent {knob.active_when.parent}")
        if knob.name in seen:
            raise RuntimeError(f"knob {knob.name} is declared twice")
        seen.add(knob.name)


_check_order(_KNOBS)
KNOBS: dict[str, Knob] = {knob.name: knob for knob in _KNOBS}
