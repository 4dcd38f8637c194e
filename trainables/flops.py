"""Model FLOPs of one training step of the native MoE VLM, MoE- and vision-aware.

Convention (recorded in every contract): 2 FLOPs per multiply-add of the model's matmuls on the
packed sequences as run (padding included); MoE layers count the router, the top-k experts each
token visits and the shared expert; causal attention counts the query-key pairs within each packed
sample; the ViT counts full attention within each image. Trainable parts count ×3 (forward and
backward), a frozen encoder ×1 (forward only); the projector counts ×1 plus ×1 for the gradient
it passes back to a trainable encoder plus ×1 for its own weights when trainable. Recompute is not
counted (model FLOPs, not hardware FLOPs).
"""

from __future__ import annotations

import torch

from autotune.core.model import ModelSpec

CONVENTION = (
    "2 per multiply-add; packed sequences as run; MoE: router + top-k + shared experts; causal pairs "
    "within samples; ViT full attention per image; trainable x3, frozen encoder x1 (forward only); "
    "recompute not counted"
)


def decoder_flops_forward(spec: ModelSpec, tokens: int, attended_pairs: int) -> float:
    d = spec.hidden_size
    head_dim = spec.kv_channels or d // spec.num_attention_heads
    q_width, kv_width = spec.num_attention_heads * head_dim, spec.num_query_groups * head_dim
    projections = 2 * d * q_width + 2 * d * 2 * kv_width + 2 * q_width * d
    moe = 2 * d * spec.num_moe_experts + spec.moe_router_topk * 6 * d * spec.moe_ffn_hidden_size
    if spec.moe_shared_expert_intermediate_size:
        moe += 6 * d * spec.moe_shared_expert_intermediate_size
    dense = 6 * d * spec.ffn_hidden_size
    dense_layers = spec.first_k_dense_layers
    per_token = spec.num_layers * projections + dense_layers * dense + (spec.num_layers - dense_layers) * moe
    attention = spec.num_layers * 4 * q_width * attended_pairs
    logits = 2 * d * spec.vocab_size * tokens
    return float(per_token * tokens + attention + logits)


def vision_flops_forward(spec: ModelSpec, image_patches: list[int]) -> tuple[float, float]:
    """(encoder, projector) forward FLOPs for images of the given patch counts."""
    v = spec.vision
    dv, patches = v.hidden_size, sum(image_patches)
    per_patch = 2 * 3 * v.patch_size**2 * dv + v.num_layers * (2 * dv * 3 * dv + 2 * dv * dv + 4 * dv * v.ffn_hidden_size)
    attention = v.num_layers * 4 * dv * sum(n * n for n in image_patches)
    merged_width = dv * v.spatial_merge_size**2
    merged_tokens = patches // v.spatial_merge_size**2
    projector = merged_tokens * (2 * merged_width * merged_width + 2 * merged_width * spec.hidden_size)
    return float(per_patch * patches + attention), float(projector)


def step_flops(
    spec: ModelSpec,
    segment_ids: torch.Tensor,
    image_grids: torch.Tensor,
    frozen_vision: bool,
    frozen_projection: bool,
) -> float:
    """Training FLOPs of one micro-batch (see the module docstring for the convention)."""
    tokens = segment_ids.numel()
    attended = 0
    for row in segment_ids:
        lengths = torch.bincount(row[row > 0]).tolist()
        attended += sum(n * (n + 1) // 2 for n in lengths) + int((row == 0).sum())
    decoder = 3 * decoder_flops_forward(spec, tokens, attended)
    patches = (image_grids[:, 0] * image_grids[:, 1]).tolist()
    encoder, projector = vision_flops_forward(spec, patches)
    encoder_factor = 1 if frozen_vision else 3
    projector_factor = 1 + (0 if frozen_vision else 1) + (0 if frozen_projection else 1)
    return decoder + encoder_factor * encoder + projector_factor * projector
