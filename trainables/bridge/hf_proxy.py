"""A small Qwen3-VL-MoE checkpoint directory in Hugging Face's format, made here (no hub, no download).

Megatron-Bridge builds its model provider from a checkpoint directory (``AutoBridge.from_hf_pretrained``),
and its Qwen-VL data path reads that directory's tokenizer and image processor. Our users point it at
their own checkpoint; tests and the demo need one that exists offline and is small enough for a CPU or
one GPU. This writes the three parts a user's directory has, with the architecture of
Qwen3-VL-30B-A3B scaled down (MoE decoder with top-k routing, MRoPE sections, DeepStack, a ViT with
16-pixel patches merged 2×2):

- ``config.json``: ``transformers``' ``Qwen3VLMoeConfig``, its special-token ids those of the tokenizer;
- the tokenizer: a byte-level BPE trained with ``tokenizers`` on our photos' captions and questions,
  with the Qwen-VL special tokens (ChatML turns, vision start/end, image and video pads) and a ChatML
  chat template, saved as a fast tokenizer (``tokenizer.json``);
- ``preprocessor_config.json``: the Qwen2-VL image processor Qwen3-VL uses (patch 16, merge 2,
  temporal patch 2) with the pixel bounds of our image budget.

No weights: Bridge initialises the model from the config when it is not asked to load them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from trainables.data.photos import PHOTOS

if TYPE_CHECKING:
    from tokenizers import Tokenizer

QWEN_VL_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                          "<|image_pad|>", "<|video_pad|>")
"""The Qwen-VL tokens Bridge's task encoders and the processor look for, each one id."""
MEDIA_TOKENS = {"image_token": "<|image_pad|>", "video_token": "<|video_pad|>"}
"""Named on the tokenizer (``tokenizer.image_token_id``): Bridge's Qwen-VL Energon task encoder reads
the image id from that attribute and otherwise falls back to Qwen's own id (151655), which a
vocabulary of our size does not hold."""
CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""ChatML with images as ``<|vision_start|><|image_pad|><|vision_end|>`` (the processor widens the pad
to the image's token count), the form Qwen-VL chat templates write."""


@dataclass(frozen=True)
class ProxyShape:
    """Qwen3-VL-30B-A3B's architecture at a size that trains on one GPU (its sizes in comments)."""

    decoder_layers: int = 4          # 48
    hidden_size: int = 256           # 2,048
    attention_heads: int = 4         # 32
    kv_heads: int = 2                # 4
    head_dim: int = 64               # 128
    experts: int = 8                 # 128
    experts_per_token: int = 2       # 8
    expert_ffn_size: int = 128       # 768
    vision_layers: int = 2           # 27
    vision_hidden_size: int = 128    # 1,152
    vision_heads: int = 2            # 16
    mrope_section: tuple[int, int, int] = (12, 10, 10)  # 24, 20, 20: sums to head_dim / 2
    min_pixels: int = 64 * 64
    max_pixels: int = 448 * 448


PROXY_SHAPES = {
    "tiny": ProxyShape(),
    # The megatron trainable's h200_small_moe_vlm sizes: enough work per step for one H200 to be
    # measured rather than the host (the tiny shape reaches 0.6 model TFLOP/s there).
    "h200": ProxyShape(decoder_layers=16, hidden_size=1024, attention_heads=16, kv_heads=4, experts=16,
                       expert_ffn_size=1024, vision_layers=12, vision_hidden_size=768, vision_heads=12),
}
"""Named sizes: ``tiny`` for the CPU tests, ``h200`` for one-GPU campaigns."""


def _texts() -> Iterator[str]:
    for photo in PHOTOS:
        yield from photo.captions
        for question, answer in photo.qa:
            yield question
            yield answer


def train_tokenizer(vocab_size: int = 2048) -> Tokenizer:
    """A byte-level BPE (Qwen's kind) trained on our captions and questions, Qwen-VL special tokens first.
    ``vocab_size`` is a ceiling: our few hundred sentences stop merging at about 1,100 tokens, which
    is the vocabulary ``config.json`` then declares."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(QWEN_VL_SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(_texts(), trainer=trainer)
    return tokenizer


def write_qwen3_vl_moe_proxy(out_dir: Path, shape: ProxyShape = ProxyShape()) -> Path:
    """Write the checkpoint directory (config, tokenizer, image processor) into ``out_dir``."""
    from transformers import PreTrainedTokenizerFast, Qwen2VLImageProcessor, Qwen3VLMoeConfig

    if 2 * sum(shape.mrope_section) != shape.head_dim:
        raise ValueError(f"mrope_section {shape.mrope_section} must sum to head_dim / 2 = {shape.head_dim // 2}")
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=train_tokenizer(), eos_token="<|im_end|>", pad_token="<|endoftext|>",
        additional_special_tokens=list(QWEN_VL_SPECIAL_TOKENS[1:]), chat_template=CHATML_TEMPLATE,
        model_max_length=4096, extra_special_tokens=MEDIA_TOKENS)
    tokenizer.save_pretrained(out_dir)
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in QWEN_VL_SPECIAL_TOKENS}
    config = Qwen3VLMoeConfig(
        text_config={
            "num_hidden_layers": shape.decoder_layers, "hidden_size": shape.hidden_size,
            "intermediate_size": 4 * shape.hidden_size, "moe_intermediate_size": shape.expert_ffn_size,
            "num_experts": shape.experts, "num_experts_per_tok": shape.experts_per_token,
            "num_attention_heads": shape.attention_heads, "num_key_value_heads": shape.kv_heads,
            "head_dim": shape.head_dim, "vocab_size": len(tokenizer), "max_position_embeddings": 4096,
            "bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"],
            "rope_scaling": {"rope_type": "default", "mrope_section": list(shape.mrope_section),
                             "mrope_interleaved": True},
        },
        vision_config={
            "depth": shape.vision_layers, "hidden_size": shape.vision_hidden_size,
            "intermediate_size": 4 * shape.vision_hidden_size, "num_heads": shape.vision_heads,
            "out_hidden_size": shape.hidden_size, "patch_size": 16, "spatial_merge_size": 2,
            "temporal_patch_size": 2, "deepstack_visual_indexes": [0],
        },
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
    )
    config.architectures = ["Qwen3VLMoeForConditionalGeneration"]  # what AutoBridge picks its bridge by
    config.save_pretrained(out_dir)
    Qwen2VLImageProcessor(patch_size=16, merge_size=2, temporal_patch_size=2, min_pixels=shape.min_pixels,
                          max_pixels=shape.max_pixels).save_pretrained(out_dir)
    return out_dir
