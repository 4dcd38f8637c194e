"""Shared builders for rule contexts and configs, campaigns and Ray clusters."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from autotune.core.contract import StackCapabilities
from autotune.core.knobs import Config, complete_config
from autotune.core.model import model_preset
from autotune.core.registry import trainable_support
from autotune.core.tables import RecordedBurst, append_row
from autotune.engine.records import TrialEntry
from autotune.engine.rundir import RunDir
from autotune.rules import RuleContext
from trainables.probe import probe

ROOT = Path(__file__).resolve().parent.parent
FULL_STACK = {"accelerator": "h200", "megatron_core": "0.19.2", "transformer_engine": "2.10.0", "deep_ep": True, "hybrid_ep": True,
              "imex_channel": True}


def make_context(
    *,
    world_size: int = 8,
    model: str = "h200_small_moe_vlm",
    model_overrides: dict[str, Any] | None = None,
    trainable: str = "megatron",
    global_batch_size: int | None = None,
    gpus_per_node: int | None = None,
    nvlink_domains_labelled: bool | None = None,
    **stack: Any,
) -> RuleContext:
    """A context where only what a test names differs from a full-featured H200 megatron stack."""
    return RuleContext(
        model=model_preset(model, model_overrides),
        world_size=world_size,
        stack=StackCapabilities(**{**FULL_STACK, **stack}),
        trainable=trainable_support(trainable),
        global_batch_size=global_batch_size,
        gpus_per_node=gpus_per_node,
        nvlink_domains_labelled=nvlink_domains_labelled,
    )


def cfg(**values: Any) -> Config:
    return complete_config(values)


@pytest.fixture
def context() -> RuleContext:
    return make_context()


@pytest.fixture(scope="session")
def photo_shards(tmp_path_factory) -> Path:
    """The full built-in photo shards, built once per test session."""
    from trainables.data.shards import build_photo_shards

    folder = tmp_path_factory.mktemp("photos")
    build_photo_shards(folder)
    return folder


# -- a small campaign for the engine's end-to-end tests --------------------------------------------

SPACE = {
    "name": "engine_test",
    "target": {"model": "cpu_tiny_moe_vlm", "trainable": "native", "gpus_per_trial": 2, "stack": {"accelerator": "cpu"}},
    "tune": {"micro_batch_size": [1, 4], "recompute_granularity": ["none", "full"], "expert_model_parallel_size": [1, 2]},
    "fixed": {"moe_token_dispatcher_type": "alltoall", "recompute_method": "uniform", "recompute_num_layers": 1,
              "freeze_vision_model": True},
    "warm_start": [
        {"name": "fast-ep2", "config": {"micro_batch_size": 4, "recompute_granularity": "none", "expert_model_parallel_size": 2}},
        {"name": "bring-up", "config": {"micro_batch_size": 1, "recompute_granularity": "full", "expert_model_parallel_size": 2}},
    ],
}


OOM_SPACE = SPACE | {
    "tune": {"micro_batch_size": [1, 2, 4]},
    "fixed": {"moe_token_dispatcher_type": "alltoall", "freeze_vision_model": True, "recompute_granularity": "none"},
    "warm_start": [{"name": "smallest", "config": {"micro_batch_size": 1}}],
}
"""With a CPU memory cap of 8 MiB even MBS 1 fails to allocate: one real OOM, after which every
larger MBS needs at least its memory and is rejected before launch."""
OOM_CAP_GIB = 8 / 1024


TEST_MODEL = {
    "seq_length": 128, "hidden_size": 128, "ffn_hidden_size": 256, "moe_ffn_hidden_size": 128,
    "moe_shared_expert_intermediate_size": 128, "num_moe_experts": 4,
    "vision": {"hidden_size": 96, "ffn_hidden_size": 384, "num_layers": 2}, "images": {"max_pixels": 112 * 112},
}
"""A smaller cpu_tiny_moe_vlm: a step takes 0.1-0.2 s on two cores. Its sequences hold the photos'
samples whole (at 64 tokens the packer dropped 97 % of them as too long, after decoding their
images: data waits were two thirds of a step)."""

NEXT_SPACE = SPACE | {
    "name": "engine_test_next",
    "reachable": {"model_tflops_per_s_per_gpu": 1e6, "source": "test: far above anything a CPU reaches"},
    "tune": {"micro_batch_size": [4]},
    "fixed": {"moe_token_dispatcher_type": "alltoall", "freeze_vision_model": True, "recompute_granularity": "none",
              "expert_model_parallel_size": 1},
    "warm_start": [],
}
"""A second space for the workflow: its declared reach guarantees the projected headroom is large,
and its one config is the first space's fastest. Screening would prune it if noise put it clearly
below that best, so the campaign that runs both spaces prunes only beyond 70 %, which also keeps the
"fast-ep2" warm start (about 0.8x the fastest) among the configs promoted. The noise is the other
test file running beside this one (``bin/test``: two at a time on two cores): that config screened
15 % apart within one campaign, and at 938 and 2,526 useful tokens/s in two campaigns, the first
beside another test file (2026-12-07). At 40 % a CI run (the same day) missed the next space's
promotion, as a screen of it pruned would."""


def campaign_file(folder: Path, *, max_trials: int, top_k: int = 1, space: dict = SPACE, then_space: dict | None = None,
                  prune_margin: float = 0.15, **hardware) -> Path:
    (folder / "space.yaml").write_text(yaml.safe_dump(space))
    campaign = {
        "name": "engine-test",
        "trainable": "native",
        "space": str(folder / "space.yaml"),
        "model": {"preset": "cpu_tiny_moe_vlm", "overrides": TEST_MODEL},
        # The test spaces fix a frozen ViT: a decoder-centric workload (one micro-batch per step).
        "workload": {"frozen": ["vision_model"]},
        "hardware": {"accelerator": "cpu", "gpus_per_node": 2, "gpus_per_trial": 2, "data_workers": 0, **hardware},
        "budget": {"max_trials": max_trials},
        # Prune only what is clearly worse (by default 15 % below the best's lower bound). On this
        # model the configs the tests name run far apart (2 gloo ranks, this box): against MBS 4, no
        # recompute, EP 1, the "fast-ep2" warm start (EP 2) runs at about 0.8x, MBS 4 with full
        # recompute at EP 2 about 0.5x, the "bring-up" warm start (MBS 1, full, EP 2) about 0.2x.
        "stages": {"warmup_steps": 1, "screen_steps": 16, "promote_top_k": top_k, "promote_steps": 50,
                   "target_relative_half_width": 0.01, "prune_margin": prune_margin},
        # Seeded random proposals for the first 4 trials (warm starts included): the same configs every run.
        "search": {"seed": 0, "startup_trials": 4},
        "output_dir": str(folder / "runs"),
    }
    if then_space is not None:
        (folder / "then.yaml").write_text(yaml.safe_dump(then_space))
        campaign["workflow"] = {"then_space": "then.yaml", "min_headroom": 0.1}
    path = folder / "campaign.yaml"
    path.write_text(yaml.safe_dump(campaign))
    return path


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def multi_node_cluster(**head_args: Any):
    """A ``ray.cluster_utils`` cluster (its head started) whose dashboard has a port of its own:
    Ray Train's placement-group cleaner asks the state API, served by the dashboard, whether its
    controller still lives, and two heads started side by side (``bin/test`` runs tests two at a
    time) both take 8265, leaving one without a dashboard. A controller that then dies instead of
    ending keeps its worker group's placement group, and the next trial waits on it until the hang
    watchdog (seen: a promotion stuck over 8 minutes)."""
    from ray.cluster_utils import Cluster

    return Cluster(initialize_head=True, head_node_args={"dashboard_port": free_port(), **head_args})


def join_cluster(address: str, runtime_env: dict | None = None) -> None:
    """Connect this process to the cluster at ``address``, its tasks and actors told that address:
    Ray code in them that looks for "the" cluster of this machine (the state API, from Ray Train's
    placement-group cleaner) takes the latest one started, another test's when tests run side by side."""
    import ray

    runtime_env = dict(runtime_env or {})
    runtime_env["env_vars"] = {**runtime_env.get("env_vars", {}), "RAY_ADDRESS": address}
    ray.init(address=address, log_to_driver=False, configure_logging=False, runtime_env=runtime_env)


@pytest.fixture(scope="session")
def cache_env(tmp_path_factory) -> dict[str, str]:
    return {**os.environ, "AUTOTUNE_CACHE": str(tmp_path_factory.mktemp("cache")), "RAY_ADDRESS": ""}


def autotune(*args: str, env: dict[str, str], timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "autotune", *args], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=ROOT)


def only_run_dir(folder: Path) -> Path:
    (run_dir,) = (folder / "runs").iterdir()
    return run_dir


def entries(run_dir: Path) -> list[TrialEntry]:
    return list(RunDir(run_dir).trials.read())


@pytest.fixture(scope="session")
def campaign_run(tmp_path_factory, cache_env) -> tuple[Path, subprocess.CompletedProcess]:
    """One real campaign (native trainable, two gloo ranks a trial, both spaces of the workflow),
    shared by the engine's and the report's tests."""
    folder = tmp_path_factory.mktemp("campaign")
    result = autotune("run", str(campaign_file(folder, max_trials=4, top_k=2, then_space=NEXT_SPACE, prune_margin=0.7)), env=cache_env,
                      timeout=900)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    return only_run_dir(folder), result


# -- a small recorded table for replay campaigns -----------------------------------------------------

REPLAY_SPACE = {
    "name": "replay_small",
    "description": "MBS x frozen vision, native trainable on two CPU ranks",
    "target": {"model": "cpu_tiny_moe_vlm", "trainable": "native", "gpus_per_trial": 2, "stack": {"accelerator": "cpu"}},
    "tune": {"micro_batch_size": [1, 2, 4, 8], "freeze_vision_model": [False, True]},
    "fixed": {"moe_token_dispatcher_type": "alltoall"},
}
STARTUP = 10.0
STEADY = [1.00, 1.03, 0.97, 1.01, 0.99, 1.02, 0.98, 1.00, 1.01, 0.99, 1.00, 1.02]


