"""What the native PyTorch MoE VLM honours for real (plain data; importing it needs no torch).

It runs data parallel (DDP or FSDP2) and expert parallel over ``torch.distributed`` with its own
all-to-all dispatch; it has no tensor, pipeline or context parallelism, no grouped GEMM, no
Megatron-FSDP, no Transformer Engine (so no fp8 and none of its fused kernels). CUDA graphs cover
the attention and router scopes only (a whole MoE layer has data-dependent shapes), only on CUDA,
and not with FSDP2 (the burst reports that combination ``invalid`` before step 1: sharded
parameters move, captured graphs would read stale storage).
"""

from autotune.core.contract import FP32, TrainableSupport, TrainingBytes

SUPPORT = TrainableSupport(
    name="native",
    # fp32 parameters and AdamW states everywhere; bf16 autocast on CUDA, plain fp32 on the CPU.
    training_bytes=TrainingBytes(frozen_parameter=4, trained_parameter=16, activation=2),
    cpu_training_bytes=FP32,
    allowed={
        "tensor_model_parallel_size": frozenset({1}),
        "pipeline_model_parallel_size": frozenset({1}),
        "context_parallel_size": frozenset({1}),
        "expert_tensor_parallel_size": frozenset({None, 1}),
        "sequence_parallel": frozenset({False}),
        "moe_token_dispatcher_type": frozenset({"alltoall"}),
        "moe_grouped_gemm": frozenset({False}),
        "moe_permute_fusion": frozenset({False}),
        "moe_router_fusion": frozenset({False}),
        "cross_entropy_loss_fusion": frozenset({False}),
        "fp8": frozenset({"none"}),
        "use_megatron_fsdp": frozenset({False}),
        "recompute_modules": frozenset({"core_attn", "mlp", "moe", "layernorm"}),
        "cuda_graph_impl": frozenset({"none", "local"}),
        "cuda_graph_scope": frozenset({"attn", "moe_router", "moe_preprocess"}),
    },
    cuda_only={"cuda_graph_impl": frozenset({"local"})},
    moe_layer_graph_scopes=frozenset({"attn", "moe_router", "moe_preprocess"}),
)
