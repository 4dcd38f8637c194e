"""The ``bridge`` trainable's CPU side, with Megatron-Bridge 0.3.1 (the release on Python 3.11): the
user's recipe file loaded, the campaign's Energon dataset and the user's overrides applied, the
trial's knobs as ``autotune export`` writes them, Bridge's own ``validate()`` deciding ``invalid``
before any GPU work, and a ``bridge`` campaign validated at load. The burst itself needs CUDA: its
runs on the H200 are committed (bench/results/bridge_gpu*.json).

Each Bridge case runs in a fresh interpreter: Hugging Face reads its offline settings once, at import.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from autotune.campaign import load_campaign
from autotune.core.errors import InputFileError
from autotune.core.model import hf_checkpoint_model
from trainables.bridge.energon import build_chatml_energon
from trainables.bridge.hf_proxy import ProxyShape, write_qwen3_vl_moe_proxy

if importlib.util.find_spec("megatron.bridge") is None:
    pytest.skip("Megatron-Bridge is not installed (bin/bootstrap installs 0.3.1)", allow_module_level=True)

HUB_ID = "Qwen/Qwen3-VL-30B-A3B-Instruct"
CASE = """
import json, os, sys
from pathlib import Path
sys.path.insert(0, "tests")
from autotune.core.contract import BurstRequest, DataSpec, RecipeSpec
from autotune.core.knobs import complete_config
from autotune.core.model import hf_checkpoint_model
from trainables.bridge.recipe import RecipeRefused, go_offline, prepare
args = json.loads(sys.argv[1])
spec = RecipeSpec(args["recipe"], overrides=tuple(args["overrides"]), tuned=tuple(args["tuned"]),
                  hf_checkpoints=((args["hub_id"], args["checkpoint"]),))
go_offline(spec, Path(args["cache"]))
import bridge_harness
bridge_harness.install()
os.environ["WORLD_SIZE"] = "1"
request = BurstRequest(config=complete_config(args["config"]),
                       model=hf_checkpoint_model(Path(args["checkpoint"]), {"seq_length": 1024}),
                       data=DataSpec(args["data"]), steps=7, world_size=1, recipe=spec, global_batch_size=8)
try:
    recipe, trial = prepare(request, "0.16.1")
except Exception as exc:
    print(json.dumps({"error": type(exc).__name__, "message": str(exc)}))
else:
    print(json.dumps({"trial": trial, "mbs": recipe.train.micro_batch_size, "gbs": recipe.train.global_batch_size,
                      "dataset_mbs": recipe.dataset.micro_batch_size, "path": recipe.dataset.path,
                      "iters": recipe.train.train_iters, "recompute": recipe.model.recompute_granularity,
                      "layers": recipe.model.num_layers, "experts": recipe.model.num_moe_experts,
                      "save": recipe.checkpoint.save}))