def recorded(config: dict, campaign: Path, stack: dict) -> RecordedBurst:
    """Tokens grow with MBS and freezing saves a little; MBS 8 runs out of memory at its first step."""
    mbs, frozen = config["micro_batch_size"], config["freeze_vision_model"]
    contract = {"world_size": 2, "campaign": str(campaign), "stack": stack}
    if mbs == 8:
        return RecordedBurst(config=config, outcome="oom", step_seconds=[], useful_tokens_per_step=0,
                             peak_memory_gib=None, startup_seconds=STARTUP, error="OutOfMemoryError", contract=contract)
    seconds = [3.0 * s * (0.9 if frozen else 1.0) for s in [2.0] + STEADY]
    return RecordedBurst(config=config, outcome="ok", step_seconds=seconds, useful_tokens_per_step=1000 * mbs,
                         peak_memory_gib=1.0 * mbs, startup_seconds=STARTUP, error=None, contract=contract)


@pytest.fixture
def small_table(tmp_path: Path) -> Path:
    campaign = campaign_file(tmp_path, max_trials=4, space=REPLAY_SPACE)
    stack = probe()
    path = tmp_path / "table.jsonl"
    for mbs in (1, 2, 4, 8):
        for frozen in (False, True):
            config = complete_config({"micro_batch_size": mbs, "freeze_vision_model": frozen,
                                      "moe_token_dispatcher_type": "alltoall"}).to_plain()
            append_row(path, recorded(config, campaign, stack))
    return path


@pytest.fixture
def ray_local():
    """A new cluster of its own: a bare ``ray.init()`` joins the last one started on this machine,
    another test's when tests run side by side."""
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()
