"""Every rule rejects a config that breaks it and accepts its nearest valid neighbour."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import pytest

from autotune.rules import RULES, violations
from conftest import cfg, make_context


@dataclass(frozen=True)
class Case:
    rule: str
    rejected: dict[str, Any]
    accepted: dict[str, Any]
    context: dict[str, Any] = field(default_factory=dict)


SELECTIVE = {"recompute_granularity": "selective"}
FULL = {"recompute_granularity": "full"}
LOCAL = {"cuda_graph_impl": "local"}
TE_GRAPHS = {"cuda_graph_impl": "transformer_engine"}
DENSE_FIRST = {"model_overrides": {"first_k_dense_layers": 1}}
DROP_AND_PAD = {"model_overrides": {"moe_expert_capacity_factor": 1.0, "moe_pad_expert_input_to_capacity": True}}

CASES = [
    Case("data_parallel_whole", {"tensor_model_parallel_size": 4, "sequence_parallel": True},
         {"tensor_model_parallel_size": 2, "sequence_parallel": True}, {"world_size": 6}),
    Case("expert_data_parallel_whole", {"expert_model_parallel_size": 4}, {"expert_model_parallel_size": 2},
         {"world_size": 6}),
    Case("experts_divisible_by_ep", {"expert_model_parallel_size": 3}, {"expert_model_parallel_size": 2},
         {"world_size": 6}),
    Case("heads_divisible_by_tp", {"tensor_model_parallel_size": 3, "sequence_parallel": True},
         {"tensor_model_parallel_size": 2, "sequence_parallel": True}, {"world_size": 6}),
    Case("ffn_divisible_by_tp", {"expert_tensor_parallel_size": 3}, {"expert_tensor_parallel_size": 2},
         {"world_size": 6}),
    Case("layers_divisible_by_pipeline", {"pipeline_model_parallel_size": 3},
         {"pipeline_model_parallel_size": 2}, {"world_size": 6}),
    Case("sequence_divisible_by_context_parallel", {"context_parallel_size": 3}, {"context_parallel_size": 2},
         {"world_size": 6, "model_overrides": {"seq_length": 2056}}),
    Case("global_batch_whole_micro_batches", {"micro_batch_size": 3}, {"micro_batch_size": 4},
         {"global_batch_size": 64}),
    Case("interleaved_pipeline_micro_batches",
         {"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2, "micro_batch_size": 2},
         {"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2, "micro_batch_size": 1},
         {"global_batch_size": 24}),
    Case("sequence_parallel_needs_tp", {"sequence_parallel": True},
         {"sequence_parallel": True, "tensor_model_parallel_size": 2}),
    Case("moe_tensor_parallel_needs_sequence_parallel", {"tensor_model_parallel_size": 2},
         {"tensor_model_parallel_size": 2, "sequence_parallel": True}),
    Case("full_recompute_needs_method_and_layers", {**FULL, "recompute_method": None},
         {**FULL, "recompute_method": "block"}),
    Case("recompute_layers_within_stage", {**FULL, "recompute_num_layers": 9, "pipeline_model_parallel_size": 2},
         {**FULL, "recompute_num_layers": 8, "pipeline_model_parallel_size": 2}),
    Case("moe_act_recompute_needs_grouped_gemm", {**SELECTIVE, "recompute_modules": ["moe_act"]},
         {**SELECTIVE, "recompute_modules": ["moe_act"], "moe_grouped_gemm": True}),
    Case("mla_up_proj_recompute_needs_mla", {**SELECTIVE, "recompute_modules": ["mla_up_proj"]},
         {**SELECTIVE, "recompute_modules": ["core_attn"]}),
    Case("shared_experts_recompute_excludes_overlap",
         {**SELECTIVE, "recompute_modules": ["shared_experts"], "moe_token_dispatcher_type": "alltoall"},
         {**SELECTIVE, "recompute_modules": ["moe"], "moe_token_dispatcher_type": "alltoall"},
         {"model_overrides": {"moe_shared_expert_intermediate_size": 1024, "moe_shared_expert_overlap": True}}),
    Case("shared_experts_recompute_needs_shared_expert", {**SELECTIVE, "recompute_modules": ["shared_experts"]},
         {**SELECTIVE, "recompute_modules": ["moe"]}),
    Case("mlp_recompute_needs_dense_layers", {**SELECTIVE, "recompute_modules": ["mlp"]},
         {**SELECTIVE, "recompute_modules": ["moe"]}),
    Case("full_recompute_needs_full_iteration_graphs", {**FULL, **LOCAL, "cuda_graph_scope": ["attn"]},
         {**FULL}, DROP_AND_PAD),
    Case("graphed_attention_recompute_needs_no_attention_dropout",
         {**SELECTIVE, **LOCAL, "cuda_graph_scope": ["attn"]},
         {**SELECTIVE, **LOCAL, "cuda_graph_scope": ["moe_router", "moe_preprocess"]},
         {"model_overrides": {"attention_dropout": 0.1}}),
    Case("graphed_mlp_recompute_needs_no_hidden_dropout",
         {**SELECTIVE, "recompute_modules": ["moe"], **LOCAL, "cuda_graph_scope": []},
         {**SELECTIVE, "recompute_modules": ["moe"], **LOCAL, "cuda_graph_scope": ["moe_router", "moe_preprocess"]},
         {"model_overrides": {"hidden_dropout": 0.1}}),
    Case("moe_preprocess_scope_needs_moe_router", {**TE_GRAPHS, "cuda_graph_scope": ["moe_preprocess"]},
         {**TE_GRAPHS, "cuda_graph_scope": ["moe_router", "moe_preprocess"]}),
    Case("moe_and_moe_router_scopes_exclusive", {**LOCAL, "cuda_graph_scope": ["moe", "moe_router"]},
         {**LOCAL, "cuda_graph_scope": ["moe"]}, DROP_AND_PAD),
    Case("moe_scope_needs_drop_and_pad", {**LOCAL, "cuda_graph_scope": ["moe"]},
         {**LOCAL, "cuda_graph_scope": ["moe_router", "moe_preprocess"]}),
    Case("moe_preprocess_scope_excludes_capacity_alltoall",
         {**LOCAL, "cuda_graph_scope": ["moe_router", "moe_preprocess"], "moe_token_dispatcher_type": "alltoall"},
         {**TE_GRAPHS, "cuda_graph_scope": ["moe_router"], "moe_token_dispatcher_type": "alltoall"},
         {"model_overrides": {"moe_expert_capacity_factor": 1.0}}),
    Case("whole_layer_graphs_need_drop_and_pad", {**LOCAL, "cuda_graph_scope": []},
         {**LOCAL, "cuda_graph_scope": ["moe_router", "moe_preprocess"]}),
    Case("local_graph_scope_captures_a_layer", {**LOCAL, "cuda_graph_scope": ["attn"]},
         {**LOCAL, "cuda_graph_scope": ["attn", "moe_router", "moe_preprocess"]}),
    Case("mlp_scope_needs_dense_layers", {**LOCAL, "cuda_graph_scope": ["mlp"]},
         {**LOCAL, "cuda_graph_scope": ["moe_router", "moe_preprocess"]}),
    Case("mamba_scope_needs_mamba_layers", {**LOCAL, "cuda_graph_scope": ["mamba"]},
         {**LOCAL, "cuda_graph_scope": ["moe_router", "moe_preprocess"]}),
    Case("te_graphs_moe_recompute_excludes_moe_router_scope",
         {**SELECTIVE, "recompute_modules": ["moe"], **TE_GRAPHS, "cuda_graph_scope": ["moe_router"]},
         {**SELECTIVE, "recompute_modules": ["moe"], **TE_GRAPHS, "cuda_graph_scope": ["attn"]}),
    Case("flex_dispatcher_needs_tp_ep_above_one", {"moe_token_dispatcher_type": "flex"},
         {"moe_token_dispatcher_type": "flex", "expert_model_parallel_size": 2}),
    Case("deepep_excludes_pad_to_capacity",
         {"moe_token_dispatcher_type": "flex", "expert_model_parallel_size": 2},
         {"moe_token_dispatcher_type": "flex", "moe_flex_dispatcher_backend": "hybridep",
          "expert_model_parallel_size": 2}, DROP_AND_PAD),
    Case("hybridep_across_trays_needs_domains_and_imex",
         {"moe_token_dispatcher_type": "flex", "moe_flex_dispatcher_backend": "hybridep", "expert_model_parallel_size": 8},
         {"moe_token_dispatcher_type": "flex", "moe_flex_dispatcher_backend": "hybridep", "expert_model_parallel_size": 4},
         {"accelerator": "gb200", "gpus_per_node": 4, "nvlink_domains_labelled": False}),
    Case("shared_expert_overlap_needs_alltoall", {"moe_token_dispatcher_type": "allgather"},
         {"moe_token_dispatcher_type": "alltoall"},
         {"model_overrides": {"moe_shared_expert_intermediate_size": 1024, "moe_shared_expert_overlap": True}}),
    Case("fsdp_implementations_exclusive", {"use_megatron_fsdp": True, "use_torch_fsdp2": True},
         {"use_torch_fsdp2": True}),
    Case("torch_fsdp2_needs_pp1_ep1", {"use_torch_fsdp2": True, "expert_model_parallel_size": 2},
         {"use_megatron_fsdp": True, "expert_model_parallel_size": 2}),
    Case("trainable_honours_value", {"tensor_model_parallel_size": 2, "sequence_parallel": True},
         {"moe_token_dispatcher_type": "alltoall", "expert_model_parallel_size": 2},
         {"trainable": "native", "model": "cpu_tiny_moe_vlm"}),
    Case("trainable_needs_cuda", {}, {}, {"accelerator": "cpu"}),
    Case("cuda_graphs_need_cuda", {**LOCAL, "cuda_graph_scope": ["attn"], "moe_token_dispatcher_type": "alltoall"},
         {"moe_token_dispatcher_type": "alltoall"},
         {"accelerator": "cpu", "trainable": "native", "model": "cpu_tiny_moe_vlm"}),
    Case("transformer_engine_graphs_need_te", {**TE_GRAPHS, "cuda_graph_scope": ["attn"]},
         {**LOCAL, "cuda_graph_scope": ["moe_router", "moe_preprocess"]}, {"transformer_engine": None}),
    Case("grouped_gemm_needs_te", {"moe_grouped_gemm": True}, {}, {"transformer_engine": None}),
    Case("flex_backend_needs_package",
         {"moe_token_dispatcher_type": "flex", "moe_flex_dispatcher_backend": "hybridep", "expert_model_parallel_size": 2},
         {"moe_token_dispatcher_type": "flex", "moe_flex_dispatcher_backend": "deepep", "expert_model_parallel_size": 2},
         {"hybrid_ep": False}),
    Case("layernorm_recompute_needs_te_on_mcore_0_19", {**SELECTIVE, "recompute_modules": ["layernorm"]},
         {**SELECTIVE, "recompute_modules": ["core_attn"]}, {"transformer_engine": None}),
    Case("local_layer_specs_lack_sequence_context_parallel", {"context_parallel_size": 2}, {},
         {"transformer_engine": None}),
    Case("fp8_needs_te_and_fp8_tensor_cores", {"fp8": "hybrid", "fp8_recipe": "tensorwise"}, {},
         {"transformer_engine": None}),
    Case("mxfp8_needs_blackwell", {"fp8": "e4m3", "fp8_recipe": "mxfp8"}, {"fp8": "e4m3", "fp8_recipe": "blockwise"}),
    Case("moe_fusions_need_te", {"moe_permute_fusion": True}, {"cross_entropy_loss_fusion": True},
         {"transformer_engine": None}),
    Case("local_graphs_exclude_grouped_gemm_on_mcore_0_19",
         {**LOCAL, "cuda_graph_scope": ["moe_router", "moe_preprocess"], "moe_grouped_gemm": True},
         {**TE_GRAPHS, "cuda_graph_scope": ["moe_router", "moe_preprocess"], "moe_grouped_gemm": True}),
    Case("fp8_delayed_excludes_moe_act_layernorm_recompute",
         {**SELECTIVE, "recompute_modules": ["moe_act"], "moe_grouped_gemm": True, "fp8": "hybrid"},
         {**SELECTIVE, "recompute_modules": ["moe_act"], "moe_grouped_gemm": True, "fp8": "hybrid",
          "fp8_recipe": "tensorwise"}),
]


def _context(case: Case):
    return make_context(**case.context)


def test_every_rule_has_a_case() -> None:
    assert sorted(c.rule for c in CASES) == sorted(RULES)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.rule)
def test_rule_rejects_its_violation(case: Case) -> None:
    found = violations(cfg(**case.rejected), _context(case))
    assert case.rule in {v.rule for v in found}
    reason = next(v.reason for v in found if v.rule == case.rule)
    assert len(reason.split()) >= 5, f"a rejection must explain itself in a sentence, got {reason!r}"


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.rule)
def test_rule_accepts_the_neighbour(case: Case) -> None:
    context = _context(case)
    if case.rule == "trainable_needs_cuda":
        context = make_context()  # the accepted side is the same config on a CUDA stack
    assert violations(cfg(**case.accepted), context) == []


def test_local_graphs_capture_router_and_preprocess_together() -> None:
    context = make_context()
    one = cfg(**LOCAL, cuda_graph_scope=["attn", "moe_router"])
    both = cfg(**LOCAL, cuda_graph_scope=["attn", "moe_router", "moe_preprocess"])
    assert "moe_preprocess_scope_needs_moe_router" in {v.rule for v in violations(one, context)}
    assert violations(both, context) == []


def test_local_attention_graphs_follow_the_trainable() -> None:
    """megatron-core graphs attention only in dense layers; the native trainable in MoE layers too."""
    attention_only = cfg(**LOCAL, cuda_graph_scope=["attn"])
    assert violations(attention_only, make_context(model_overrides={"first_k_dense_layers": 1})) == []
    native = make_context(trainable="native", model="cpu_tiny_moe_vlm")
    assert "local_graph_scope_captures_a_layer" not in {v.rule for v in violations(attention_only, native)}


def test_layernorm_recompute_allowed_before_0_19_and_with_te() -> None:
    config = cfg(**SELECTIVE, recompute_modules=["layernorm"])
    assert violations(config, make_context(transformer_engine=None, megatron_core="0.16.1")) == []
    assert violations(config, make_context(megatron_core="0.19.2")) == []


def test_fp8_follows_the_accelerator() -> None:
    """FP8 needs Hopper or Blackwell tensor cores; MXFP8 needs Blackwell."""
    mxfp8 = cfg(fp8="hybrid", fp8_recipe="mxfp8")
    assert violations(mxfp8, make_context(accelerator="gb200")) == []
    assert violations(mxfp8, make_context(accelerator="b200")) == []
    assert "mxfp8_needs_blackwell" in {v.rule for v in violations(mxfp8, make_context(accelerator="h100"))}
    on_cpu = {v.rule for v in violations(cfg(fp8="e4m3"), make_context(accelerator="cpu"))}
    assert "fp8_needs_te_and_fp8_tensor_cores" in on_cpu
    native = make_context(trainable="native", model="cpu_tiny_moe_vlm")
    assert "trainable_honours_value" in {v.rule for v in violations(cfg(fp8="e4m3"), native)}


def test_megatron_trainable_refuses_full_iteration_graphs() -> None:
    """The megatron trainable's loop has no full-iteration graph wrapper: it never ignores the knob."""
    found = violations(cfg(cuda_graph_impl="full_iteration"), make_context(model_overrides=DROP_AND_PAD["model_overrides"]))
    assert {v.rule for v in found} == {"trainable_honours_value"}


