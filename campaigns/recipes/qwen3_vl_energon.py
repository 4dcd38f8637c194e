"""A user's recipe file, as a performance engineer writes one: Megatron-Bridge 0.6's Qwen3-VL-30B-A3B
SFT recipe (8 H100s, expert parallel 8) on an Energon dataset instead of the Hub's CORD-v2, the way
Bridge's own Qwen3-VL-8B Energon recipe swaps its data. A ``bridge`` campaign names it as
``recipe: recipes/qwen3_vl_energon.py:qwen3_vl_30b_a3b_sft_energon_config`` and passes the rest
(``dataset.path=…``, a one-GPU layout) as ``recipe_overrides``, as on a launch line.
"""

from megatron.bridge.data.builders import EnergonDatasetConfig, QwenVLEnergonTaskEncoderConfig
from megatron.bridge.recipes.qwen_vl.h100.qwen3_vl import qwen3_vl_30b_a3b_sft_8gpu_h100_bf16_config

HF_PATH = "Qwen/Qwen3-VL-30B-A3B-Instruct"


def qwen3_vl_30b_a3b_sft_energon_config():
    """The SFT recipe with its data read by Bridge's Qwen-VL Energon task encoder (path set by override)."""
    cfg = qwen3_vl_30b_a3b_sft_8gpu_h100_bf16_config()
    cfg.dataset = EnergonDatasetConfig(
        path=None,
        seq_length=cfg.model.seq_length,
        micro_batch_size=cfg.train.micro_batch_size,
        num_workers=2,
        task_encoder=QwenVLEnergonTaskEncoderConfig(hf_processor_path=HF_PATH, patch_size=16),
    )
    return cfg
