"""The megatron-core MoE VLM: a ViT over each image's own patch grid → an MLP projector over 2×2
merged patches → a megatron-core MoE ``GPTModel`` whose image-placeholder embeddings are replaced
by the projected image features.

Why not ``LLaVAModel``: its CLIP ViT takes fixed-size tiles with a class token and expands one
placeholder per image inside the model, while our data (the README's Data section) is dynamic-resolution
images packed into fixed-length sequences with the image tokens already laid out, like Qwen-VL.
The parts are megatron-core's own (``TransformerBlock`` with the ViT layer spec,
``MultimodalProjector``, ``GPTModel`` with the MoE decoder block spec), so every decoder knob
(recompute, CUDA graphs, dispatcher, TP/PP/EP/ETP, DDP/FSDP) acts on megatron-core code; the
freeze knobs keep ``LLaVAModel.freeze``'s meaning. The architecture, and so the FLOPs, match the
native trainable's.

The knobs act on the decoder; the vision encoder runs eager, without recompute or graphs (its
sequence lengths change with every batch of images).
"""

from __future__ import annotations

import dataclasses
import importlib.util

import torch
import torch.nn.functional as F
from megatron.core.enums import ModelType
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.models.vision.multimodal_projector import MultimodalProjector
from megatron.core.models.vision.vit_layer_specs import get_vit_layer_with_local_spec
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_block import TransformerBlock, TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import MoETransformerLayer, get_transformer_layer_offset
from torch import nn

from autotune.core.model import ModelSpec
from trainables.data.tokenizer import IMAGE
from trainables.native.model import patch_positions, sincos_2d

# Fused kernels that need apex or Transformer Engine: all off where neither is installed, and
# always off in the ViT and projector (megatron-core's local layers and linears, without apex).
PORTABLE_FIELDS = {
    "masked_softmax_fusion": False,
    "bias_activation_fusion": False,
    "bias_dropout_fusion": False,
    "apply_rope_fusion": False,
    "gradient_accumulation_fusion": False,
    "persist_layer_norm": False,
}


def decoder_kernel_fields(use_te: bool) -> dict[str, bool]:
    """The decoder's fused kernels that no knob owns. With Transformer Engine: bias-SwiGLU,
    bias-dropout-add and TE's fused RoPE, as Megatron-Bridge's recipes run them, and
    gradient-accumulation fusion where apex's fused weight-gradient kernel is installed (the output
    layer is megatron-core's ``ColumnParallelLinear``, which raises without it). Without TE, none.
    The softmax and layer-norm fusions act on local attention and apex norms only, so they stay off."""
    if not use_te:
        return dict(PORTABLE_FIELDS)
    return PORTABLE_FIELDS | {
        "bias_activation_fusion": True,
        "bias_dropout_fusion": True,
        "apply_rope_fusion": True,
        "gradient_accumulation_fusion": importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None,
    }


def vision_config(decoder: TransformerConfig, spec: ModelSpec) -> TransformerConfig:
    """The ViT: LayerNorm, GELU MLP with biases, the decoder's tensor parallelism and precision."""
    v = spec.vision
    return TransformerConfig(
        num_layers=v.num_layers,
        hidden_size=v.hidden_size,
        ffn_hidden_size=v.ffn_hidden_size,
        num_attention_heads=v.num_attention_heads,
        add_bias_linear=True,
        gated_linear_unit=False,
        activation_func=F.gelu,
        normalization="LayerNorm",
        attention_dropout=0.0,
        hidden_dropout=0.0,
        tensor_model_parallel_size=decoder.tensor_model_parallel_size,
        bf16=decoder.bf16,
        params_dtype=decoder.params_dtype,
        use_cpu_initialization=decoder.use_cpu_initialization,
        **PORTABLE_FIELDS,
    )


def projector_config(decoder: TransformerConfig, spec: ModelSpec) -> TransformerConfig:
    merged = spec.vision.hidden_size * spec.vision.spatial_merge_size**2
    return dataclasses.replace(
        vision_config(decoder, spec), num_layers=1, hidden_size=spec.hidden_size, ffn_hidden_size=merged,
        num_attention_heads=1,
    )


class VisionEncoder(MegatronModule):
    """Patch embedding with 2-D sin-cos positions, then megatron-core ViT layers over every image
    of the micro-batch at once (padded to the longest, padding keys masked out)."""

    def __init__(self, config: TransformerConfig, spec: ModelSpec) -> None:
        super().__init__(config)
        v = spec.vision
        self.merge = v.spatial_merge_size
        self.patch_embed = nn.Linear(3 * v.patch_size**2, v.hidden_size, dtype=config.params_dtype)
        self.blocks = TransformerBlock(config, get_vit_layer_with_local_spec(), post_layer_norm=True)

    def forward(self, patches: torch.Tensor, grids: torch.Tensor) -> torch.Tensor:
        rows, cols = patch_positions(grids, self.merge)
        dim = self.patch_embed.out_features
        x = self.patch_embed(patches) + sincos_2d(rows, cols, dim).to(patches.device, patches.dtype)
        lengths = (grids[:, 0] * grids[:, 1]).tolist()
        padded = nn.utils.rnn.pad_sequence(list(x.split(lengths)), batch_first=False)  # [S, N, H]
        keep = torch.arange(padded.shape[0], device=x.device)[None, :] < torch.tensor(lengths, device=x.device)[:, None]
        out = self.blocks(hidden_states=padded, attention_mask=~keep[:, None, None, :])  # True = masked
        return out.transpose(0, 1)[keep]  # [patches, H], in input order


