"""Capabilities of the target stack: trainable, accelerator, Transformer Engine, DeepEP, versions."""

from __future__ import annotations

from packaging.version import Version

from autotune.core.knobs import Config
from autotune.rules._base import RuleContext, rule, selective


@rule(
    "trainable_honours_value",
    source="stack",
    summary="the trainable must honour every knob value (never silently ignore one)",
)
def _trainable_honours(config: Config, ctx: RuleContext) -> str | None:
    reasons = [
        reason
        for name, value in config.items()
        if (reason := ctx.trainable.unsupported(name, value, ctx.stack)) is not None
    ]
    return "; ".join(reasons) or None


@rule("trainable_needs_cuda", source="stack", summary="the trainable needs a CUDA accelerator")
def _trainable_needs_cuda(config: Config, ctx: RuleContext) -> str | None:
    if ctx.trainable.requires_cuda and not ctx.stack.has_cuda:
        return f"the {ctx.trainable.name} trainable trains only on CUDA devices; this stack is {ctx.stack.accelerator}"
    return None


@rule("cuda_graphs_need_cuda", source="stack", summary="CUDA graphs need a CUDA accelerator")
def _graphs_need_cuda(config: Config, ctx: RuleContext) -> str | None:
    if config.cuda_graph_impl != "none" and not ctx.stack.has_cuda:
        return f"cuda_graph_impl={config.cuda_graph_impl} needs a CUDA device; this stack is {ctx.stack.accelerator}"
    return None


@rule(
    "transformer_engine_graphs_need_te",
    source="stack",
    summary="cuda_graph_impl=transformer_engine needs Transformer Engine",
)
def _te_graphs_need_te(config: Config, ctx: RuleContext) -> str | None:
    if config.cuda_graph_impl == "transformer_engine" and ctx.stack.transformer_engine is None:
        return "transformer_engine graphs need Transformer Engine, which this stack lacks"
    return None


@rule("grouped_gemm_needs_te", source="stack", summary="moe_grouped_gemm needs Transformer Engine")
def _grouped_gemm_needs_te(config: Config, ctx: RuleContext) -> str | None:
    if config.moe_grouped_gemm and ctx.stack.transformer_engine is None:
        return "moe_grouped_gemm uses Transformer Engine's grouped linear, which this stack lacks"
    return None


@rule(
    "flex_backend_needs_package",
    source="stack",
    summary="the flex dispatcher's backend package (deep_ep / HybridEP) must be installed",
)
def _flex_backend_package(config: Config, ctx: RuleContext) -> str | None:
    backend = config.moe_flex_dispatcher_backend
    if backend == "deepep" and not ctx.stack.deep_ep:
        return "the flex dispatcher's deepep backend needs the deep_ep package, which this stack lacks"
    if backend == "hybridep" and not ctx.stack.hybrid_ep:
        return "the flex dispatcher's hybridep backend needs HybridEP, which this stack lacks"
    return None


def _megatron_core_layers_from(ctx: RuleContext, version: str) -> bool:
    """The trainable builds megatron-core's layers, and the stack runs ``version`` or newer (the
    version-bound crashes measured on megatron-core 0.19.2 apply from 0.19.0 on)."""
    megatron_core = ctx.stack.megatron_core
    return ctx.trainable.megatron_core_layers and megatron_core is not None and Version(megatron_core) >= Version(version)


@rule(
    "layernorm_recompute_needs_te_on_mcore_0_19",
    source="stack",
    summary="layernorm recompute crashes on megatron-core >= 0.19 without Transformer Engine",
)
def _layernorm_recompute(config: Config, ctx: RuleContext) -> str | None:
    # Measured on the H200 with megatron-core 0.19.2 and no TE: the first step raises
    # NameError: FP8GlobalStateManager.
    if (
        _megatron_core_layers_from(ctx, "0.19.0")
        and selective(config, "layernorm")
        and ctx.stack.transformer_engine is None
    ):
        return f"layernorm recompute crashes on megatron-core {ctx.stack.megatron_core} without Transformer Engine"
    return None


