"""Model presets: the shape of the MoE VLM a campaign tunes (vision encoder → projector → MoE decoder).

A preset is data every trainable reads; the rules engine reads it too (heads % TP, experts % EP,
dropouts for the CUDA-graph rules). Campaigns pick a preset by name and may override fields.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from autotune.core.errors import AutotuneError


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class VisionSpec(_Frozen):
    """A ViT over dynamic-resolution patches, followed by a 2×2-merge MLP projector."""

    num_layers: int = Field(ge=1)
    hidden_size: int = Field(ge=1)
    ffn_hidden_size: int = Field(ge=1)
    num_attention_heads: int = Field(ge=1)
    patch_size: int = Field(ge=1, description="Pixels per patch side (14 for CLIP/Qwen2-VL, 16 for Qwen3-VL).")
    spatial_merge_size: int = Field(default=2, ge=1, description="Patches merged per side by the projector.")

    @model_validator(mode="after")
    def _heads_divide_hidden(self) -> "VisionSpec":
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be a multiple of num_attention_heads "
                f"({self.num_attention_heads})"
            )
        return self


class ImagePolicy(_Frozen):
    """Qwen-VL ``smart_resize`` bounds: images are resized to a multiple of patch·merge pixels."""

    min_pixels: int = Field(ge=1)
    max_pixels: int = Field(ge=1)
    max_images_per_sample: int = Field(default=1, ge=1)

    @model_validator(mode="after")
    def _ordered(self) -> "ImagePolicy":
        if self.min_pixels > self.max_pixels:
            raise ValueError(f"min_pixels ({self.min_pixels}) exceeds max_pixels ({self.max_pixels})")
        return self


class ModelSpec(_Frozen):
    """Decoder and vision sizes of a MoE VLM, in megatron-core's vocabulary."""

    name: str
    num_layers: int = Field(ge=1)
    hidden_size: int = Field(ge=1)
    ffn_hidden_size: int = Field(ge=1, description="FFN width of the dense (non-MoE) layers.")
    num_attention_heads: int = Field(ge=1)
    num_query_groups: int = Field(ge=1, description="GQA key/value heads.")
    kv_channels: int | None = Field(default=None, ge=1, description="Head dim; null means hidden/heads.")
    vocab_size: int = Field(ge=1)
    seq_length: int = Field(ge=8)
    num_moe_experts: int = Field(ge=2)
    moe_router_topk: int = Field(ge=1)
    moe_ffn_hidden_size: int = Field(ge=1)
    moe_shared_expert_intermediate_size: int | None = Field(default=None, ge=1)
    moe_shared_expert_overlap: bool = False
    first_k_dense_layers: int = Field(default=0, ge=0, description="Leading dense layers; the rest are MoE.")
    moe_expert_capacity_factor: float | None = Field(default=None, gt=0, description="null: dropless MoE.")
    moe_pad_expert_input_to_capacity: bool = False
    multi_latent_attention: bool = False
    attention_dropout: float = Field(default=0.0, ge=0, lt=1)
    hidden_dropout: float = Field(default=0.0, ge=0, lt=1)
    vision: VisionSpec
    images: ImagePolicy

    @model_validator(mode="after")
    def _consistent(self) -> "ModelSpec":
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_query_groups ({self.num_query_groups})"
            )
        if self.moe_router_topk > self.num_moe_experts:
            raise ValueError(
                f"moe_router_topk ({self.moe_router_topk}) exceeds num_moe_experts ({self.num_moe_experts})"
            )
        if self.first_k_dense_layers >= self.num_layers:
            raise ValueError(f"first_k_dense_layers must be below num_layers ({self.num_layers})")
        if self.moe_pad_expert_input_to_capacity and self.moe_expert_capacity_factor is None:
            raise ValueError("moe_pad_expert_input_to_capacity needs moe_expert_capacity_factor")
        return self

    @property
    def has_dense_layers(self) -> bool:
        return self.first_k_dense_layers > 0

    @property
    def drop_and_pad(self) -> bool:
        return self.moe_expert_capacity_factor is not None and self.moe_pad_expert_input_to_capacity


_QWEN3_VL_VISION = VisionSpec(
    num_layers=27, hidden_size=1152, ffn_hidden_size=4304, num_attention_heads=16, patch_size=16
)
_QWEN3_VL_IMAGES = ImagePolicy(min_pixels=64 * 32 * 32, max_pixels=1024 * 32 * 32)

