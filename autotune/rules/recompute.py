"""Activation recompute: what each granularity needs and which modules exist in the model."""

from __future__ import annotations

from autotune.core.knobs import Config
from autotune.rules._base import RuleContext, rule, selective


@rule(
    "full_recompute_needs_method_and_layers",
    source="megatron-core",
    summary="full recompute needs recompute_method uniform|block and recompute_num_layers",
)
def _full_needs_method_and_layers(config: Config, ctx: RuleContext) -> str | None:
    if config.recompute_granularity != "full":
        return None
    if config.recompute_method is None or config.recompute_num_layers is None:
        return "full recompute needs recompute_method (uniform or block) and recompute_num_layers"
    return None


@rule(
    "recompute_layers_within_stage",
    source="autotune",
    summary="recompute_num_layers above the layers of a pipeline stage recomputes the same layers (duplicate)",
)
def _recompute_layers_within_stage(config: Config, ctx: RuleContext) -> str | None:
    if config.recompute_granularity != "full" or config.recompute_num_layers is None:
        return None
    per_stage = ctx.model.num_layers // config.pipeline_model_parallel_size
    if config.recompute_num_layers > per_stage:
        return (
            f"recompute_num_layers={config.recompute_num_layers} exceeds the {per_stage} layers "
            "of a pipeline stage"
        )
    return None


@rule(
    "moe_act_recompute_needs_grouped_gemm",
    source="megatron-core",
    summary="recompute of moe_act needs moe_grouped_gemm",
)
def _moe_act_needs_grouped_gemm(config: Config, ctx: RuleContext) -> str | None:
    if selective(config, "moe_act") and not config.moe_grouped_gemm:
        return "recompute_modules moe_act is only supported with moe_grouped_gemm=true"
    return None


@rule("mla_up_proj_recompute_needs_mla", source="megatron-core", summary="mla_up_proj recompute needs MLA")
def _mla_up_proj_needs_mla(config: Config, ctx: RuleContext) -> str | None:
    if selective(config, "mla_up_proj") and not ctx.model.multi_latent_attention:
        return f"recompute_modules mla_up_proj needs multi-latent attention, which {ctx.model.name} does not use"
    return None


@rule(
    "shared_experts_recompute_excludes_overlap",
    source="megatron-core",
    summary="shared_experts recompute cannot run with shared-expert overlap",
)
def _shared_experts_excludes_overlap(config: Config, ctx: RuleContext) -> str | None:
    model = ctx.model
    if (
        selective(config, "shared_experts")
        and model.moe_shared_expert_intermediate_size is not None
        and model.moe_shared_expert_overlap
    ):
        return "recompute_modules shared_experts cannot work with moe_shared_expert_overlap"
    return None


@rule(
    "shared_experts_recompute_needs_shared_expert",
    source="autotune",
    summary="shared_experts recompute on a model without shared experts is a no-op duplicate",
)
def _shared_experts_needs_shared_expert(config: Config, ctx: RuleContext) -> str | None:
    if selective(config, "shared_experts") and ctx.model.moe_shared_expert_intermediate_size is None:
        return f"{ctx.model.name} has no shared expert, so recomputing shared_experts does nothing"
    return None


@rule(
    "mlp_recompute_needs_dense_layers",
    source="autotune",
    summary="mlp recompute on a model without dense layers is a no-op duplicate",
)
def _mlp_recompute_needs_dense_layers(config: Config, ctx: RuleContext) -> str | None:
    if selective(config, "mlp") and not ctx.model.has_dense_layers:
        return f"{ctx.model.name} has no dense MLP layers, so recomputing mlp does nothing"
    return None


@rule(
    "fp8_delayed_excludes_moe_act_layernorm_recompute",
    source="megatron-core",
    summary="fp8 delayed scaling cannot recompute moe_act or layernorm",
)
def _fp8_delayed_recompute(config: Config, ctx: RuleContext) -> str | None:
    recomputed = [module for module in ("moe_act", "layernorm") if selective(config, module)]
    if config.fp8 != "none" and config.fp8_recipe == "delayed" and recomputed:
        return f"fp8 delayed scaling does not support {' and '.join(recomputed)} recompute; use tensorwise or blockwise"
    return None
