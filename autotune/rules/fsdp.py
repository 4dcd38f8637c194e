"""Sharded data parallelism: Megatron-FSDP and torch FSDP2."""

from __future__ import annotations

from autotune.core.knobs import Config
from autotune.rules._base import RuleContext, rule


@rule(
    "fsdp_implementations_exclusive",
    source="megatron-lm",
    summary="use_megatron_fsdp and use_torch_fsdp2 are mutually exclusive",
)
def _fsdp_exclusive(config: Config, ctx: RuleContext) -> str | None:
    if config.use_megatron_fsdp and config.use_torch_fsdp2:
        return "choose one of use_megatron_fsdp and use_torch_fsdp2"
    return None


@rule("torch_fsdp2_needs_pp1_ep1", source="megatron-lm", summary="torch FSDP2 asserts PP = 1 and EP = 1")
def _torch_fsdp2_layout(config: Config, ctx: RuleContext) -> str | None:
    if config.use_torch_fsdp2 and (
        config.pipeline_model_parallel_size > 1 or config.expert_model_parallel_size > 1
    ):
        return (
            "torch FSDP2 in Megatron supports neither pipeline nor expert parallelism "
            f"(PP={config.pipeline_model_parallel_size}, EP={config.expert_model_parallel_size})"
        )
    return None
