"""MoE token dispatch: the flex dispatcher's requirements."""

from __future__ import annotations

from autotune.core.fabric import hybrid_ep_span_problem
from autotune.core.knobs import Config
from autotune.rules._base import RuleContext, rule


@rule(
    "flex_dispatcher_needs_tp_ep_above_one",
    source="megatron-core",
    summary="the flex dispatcher (DeepEP/HybridEP) needs TP·EP > 1",
)
def _flex_needs_parallelism(config: Config, ctx: RuleContext) -> str | None:
    if config.moe_token_dispatcher_type == "flex":
        if config.tensor_model_parallel_size * config.expert_model_parallel_size == 1:
            return "the flex dispatcher has nothing to dispatch across with TP·EP = 1"
    return None


@rule(
    "deepep_excludes_pad_to_capacity",
    source="megatron-core",
    summary="flex with DeepEP does not support padding expert input to capacity",
)
def _deepep_pad(config: Config, ctx: RuleContext) -> str | None:
    if config.moe_flex_dispatcher_backend == "deepep" and ctx.model.moe_pad_expert_input_to_capacity:
        return f"the DeepEP backend cannot pad expert input to capacity, which {ctx.model.name} does"
    return None


@rule(
    "shared_expert_overlap_needs_alltoall",
    source="megatron-core",
    summary="overlapping the shared expert needs the alltoall dispatcher",
)
def _shared_expert_overlap(config: Config, ctx: RuleContext) -> str | None:
    model = ctx.model
    if (
        model.moe_shared_expert_intermediate_size is not None
        and model.moe_shared_expert_overlap
        and config.moe_token_dispatcher_type != "alltoall"
    ):
        return f"{model.name} overlaps its shared expert, which only works with the alltoall dispatcher"
    return None


@rule(
    "hybridep_across_trays_needs_domains_and_imex",
    source="stack",
    summary="HybridEP over several GB200 trays needs nodes labelled with their NVLink domain, and an IMEX channel",
)
def _hybridep_domains(config: Config, ctx: RuleContext) -> str | None:
    if ctx.nvlink_domains_labelled is None or ctx.gpus_per_node is None:
        return None
    return hybrid_ep_span_problem(config, ctx.stack.accelerator, ctx.gpus_per_node, ctx.nvlink_domains_labelled,
                                  ctx.stack.imex_channel)
