"""CUDA graphs: scopes that exist, scopes that combine, and their coupling with recompute."""

from __future__ import annotations

from autotune.core.knobs import Config
from autotune.rules._base import (
    RuleContext,
    graph_scope,
    graphed,
    graphs_whole_layer,
    per_layer_graphs,
    rule,
    selective,
)


@rule(
    "full_recompute_needs_full_iteration_graphs",
    source="megatron-core",
    summary="full recompute with CUDA graphs only with cuda_graph_impl=full_iteration",
)
def _full_recompute_graphs(config: Config, ctx: RuleContext) -> str | None:
    if config.recompute_granularity == "full" and per_layer_graphs(config):
        return (
            f"full recompute is rejected with per-layer {config.cuda_graph_impl} graphs; "
            "use cuda_graph_impl full_iteration or none"
        )
    return None


@rule(
    "graphed_attention_recompute_needs_no_attention_dropout",
    source="megatron-core",
    summary="core_attn recompute inside a graph needs attention_dropout = 0",
)
def _graphed_attention_recompute(config: Config, ctx: RuleContext) -> str | None:
    if ctx.model.attention_dropout and selective(config, "core_attn") and graphed(config, "attn"):
        return (
            f"graphed attention with core_attn recompute needs attention_dropout 0 "
            f"({ctx.model.name} has {ctx.model.attention_dropout})"
        )
    return None


@rule(
    "graphed_mlp_recompute_needs_no_hidden_dropout",
    source="megatron-core",
    summary="mlp/moe recompute inside a graph needs hidden_dropout = 0",
)
def _graphed_mlp_recompute(config: Config, ctx: RuleContext) -> str | None:
    if not ctx.model.hidden_dropout:
        return None
    for module in ("mlp", "moe"):
        if selective(config, module) and graphed(config, module):
            return (
                f"graphed {module} with {module} recompute needs hidden_dropout 0 "
                f"({ctx.model.name} has {ctx.model.hidden_dropout})"
            )
    return None


@rule(
    "moe_preprocess_scope_needs_moe_router",
    source="megatron-core",
    summary="moe_preprocess graphs need moe_router; local graphs capture the two together",
)
def _moe_preprocess_needs_router(config: Config, ctx: RuleContext) -> str | None:
    scope = set(config.cuda_graph_scope or ())
    if config.cuda_graph_impl == "transformer_engine" and "moe_preprocess" in scope and "moe_router" not in scope:
        return "cuda_graph_scope moe_preprocess needs moe_router in the scope too"
    # megatron-core's local impl silently adds whichever of the two is missing; we require both
    # spelled out so two configs of a space never launch the same graphs.
    if config.cuda_graph_impl == "local" and len(scope & {"moe_router", "moe_preprocess"}) == 1:
        return "local graphs capture moe_router and moe_preprocess together; list both"
    return None


@rule(
    "moe_and_moe_router_scopes_exclusive",
    source="megatron-core",
    summary="cuda_graph_scope cannot hold both moe and moe_router",
)
def _moe_router_exclusive(config: Config, ctx: RuleContext) -> str | None:
    if per_layer_graphs(config) and {"moe", "moe_router"} <= set(config.cuda_graph_scope):
        return "cuda_graph_scope must not contain both moe and moe_router"
    return None


@rule(
    "moe_scope_needs_drop_and_pad",
    source="megatron-core",
    summary="the moe graph scope needs drop-and-pad MoE (capacity factor + padding)",
)
def _moe_scope_needs_drop_and_pad(config: Config, ctx: RuleContext) -> str | None:
    if per_layer_graphs(config) and "moe" in config.cuda_graph_scope and not ctx.model.drop_and_pad:
        return f"cuda_graph_scope moe needs drop-and-pad MoE; {ctx.model.name} is dropless"
    return None


@rule(
    "moe_preprocess_scope_excludes_capacity_alltoall",
    source="megatron-core",
    summary="moe_preprocess graphs are not supported with alltoall and a capacity factor",
)
def _moe_preprocess_capacity(config: Config, ctx: RuleContext) -> str | None:
    if (
        "moe_preprocess" in graph_scope(config)
        and config.moe_token_dispatcher_type == "alltoall"
        and ctx.model.moe_expert_capacity_factor is not None
        and not ctx.model.drop_and_pad
    ):
        return "moe_preprocess graphs would capture host syncs of alltoall with a capacity factor"
    return None


@rule(
    "whole_layer_graphs_need_drop_and_pad",
    source="megatron-core",
    summary="graphs of whole MoE layers need drop-and-pad MoE (dropless dispatch waits on the host)",
)
def _whole_layer_graphs_need_drop_and_pad(config: Config, ctx: RuleContext) -> str | None:
    # megatron-core checks this for the moe scope only; an empty scope (or a full-iteration
    # graph) captures the same dispatch, and on 0.19.2 its capture fails (cudaErrorCapturedEvent
    # at the dispatcher's device-to-host event, measured on the H200).
    if graphs_whole_layer(config) and not ctx.model.drop_and_pad:
        graphs = "a full-iteration graph" if config.cuda_graph_impl == "full_iteration" else "whole-layer graphs"
        return (
            f"{graphs} would capture the dropless MoE dispatch of {ctx.model.name}, which waits on a "
            "device-to-host copy, so capture fails; needs drop-and-pad MoE"
        )
    return None


@rule(
    "local_graph_scope_captures_a_layer",
    source="autotune",
    summary="local graphs whose scope captures no layer of the model are a no-op duplicate of no graphs",
)
def _local_scope_captures_a_layer(config: Config, ctx: RuleContext) -> str | None:
    if config.cuda_graph_impl != "local" or not config.cuda_graph_scope:
        return None
    scope = graph_scope(config)
    if scope & ctx.trainable.moe_layer_graph_scopes or (ctx.model.has_dense_layers and scope & {"attn", "mlp"}):
        return None
    listed = " ".join(config.cuda_graph_scope)
    graphing = "/".join(sorted(ctx.trainable.moe_layer_graph_scopes))
    return (
        f"local graphs of scope [{listed}] capture nothing in {ctx.model.name}: its layers are MoE, and the "
        f"{ctx.trainable.name} trainable graphs a MoE layer only for {graphing} in the scope"
    )


@rule("mlp_scope_needs_dense_layers", source="megatron-core", summary="the mlp graph scope needs dense layers")
def _mlp_scope_needs_dense(config: Config, ctx: RuleContext) -> str | None:
    if per_layer_graphs(config) and "mlp" in config.cuda_graph_scope and not ctx.model.has_dense_layers:
        return f"cuda_graph_scope mlp needs dense layers; every layer of {ctx.model.name} is MoE"
    return None


@rule(
    "mamba_scope_needs_mamba_layers",
    source="autotune",
    summary="the mamba graph scope on a model without Mamba layers is a no-op duplicate",
)
def _mamba_scope(config: Config, ctx: RuleContext) -> str | None:
    if per_layer_graphs(config) and "mamba" in config.cuda_graph_scope:
        return f"cuda_graph_scope mamba captures nothing: {ctx.model.name} has no Mamba layers"
    return None


@rule(
    "te_graphs_moe_recompute_excludes_moe_router_scope",
    source="megatron-core",
    summary="moe recompute is not supported with transformer_engine graphs of moe_router",
)
def _te_graphs_moe_recompute(config: Config, ctx: RuleContext) -> str | None:
    if (
        config.cuda_graph_impl == "transformer_engine"
        and selective(config, "moe")
        and "moe_router" in config.cuda_graph_scope
    ):
        return "moe recompute cannot run with a transformer_engine moe_router graph"
    return None
