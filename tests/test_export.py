"""Export formats round-trip through the registry; Bridge overrides name real megatron-core fields;
the flag formats carry what Megatron-Bridge and Megatron-LM demand of a value, in each version's
spelling, and refuse what a tool cannot take with its reason."""

from __future__ import annotations

import json
import random
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from autotune.core.knobs import KNOBS, complete_config
from autotune.core.tool_flags import (
    BRIDGE_COMPANION_KEYS, BRIDGE_PRECISION_PRESET, ExportRefused, bridge_overrides, megatron_lm_args,
    read_bridge_overrides, read_megatron_lm_args,
)
from autotune.export import FORMATS, header, load_document, render
from autotune.space import load_space

SPACES = sorted(Path("search_spaces").glob("*.yaml"))


def sample_configs(count_per_space: int = 25):
    rng = random.Random(0)
    for path in SPACES:
        configs = list(load_space(path).configs())
        yield from rng.sample(configs, min(count_per_space, len(configs)))


def refused(config, fmt: str, version: str) -> bool:
    """Whether the tool cannot take ``config`` (the reasons are tested below)."""
    if fmt == "megatron-lm":
        return bool(config.freeze_vision_projection)
    no_preset = (config.fp8, None if config.fp8 == "none" else config.fp8_recipe) not in BRIDGE_PRECISION_PRESET
    return version >= "0.19" and (config.cuda_graph_impl == "local" or no_preset)


@pytest.mark.parametrize("version", ["0.16.1", "0.17.1", "0.18.0", "0.19.2"])
def test_every_format_reads_back_to_the_same_config(version: str) -> None:
    exported = 0
    for config in sample_configs():
        if not refused(config, "bridge", version):
            assert read_bridge_overrides(shlex.split(render(config, "bridge", version))) == config
            exported += 1
        if not refused(config, "megatron-lm", version):
            assert read_megatron_lm_args(shlex.split(render(config, "megatron-lm", version))) == config
        assert complete_config(yaml.safe_load(render(config, "yaml", version))["config"]) == config
        assert complete_config(json.loads(render(config, "json", version))["config"]) == config
    assert exported > 100


def test_what_a_tool_cannot_take_is_refused_with_its_reason() -> None:
    local = complete_config({"cuda_graph_impl": "local", "cuda_graph_scope": ["attn"]})
    with pytest.raises(ExportRefused, match='cuda_graph_impl="local" only for full-iteration'):
        render(local, "bridge", "0.19.2")
    assert "model.cuda_graph_impl=local" in bridge_overrides(local, "0.16.1")  # Bridge 0.3 takes it
    assert " ".join(megatron_lm_args(local, "0.19.2")).endswith("--cuda-graph-impl local --cuda-graph-modules attn")
    projection = complete_config({"freeze_vision_projection": True})
    with pytest.raises(ExportRefused, match="no flag that freezes the vision projection"):
        render(projection, "megatron-lm", "0.19.2")
    assert "model.freeze_vision_projection=true" in bridge_overrides(projection, "0.19.2")
    e4m3_delayed = complete_config({"fp8": "e4m3", "fp8_recipe": "delayed"})
    with pytest.raises(ExportRefused, match="none is fp8 e4m3 with delayed scaling"):
        bridge_overrides(e4m3_delayed, "0.19.2")
    assert "mixed_precision.fp8=e4m3" in bridge_overrides(e4m3_delayed, "0.16.1")  # Bridge 0.3: the fields
    mxfp8 = complete_config({"fp8": "e4m3", "fp8_recipe": "mxfp8"})
    assert "mixed_precision=bf16_with_mxfp8_mixed" in bridge_overrides(mxfp8, "0.19.2")