PRESETS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        # Small enough for two CPU cores to train a few steps a second; one leading dense layer
        # keeps the `mlp` graph scope and dense-layer code paths exercised.
        ModelSpec(
            name="cpu_tiny_moe_vlm",
            num_layers=4,
            hidden_size=256,
            ffn_hidden_size=512,
            num_attention_heads=4,
            num_query_groups=2,
            vocab_size=512,
            seq_length=512,
            num_moe_experts=8,
            moe_router_topk=2,
            moe_ffn_hidden_size=256,
            moe_shared_expert_intermediate_size=256,
            first_k_dense_layers=1,
            vision=VisionSpec(num_layers=4, hidden_size=192, ffn_hidden_size=768, num_attention_heads=3, patch_size=14),
            images=ImagePolicy(min_pixels=56 * 56, max_pixels=336 * 336),
        ),
        # What one H200 trains without Transformer Engine: a CLIP-sized ViT (12 x 768, the one
        # first run there without TE) and a 16-layer MoE decoder.
        ModelSpec(
            name="h200_small_moe_vlm",
            num_layers=16,
            hidden_size=1024,
            ffn_hidden_size=4096,
            num_attention_heads=16,
            num_query_groups=4,
            vocab_size=32768,
            seq_length=2048,
            num_moe_experts=16,
            moe_router_topk=2,
            moe_ffn_hidden_size=1024,
            vision=VisionSpec(num_layers=12, hidden_size=768, ffn_hidden_size=3072, num_attention_heads=12, patch_size=14),
            images=ImagePolicy(min_pixels=56 * 56, max_pixels=448 * 448),
        ),
        # Cluster shapes, published Qwen3-VL sizes (text: 48x2048 / 94x4096, 128 experts top-8,
        # GQA with 4 KV heads, head dim 128; vision: 27x1152 ViT, patch 16, 2x2 merge).
        ModelSpec(
            name="qwen3_vl_30b_a3b_like",
            num_layers=48,
            hidden_size=2048,
            ffn_hidden_size=6144,
            num_attention_heads=32,
            num_query_groups=4,
            kv_channels=128,
            vocab_size=151936,
            seq_length=4096,
            num_moe_experts=128,
            moe_router_topk=8,
            moe_ffn_hidden_size=768,
            vision=_QWEN3_VL_VISION,
            images=_QWEN3_VL_IMAGES,
        ),
        ModelSpec(
            name="qwen3_vl_235b_a22b_like",
            num_layers=94,
            hidden_size=4096,
            ffn_hidden_size=12288,
            num_attention_heads=64,
            num_query_groups=4,
            kv_channels=128,
            vocab_size=151936,
            seq_length=4096,
            num_moe_experts=128,
            moe_router_topk=8,
            moe_ffn_hidden_size=1536,
            vision=_QWEN3_VL_VISION,
            images=_QWEN3_VL_IMAGES,
        ),
    )
}


def model_preset(name: str, overrides: dict[str, Any] | None = None) -> ModelSpec:
    """The preset ``name`` with ``overrides`` applied and re-validated."""
    if name not in PRESETS:
        raise AutotuneError(f"unknown model preset {name!r}; known presets: {', '.join(PRESETS)}")
    base = PRESETS[name]
    if not overrides:
        return base
    return ModelSpec.model_validate(_deep_merge(base.model_dump(), overrides))


HF_SIZE_FILES = ("config.json", "preprocessor_config.json")
"""What :func:`hf_checkpoint_model` reads of a checkpoint directory (no weights)."""


def hf_checkpoint_model(directory: Path, overrides: dict[str, Any]) -> ModelSpec:
    """The sizes of a Qwen-VL MoE checkpoint directory (``config.json``'s text and vision configs, the
    image processor's pixel bounds, in transformers 4's or 5's spelling), as the rules and the memory
    model read a preset, with
    ``overrides`` applied. The training sequence length is the recipe's, not the checkpoint's: it
    comes from ``overrides`` (``seq_length``).

    Raises:
        AutotuneError: the directory, a file or a field is missing (named).
    """
    config_path, processor_path = (directory / name for name in HF_SIZE_FILES)
    for path in (config_path, processor_path):
        if not path.is_file():
            raise AutotuneError(f"{path} does not exist: a Hugging Face checkpoint directory has it")
    config, processor = json.loads(config_path.read_text()), json.loads(processor_path.read_text())
    if "seq_length" not in overrides:
        raise AutotuneError("seq_length: the recipe's training sequence length (the checkpoint does not say it)")
    try:
        text, vision = config["text_config"], config["vision_config"]
        base = {
            "name": directory.name,
            "num_layers": text["num_hidden_layers"], "hidden_size": text["hidden_size"],
            "ffn_hidden_size": text["intermediate_size"], "num_attention_heads": text["num_attention_heads"],
            "num_query_groups": text["num_key_value_heads"], "kv_channels": text.get("head_dim"),
            "vocab_size": text["vocab_size"], "num_moe_experts": _first(text, "num_experts", "num_local_experts"),
            "moe_router_topk": text["num_experts_per_tok"], "moe_ffn_hidden_size": text["moe_intermediate_size"],
            "first_k_dense_layers": len(text.get("mlp_only_layers") or []),
            "vision": {"num_layers": vision["depth"], "hidden_size": vision["hidden_size"],
                       "ffn_hidden_size": vision["intermediate_size"], "num_attention_heads": vision["num_heads"],
                       "patch_size": vision["patch_size"], "spatial_merge_size": vision["spatial_merge_size"]},
            "images": {"min_pixels": processor.get("min_pixels") or processor["size"]["shortest_edge"],
                       "max_pixels": processor.get("max_pixels") or processor["size"]["longest_edge"]},
        }
    except KeyError as exc:
        raise AutotuneError(f"{exc.args[0]}: missing from {config_path} or {processor_path} (a Qwen-VL MoE "
                            "checkpoint has it)") from None
    return ModelSpec.model_validate(_deep_merge(base, overrides))


def _first(section: dict[str, Any], *names: str) -> Any:
    """The value under the first of ``names`` present (transformers renamed some fields: Qwen's
    checkpoints say ``num_experts``, transformers 5 writes ``num_local_experts``)."""
    for name in names:
        if name in section:
            return section[name]
    raise KeyError(names[0])


def _deep_merge(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged
