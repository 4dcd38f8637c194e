"""Recipe files as a user writes them, for the ``bridge`` trainable's CPU tests (Bridge 0.3.1 here).

Bridge 0.3's Qwen3-VL-30B-A3B recipe takes its checkpoint and data as arguments; this one trains on
an Energon dataset whose path the trial's ``dataset.path`` override sets, like the 0.6 recipe file
``campaigns/recipes/qwen3_vl_energon.py`` that the GPU campaign runs.
"""

from megatron.bridge.recipes.qwen_vl.qwen3_vl import qwen3_vl_30b_a3b_pretrain_config


def qwen3_vl_30b_a3b_energon():
    return qwen3_vl_30b_a3b_pretrain_config(dataset_type="energon", train_data_path=["unset"],
                                            tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                                            expert_model_parallel_size=1, seq_length=1024)


def qwen3_vl_30b_a3b_mock():
    return qwen3_vl_30b_a3b_pretrain_config(mock=True)