def test_the_export_command_refuses_with_the_tools_reason(tmp_path: Path) -> None:
    (tmp_path / "winner.yaml").write_text(render(complete_config({"freeze_vision_projection": True}), "yaml", "0.19.2"))
    result = subprocess.run([sys.executable, "-m", "autotune", "export", str(tmp_path), "--format", "megatron-lm"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "no flag that freezes the vision projection" in result.stderr


def test_full_iteration_graphs_are_spelled_per_version_with_the_nan_check_off() -> None:
    config = complete_config({"cuda_graph_impl": "full_iteration", "expert_model_parallel_size": 2})
    old, new = bridge_overrides(config, "0.17.1"), bridge_overrides(config, "0.18.0")
    assert {"model.cuda_graph_impl=local", "model.cuda_graph_scope=[full_iteration]"} <= set(old)
    assert "model.cuda_graph_impl=full_iteration" in new and not any("full_iteration]" in o for o in new)
    assert "model.cuda_graph_scope=null" in new  # Bridge 0.6 recipes still set the deprecated field
    for overrides in (old, new):
        assert "rerun_state_machine.check_for_nan_in_loss=false" in overrides
    old_flags, new_flags = megatron_lm_args(config, "0.17.1"), megatron_lm_args(config, "0.18.0")
    assert " ".join(old_flags).count("--cuda-graph-impl local --cuda-graph-scope full_iteration") == 1
    assert "--moe-pad-experts-for-cuda-graph-inference" in old_flags  # 0.16/0.17: local graphs with EP > 1
    assert " ".join(new_flags).count("--cuda-graph-impl full_iteration") == 1 and "--cuda-graph-modules" not in new_flags
    assert "--moe-pad-experts-for-cuda-graph-inference" not in new_flags
    assert all("--no-check-for-nan-in-loss-and-grad" in flags for flags in (old_flags, new_flags))


def test_sharding_and_precision_carry_what_the_tools_demand() -> None:
    fsdp2 = megatron_lm_args(complete_config({"use_torch_fsdp2": True}), "0.19.2")
    assert {"--use-torch-fsdp2", "--no-gradient-accumulation-fusion", "--untie-embeddings-and-output-weights"} \
        <= set(fsdp2)
    megatron_fsdp = complete_config({"use_megatron_fsdp": True, "data_parallel_sharding_strategy": "optim_grads"})
    flags = " ".join(megatron_lm_args(megatron_fsdp, "0.16.1"))
    assert "--use-distributed-optimizer" in flags and "--ckpt-format fsdp_dtensor" in flags
    overrides = bridge_overrides(megatron_fsdp, "0.19.2")
    assert {"ddp.use_megatron_fsdp=true", "dist.use_megatron_fsdp=true"} <= set(overrides)
    assert "dist.use_megatron_fsdp=false" in bridge_overrides(complete_config({}), "0.19.2")  # Bridge ORs the two
    fp8 = bridge_overrides(complete_config({"fp8": "hybrid", "fp8_recipe": "tensorwise"}), "0.16.1")
    assert {"mixed_precision.fp8=hybrid", "mixed_precision.fp8_recipe=tensorwise"} <= set(fp8)
    assert "mixed_precision=bf16_with_fp8_current_scaling_mixed" in bridge_overrides(
        complete_config({"fp8": "hybrid", "fp8_recipe": "tensorwise"}), "0.19.2")  # Bridge 0.6: its preset
    assert not any(o.startswith("model.fp8") for o in fp8)  # Bridge resets model.fp8 from mixed_precision
    assert "model.freeze_language_model=false" in fp8  # the Qwen3-VL MoE provider freezes the LM by default


def test_the_flag_formats_carry_the_workloads_global_batch() -> None:
    config = complete_config({"micro_batch_size": 4})
    workload = {"workload": {"global_batch_size": 512, "frozen": [], "tunable_freezing": False}}
    bridge = shlex.split(render(config, "bridge", "0.19.2", workload))
    assert bridge[-1] == "train.global_batch_size=512" and read_bridge_overrides(bridge) == config
    flags = shlex.split(render(config, "megatron-lm", "0.19.2", workload))
    assert flags[-2:] == ["--global-batch-size", "512"] and read_megatron_lm_args(flags) == config
    assert "global_batch_size" not in render(config, "bridge", "0.19.2")


def test_bridge_names_follow_the_megatron_core_version() -> None:
    config = complete_config({"cuda_graph_impl": "transformer_engine", "cuda_graph_scope": ["attn"]})
    assert "model.cuda_graph_scope=[attn]" in bridge_overrides(config, "0.16.1")
    assert "model.cuda_graph_modules=[attn]" in bridge_overrides(config, "0.18.0")
    args = megatron_lm_args(config, "0.19.2")
    assert args[args.index("--cuda-graph-modules") + 1] == "attn" and "--cuda-graph-scope" not in args


def test_bridge_overrides_name_real_megatron_core_fields() -> None:
    pytest.importorskip("megatron.core")
    import dataclasses

    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.transformer.transformer_config import TransformerConfig

    from trainables.megatron.config_mapping import installed_megatron_core_version

    version = installed_megatron_core_version()
    fields = {
        "transformer": {f.name for f in dataclasses.fields(TransformerConfig)},
        "ddp": {f.name for f in dataclasses.fields(DistributedDataParallelConfig)},
    }
    for config in sample_configs():
        if refused(config, "bridge", version):
            continue
        for override in bridge_overrides(config, version):
            key = override.split("=", 1)[0]
            section, leaf = key.split(".", 1)
            if key in BRIDGE_COMPANION_KEYS:
                continue  # Bridge's own settings (rerun state machine, dist, the provider's LM freeze)
            knob = next(k for k in KNOBS.values() if key in (k.bridge_key_for(version), k.bridge_key))
            if knob.megatron_target in fields:
                # Bridge's model.* is its model provider, a TransformerConfig subclass; ddp.* is the DDP
                # config; mixed_precision.* is copied onto the model provider before validation.
                assert section in {"transformer": ("model", "mixed_precision"), "ddp": ("ddp",)}[knob.megatron_target]
                assert leaf in fields[knob.megatron_target], key


def test_export_command_reads_a_winner_document(tmp_path: Path) -> None:
    config = complete_config({"micro_batch_size": 4, "recompute_granularity": "selective",
                              "recompute_modules": ["core_attn"], "freeze_vision_model": True})
    (tmp_path / "winner.yaml").write_text(render(config, "yaml", "0.19.2", {"steady": {"mean": 1.0}}))
    loaded, version, rest = load_document(tmp_path / "winner.yaml")
    assert loaded == config and version == "0.19.2" and rest == {"steady": {"mean": 1.0}}
    for fmt in FORMATS:
        result = subprocess.run([sys.executable, "-m", "autotune", "export", str(tmp_path), "--format", fmt],
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        body = [line for line in result.stdout.splitlines() if not line.startswith("#")]
        assert "\n".join(body).strip() == render(config, fmt, "0.19.2", rest).strip()
        assert (fmt in ("bridge", "megatron-lm")) == result.stdout.startswith("# ")


def test_a_winner_exports_what_its_campaign_tuned_and_says_what_it_depends_on(tmp_path: Path) -> None:
    config = complete_config({"micro_batch_size": 4, "recompute_granularity": "full", "recompute_method": "uniform",
                              "recompute_num_layers": 1, "moe_token_dispatcher_type": "alltoall",
                              "moe_grouped_gemm": True, "freeze_vision_model": True})
    extra = {"campaign": "c", "tuned": ["micro_batch_size", "recompute_granularity"],
             "objective": {"metric": "useful_tokens_per_s_per_gpu", "mean": 9592.0, "ci_low": 9233.0,
                           "ci_high": 9952.0, "confidence": 0.95, "steady_steps": 47},
             "workload": {"global_batch_size": 8, "frozen": [], "tunable_freezing": True},
             "frozen_beyond_workload": ["vision_model"]}
    (tmp_path / "winner.yaml").write_text(render(config, "yaml", "0.19.2", extra))
    overrides = shlex.split(render(config, "bridge", "0.19.2", extra))
    assert [o for o in overrides if o.split("=")[0] not in BRIDGE_COMPANION_KEYS] == [
        "train.micro_batch_size=4", "model.recompute_granularity=full", "model.recompute_method=uniform",
        "model.recompute_num_layers=1"]  # the tuned knobs and those full recompute switches on
    every = shlex.split(render(config, "bridge", "0.19.2", extra, every_knob=True))
    assert "model.moe_grouped_gemm=true" in every and read_bridge_overrides(every) == config
    flags = render(config, "megatron-lm", "0.19.2", extra)
    assert flags.startswith("--micro-batch-size 4 --recompute-granularity full") and "--moe-grouped-gemm" not in flags
    result = subprocess.run([sys.executable, "-m", "autotune", "export", str(tmp_path)], capture_output=True,
                            text=True, timeout=60)
    lines = result.stdout.splitlines()
    assert lines[0] == "# Megatron-Bridge overrides for megatron-core 0.19.2, from campaign c"
    assert lines[1] == "# measured: 9,592 useful_tokens_per_s_per_gpu (95 % 9,233–9,952, 47 steady steps)"
    assert lines[2] == ("# depends on: global batch 8; precision bf16; frozen: freeze_vision_model; freezing the "
                        "workload does not declare: vision_model")
    assert lines[3].startswith("# also measured with (not written; --all writes them):")
    assert "moe_grouped_gemm=true" in lines[3] and "freeze_vision_model=true" in lines[3]
    assert shlex.split(lines[4]) == overrides


def test_export_of_a_bad_document_names_the_field(tmp_path: Path) -> None:
    path = tmp_path / "w.yaml"
    path.write_text("config: {micro_batch_size: 0}\n")
    result = subprocess.run([sys.executable, "-m", "autotune", "export", str(path)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 2
    assert f"{path}: config.micro_batch_size: expected an integer >= 1, got 0" in result.stderr


def test_an_fsdp_winner_for_megatron_lm_says_pretrain_vlm_cannot_save_it() -> None:
    for sharding in ({"use_torch_fsdp2": True}, {"use_megatron_fsdp": True, "data_parallel_sharding_strategy": "optim_grads"}):
        lines = header(complete_config(sharding), "megatron-lm", "0.19.2", {})
        assert any("pretrain_vlm.py asserts --ckpt-format torch" in line for line in lines)
    assert not any("pretrain_vlm.py" in line for line in header(complete_config({}), "megatron-lm", "0.19.2", {}))
    assert not any("pretrain_vlm.py" in line
                   for line in header(complete_config({"use_torch_fsdp2": True}), "bridge", "0.19.2", {}))


def test_a_target_release_picks_the_format_and_the_spelling(tmp_path: Path) -> None:
    config = complete_config({"cuda_graph_impl": "transformer_engine", "cuda_graph_scope": ["attn"]})
    (tmp_path / "winner.yaml").write_text(render(config, "yaml", "0.19.2", {"tuned": ["cuda_graph_impl"]}))

    def export(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "autotune", "export", str(tmp_path), *args],
                              capture_output=True, text=True, timeout=60)

    default, old_bridge, old_mlm = export(), export("--target", "bridge-0.3"), export("--target", "megatron-lm-0.17")
    assert "model.cuda_graph_modules=[attn]" in default.stdout  # the version the winner ran on
    assert "model.cuda_graph_scope=[attn]" in old_bridge.stdout and "cuda_graph_modules" not in old_bridge.stdout
    assert "--cuda-graph-impl transformer_engine --cuda-graph-scope attn" in old_mlm.stdout
    assert old_mlm.stdout.startswith("# Megatron-LM flags for megatron-core 0.17.1")
    wrong = export("--target", "bridge-0.4")
    assert wrong.returncode == 2 and "bridge-0.3" in wrong.stderr


def test_a_bridge_winner_exports_the_overrides_its_trial_applied_to_the_users_recipe() -> None:
    config = complete_config({"micro_batch_size": 4})
    ran = ["train.micro_batch_size=4", "model.freeze_language_model=false", "dataset.micro_batch_size=4",
           "train.global_batch_size=8"]
    extra = {"tuned": ["micro_batch_size"], "workload": {"global_batch_size": 8},
             "contract": {"recipe": "recipes/qwen3_vl_energon.py:qwen3_vl_30b_a3b_sft_energon_config",
                          "recipe_overrides": ran, "versions": {"megatron_core": "0.19.2"}}}
    assert shlex.split(render(config, "bridge", "0.19.2", extra)) == ran
    respelled = shlex.split(render(config, "bridge", "0.16.1", extra))
    assert "dataset.micro_batch_size=4" not in respelled and read_bridge_overrides(respelled) == config
    lines = header(config, "bridge", "0.19.2", extra)
    assert any("append to your launch of recipes/qwen3_vl_energon.py" in line and "as the winning trial" in line
               for line in lines)
