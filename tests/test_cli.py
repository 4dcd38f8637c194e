"""The command line as users run it: exit codes, messages, JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml


def autotune(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "autotune", *args], capture_output=True, text=True, env={"COLUMNS": "200", "PATH": ""},
        timeout=120,
    )


def test_validate_builtin_demo() -> None:
    result = autotune("validate")
    assert result.returncode == 0, result.stderr
    assert "campaign cpu-demo" in result.stdout and "valid" in result.stdout
    # the demo's workload trains the ViT: freezing is fixed off, which halves the space's 160 configs
    assert "80 configs, 60 accepted, 20 rejected" in result.stdout
    assert "workload: global batch 16 samples per step · frozen: nothing" in result.stdout


def test_validate_bad_file_exits_2_with_one_clear_line(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    campaign = yaml.safe_load(Path("campaigns/cpu_demo.yaml").read_text())
    campaign["budget"]["max_trials"] = 0
    path.write_text(yaml.safe_dump(campaign))
    result = autotune("validate", str(path))
    assert result.returncode == 2
    assert f"{path}: budget.max_trials: Input should be greater than or equal to 1 (got 0)" in result.stderr
    assert "Traceback" not in result.stderr


def test_validate_rejects_a_campaign_whose_space_is_all_rejected(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    text = Path("campaigns/h200_single.yaml").read_text().replace("accelerator: h200", "accelerator: cpu")
    path.write_text(text.replace("space: h200_single", f"space: {Path('search_spaces/h200_single.yaml').resolve()}"))
    result = autotune("validate", str(path))
    assert result.returncode == 2
    assert "space: the rules reject all 40 configs of h200_single" in result.stderr


def test_space_show_json_groups_rejections_by_rule() -> None:
    result = autotune("space", "show", "search_spaces/h200_dual.yaml", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["configs"] == report["accepted"] + report["rejected"]
    assert report["rejected_by_rule"]["expert_data_parallel_whole"]["count"] > 0
    assert "ETP·EP·PP" in report["rejected_by_rule"]["expert_data_parallel_whole"]["example"]
    assert [w["name"] for w in report["warm_starts"]] == ["fsdp-first", "ddp-ep2"]


def test_space_show_table_in_a_campaign_context() -> None:
    result = autotune("space", "show", "search_spaces/cpu_demo.yaml", "--campaign", "campaigns/cpu_demo.yaml")
    assert result.returncode == 0, result.stderr
    assert "torch_fsdp2_needs_pp1_ep1" in result.stdout
    assert "recompute_modules" in result.stdout and "[core_attn]" in result.stdout


def test_knobs_lists_megatron_names_per_version() -> None:
    old = autotune("knobs", "--megatron-core", "0.16.1").stdout
    new = autotune("knobs", "--megatron-core", "0.19.2").stdout
    assert "model.cuda_graph_scope" in old and "model.cuda_graph_modules" not in old
    assert "model.cuda_graph_modules" in new


def _cache_with_photos(tmp_path: Path, photo_shards: Path) -> dict:
    from trainables.data.shards import BUILD_VERSION

    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / f"photos-v{BUILD_VERSION}").symlink_to(photo_shards)
    (photo_shards / "COMPLETE").write_text("{}")
    return {"COLUMNS": "200", "PATH": "", "AUTOTUNE_CACHE": str(cache), "HOME": str(tmp_path)}


def burst(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "autotune", "burst", *args], capture_output=True, text=True,
                          env=env, timeout=600)


def test_burst_on_the_cpu_demo_writes_records_and_contract(tmp_path: Path, photo_shards: Path) -> None:
    out = tmp_path / "burst.json"
    config = '{"micro_batch_size": 1, "recompute_granularity": "selective", "recompute_modules": ["core_attn"]}'
    result = burst(_cache_with_photos(tmp_path, photo_shards), "--config", config, "--steps", "7", "--workers", "1",
                   "--json", str(out))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "steady useful tokens/s" in result.stdout and "data wait" in result.stdout
    summary = json.loads(out.read_text())
    assert summary["outcome"] == "ok" and len(summary["records"]) == 7
    assert summary["data_realism"] == "real" and summary["benchmark_only"] is False
    assert summary["contract"]["hardware"]["world_size"] == 2
    assert summary["contract"]["config"]["recompute_modules"] == ["core_attn"]
    assert summary["steady"]["warmup_steps"] >= 2 and summary["contract"]["steady_window"]["first_step"] >= 2


def test_burst_with_mock_data_is_labelled_benchmark_only(tmp_path: Path, photo_shards: Path) -> None:
    out = tmp_path / "burst.json"
    result = burst(_cache_with_photos(tmp_path, photo_shards), "--mock", "--steps", "3", "--workers", "0",
                   "--json", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(out.read_text())
    assert summary["data_realism"] == "mock" and summary["benchmark_only"] is True
    assert all(r["image_tokens"] == 0 for r in summary["records"])


def test_burst_of_a_rejected_config_is_invalid_before_launch(tmp_path: Path, photo_shards: Path) -> None:
    out = tmp_path / "burst.json"
    result = burst(_cache_with_photos(tmp_path, photo_shards), "--config",
                   '{"use_torch_fsdp2": true, "expert_model_parallel_size": 2}', "--json", str(out))
    assert result.returncode == 1
    summary = json.loads(out.read_text())
    assert summary["outcome"] == "invalid"
    assert [v["rule"] for v in summary["violations"]] == ["torch_fsdp2_needs_pp1_ep1"]


def test_data_build_command(tmp_path: Path) -> None:
    result = autotune("data", "build", str(tmp_path / "shards"), "--samples-per-photo", "1")
    assert result.returncode == 0, result.stderr
    assert "16 samples in 1 shards" in result.stdout


def test_data_hf_proxy_command_writes_a_checkpoint_directory(tmp_path: Path) -> None:
    result = autotune("data", "hf-proxy", str(tmp_path / "proxy"))
    assert result.returncode == 0, result.stderr
    assert "4 decoder layers of 8 experts" in result.stdout
    assert {"config.json", "tokenizer.json", "preprocessor_config.json"} <= {p.name for p in (tmp_path / "proxy").iterdir()}


def test_data_hf_proxy_without_transformers_names_the_extra(tmp_path: Path) -> None:
    hide_transformers = (
        "import sys\n"
        "class Hide:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('transformers', 'tokenizers'): raise ImportError(f'No module named {name!r}')\n"
        "sys.meta_path.insert(0, Hide())\n"
        f"sys.argv = ['autotune', 'data', 'hf-proxy', {str(tmp_path / 'proxy')!r}]\n"
        "from autotune.cli import main\nmain()\n")
    result = subprocess.run([sys.executable, "-c", hide_transformers], capture_output=True, text=True,
                            env={"COLUMNS": "200", "PATH": ""}, timeout=120)
    assert result.returncode == 2
    assert "needs transformers (No module named 'transformers'): pip install -e '.[bridge]'" in result.stdout