"""


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bridge")
    checkpoint = write_qwen3_vl_moe_proxy(root / "hf-proxy")
    data = build_chatml_energon(root / "energon", samples_per_photo=1, samples_per_shard=8).folder
    return {"root": root, "checkpoint": checkpoint, "data": data}


def prepare_case(made: dict[str, Path], config: dict, recipe: str = "tests/bridge_recipes.py:qwen3_vl_30b_a3b_energon",
                 overrides: tuple[str, ...] = (), tuned: tuple[str, ...] = ("micro_batch_size", "recompute_granularity",
                                                                            "tensor_model_parallel_size")) -> dict:
    args = {"recipe": recipe, "overrides": list(overrides), "tuned": list(tuned), "hub_id": HUB_ID,
            "checkpoint": str(made["checkpoint"]), "cache": str(made["root"] / f"hub-{os.urandom(4).hex()}"),
            "data": str(made["data"]), "config": config}
    result = subprocess.run([sys.executable, "-c", CASE, json.dumps(args)], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_a_trial_is_the_users_recipe_on_the_campaigns_data_with_the_tuned_knobs_as_exported(made) -> None:
    case = prepare_case(made, {"micro_batch_size": 4, "recompute_granularity": "selective",
                               "recompute_modules": ["core_attn"]}, overrides=("model.num_layers=2",))
    assert case["trial"][:3] == ["train.micro_batch_size=4", "model.recompute_granularity=selective",
                                 "model.recompute_modules=[core_attn]"]
    assert {"dataset.micro_batch_size=4", "train.global_batch_size=8", "dataset.global_batch_size=8"} <= set(case["trial"])
    assert (case["mbs"], case["dataset_mbs"], case["gbs"], case["recompute"]) == (4, 4, 8, "selective")
    assert case["path"] == str(made["data"]) and case["iters"] == 7 and case["save"] is None
    assert case["layers"] == 2, "the user's override holds"
    assert case["experts"] == ProxyShape().experts, "the model is the checkpoint directory's"


def test_a_config_bridge_refuses_is_invalid_with_bridges_reason(made) -> None:
    case = prepare_case(made, {"micro_batch_size": 2, "tensor_model_parallel_size": 2})
    assert case["error"] == "InvalidConfig"
    assert "world size (1) is not divisible by total_model_size" in case["message"]


def test_a_recipe_the_users_overrides_break_is_the_campaigns_error_not_a_configs(made) -> None:
    case = prepare_case(made, {"micro_batch_size": 2}, overrides=("model.no_such_field=1",))
    assert case["error"] == "RecipeRefused" and "bridge.recipe_overrides" in case["message"]
    assert "no_such_field" in case["message"]


def test_a_recipe_whose_data_takes_no_path_is_refused_saying_what_the_campaign_needs(made) -> None:
    case = prepare_case(made, {"micro_batch_size": 2}, recipe="tests/bridge_recipes.py:qwen3_vl_30b_a3b_mock")
    assert case["error"] == "RecipeRefused" and "EnergonDatasetConfig" in case["message"]


def test_the_model_sizes_are_read_from_the_checkpoint_directory(made) -> None:
    shape = ProxyShape()
    model = hf_checkpoint_model(made["checkpoint"], {"seq_length": 1024})
    assert (model.num_layers, model.hidden_size, model.num_moe_experts, model.moe_router_topk) == (
        shape.decoder_layers, shape.hidden_size, shape.experts, shape.experts_per_token)
    assert (model.vision.num_layers, model.vision.patch_size, model.images.max_pixels) == (
        shape.vision_layers, 16, shape.max_pixels)


def _campaign(made: dict[str, Path], **changes: object) -> Path:
    text = {
        "name": "bridge-test", "trainable": "bridge", "space": "h200_bridge",
        "model": {"hf_checkpoint": str(made["checkpoint"]), "overrides": {"seq_length": 1024}},
        "bridge": {"recipe": "recipes/qwen3_vl_energon.py:qwen3_vl_30b_a3b_sft_energon_config",
                   "recipe_overrides": ["model.expert_model_parallel_size=1"],
                   "hf_checkpoints": {HUB_ID: str(made["checkpoint"])}},
        "data": {"source": "shards", "path": str(made["data"])},
        "hardware": {"accelerator": "h200", "gpus_per_node": 1, "gpus_per_trial": 1},
        "budget": {"max_trials": 4}, "output_dir": str(made["root"] / "run"),
    } | changes
    path = Path("campaigns") / f"_test_{os.getpid()}_{len(changes)}.yaml"
    path.write_text(json.dumps(text))
    return path


def test_a_bridge_campaign_loads_its_recipe_checkpoint_and_data(made) -> None:
    path = _campaign(made)
    try:
        campaign = load_campaign(path)
    finally:
        path.unlink()
    recipe = campaign.recipe
    assert recipe.recipe == f"{Path('campaigns/recipes/qwen3_vl_energon.py').resolve()}:qwen3_vl_30b_a3b_sft_energon_config"
    assert recipe.hf_checkpoints == ((HUB_ID, str(made["checkpoint"])),)
    assert set(recipe.tuned) == set(campaign.space.tuned)
    assert campaign.model.num_moe_experts == ProxyShape().experts


@pytest.mark.parametrize(("changes", "field"), [
    ({"data": {"source": "builtin_photos"}}, "Energon dataset"),
    ({"bridge": None}, "needs a bridge section"),
])
def test_a_bridge_campaign_without_energon_data_or_recipe_is_refused_naming_why(made, changes, field) -> None:
    path = _campaign(made, **changes)
    try:
        with pytest.raises(InputFileError, match=field):
            load_campaign(path)
    finally:
        path.unlink()


def test_the_forward_steps_batches_are_counted_as_useful_tokens_and_their_wait_timed() -> None:
    import torch

    from trainables.bridge.burst import _CountingIterator, _StepCounter

    image = 5
    batches = [{"input_ids": torch.tensor([[1, image, image, 7, 0], [image, 3, 4, 0, 0]]),
                "loss_mask": torch.tensor([[0, 0, 0, 1, 0], [0, 1, 1, 0, 0]])},
               {"tokens": torch.tensor([[image, 2, 2, 2, 2]]), "loss_mask": torch.tensor([[0, 1, 1, 1, 1]])}]
    counter = _StepCounter(image_token_id=image)
    drawn = list(_CountingIterator(iter(batches), counter))
    assert drawn == batches
    counts, wait = counter.take()
    assert (counts.image_tokens, counts.loss_tokens, counts.useful_tokens, counts.samples) == (4, 7, 11, 3)
    assert wait >= 0.0 and counter.take()[0].useful_tokens == 0, "take() starts the next step from zero"
    assert counter.micro_batch_sizes == {2, 1}, "what the MBS evidence is read from"


def _bridge_run(made: dict[str, Path], config: dict, built: object, replays: int = 0):
    """A finished burst's run state as the callback leaves it: the model's config as built, the
    micro-batch sizes drawn and the TE graphs counted."""
    import torch

    from autotune.core.contract import BurstRequest, DataSpec
    from autotune.core.knobs import complete_config
    from trainables.bridge.burst import BridgeRun, _StepCounter
    from trainables.steps import BuildClock
    from trainables.graph_replays import CountedGraph

    config = complete_config(config)
    request = BurstRequest(config=config, model=hf_checkpoint_model(made["checkpoint"], {"seq_length": 1024}),
                           data=DataSpec(str(made["data"])), steps=4, world_size=1, global_batch_size=8)
    counter = _StepCounter(image_token_id=5)
    counter.micro_batch_sizes.add(config.micro_batch_size)
    graph = CountedGraph(lambda: None)
    graph.replays = replays
    return BridgeRun(request=request, device=torch.device("cpu"), rank=0, world_size=1, recipe=None,
                     trial_overrides=[], counter=counter, counts_data=True, computes_loss=True, precision="bf16_mixed",
                     build=BuildClock(torch.device("cpu")),
                     model_config=built, graphs=[graph] if replays else [])


def test_the_evidence_reads_recompute_from_the_model_as_built_and_graphs_from_their_replays(made) -> None:
    from types import SimpleNamespace

    selective = {"micro_batch_size": 4, "recompute_granularity": "selective", "recompute_modules": ["core_attn"]}
    built = SimpleNamespace(recompute_granularity="selective", recompute_modules=["core_attn"])
    held = _bridge_run(made, selective, built).evidence()
    assert held.checks == {"micro_batch_size": True, "recompute_granularity": True, "recompute_modules": True,
                           "cuda_graph_impl": True}
    assert held.model_extra["te_graph_replays"] == 0

    lost = _bridge_run(made, selective, SimpleNamespace(recompute_granularity=None, recompute_modules=None)).evidence()
    assert lost.failed_checks() == ["recompute_granularity", "recompute_modules"], \
        "an override that did not reach the model's layers fails"
    graphed_anyway = _bridge_run(made, {"micro_batch_size": 2}, SimpleNamespace(recompute_granularity=None),
                                 replays=3).evidence()
    assert graphed_anyway.failed_checks() == ["cuda_graph_impl"], "graphs replayed under cuda_graph_impl none fail"
    assert _bridge_run(made, {"micro_batch_size": 2}, None).evidence().checks == {"micro_batch_size": True}, \
        "a model whose config was not seen gives no recompute or graph evidence, rather than a vacuous pass"
