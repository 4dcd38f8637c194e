"""Parallel layout: the products that must divide the trial's world and the model's shapes."""

from __future__ import annotations

from autotune.core.knobs import (
    Config,
    data_parallel,
    expert_tensor_parallel,
    global_batch_misfit,
    micro_batches_per_step,
)
from autotune.rules._base import RuleContext, rule


@rule(
    "data_parallel_whole",
    source="megatron-core",
    summary="DP = world / (TP·PP·CP) must be a whole number",
)
def _data_parallel_whole(config: Config, ctx: RuleContext) -> str | None:
    model_parallel = (
        config.tensor_model_parallel_size * config.pipeline_model_parallel_size * config.context_parallel_size
    )
    if ctx.world_size % model_parallel:
        return (
            f"{ctx.world_size} GPUs per trial cannot be split into TP·PP·CP = {model_parallel} "
            "model-parallel groups"
        )
    return None


@rule(
    "expert_data_parallel_whole",
    source="megatron-core",
    summary="expert-DP = world / (ETP·EP·PP) must be a whole number",
)
def _expert_data_parallel_whole(config: Config, ctx: RuleContext) -> str | None:
    expert_parallel = (
        expert_tensor_parallel(config) * config.expert_model_parallel_size * config.pipeline_model_parallel_size
    )
    if ctx.world_size % expert_parallel:
        return (
            f"{ctx.world_size} GPUs per trial cannot be split into ETP·EP·PP = {expert_parallel} "
            "expert-parallel groups"
        )
    return None


@rule("experts_divisible_by_ep", source="megatron-core", summary="num_moe_experts % EP == 0")
def _experts_divisible_by_ep(config: Config, ctx: RuleContext) -> str | None:
    if ctx.model.num_moe_experts % config.expert_model_parallel_size:
        return (
            f"{ctx.model.num_moe_experts} experts cannot be spread evenly over "
            f"EP={config.expert_model_parallel_size} ranks"
        )
    return None


@rule("heads_divisible_by_tp", source="megatron-core", summary="attention heads % TP == 0")
def _heads_divisible_by_tp(config: Config, ctx: RuleContext) -> str | None:
    tp = config.tensor_model_parallel_size
    if ctx.model.num_attention_heads % tp:
        return f"{ctx.model.num_attention_heads} attention heads cannot be split over TP={tp}"
    groups = ctx.model.num_query_groups
    if groups % tp and tp % groups:
        return f"{groups} query groups must be a multiple or a divisor of TP={tp}"
    return None


@rule(
    "ffn_divisible_by_tp",
    source="megatron-core",
    summary="dense FFN width % TP == 0 and expert FFN width % ETP == 0",
)
def _ffn_divisible_by_tp(config: Config, ctx: RuleContext) -> str | None:
    tp, etp = config.tensor_model_parallel_size, expert_tensor_parallel(config)
    if ctx.model.has_dense_layers and ctx.model.ffn_hidden_size % tp:
        return f"dense FFN width {ctx.model.ffn_hidden_size} cannot be split over TP={tp}"
    if ctx.model.moe_ffn_hidden_size % etp:
        return f"expert FFN width {ctx.model.moe_ffn_hidden_size} cannot be split over ETP={etp}"
    return None


@rule(
    "layers_divisible_by_pipeline",
    source="megatron-core",
    summary="num_layers % (PP·VPP) == 0 (even pipeline stages)",
)
def _layers_divisible_by_pipeline(config: Config, ctx: RuleContext) -> str | None:
    stages = config.pipeline_model_parallel_size * (config.virtual_pipeline_model_parallel_size or 1)
    if ctx.model.num_layers % stages:
        return f"{ctx.model.num_layers} decoder layers cannot be split evenly into PP·VPP = {stages} stages"
    return None


@rule(
    "sequence_divisible_by_context_parallel",
    source="megatron-core",
    summary="sequence length % (2·CP) == 0 when CP > 1 (load-balanced chunks)",
)
def _sequence_divisible_by_cp(config: Config, ctx: RuleContext) -> str | None:
    cp = config.context_parallel_size
    if cp > 1 and ctx.model.seq_length % (2 * cp):
        return f"sequence length {ctx.model.seq_length} is not a multiple of 2·CP = {2 * cp}"
    return None


@rule("sequence_parallel_needs_tp", source="megatron-core", summary="sequence parallel needs TP > 1")
def _sequence_parallel_needs_tp(config: Config, ctx: RuleContext) -> str | None:
    if config.sequence_parallel and config.tensor_model_parallel_size == 1:
        return "sequence_parallel has nothing to split with TP=1"
    return None


@rule(
    "moe_tensor_parallel_needs_sequence_parallel",
    source="megatron-lm",
    summary="a MoE model with TP > 1 needs sequence parallel",
)
def _moe_tp_needs_sp(config: Config, ctx: RuleContext) -> str | None:
    if config.tensor_model_parallel_size > 1 and not config.sequence_parallel:
        return f"MoE layers with TP={config.tensor_model_parallel_size} need sequence_parallel=true"
    return None


@rule(
    "global_batch_whole_micro_batches",
    source="megatron-core",
    summary="the workload's global batch % (MBS·DP) == 0",
)
def _global_batch_whole_micro_batches(config: Config, ctx: RuleContext) -> str | None:
    return global_batch_misfit(config, ctx.world_size, ctx.global_batch_size)


@rule(
    "interleaved_pipeline_micro_batches",
    source="megatron-core",
    summary="with a virtual pipeline, micro-batches per step % PP == 0",
)
def _interleaved_pipeline_micro_batches(config: Config, ctx: RuleContext) -> str | None:
    if config.virtual_pipeline_model_parallel_size is None or global_batch_misfit(
        config, ctx.world_size, ctx.global_batch_size
    ):
        return None
    count = micro_batches_per_step(config, ctx.world_size, ctx.global_batch_size)
    pipeline = config.pipeline_model_parallel_size
    if count % pipeline:
        return (f"the interleaved pipeline schedule runs micro-batches in groups of PP = {pipeline}, but each step "
                f"has {count} (global batch {ctx.global_batch_size} / (MBS {config.micro_batch_size} × DP "
                f"{data_parallel(config, ctx.world_size)}))")
    return None
