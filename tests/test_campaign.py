"""Campaign files: the shipped ones validate; malformed ones get errors naming file and field."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from autotune.campaign import builtin_campaign_path, load_campaign
from autotune.core.errors import InputFileError

SHIPPED = sorted(Path("campaigns").glob("*.yaml"))


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_shipped_campaign_loads(path: Path, tmp_path: Path) -> None:
    campaign = load_campaign(_with_its_inputs_made(path, tmp_path))
    assert campaign.space.path.exists()
    assert campaign.rule_context.world_size == campaign.spec.hardware.gpus_per_trial


def _with_its_inputs_made(path: Path, folder: Path) -> Path:
    """A ``bridge`` campaign reads a checkpoint directory and an Energon dataset that its user makes
    first (its comments say how): made here in ``folder``, with a copy of the campaign pointing at
    them; any other campaign as shipped."""
    data = yaml.safe_load(path.read_text())
    if data["trainable"] != "bridge":
        return path
    from trainables.bridge.energon import build_chatml_energon
    from trainables.bridge.hf_proxy import write_qwen3_vl_moe_proxy

    checkpoint = write_qwen3_vl_moe_proxy(folder / "hf-proxy")
    energon = build_chatml_energon(folder / "energon", samples_per_photo=1, samples_per_shard=8).folder
    target, _, function = data["bridge"]["recipe"].rpartition(":")
    data["bridge"]["recipe"] = f"{(path.parent / target).resolve()}:{function}"
    data["bridge"]["hf_checkpoints"] = {hub_id: str(checkpoint) for hub_id in data["bridge"]["hf_checkpoints"]}
    data["model"]["hf_checkpoint"], data["data"]["path"] = str(checkpoint), str(energon)
    copy = folder / path.name
    copy.write_text(yaml.safe_dump(data))
    return copy


def test_a_run_directory_of_a_bridge_campaign_loads_its_recipe_checkpoint_and_data_from_anywhere(
        tmp_path: Path) -> None:
    """The run directory's copy of the campaign is what resume, report and export load: the paths
    the user wrote relative to their campaign file must still lead to the same files from there."""
    import shutil

    from autotune.engine.rundir import create_run_dir, open_run_dir

    made = yaml.safe_load(_with_its_inputs_made(Path("campaigns/h200_bridge.yaml"), tmp_path).read_text())
    user = tmp_path / "user" / "campaigns"
    shutil.copytree("campaigns/recipes", user / "recipes")
    made["bridge"]["recipe"] = "recipes/qwen3_vl_energon.py:qwen3_vl_30b_a3b_sft_energon_config"
    made["bridge"]["hf_checkpoints"] = {hub_id: "../../hf-proxy" for hub_id in made["bridge"]["hf_checkpoints"]}
    made["model"]["hf_checkpoint"], made["data"]["path"] = "../../hf-proxy", "../../energon"
    made["space"] = str(Path("search_spaces/h200_bridge.yaml").resolve())
    (user / "bridge.yaml").write_text(yaml.safe_dump(made))
    campaign = load_campaign(user / "bridge.yaml")

    copied = open_run_dir(create_run_dir(campaign, tmp_path / "runs").path).load_campaign()

    assert copied.recipe == campaign.recipe
    assert copied.recipe.recipe == f"{(user / 'recipes' / 'qwen3_vl_energon.py').resolve()}:" \
                                   "qwen3_vl_30b_a3b_sft_energon_config"
    assert dict(copied.recipe.hf_checkpoints) == {"Qwen/Qwen3-VL-30B-A3B-Instruct": str((tmp_path / "hf-proxy").resolve())}
    bring_up = campaign.space.warm_starts[0].config
    assert copied.burst_request(bring_up, 4).data == campaign.burst_request(bring_up, 4).data
    assert copied.model == campaign.model

    for moved in ("hf-proxy", "energon", "user"):  # the run directory read on another machine
        shutil.move(tmp_path / moved, tmp_path / f"{moved}-elsewhere")
    elsewhere = open_run_dir(next((tmp_path / "runs").iterdir())).load_campaign(check_inputs=False)
    assert elsewhere.model == campaign.model and elsewhere.recipe == campaign.recipe
    with pytest.raises(InputFileError, match="data.path"):
        open_run_dir(next((tmp_path / "runs").iterdir())).load_campaign()


def test_builtin_demo_is_the_cpu_native_campaign() -> None:
    campaign = load_campaign(builtin_campaign_path("cpu_demo"))
    assert campaign.trainable.name == "native"
    assert campaign.stack.accelerator == "cpu"
    assert campaign.spec.data.realism == "real"
    assert campaign.spec.stages.promote_steps >= 50


BASE = yaml.safe_load(Path("campaigns/cpu_demo.yaml").read_text())


def _with(path_value: str, value) -> dict:
    data = yaml.safe_load(yaml.safe_dump(BASE))
    *parents, leaf = path_value.split(".")
    node = data
    for key in parents:
        node = node.setdefault(key, {})
    if value is _DELETE:
        del node[leaf]
    else:
        node[leaf] = value
    return data


_DELETE = object()

BAD_CAMPAIGNS = [
    (_with("trainable", "jax"), "trainable", "unknown trainable 'jax'; known trainables: native, megatron"),
    (_with("model.preset", "llama"), "model.preset", "unknown model preset 'llama'"),
    (_with("model.overrides", {"num_layers": 0}), "model.overrides.num_layers", "greater than or equal to 1"),
    (_with("model.overrides", {"num_query_groups": 3}), "model.overrides", "multiple of num_query_groups"),
    (_with("model.overrides", {"layers": 3}), "model.overrides.layers", "unknown field"),
    (_with("hardware.gpus_per_trial", 4), "hardware", r"gpus_per_trial \(4\) exceeds the cluster's 2 GPUs"),
    (_with("hardware.accelerator", "a100"), "hardware.accelerator", "Input should be"),
    (_with("stages.promote_steps", 20), "stages.promote_steps", "greater than or equal to 50"),
    (_with("stages.screen_steps", 6), "stages", r"screen_steps \(6\) must exceed warmup_steps \(2\) by at least 5"),
    (_with("budget.max_trials", _DELETE), "budget.max_trials", "Field required"),
    (_with("workflow", {"then_space": "h200_single"}), "workflow.then_space", "declares no `reachable` throughput"),
    (_with("workflow", {"then_space": "parallel_3d", "min_headroom": -1}), "workflow.min_headroom", "greater than or equal to 0"),
    (_with("search.sampler", "grid"), "search.sampler", "Input should be 'tpe' or 'random'"),
    (_with("stages.prune_margin", 1.5), "stages.prune_margin", "less than 1"),
    (_with("hardware.launcher", "slurm"), "hardware.launcher", "Input should be 'auto', 'local' or 'ray_train'"),
    (_with("hardware", {"accelerator": "h200", "gpus_per_node": 2, "gpus_per_trial": 2, "cpu_memory_cap_gib": 1}),
     "hardware", "cpu_memory_cap_gib applies to accelerator 'cpu'"),
    (_with("hardware", {"accelerator": "h200", "gpus_per_node": 2, "gpus_per_trial": 2, "cpu_device_memory_gib": 1}),
     "hardware", "cpu_device_memory_gib applies to accelerator 'cpu'"),
    (_with("hardware.cpu_device_memory_gib", 0), "hardware.cpu_device_memory_gib", "greater than 0"),
    (_with("hardware", {"accelerator": "cpu", "gpus_per_node": 2, "nodes": 2, "gpus_per_trial": 4, "launcher": "local"}),
     "hardware", "launcher 'local' runs a trial on one node"),
    (_with("budget.deadline", "2026-12-02T06:00:00"), "budget.deadline", "needs a time zone"),
    (_with("data.source", "shards"), "data", "needs path"),
    (_with("data.realism", "synthetic"), "data.realism", "Input should be 'real' or 'mock'"),
    (_with("objective", "step_time"), "objective", "Input should be"),
    (_with("outputdir", "x"), "outputdir", "unknown field"),
    (_with("space", "no_such_space"), "space", "no space file at"),
    (_with("workload.global_batch_size", 0), "workload.global_batch_size", "greater than or equal to 1"),
    (_with("workload.frozen", ["vision_model", "vision_model"]), "workload.frozen", "names a part twice"),
    (_with("workload.frozen", ["decoder"]), "workload.frozen[0]", "Input should be"),
]


@pytest.mark.parametrize(("data", "field", "message"), BAD_CAMPAIGNS, ids=[b[1] + ":" + b[2][:20] for b in BAD_CAMPAIGNS])
def test_bad_campaign_names_file_and_field(tmp_path: Path, data: dict, field: str, message: str) -> None:
    path = tmp_path / "campaign.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(InputFileError) as info:
        load_campaign(path)
    assert info.value.path == path
    assert info.value.field == field, str(info.value)
    assert re.search(message, str(info.value)), str(info.value)


def test_space_path_is_relative_to_the_campaign(tmp_path: Path) -> None:
    (tmp_path / "spaces").mkdir()
    (tmp_path / "spaces" / "mine.yaml").write_text(Path("search_spaces/cpu_demo.yaml").read_text())
    path = tmp_path / "campaign.yaml"
    path.write_text(yaml.safe_dump(_with("space", "spaces/mine.yaml")))
    assert load_campaign(path).space.path == tmp_path / "spaces" / "mine.yaml"


def test_python_tags_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "campaign.yaml"
    path.write_text("name: !!python/object/apply:os.system ['echo pwned']\n")
    with pytest.raises(InputFileError, match="invalid YAML"):
        load_campaign(path)


FREEZE_KNOBS = ("freeze_vision_model", "freeze_vision_projection")


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_where_the_workload_freezes_nothing_no_config_freezes_anything(path: Path, tmp_path: Path) -> None:
    campaign = load_campaign(_with_its_inputs_made(path, tmp_path))
    assert not campaign.spec.workload.frozen and not campaign.spec.workload.tunable_freezing
    configs = [*campaign.space.configs(), *(start.config for start in campaign.space.warm_starts)]
    assert configs and not any(config[knob] for config in configs for knob in FREEZE_KNOBS)
    assert not any(knob in campaign.space.tuned for knob in FREEZE_KNOBS)


def _load_with_workload(tmp_path: Path, workload: dict):
    path = tmp_path / "campaign.yaml"
    path.write_text(yaml.safe_dump(_with("workload", workload)))
    return load_campaign(path)


def test_a_declared_frozen_part_is_frozen_in_every_config(tmp_path: Path) -> None:
    campaign = _load_with_workload(tmp_path, {"global_batch_size": 16, "frozen": ["vision_model"]})
    configs = [*campaign.space.configs(), *(start.config for start in campaign.space.warm_starts)]
    assert all(config.freeze_vision_model and not config.freeze_vision_projection for config in configs)
    assert campaign.frozen_beyond_workload(configs[0]) == []


def test_tunable_freezing_lets_the_search_try_it_and_names_what_a_config_freezes_beyond_the_workload(
        tmp_path: Path) -> None:
    campaign = _load_with_workload(tmp_path, {"global_batch_size": 16, "tunable_freezing": True})
    assert campaign.space.tuned["freeze_vision_model"] == (False, True)
    frozen = next(c for c in campaign.space.configs() if c.freeze_vision_model)
    assert campaign.frozen_beyond_workload(frozen) == ["vision_model"]
    assert [start.config.freeze_vision_model for start in campaign.space.warm_starts] == [False, True]


def test_a_space_that_fixes_freezing_against_the_workload_is_refused(tmp_path: Path) -> None:
    space = yaml.safe_load(Path("search_spaces/cpu_demo.yaml").read_text())
    del space["tune"]["freeze_vision_model"]
    space["fixed"]["freeze_vision_model"] = True
    space["warm_start"] = [start for start in space["warm_start"]
                           if "freeze_vision_model" not in start["config"]]
    (tmp_path / "frozen.yaml").write_text(yaml.safe_dump(space))
    path = tmp_path / "campaign.yaml"
    path.write_text(yaml.safe_dump(_with("space", "frozen.yaml")))
    with pytest.raises(InputFileError) as info:
        load_campaign(path)
    assert info.value.field == "workload.frozen"
    assert "fixes freeze_vision_model: True, but the workload trains vision_model" in str(info.value)


def test_the_burst_carries_the_workloads_global_batch() -> None:
    campaign = load_campaign(Path("campaigns/cpu_demo.yaml"))
    config = campaign.space.warm_starts[0].config
    assert campaign.burst_request(config, 8).global_batch_size == campaign.spec.workload.global_batch_size == 16
    assert campaign.rule_context.global_batch_size == 16