@rule(
    "local_layer_specs_lack_sequence_context_parallel",
    source="stack",
    summary="without Transformer Engine, megatron-core's local layer specs have no SP or CP",
)
def _local_specs_sp_cp(config: Config, ctx: RuleContext) -> str | None:
    if not ctx.trainable.megatron_core_layers or ctx.stack.transformer_engine is not None:
        return None
    reasons = []
    if config.context_parallel_size > 1:
        reasons.append("its DotProductAttention asserts context_parallel_size == 1 "
                       "(\"Context parallelism is only supported by TEDotProductAttention\")")
    if config.sequence_parallel:
        reasons.append("its torch norms assert sequence_parallel is off")
    if not reasons:
        return None
    return f"without Transformer Engine the {ctx.trainable.name} trainable builds megatron-core's local layer specs: " \
        + "; ".join(reasons)


_FP8_ACCELERATORS = frozenset({"h100", "h200", "b200", "gb200"})
_BLACKWELL = frozenset({"b200", "gb200"})


@rule("fp8_needs_te_and_fp8_tensor_cores", source="stack",
      summary="fp8 runs in Transformer Engine's layers on Hopper or Blackwell")
def _fp8_stack(config: Config, ctx: RuleContext) -> str | None:
    if config.fp8 == "none":
        return None
    if ctx.stack.accelerator not in _FP8_ACCELERATORS:
        return f"fp8={config.fp8} needs FP8 tensor cores (Hopper or Blackwell); this stack is {ctx.stack.accelerator}"
    if ctx.stack.transformer_engine is None:
        return f"fp8={config.fp8} runs in Transformer Engine's layers, which this stack lacks"
    return None


@rule("mxfp8_needs_blackwell", source="stack", summary="the mxfp8 recipe needs Blackwell (B200 / GB200)")
def _mxfp8_needs_blackwell(config: Config, ctx: RuleContext) -> str | None:
    if config.fp8_recipe == "mxfp8" and ctx.stack.accelerator not in _BLACKWELL:
        return (f"fp8_recipe=mxfp8 scales 32-element blocks in hardware only Blackwell has; "
                f"this stack is {ctx.stack.accelerator}")
    return None


@rule("moe_fusions_need_te", source="stack",
      summary="moe_permute_fusion and moe_router_fusion are Transformer Engine kernels")
def _moe_fusions_need_te(config: Config, ctx: RuleContext) -> str | None:
    fused = [name for name in ("moe_permute_fusion", "moe_router_fusion") if config[name]]
    if fused and ctx.stack.transformer_engine is None:
        return f"{' and '.join(fused)} use Transformer Engine's fused kernels, which this stack lacks"
    return None


@rule(
    "local_graphs_exclude_grouped_gemm_on_mcore_0_19",
    source="stack",
    summary="local CUDA graphs with grouped GEMM experts hit a device-side assert on megatron-core >= 0.19",
)
def _local_graphs_grouped_gemm(config: Config, ctx: RuleContext) -> str | None:
    # Measured on the H200 (megatron-core 0.19.2, TE 2.20.2, scope attn moe_router moe_preprocess):
    # the first replays index out of bounds in a gather ("vectorized gather kernel index out of
    # bounds", under CUDA_LAUNCH_BLOCKING=1), the graphs having captured routing-dependent indices
    # from megatron-core's zero-filled capture inputs; the same scope without grouped GEMM runs.
    if _megatron_core_layers_from(ctx, "0.19.0") and config.cuda_graph_impl == "local" and config.moe_grouped_gemm:
        return (f"local CUDA graphs with grouped GEMM experts fail with a device-side assert on megatron-core "
                f"{ctx.stack.megatron_core} (an out-of-bounds gather at the first replays); use transformer_engine "
                "graphs or no grouped GEMM")
    return None