def test_every_violation_is_listed() -> None:
    config = cfg(sequence_parallel=True, moe_grouped_gemm=True)
    names = {v.rule for v in violations(config, make_context(transformer_engine=None))}
    assert names == {"sequence_parallel_needs_tp", "grouped_gemm_needs_te",
                     "local_layer_specs_lack_sequence_context_parallel"}


def test_sequence_and_context_parallel_rule_reads_what_the_trainable_builds() -> None:
    """The rule follows the trainable's support (megatron-core layers), not its name."""
    context = make_context(transformer_engine=None)
    reason = next(v.reason for v in violations(cfg(context_parallel_size=2), context)
                  if v.rule == "local_layer_specs_lack_sequence_context_parallel")
    assert "TEDotProductAttention" in reason and "megatron trainable" in reason
    native = replace(context, trainable=replace(context.trainable, megatron_core_layers=False))
    assert "local_layer_specs_lack_sequence_context_parallel" not in {
        v.rule for v in violations(cfg(context_parallel_size=2), native)}


def test_a_global_batch_the_micro_batches_do_not_divide_names_the_numbers() -> None:
    found = violations(cfg(micro_batch_size=3), make_context(global_batch_size=64))
    reason = next(v.reason for v in found if v.rule == "global_batch_whole_micro_batches")
    assert reason == ("the global batch of 64 samples is not a whole number of micro-batches: "
                      "micro_batch_size 3 × data-parallel 8 = 24 samples each")
    assert not violations(cfg(micro_batch_size=3), make_context())  # no global batch declared: MBS sets it
