"""The search benchmark on a small recorded table: the campaign engine replays it on Ray Tune with
recorded costs, and the baselines and the grid are charged exactly what the table says."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autotune.core.knobs import complete_config
from autotune.core.tables import TableError, append_row, load_table
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
    assert replayer.burst(rejected, 8, new_rank_processes=False) == (2 * STARTUP, None, "invalid")
    assert rejected not in replayer.truth.rates and max(map(replayer.ratio, replayer.truth.rates)) == 1.0


def test_the_grid_is_charged_every_screen_and_one_promotion(small_table: Path) -> None:
    table = load_table(small_table)
    campaign = replay_campaign(table, 0, small_table.parent / "runs")
    replayer = Replayer(campaign, table, truth(campaign, table), 0)
    best = max(replayer.truth.rates, key=replayer.ratio)
    assert (best.micro_batch_size, best.freeze_vision_model) == (4, True) and replayer.ratio(best) == 1.0
    stages = campaign.spec.stages
    screens = sum(replayer.burst(config, stages.screen_steps, new_rank_processes=False)[0] for config in table.rows)
    grid = run_grid(replayer)
    assert grid.spent == pytest.approx(screens + replayer.burst(best, stages.promote_steps, new_rank_processes=True)[0])
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


def test_the_engine_charges_kept_ranks_to_screens_after_a_healthy_one(small_table: Path, tmp_path: Path,
                                                                      ray_local) -> None:
    """Tune runs a slot's trials one after another in one trial process, as the zygote keeps a
    slot's ranks: the engine's replays after a healthy trial are charged the kept burst, its
    promotions new rank processes, and a screen after an out of memory new ones too."""
    kept = tmp_path / "kept.jsonl"
    for row in load_table(small_table).rows.values():
        append_row(kept, row.model_copy(update={"warm_startup_seconds": 0.5, "kept_startup_seconds": 0.1,
                                                "kept_first_step_seconds": 1.5 if row.step_seconds else None}))
    table = load_table(kept)
    campaign = replay_campaign(table, 0, tmp_path / "runs")
    run_autotune(campaign, truth(campaign, table))
    lines = next((tmp_path / "runs").iterdir()).joinpath("trials.jsonl").read_text().splitlines()
    starts = [(entry["stage"], entry["outcome"], entry["rank_start"]) for entry in map(json.loads, lines)
              if entry["launched"]]
    assert starts[0][2] == "warm"  # the campaign's first trial: no rank kept for it yet
    assert ("screen", "ok", "kept") in starts and all(start is not None for *_, start in starts), starts
    assert all(start == "warm" for stage, outcome, start in starts if stage == "promote"), starts
    assert any(outcome == "oom" for _, outcome, _ in starts), starts
    for before, after in zip(starts, starts[1:]):
        if before[1] == "oom":
            assert after[2] == "warm", starts


def test_a_table_with_warm_start_up_is_charged_it_unless_cold_is_asked(small_table: Path, tmp_path: Path) -> None:
    """Every method pays one start-up: the warm one (0.5 s, ranks forked from a running zygote) where
    every row recorded it; the two out-of-memory rows cost only their start-up, on two devices."""
    warm = tmp_path / "warm.jsonl"
    for row in load_table(small_table).rows.values():
        append_row(warm, row.model_copy(update={"warm_startup_seconds": 0.5}))
    table = load_table(warm)
    for start, startup in (("warm", 0.5), ("cold", STARTUP)):
        campaign = replay_campaign(table, 0, tmp_path / "runs", start=start)
        assert campaign.replay_start == start
        assert run_grid(Replayer(campaign, table, truth(campaign, table), 0)).wasted == pytest.approx(2 * 2 * startup)
    cold_only = load_table(small_table)
    assert replay_campaign(cold_only, 0, tmp_path / "runs", start="warm").replay_start == "cold"


def test_screens_after_a_healthy_one_are_charged_the_kept_ranks_start_up_and_first_step(small_table: Path,
                                                                                          tmp_path: Path) -> None:
    """Where every row recorded a burst in kept ranks, every method's screen after a healthy one pays
    what that burst paid (0.1 s of start-up and a first step of 1.5 s, against 0.5 s and 5.4–6 s in new
    rank processes); the first screen and the promotion start new ones, and so does a screen after an
    out of memory."""
    warm, kept = tmp_path / "warm.jsonl", tmp_path / "kept.jsonl"
    for row in load_table(small_table).rows.values():
        append_row(warm, row.model_copy(update={"warm_startup_seconds": 0.5}))
        append_row(kept, row.model_copy(update={"warm_startup_seconds": 0.5, "kept_startup_seconds": 0.1,
                                                "kept_first_step_seconds": 1.5 if row.step_seconds else None}))
    grids = {}
    for path in (warm, kept):
        table = load_table(path)
        campaign = replay_campaign(table, 0, tmp_path / "runs")
        grids[path] = run_grid(Replayer(campaign, table, truth(campaign, table), 0))
    table = load_table(kept)
    saved, healthy_before = 0.0, False
    for config in replay_campaign(table, 0, tmp_path / "runs").space.configs():  # the grid's order
        row = table.row(config)
        if healthy_before:  # two devices each
            saved += 2 * (0.5 - 0.1) + (2 * (row.step_seconds[0] - 1.5) if row.step_seconds else 0.0)
        healthy_before = row.outcome == "ok"
    assert saved > 0 and grids[warm].spent - grids[kept].spent == pytest.approx(saved)


def test_a_cpu_table_replays_with_the_counted_device_memory_its_rows_ran_with(small_table: Path, tmp_path: Path) -> None:
    counted = tmp_path / "counted.jsonl"
    for row in load_table(small_table).rows.values():
        hardware = {"accelerator": "cpu", "world_size": 2, "counted_memory_bytes": 3 * 2**30}
        append_row(counted, row.model_copy(update={"contract": row.contract | {"hardware": hardware}}))
    campaign = replay_campaign(load_table(counted), 0, tmp_path / "runs")
    assert campaign.spec.hardware.cpu_device_memory_bytes == 3 * 2**30
    assert replay_campaign(load_table(small_table), 0, tmp_path / "runs").spec.hardware.cpu_device_memory_gib is None
    with counted.open("a") as file:  # one more row, run with another memory: the table is ambiguous
        row = next(iter(load_table(small_table).rows.values()))
        other = {"accelerator": "cpu", "world_size": 2, "counted_memory_bytes": 2**30}
        file.write(row.model_copy(update={"config": {**row.config, "micro_batch_size": 16},
                                          "contract": row.contract | {"hardware": other}}).model_dump_json() + "\n")
    with pytest.raises(TableError, match="different counted device memories"):
        replay_campaign(load_table(counted), 0, tmp_path / "runs")
