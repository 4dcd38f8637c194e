"""Recorded tables and the replay trainable: a table is read strictly, a replay serves what was
recorded (warm-up as recorded, the recorded steady steps shuffled, each once before any again,
outcomes as recorded) and its recorded seconds, not the wall clock, are what the ledger charges."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from autotune.campaign import load_campaign
from autotune.core.contract import BurstRequest, BurstResult, Contract, DataSpec, Evidence, StepRecord, StepReport
from autotune.core.knobs import complete_config
from autotune.core.model import model_preset
from autotune.core.steady import steady_state
from autotune.core.tables import RecordedBurst, TableError, anchors_path, append_row, load_table
from autotune.engine.ledger import Ledger
from autotune.engine.records import Launch, spend
from autotune.engine.rundir import create_run_dir
from autotune.engine.trial import end_result, step_result
from autotune.space import load_space
from conftest import campaign_file
from trainables.replay.burst import run_replay, warmup_steps

CPU_DEMO = load_space(Path("search_spaces/cpu_demo.yaml"))
WARMUP = [3.0, 1.5]
STEADY = [1.00, 1.02, 0.98, 1.01, 0.99, 1.03, 0.97, 1.00]
DISTINCT = [1.00, 1.05, 0.98, 1.03, 0.99, 1.04, 0.97, 1.02, 1.01, 0.96]
"""Ten steady steps, no two alike (as measured step times are)."""


def row(outcome: str = "ok", steps: list[float] | None = None, **config) -> RecordedBurst:
    steps = WARMUP + STEADY if steps is None else steps
    return RecordedBurst(
        config=complete_config(config).to_plain(), outcome=outcome, step_seconds=steps,
        useful_tokens_per_step=1000, peak_memory_gib=2.5 if steps else None, startup_seconds=12.0,
        error=None if outcome == "ok" else "OutOfMemoryError: out of memory", contract={"world_size": 2},
    )


def table(tmp_path: Path, *rows: RecordedBurst) -> Path:
    path = tmp_path / "table.jsonl"
    for recorded in rows:
        append_row(path, recorded)
    return path


def request(path: Path, steps: int, seed: int = 0, **config) -> BurstRequest:
    return BurstRequest(config=complete_config(config), model=model_preset("cpu_tiny_moe_vlm"),
                        data=DataSpec("unused"), steps=steps, world_size=2, seed=seed, replay_table=str(path))


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "table.jsonl:2: not a JSON object"),
        (json.dumps({"outcome": "ok"}), "table.jsonl:2: config: Field required"),
        (row().model_dump_json().replace('"ok"', '"great"'), "table.jsonl:2: outcome: Input should be"),
        (row(micro_batch_size=2).model_dump_json().replace("micro_batch_size", "micro_batch"),
         "table.jsonl:2: config.micro_batch: unknown knob"),
        (row().model_dump_json(), "table.jsonl:2: defaults is recorded twice"),
        (row(micro_batch_size=4).model_dump_json().replace('{"world_size":2}', "{}"),
         "table.jsonl:2: contract.world_size: missing"),
    ],
    ids=["json", "missing-field", "bad-outcome", "unknown-knob", "duplicate", "no-world-size"],
)
def test_a_bad_line_is_an_error_naming_the_file_line_and_field(tmp_path, line: str, message: str) -> None:
    path = table(tmp_path, row())
    with path.open("a") as file:
        file.write(line + "\n")
    with pytest.raises(TableError) as info:
        load_table(path)
    assert message in str(info.value)


def test_a_space_config_the_table_lacks_is_an_error(tmp_path) -> None:
    recorded = load_table(table(tmp_path, row(moe_token_dispatcher_type="alltoall")))
    with pytest.raises(TableError, match=f"{CPU_DEMO.size() - 1} of the {CPU_DEMO.size()} configs"):
        recorded.require_complete(CPU_DEMO)


def test_replay_keeps_the_warmup_and_draws_steady_steps_from_the_recorded_ones(tmp_path) -> None:
    path = table(tmp_path, row())
    assert warmup_steps(load_table(path).row(complete_config({}))) == len(WARMUP)
    result = run_replay(request(path, 40))
    seconds = [record.step_seconds for record in result.records]
    assert result.outcome == "ok" and len(seconds) == 40
    assert seconds[:2] == WARMUP and set(seconds[2:]) <= set(STEADY) and len(set(seconds[2:])) > 3
    assert result.elapsed_seconds == pytest.approx(12.0 + sum(seconds))
    assert all(record.useful_tokens == 1000 for record in result.records)
    # Seeded: the same request replays identically; another seed or length draws differently.
    assert run_replay(request(path, 40)).records == result.records
    assert [r.step_seconds for r in run_replay(request(path, 40, seed=1)).records] != seconds
    assert [r.step_seconds for r in run_replay(request(path, 41)).records][:40] != seconds


def test_a_replay_reports_each_recorded_steady_step_once_before_any_again(tmp_path) -> None:
    path = table(tmp_path, row(steps=WARMUP + DISTINCT))
    assert warmup_steps(load_table(path).row(complete_config({}))) == len(WARMUP)
    for seed in range(20):  # an 8-step screen: 6 steady steps, all different
        screen = [r.step_seconds for r in run_replay(request(path, 8, seed=seed)).records]
        assert screen[:2] == WARMUP and len(set(screen[2:])) == 6
    # Longer than the recording: every recorded steady step once a pass, in a fresh order each pass.
    steady = [r.step_seconds for r in run_replay(request(path, 2 + 25)).records][2:]
    assert sorted(steady[:10]) == sorted(steady[10:20]) == sorted(DISTINCT) and set(steady[20:]) <= set(DISTINCT)
    assert len(set(steady[20:])) == 5 and steady[:10] != steady[10:20]


def test_no_replayed_screen_has_a_steady_interval_of_no_width(tmp_path) -> None:
    path = table(tmp_path, row(steps=WARMUP + DISTINCT))
    for seed in range(500):
        tokens_per_second = [r.tokens_per_second for r in run_replay(request(path, 8, seed=seed)).records]
        estimate = steady_state(tokens_per_second, min_warmup=2)
        assert estimate.ci_low < estimate.ci_high, seed


def test_replay_ends_as_recorded_and_stops_when_told(tmp_path) -> None:
    path = table(tmp_path, row(), row("oom", [2.0], micro_batch_size=8))
    oom = run_replay(request(path, 10, micro_batch_size=8))
    assert (oom.outcome, len(oom.records), oom.elapsed_seconds) == ("oom", 1, 14.0)
    assert "out of memory" in oom.error and oom.contract is None
    reports: list[StepReport] = []
    stopped = run_replay(request(path, 10), lambda report: reports.append(report) or len(reports) < 3)
    assert stopped.outcome == "pruned" and len(stopped.records) == 3
    assert [r.elapsed_seconds for r in reports] == pytest.approx([15.0, 16.5, 16.5 + stopped.records[2].step_seconds])
    # A replay measured nothing: its contract names the table and carries the recorded contract.
    assert reports[0].contract == Contract(trainable="replay", replayed_from=str(path), recorded={"world_size": 2},
                                           rank_start="cold")
    assert reports[1].contract is None and stopped.contract == reports[0].contract
    assert all(report.evidence.is_empty() for report in reports) and stopped.evidence.is_empty()


def test_a_replay_charges_the_warm_start_up_where_every_row_recorded_it(tmp_path) -> None:
    """Campaigns fork their trials' ranks from warm zygotes: a replay charges what that start cost
    where the table measured it, the cold start where asked, and the cold one for a whole table
    where any row lacks the warm one (one table, one start-up)."""
    warm = [row(micro_batch_size=mbs).model_copy(update={"warm_startup_seconds": 0.5}) for mbs in (1, 2)]
    path = table(tmp_path, *warm)
    assert load_table(path).charged_start == "warm"
    replayed = run_replay(request(path, 4, micro_batch_size=2))
    steps = sum(record.step_seconds for record in replayed.records)
    assert replayed.contract.rank_start == "warm" and replayed.elapsed_seconds == pytest.approx(0.5 + steps)
    cold = run_replay(replace(request(path, 4, micro_batch_size=2), replay_start="cold"))
    assert cold.contract.rank_start == "cold" and cold.elapsed_seconds == pytest.approx(12.0 + steps)
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    path = table(mixed, warm[0], row(micro_batch_size=2))
    assert load_table(path).charged_start == "cold"
    replayed = run_replay(request(path, 4, micro_batch_size=2))
    assert replayed.contract.rank_start == "cold" and replayed.elapsed_seconds == pytest.approx(12.0 + steps)
    with pytest.raises(TableError, match="no warm start-up"):
        load_table(path).row(complete_config({"micro_batch_size": 2})).startup("warm")


def test_a_replay_after_a_healthy_one_charges_what_kept_ranks_paid(tmp_path) -> None:
    """A Tune trial process runs its slot's trials one after another, as the node's zygote keeps a
    slot's ranks: after a healthy replay the next one charges the kept burst's start-up and first
    step, where every row recorded them; never after an out of memory (its ranks are replaced), for
    new rank processes (a promotion), nor from a table where a row lacks them."""
    kept = {"warm_startup_seconds": 0.5, "kept_startup_seconds": 0.2, "kept_first_step_seconds": 1.25}
    oom = row("oom", [2.0], micro_batch_size=8).model_copy(update={"warm_startup_seconds": 0.5,
                                                                   "kept_startup_seconds": 0.3})
    unknown = row("oom", [2.0], micro_batch_size=16).model_copy(update={"warm_startup_seconds": 0.5})
    path = table(tmp_path, *[row(micro_batch_size=mbs).model_copy(update=kept) for mbs in (1, 2)], oom, unknown)
    assert load_table(path).kept_recorded

    def elapsed(result: BurstResult) -> float:
        return result.elapsed_seconds - sum(record.step_seconds for record in result.records)

    first = run_replay(request(path, 4, micro_batch_size=1))
    assert first.contract.rank_start == "warm" and first.records[0].step_seconds == WARMUP[0]
    after_healthy = run_replay(request(path, 4, micro_batch_size=2))
    assert after_healthy.contract.rank_start == "kept" and elapsed(after_healthy) == pytest.approx(0.2)
    assert [r.step_seconds for r in after_healthy.records[:2]] == [1.25, WARMUP[1]]
    out_of_memory = run_replay(request(path, 4, micro_batch_size=8))  # kept, and no step of its own there
    assert out_of_memory.outcome == "oom" and out_of_memory.elapsed_seconds == pytest.approx(0.3 + 2.0)
    assert out_of_memory.contract is None and out_of_memory.rank_start == "kept"
    run_replay(request(path, 4, micro_batch_size=1))
    unknown = run_replay(request(path, 4, micro_batch_size=16))  # its kept burst could not tell: warm
    assert unknown.outcome == "oom" and unknown.elapsed_seconds == pytest.approx(0.5 + 2.0)
    after_oom = run_replay(request(path, 4, micro_batch_size=1))
    assert after_oom.contract.rank_start == "warm" and elapsed(after_oom) == pytest.approx(0.5)
    promoted = run_replay(replace(request(path, 4, micro_batch_size=2), new_rank_processes=True))
    assert promoted.contract.rank_start == "warm" and promoted.records[0].step_seconds == WARMUP[0]
    assert run_replay(request(path, 4, micro_batch_size=2)).contract.rank_start == "kept"
    partial = tmp_path / "partial"
    partial.mkdir()
    path = table(partial, row(micro_batch_size=1).model_copy(update=kept),
                 row(micro_batch_size=2).model_copy(update={"warm_startup_seconds": 0.5}))
    assert not load_table(path).kept_recorded
    run_replay(request(path, 4, micro_batch_size=1))
    assert run_replay(request(path, 4, micro_batch_size=1)).contract.rank_start == "warm"
    with pytest.raises(TableError, match="no kept start-up"):
        load_table(path).row(complete_config({"micro_batch_size": 2})).startup("kept")


def test_the_ledger_charges_replayed_seconds_not_its_clock(tmp_path) -> None:
    campaign = load_campaign(campaign_file(tmp_path, max_trials=1))
    ledger = Ledger(create_run_dir(campaign, tmp_path / "runs"), world_size=2, warmup_steps=1,
                    target_relative_half_width=0.02, benchmark_only=False)
    config = complete_config({})
    ledger.start("t1", Launch(stage="screen", space=campaign.space.name, config=config, origin="sampler", number=0))
    record = StepRecord(step=0, step_seconds=1.0, data_wait_seconds=0.0, vision_seconds=0.0, projector_seconds=0.0,
                        decoder_seconds=0.0, useful_tokens=1000, image_tokens=0, loss_tokens=0, samples=0,
                        model_flops=0.0, peak_memory_bytes=0, loss=0.0)
    for step in range(6):
        report = StepReport(replace(record, step=step), Evidence(), elapsed_seconds=100.0 + step)
        ledger.record("t1", step_result(report, campaign.spec.objective, 2))
    assert ledger.device_seconds() == pytest.approx(2 * 105.0)
    ledger.record("t1", end_result(BurstResult("ok", elapsed_seconds=130.0)))
    entry = ledger.finish("t1", errored=False)
    assert entry.device_seconds == pytest.approx(260.0)
    assert entry.wall_seconds < 60.0
    assert entry.training_device_seconds == pytest.approx(2 * 6 * 1.0)  # the rest was the recorded start-up
    assert spend([entry]).outside_steps == pytest.approx(248.0)
    assert entry.outside_steps is None  # recorded seconds have no parts timed here


def test_a_table_summary_ranks_what_ran_per_device_and_says_once_what_every_row_sets(tmp_path) -> None:
    """``bench/table_summary.py``, which the README quotes tables from: each row's steady rate per
    device (the search benchmark's estimator), fastest first, the rows that did not run last with
    why, and the knobs every row sets alike said once instead of in every row."""
    import subprocess
    import sys

    def on(device_uuid: str) -> dict:
        return {"world_size": 2, "stack": {"device_name": "NVIDIA H100 80GB HBM3", "device_uuid": device_uuid,
                                           "host_cpu": "Xeon, 16 cores"}}

    path = table(tmp_path, row(steps=[2.0] * 10, micro_batch_size=2, freeze_vision_model=True).model_copy(
                     update={"contract": on("GPU-1")}),
                 row("oom", [], micro_batch_size=4, freeze_vision_model=True).model_copy(update={"contract": on("GPU-2")}),
                 row(micro_batch_size=1, freeze_vision_model=True))
    # The anchor (the first row that ran ok) run again on a third machine, at half its row's speed.
    append_row(anchors_path(path), row(steps=[4.0] * 10, micro_batch_size=2, freeze_vision_model=True).model_copy(
        update={"contract": on("GPU-3")}))
    out = tmp_path / "summary.json"
    subprocess.run([sys.executable, "bench/table_summary.py", "--table", str(path), "--out", str(out)],
                   check=True, capture_output=True, cwd=Path(__file__).resolve().parent.parent)
    summary = json.loads(out.read_text())
    rows = summary["summaries"]
    assert summary["every_row"] == "freeze_vision_model=true" and summary["outcomes"] == {"ok": 2, "oom": 1}
    assert [(r["varied"], r["outcome"]) for r in rows] == [("micro_batch_size=1", "ok"), ("micro_batch_size=2", "ok"),
                                                          ("micro_batch_size=4", "oom")]
    assert rows[0]["tokens_per_second"] == pytest.approx(steady_state([1000 / s for s in WARMUP + STEADY],
                                                                      min_warmup=1).mean / 2)
    assert rows[1]["tokens_per_second"] == pytest.approx(250.0)  # 1,000 tokens in 2 s, on 2 devices
    assert rows[2]["tokens_per_second"] is None and rows[2]["error"] == "OutOfMemoryError: out of memory"
    # Which machine each row ran on, where it says (a row recorded before 2026-12-07 does not).
    assert [r["machine"] for r in rows] == [None, "NVIDIA H100 80GB HBM3 GPU-1 on Xeon, 16 cores",
                                            "NVIDIA H100 80GB HBM3 GPU-2 on Xeon, 16 cores"]
    assert len(summary["machines"]) == 2 and summary["rows_without_machine"] == 1
    [anchor] = summary["anchors"]
    assert anchor["config"] == rows[1]["config"] and anchor["machine"].startswith("NVIDIA H100 80GB HBM3 GPU-3")
    assert anchor["over_its_row"] == pytest.approx(0.5)
