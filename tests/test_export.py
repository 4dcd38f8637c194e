"""Export formats round-trip through the registry; Bridge overrides name real megatron-core fields."""

from __future__ import annotations

import json
import random
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from autotune.core.knobs import KNOBS, complete_config, parse_bridge_overrides, parse_megatron_lm_args
from autotune.export import FORMATS, bridge_overrides, load_document, megatron_lm_args, render
from autotune.space import load_space

SPACES = sorted(Path("search_spaces").glob("*.yaml"))


def sample_configs(count_per_space: int = 25):
    rng = random.Random(0)
    for path in SPACES:
        configs = list(load_space(path).configs())
        yield from rng.sample(configs, min(count_per_space, len(configs)))


@pytest.mark.parametrize("version", ["0.16.1", "0.19.2"])
def test_every_format_reads_back_to_the_same_config(version: str) -> None:
    for config in sample_configs():
        bridge = shlex.split(render(config, "bridge", version))
        assert parse_bridge_overrides(bridge) == config
        flags = shlex.split(render(config, "megatron-lm", version))
        assert parse_megatron_lm_args(flags) == config
        assert complete_config(yaml.safe_load(render(config, "yaml", version))["config"]) == config
        assert complete_config(json.loads(render(config, "json", version))["config"]) == config


def test_the_flag_formats_carry_the_workloads_global_batch() -> None:
    config = complete_config({"micro_batch_size": 4})
    workload = {"workload": {"global_batch_size": 512, "frozen": [], "tunable_freezing": False}}
    bridge = shlex.split(render(config, "bridge", "0.19.2", workload))
    assert bridge[-1] == "train.global_batch_size=512" and parse_bridge_overrides(bridge[:-1]) == config
    flags = shlex.split(render(config, "megatron-lm", "0.19.2", workload))
    assert flags[-2:] == ["--global-batch-size", "512"] and parse_megatron_lm_args(flags[:-2]) == config
    assert "global_batch_size" not in render(config, "bridge", "0.19.2")


def test_bridge_names_follow_the_megatron_core_version() -> None:
    config = complete_config({"cuda_graph_impl": "local", "cuda_graph_scope": ["attn"]})
    assert "model.cuda_graph_scope=[attn]" in bridge_overrides(config, "0.16.1")
    assert "model.cuda_graph_modules=[attn]" in bridge_overrides(config, "0.19.2")
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
        for override in bridge_overrides(config, version):
            key = override.split("=", 1)[0]
            section, leaf = key.split(".", 1)
            knob = next(k for k in KNOBS.values() if k.bridge_key_for(version) == key)
            if knob.megatron_target in fields:
                # Bridge's model.* is its model provider, a TransformerConfig subclass; ddp.* is the DDP config.
                assert section == {"transformer": "model", "ddp": "ddp"}[knob.megatron_target]
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
        assert result.stdout.strip() == render(config, fmt, "0.19.2", rest).strip()


def test_export_of_a_bad_document_names_the_field(tmp_path: Path) -> None:
    path = tmp_path / "w.yaml"
    path.write_text("config: {micro_batch_size: 0}\n")
    result = subprocess.run([sys.executable, "-m", "autotune", "export", str(path)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 2
    assert f"{path}: config.micro_batch_size: expected an integer >= 1, got 0" in result.stderr