class MegatronMoEVLM(MegatronModule):
    """Vision encoder → projector → MoE decoder. ``forward`` returns the per-token loss [B, S]
    on the last pipeline stage, the hidden states elsewhere."""

    def __init__(self, decoder_config: TransformerConfig, spec: ModelSpec, use_te: bool,
                 pre_process: bool = True, post_process: bool = True) -> None:
        super().__init__(decoder_config)
        # What megatron-core's schedules and gradient finalisation look up on a model (the
        # attribute names are LLaVAModel's, so its helpers find the language model's layers).
        self.model_type = ModelType.encoder_or_decoder
        self.share_embeddings_and_output_weights = False
        self.spec = spec
        self.pre_process = pre_process
        self.post_process = post_process
        self.merge_group = spec.vision.spatial_merge_size**2
        if pre_process:
            self.vision_model = VisionEncoder(vision_config(decoder_config, spec), spec)
            self.vision_projection = MultimodalProjector(
                projector_config(decoder_config, spec),
                MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
                projector_type="mlp",
                input_size=spec.vision.hidden_size * self.merge_group,
            )
        self.language_model = GPTModel(
            config=decoder_config,
            transformer_layer_spec=decoder_block_spec(decoder_config, use_te),
            vocab_size=spec.vocab_size,
            max_sequence_length=spec.seq_length,
            pre_process=pre_process,
            post_process=post_process,
            position_embedding_type="rope",
        )

    # What megatron-core's TECudaGraphHelper looks up on the model it graphs (as Megatron-Bridge's
    # Qwen-VL models expose them): the decoder whose layers it captures, and the rotary embedding
    # that builds each layer's sample inputs. Properties, so parameter names stay language_model.*.
    position_embedding_type = "rope"

    @property
    def decoder(self) -> TransformerBlock:
        return self.language_model.decoder

    @property
    def rotary_pos_emb(self):
        return self.language_model.rotary_pos_emb

    def shared_embedding_or_output_weight(self):
        return self.language_model.shared_embedding_or_output_weight()

    def set_input_tensor(self, input_tensor) -> None:
        """Pipeline stages after the first receive the previous stage's hidden states here."""
        self.language_model.set_input_tensor(input_tensor)

    def freeze(self, freeze_vision_model: bool, freeze_vision_projection: bool, freeze_language_model: bool) -> None:
        """``LLaVAModel.freeze``'s contract: frozen parts get no gradients and no optimizer state."""
        parts = [(freeze_language_model, self.language_model)]
        if self.pre_process:
            parts += [(freeze_vision_model, self.vision_model), (freeze_vision_projection, self.vision_projection)]
        for frozen, module in parts:
            if frozen and module is not None:
                for param in module.parameters():
                    param.requires_grad_(False)

    def forward(self, tokens, labels, segment_ids, position_ids, patches, grids) -> torch.Tensor:
        decoder_input = self._embed(tokens, patches, grids) if self.pre_process else None
        return self.language_model(
            input_ids=tokens, position_ids=position_ids, attention_mask=packed_causal_mask(segment_ids),
            decoder_input=decoder_input, labels=labels,
        )

    def _embed(self, tokens: torch.Tensor, patches: torch.Tensor, grids: torch.Tensor) -> torch.Tensor:
        """Token embeddings [S, B, H] with each image placeholder replaced by its image feature."""
        embeddings = self.language_model.embedding(input_ids=tokens, position_ids=None)
        if grids.numel() == 0:
            return embeddings
        features = self.vision_model(patches.to(embeddings.dtype), grids)
        merged = features.reshape(-1, 1, self.merge_group * features.shape[-1])  # [tokens, 1, merged]
        projected = self.vision_projection(merged).squeeze(1)
        batch_first = embeddings.transpose(0, 1)
        slots = (tokens == IMAGE)[..., None]
        return batch_first.masked_scatter(slots, projected.to(embeddings.dtype)).transpose(0, 1).contiguous()


def decoder_block_spec(config: TransformerConfig, use_te: bool) -> TransformerBlockSubmodules:
    """megatron-core's GPT decoder block spec for this pipeline stage, its MoE layers built as
    ``MoETransformerLayer`` (as megatron-core's hybrid specs do).

    Why: the GPT specs build MoE layers as plain ``TransformerLayer``s, and on those local CUDA
    graphs either capture nothing (scope ``moe_router moe_preprocess``) or capture the whole layer
    (scope ``attn``), dropless dispatch and its device-to-host sync included, which fails at
    capture (measured on megatron-core 0.19.2). ``MoETransformerLayer`` is the class whose local
    graphs capture the router and the postprocess and run the expert dispatch eagerly.
    """
    block = get_gpt_decoder_block_spec(config, use_transformer_engine=use_te, normalization="RMSNorm")
    offset = get_transformer_layer_offset(config)
    block.layer_specs = [
        dataclasses.replace(spec, module=MoETransformerLayer) if config.moe_layer_freq[offset + index] else spec
        for index, spec in enumerate(block.layer_specs)
    ]
    return block


def packed_causal_mask(segment_ids: torch.Tensor) -> torch.Tensor:
    """[B, 1, S, S], True where attention is masked: causal, and only within one packed sample
    (RoPE is relative, so positions counted across the packed sequence give the same scores)."""
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    causal = torch.ones(segment_ids.shape[1], segment_ids.shape[1], dtype=torch.bool,
                        device=segment_ids.device).tril()
    return ~(same & causal)[:, None]
