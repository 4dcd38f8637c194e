"""Config + model preset → megatron-core configs. The one place knobs become Megatron fields.

Field names per megatron-core version come from the knob registry (``cuda_graph_scope`` became
``cuda_graph_modules`` in 0.18); the one value encoding that changed, a full-iteration graph, is
spelled as that version wants by ``megatron_graph_settings`` (the export spells it the same way).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from autotune.core.contract import BurstRequest
from autotune.core.knobs import KNOBS, Config, megatron_graph_settings
from autotune.core.model import ModelSpec


def installed_megatron_core_version() -> str:
    import megatron.core

    return megatron.core.__version__


def model_fields(model: ModelSpec) -> dict[str, Any]:
    """The decoder's shape and training numerics as ``TransformerConfig`` fields."""
    if model.multi_latent_attention:
        raise ValueError(f"{model.name}: multi-latent attention presets need MLATransformerConfig, not supported yet")
    return {
        "num_layers": model.num_layers,
        "hidden_size": model.hidden_size,
        "ffn_hidden_size": model.ffn_hidden_size,
        "num_attention_heads": model.num_attention_heads,
        "num_query_groups": model.num_query_groups,
        "kv_channels": model.kv_channels,
        "num_moe_experts": model.num_moe_experts,
        "moe_router_topk": model.moe_router_topk,
        "moe_ffn_hidden_size": model.moe_ffn_hidden_size,
        "moe_shared_expert_intermediate_size": model.moe_shared_expert_intermediate_size,
        "moe_shared_expert_overlap": model.moe_shared_expert_overlap,
        "moe_layer_freq": [0] * model.first_k_dense_layers + [1] * (model.num_layers - model.first_k_dense_layers),
        "moe_expert_capacity_factor": model.moe_expert_capacity_factor,
        "moe_pad_expert_input_to_capacity": model.moe_pad_expert_input_to_capacity,
        "moe_router_load_balancing_type": "aux_loss",
        "moe_aux_loss_coeff": 1e-2,
        "attention_dropout": model.attention_dropout,
        "hidden_dropout": model.hidden_dropout,
        "normalization": "RMSNorm",
        "gated_linear_unit": True,
        "activation_func": F.silu,
        "add_bias_linear": False,
        "bf16": True,
        "params_dtype": torch.bfloat16,
    }


def knob_fields(config: Config, megatron_core_version: str, target: str) -> dict[str, Any]:
    """Fields of the megatron-core config ``target`` ("transformer" or "ddp") set by the knobs."""
    fields: dict[str, Any] = {}
    for name, knob in KNOBS.items():
        value = config[name]
        if knob.megatron_target != target or value is None:
            continue
        fields[knob.megatron_field_for(megatron_core_version)] = knob.to_megatron(value)
    if target == "transformer":
        impl, scope = megatron_graph_settings(config, megatron_core_version)
        fields["cuda_graph_impl"] = impl
        if scope is not None:
            fields[KNOBS["cuda_graph_scope"].megatron_field_for(megatron_core_version)] = list(scope)
    if target == "transformer" and config.pipeline_model_parallel_size > 1:
        fields["pipeline_dtype"] = torch.bfloat16
    if target == "ddp" and config.use_megatron_fsdp:
        fields["use_distributed_optimizer"] = True  # Megatron-FSDP forces it
    return fields


def build_transformer_config(config: Config, model: ModelSpec, megatron_core_version: str | None = None,
                             extra: dict[str, Any] | None = None):
    """A megatron-core ``TransformerConfig``; its own checks run in ``__post_init__``. ``extra``
    adds fields no knob owns (the trainable's kernel choices)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    version = megatron_core_version or installed_megatron_core_version()
    return TransformerConfig(**(model_fields(model) | knob_fields(config, version, "transformer") | (extra or {})))


def build_ddp_config(config: Config, megatron_core_version: str | None = None):
    from megatron.core.distributed import DistributedDataParallelConfig

    version = megatron_core_version or installed_megatron_core_version()
    return DistributedDataParallelConfig(**knob_fields(config, version, "ddp"))


def freeze_arguments(config: Config) -> dict[str, bool]:
    """Keyword arguments of ``LLaVAModel.freeze`` (the language model is never frozen here)."""
    return {
        KNOBS[name].megatron_field: bool(config[name])
        for name, knob in KNOBS.items()
        if knob.megatron_target == "llava_freeze"
    } | {"freeze_language_model": False}


def init_micro_batch_calculator(request: BurstRequest, data_parallel: int, rank: int) -> int:
    """Set megatron-core's global micro-batch calculator to the workload's global batch, as
    Megatron-LM and Megatron-Bridge do at start-up, and return its micro-batches per step (its own
    count, which must equal ours: GBS / (MBS × DP))."""
    from megatron.core.num_microbatches_calculator import get_num_microbatches, init_num_microbatches_calculator

    micro_batch_size = request.config.micro_batch_size
    global_batch_size = micro_batch_size * request.micro_batches_per_step * data_parallel
    init_num_microbatches_calculator(rank, None, global_batch_size, micro_batch_size, data_parallel)
    return get_num_microbatches()
