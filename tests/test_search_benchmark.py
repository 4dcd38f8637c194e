"""The search benchmark on a small recorded table: the campaign engine replays it on Ray Tune with
recorded costs, and the baselines and the grid are charged exactly what the table says."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autotune.core.knobs import complete_config
from autotune.core.tables import append_row, load_table
from autotune.search_benchmark import REACH, Replayer, replay_campaign, run_autotune, run_grid, run_random, truth
from conftest import REPLAY_SPACE as SPACE
from conftest import STARTUP, campaign_file, recorded
from trainables.probe import probe


def test_a_config_megatron_rejects_is_charged_its_start_up_and_never_best(tmp_path: Path) -> None:
    """Torch FSDP2 with EP 2 ran on the native trainable, fastest of all; Megatron-LM rejects it."""
    space = {**SPACE, "tune": {"micro_batch_size": [1, 2], "expert_model_parallel_size": [1, 2],
                               "use_torch_fsdp2": [False, True]}}
    campaign, stack, path = campaign_file(tmp_path, max_trials=4, space=space), probe(), tmp_path / "table.jsonl"
    for mbs in (1, 2):
        for ep in (1, 2):
            for fsdp2 in (False, True):
                config = complete_config({"micro_batch_size": mbs, "expert_model_parallel_size": ep,
                                          "use_torch_fsdp2": fsdp2, "moe_token_dispatcher_type": "alltoall"})
                row = recorded({**config.to_plain(), "freeze_vision_model": False}, campaign, stack)
                faster = [s / 3 for s in row.step_seconds] if ep == 2 and fsdp2 else row.step_seconds
                append_row(path, row.model_copy(update={"config": config.to_plain(), "step_seconds": faster}))
    table = load_table(path)
    campaign = replay_campaign(table, 0, tmp_path / "runs")
    replayer = Replayer(campaign, table, truth(campaign, table), 0)
    rejected = complete_config({"micro_batch_size": 2, "expert_model_parallel_size": 2, "use_torch_fsdp2": True,
                                "moe_token_dispatcher_type": "alltoall"})
    assert replayer.burst(rejected, 8) == (2 * STARTUP, None, "invalid")
    assert rejected not in replayer.truth.rates and max(map(replayer.ratio, replayer.truth.rates)) == 1.0


def test_the_grid_is_charged_every_screen_and_one_promotion(small_table: Path) -> None:
    table = load_table(small_table)
    campaign = replay_campaign(table, 0, small_table.parent / "runs")
    replayer = Replayer(campaign, table, truth(campaign, table), 0)
    best = max(replayer.truth.rates, key=replayer.ratio)
    assert (best.micro_batch_size, best.freeze_vision_model) == (4, True) and replayer.ratio(best) == 1.0
    stages = campaign.spec.stages
    screens = sum(replayer.burst(config, stages.screen_steps)[0] for config in table.rows)
    grid = run_grid(replayer)
    assert grid.spent == pytest.approx(screens + replayer.burst(best, stages.promote_steps)[0])
    # Two out-of-memory rows: start-up of two devices each is all they cost, and it is waste.
    assert grid.wasted == pytest.approx(2 * 2 * STARTUP)
    # Random order reaches the best once it has screened it, and pays its promotion then.
    walk = run_random(replayer, seed=3, budget=grid.spent)
    assert walk.reached_at is not None and walk.reached_at <= grid.spent
    assert walk.timeline[-1][1] == pytest.approx(1.0)


def test_the_engine_replays_the_table_charging_recorded_seconds(small_table: Path, ray_local, monkeypatch) -> None:
    monkeypatch.chdir(small_table.parent)
    table = load_table(Path(small_table.name))  # a relative path, as users give it; trials run elsewhere
    campaign = replay_campaign(table, 0, small_table.parent / "runs")
    trace = run_autotune(campaign, truth(campaign, table))
    run_dir = next((small_table.parent / "runs").iterdir())
    entries = [json.loads(line) for line in (run_dir / "trials.jsonl").read_text().splitlines()]
    launched = [entry for entry in entries if entry["launched"]]
    assert launched and trace.spent == pytest.approx(sum(entry["device_seconds"] for entry in entries))
    for entry in launched:
        row = table.row(complete_config(entry["config"]))
        if entry["outcome"] == "oom":
            assert entry["device_seconds"] == pytest.approx(2 * row.cost_seconds)
        # Replayed time is charged, not the seconds the replay took.
        assert entry["device_seconds"] >= 2 * STARTUP > entry["wall_seconds"]  # an OOM: its start-up only
    assert trace.reached_at is not None and trace.timeline[-1][1] >= REACH
