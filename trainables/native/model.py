"""A MoE vision-language model in plain PyTorch: ViT encoder → 2×2-merge projector → MoE decoder.

No parallelism and no recompute here (``parallelize.py`` and ``recompute.py`` wrap the modules);
the MoE layer hands its tokens to a dispatcher object so expert parallelism can be installed
from outside. Sizes come from the model preset.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from autotune.core.contract import InvalidConfig
from autotune.core.model import ModelSpec
from trainables.data import tokenizer


# -- shared pieces ------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class CoreAttention(nn.Module):
    """Scaled dot-product attention on already projected q, k, v (the ``core_attn`` recompute unit)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


# -- vision ---------------------------------------------------------------------------------------


def patch_positions(grids: torch.Tensor, merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and column of every patch, in the merge-group order ``to_patches`` produces."""
    rows, cols = [], []
    for grid_h, grid_w in grids.tolist():
        r = torch.arange(grid_h).view(grid_h // merge, merge, 1, 1).expand(-1, -1, grid_w // merge, merge)
        c = torch.arange(grid_w).view(1, 1, grid_w // merge, merge).expand(grid_h // merge, merge, -1, -1)
        rows.append(r.permute(0, 2, 1, 3).reshape(-1))
        cols.append(c.permute(0, 2, 1, 3).reshape(-1))
    return torch.cat(rows), torch.cat(cols)


def sincos_2d(rows: torch.Tensor, cols: torch.Tensor, dim: int) -> torch.Tensor:
    quarter = dim // 4
    freq = torch.exp(-math.log(10000.0) * torch.arange(quarter, dtype=torch.float32) / quarter)
    r, c = rows.float()[:, None] * freq, cols.float()[:, None] * freq
    emb = torch.cat([r.sin(), r.cos(), c.sin(), c.cos()], dim=1)
    return F.pad(emb, (0, dim - emb.shape[1]))


class VisionBlock(nn.Module):
    def __init__(self, dim: int, heads: int, ffn: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, ffn), nn.GELU(), nn.Linear(ffn, dim))

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        images, length, dim = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(images, length, 3, self.heads, dim // self.heads).unbind(2)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=key_mask[:, None, None, :]
        )
        x = x + self.proj(out.transpose(1, 2).reshape(images, length, dim))
        return x + self.mlp(self.norm2(x))


class VisionEncoder(nn.Module):
    """A ViT over each image's own patch grid (dynamic resolution); images attend only to themselves."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        vision = spec.vision
        self.merge = vision.spatial_merge_size
        self.dim = vision.hidden_size
        self.patch_embed = nn.Linear(3 * vision.patch_size**2, vision.hidden_size)
        self.blocks = nn.ModuleList(
            VisionBlock(vision.hidden_size, vision.num_attention_heads, vision.ffn_hidden_size)
            for _ in range(vision.num_layers)
        )
        self.norm = nn.LayerNorm(vision.hidden_size)

    def forward(self, patches: torch.Tensor, grids: torch.Tensor) -> torch.Tensor:
        rows, cols = patch_positions(grids, self.merge)
        x = self.patch_embed(patches) + sincos_2d(rows, cols, self.dim).to(patches.device, patches.dtype)
        lengths = (grids[:, 0] * grids[:, 1]).tolist()
        padded = nn.utils.rnn.pad_sequence(list(x.split(lengths)), batch_first=True)
        key_mask = torch.arange(padded.shape[1], device=x.device)[None, :] < torch.tensor(lengths, device=x.device)[:, None]
        for block in self.blocks:
            padded = block(padded, key_mask)
        return self.norm(padded[key_mask])


class Projector(nn.Module):
    """Merges each 2×2 group of patch features and maps it to the decoder's width."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        vision = spec.vision
        merged = vision.hidden_size * vision.spatial_merge_size**2
        self.group = vision.spatial_merge_size**2
        self.norm = nn.LayerNorm(vision.hidden_size)
        self.mlp = nn.Sequential(nn.Linear(merged, merged), nn.GELU(), nn.Linear(merged, spec.hidden_size))

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        merged = self.norm(features).reshape(-1, self.group * features.shape[-1])
        return self.mlp(merged)


# -- decoder --------------------------------------------------------------------------------------


def rotary(position_ids: torch.Tensor, head_dim: int, base: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / base ** (torch.arange(0, head_dim, 2, device=position_ids.device, dtype=torch.float32) / head_dim)
    angles = position_ids.float()[..., None] * inv  # [B, S, D/2]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos()[:, None], angles.sin()[:, None]  # [B, 1, S, D]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


class Attention(nn.Module):
    """GQA self-attention with RoPE."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.heads, self.groups = spec.num_attention_heads, spec.num_query_groups
        self.head_dim = spec.kv_channels or spec.hidden_size // spec.num_attention_heads
        self.q = nn.Linear(spec.hidden_size, self.heads * self.head_dim, bias=False)
        self.kv = nn.Linear(spec.hidden_size, 2 * self.groups * self.head_dim, bias=False)
        self.out = nn.Linear(self.heads * self.head_dim, spec.hidden_size, bias=False)
        self.core = CoreAttention()

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = self.q(x).view(batch, seq, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(x).view(batch, seq, 2, self.groups, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        out = self.core(q, k, v, mask)
        return self.out(out.transpose(1, 2).reshape(batch, seq, -1))


class Router(nn.Module):
    """Top-k softmax router with the Switch-style auxiliary load-balancing loss, followed by the
    token permutation's preprocessing (sort order by expert, tokens per expert): the
    ``moe_router`` + ``moe_preprocess`` graph unit. Fixed output shapes, no host sync."""

    def __init__(self, dim: int, experts: int, top_k: int) -> None:
        super().__init__()
        self.experts, self.top_k = experts, top_k
        self.gate = nn.Linear(dim, experts, bias=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns (sort order of the token-expert assignments, tokens per expert, top-k weights, aux loss)."""
        probs = self.gate(x).float().softmax(dim=-1)
        weights, experts = probs.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        assignments = experts.reshape(-1)
        # scatter_add rather than bincount: bincount syncs with the host, which graphs forbid.
        counts = torch.zeros(self.experts, dtype=torch.long, device=x.device).scatter_add_(
            0, assignments, torch.ones_like(assignments)
        )
        load = counts.float() / assignments.numel()
        aux = self.experts * (load * probs.mean(dim=0)).sum()
        return assignments.argsort(stable=True), counts, weights.to(x.dtype), aux


class GroupedExperts(nn.Module):
    """SwiGLU experts stored as stacked weights; ``first`` is the global index of expert 0 here."""

    def __init__(self, experts: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.first = 0
        self.gate = nn.Parameter(torch.empty(experts, dim, hidden))
        self.up = nn.Parameter(torch.empty(experts, dim, hidden))
        self.down = nn.Parameter(torch.empty(experts, hidden, dim))
        for weight, fan_in in ((self.gate, dim), (self.up, dim), (self.down, hidden)):
            nn.init.normal_(weight, std=fan_in**-0.5)

    @property
    def local_count(self) -> int:
        return self.gate.shape[0]

    def forward(self, tokens: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """``tokens`` sorted by local expert, ``counts[e]`` of them for local expert ``e``."""
        outputs = []
        for expert, chunk in enumerate(tokens.split(counts)):
            hidden = F.silu(chunk @ self.gate[expert]) * (chunk @ self.up[expert])
            outputs.append(hidden @ self.down[expert])
        return torch.cat(outputs) if outputs else tokens[:0]


class LocalDispatcher:
    """All experts live on this rank: tokens go straight to them."""

    def __call__(self, tokens: torch.Tensor, counts: torch.Tensor, experts: GroupedExperts) -> torch.Tensor:
        return experts(tokens, counts.tolist())


class MoE(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.top_k = spec.moe_router_topk
        self.router = Router(spec.hidden_size, spec.num_moe_experts, spec.moe_router_topk)
        self.experts = GroupedExperts(spec.num_moe_experts, spec.hidden_size, spec.moe_ffn_hidden_size)
        self.shared = (
            SwiGLU(spec.hidden_size, spec.moe_shared_expert_intermediate_size)
            if spec.moe_shared_expert_intermediate_size
            else None
        )
        self.dispatcher = LocalDispatcher()
        self.num_experts = spec.num_moe_experts

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        order, counts, weights, aux = self.router(flat)
        expert_out = self.dispatcher(flat[order // self.top_k], counts, self.experts)
        combined = torch.empty_like(expert_out).index_copy_(0, order, expert_out)
        out = (combined.view(-1, self.top_k, shape[-1]) * weights.unsqueeze(-1)).sum(dim=1)
        if self.shared is not None:
            out = out + self.shared(flat)
        return out.view(shape), aux


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, dense: bool) -> None:
        super().__init__()
        self.input_norm = RMSNorm(spec.hidden_size)
        self.attention = Attention(spec)
        self.mlp_norm = RMSNorm(spec.hidden_size)
        self.mlp = SwiGLU(spec.hidden_size, spec.ffn_hidden_size) if dense else None
        self.moe = None if dense else MoE(spec)

    def forward(self, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor):
        h = h + self.attention(self.input_norm(h), rope, mask)
        normed = self.mlp_norm(h)
        if self.mlp is not None:
            return h + self.mlp(normed), h.new_zeros(())
        out, aux = self.moe(normed)
        return h + out, aux


class LayerStack(nn.Module):
    """A run of decoder layers applied in order (the unit full recompute checkpoints)."""

    def __init__(self, layers: list[DecoderLayer]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor):
        aux = h.new_zeros(())
        for layer in self.layers:
            h, layer_aux = layer(h, rope, mask)
            aux = aux + layer_aux
        return h, aux


def packed_causal_mask(segment_ids: torch.Tensor) -> torch.Tensor:
    """``[B, 1, S, S]`` bool: causal attention within each packed sample; padding sees itself."""
    seq = segment_ids.shape[1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=segment_ids.device).tril()
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    mask = causal & same & (segment_ids[:, :, None] > 0)
    return (mask | torch.eye(seq, dtype=torch.bool, device=segment_ids.device))[:, None]


@dataclass
class ForwardOutput:
    loss: torch.Tensor
    lm_loss: torch.Tensor
    aux_loss: torch.Tensor


class MoEVLM(nn.Module):
    AUX_LOSS_COEFF = 1e-2

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        if spec.vocab_size < tokenizer.VOCAB_SIZE:
            raise InvalidConfig(f"vocab_size {spec.vocab_size} is below the tokenizer's {tokenizer.VOCAB_SIZE} ids: "
                                f"the model {spec.name} cannot embed every token the data holds")
        self.spec = spec
        self.vision = VisionEncoder(spec)
        self.projector = Projector(spec)
        self.embed = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.decoder = nn.ModuleList(
            LayerStack([DecoderLayer(spec, dense=index < spec.first_k_dense_layers)])
            for index in range(spec.num_layers)
        )
        self.final_norm = RMSNorm(spec.hidden_size)
        self.output = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        self.head_dim = spec.kv_channels or spec.hidden_size // spec.num_attention_heads
        self.frozen_vision = self.frozen_projection = False

    def decoder_layers(self) -> list[DecoderLayer]:
        """The decoder layers in order, whatever wraps them (recompute chunks, FSDP units)."""
        return [module for module in self.decoder.modules() if isinstance(module, DecoderLayer)]

    def freeze(self, vision_model: bool, vision_projection: bool) -> None:
        """Frozen parts keep no gradients; a frozen encoder also runs without autograd."""
        self.frozen_vision, self.frozen_projection = vision_model, vision_projection
        self.vision.requires_grad_(not vision_model)
        self.projector.requires_grad_(not vision_projection)

    def forward(
        self,
        tokens: torch.Tensor,
        labels: torch.Tensor,
        loss_mask: torch.Tensor,
        segment_ids: torch.Tensor,
        position_ids: torch.Tensor,
        patches: torch.Tensor,
        image_grids: torch.Tensor,
    ) -> ForwardOutput:
        h = self.embed(tokens)
        if image_grids.numel():
            with torch.set_grad_enabled(torch.is_grad_enabled() and not self.frozen_vision):
                features = self.vision(patches, image_grids)
            image_embeddings = self.projector(features)
            slots = (tokens == tokenizer.IMAGE).unsqueeze(-1)
            h = h.masked_scatter(slots, image_embeddings.to(h.dtype))
        rope = rotary(position_ids, self.head_dim)
        mask = packed_causal_mask(segment_ids)
        aux = h.new_zeros(())
        for stack in self.decoder:
            h, stack_aux = stack(h, rope, mask)
            aux = aux + stack_aux
        logits = self.output(self.final_norm(h)).float()
        token_loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1), reduction="none")
        lm_loss = (token_loss * loss_mask.view(-1)).sum() / loss_mask.sum().clamp(min=1)
        return ForwardOutput(loss=lm_loss + self.AUX_LOSS_COEFF * aux, lm_loss=lm_loss, aux_loss=aux)
