"""The Qwen3-VL-MoE checkpoint directory we make offline reads as a user's does: with transformers'
Auto classes here, and with Megatron-Bridge's AutoBridge in tests/test_export_tools.py (its recipes
are built on it)."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer

from trainables.bridge.hf_proxy import QWEN_VL_SPECIAL_TOKENS, ProxyShape, write_qwen3_vl_moe_proxy
from trainables.data.photos import PHOTOS


@pytest.fixture(scope="module")
def proxy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_qwen3_vl_moe_proxy(tmp_path_factory.mktemp("proxy"))


def test_the_config_is_qwen3_vl_moe_at_the_proxy_shape_with_the_tokenizers_ids(proxy: Path) -> None:
    config, tokenizer, shape = AutoConfig.from_pretrained(proxy), AutoTokenizer.from_pretrained(proxy), ProxyShape()
    assert type(config).__name__ == "Qwen3VLMoeConfig" and config.architectures == ["Qwen3VLMoeForConditionalGeneration"]
    text = config.text_config
    assert (text.num_hidden_layers, text.hidden_size, text.num_experts, text.num_experts_per_tok) == (
        shape.decoder_layers, shape.hidden_size, shape.experts, shape.experts_per_token)
    assert config.vision_config.depth == shape.vision_layers and config.vision_config.out_hidden_size == shape.hidden_size
    assert text.vocab_size == len(tokenizer)
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in QWEN_VL_SPECIAL_TOKENS}
    assert len(set(ids.values())) == len(QWEN_VL_SPECIAL_TOKENS) and tokenizer.unk_token_id not in ids.values()
    assert (config.image_token_id, config.video_token_id, config.vision_start_token_id, config.vision_end_token_id) == (
        ids["<|image_pad|>"], ids["<|video_pad|>"], ids["<|vision_start|>"], ids["<|vision_end|>"])
    # Bridge's Qwen-VL task encoder reads these attributes (else Qwen's 151655, beyond this vocabulary)
    assert (tokenizer.image_token_id, tokenizer.video_token_id) == (config.image_token_id, config.video_token_id)


def test_the_tokenizer_round_trips_our_texts_and_writes_chatml_with_one_image_pad(proxy: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(proxy)
    for photo in PHOTOS:
        for caption in photo.captions:
            ids = tokenizer(caption)["input_ids"]
            assert tokenizer.decode(ids) == caption and len(ids) < len(caption.encode())  # BPE merges, bytes back
    question, answer = PHOTOS[0].qa[0]
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]},
         {"role": "assistant", "content": answer}], tokenize=False)
    assert chat == (f"<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>{question}<|im_end|>\n"
                    f"<|im_start|>assistant\n{answer}<|im_end|>\n")
    assert tokenizer(chat)["input_ids"].count(tokenizer.convert_tokens_to_ids("<|image_pad|>")) == 1


def test_the_image_processor_patches_a_real_photo_within_the_pixel_bounds(proxy: Path) -> None:
    processor, shape = AutoImageProcessor.from_pretrained(proxy), ProxyShape()
    for photo in PHOTOS[:3]:
        grid = processor(images=[photo.load()], return_tensors="np")["image_grid_thw"][0]
        temporal, rows, columns = (int(n) for n in grid)
        assert temporal == 1 and rows % 2 == 0 and columns % 2 == 0  # 2×2 merges of 16-pixel patches
        assert shape.min_pixels <= rows * columns * 16 * 16 <= shape.max_pixels


def test_mrope_sections_must_fill_half_the_head(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="mrope_section"):
        write_qwen3_vl_moe_proxy(tmp_path, ProxyShape(mrope_section=(16, 16, 16)))
