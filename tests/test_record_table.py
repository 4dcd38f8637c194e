"""``bench/record_table.py`` on the CPU: a table recorded over two calls, as over two device sessions,
with the table's anchor run again at the start of the second, then a long run of its fastest config."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from autotune.core.tables import anchors_path, load_anchors, load_table
from conftest import SPACE, campaign_file

ROOT = Path(__file__).resolve().parent.parent

TWO_CONFIGS = SPACE | {
    "tune": {"micro_batch_size": [1, 2]},
    "fixed": {"moe_token_dispatcher_type": "alltoall", "recompute_granularity": "none", "freeze_vision_model": True},
    "warm_start": [],
}


def record(campaign: Path, table: Path) -> str:
    done = subprocess.run([sys.executable, "bench/record_table.py", "--campaign", str(campaign), "--steps", "8",
                           "--limit", "1", "--order", "config", "--out", str(table)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_a_session_that_adds_rows_first_runs_the_anchor_again_and_long_runs_take_the_fastest_configs_first(tmp_path: Path) -> None:
    campaign = campaign_file(tmp_path, max_trials=2, space=TWO_CONFIGS)
    table = tmp_path / "table.jsonl"
    record(campaign, table)
    assert not anchors_path(table).exists()  # the first session's first row is the anchor itself
    [(anchor, first)] = load_table(table).rows.items()
    assert first.outcome == "ok" and first.contract["stack"]["host_cpu"]

    printed = record(campaign, table)
    assert len(load_table(table).rows) == 2
    [again] = load_anchors(table)
    assert again.config == first.config and again.outcome == "ok" and again.steady is not None
    assert again.contract["recorded_at"] >= first.contract["recorded_at"] and again.contract["stack"]["host_cpu"]
    assert f"anchor {anchor.describe()}:" in printed

    # Long runs for the fidelity benchmark: the configs that ran fastest first, and no kept pass after them.
    long = tmp_path / "long.jsonl"
    done = subprocess.run([sys.executable, "bench/record_table.py", "--campaign", str(campaign), "--steps", "10",
                           "--limit", "1", "--ok-in", str(table), "--order", "best", "--out", str(long)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = load_table(table).rows
    fastest = max((config for config, row in rows.items() if row.steady is not None), key=lambda c: rows[c].steady.mean)
    [(config, row)] = load_table(long).rows.items()
    assert config == fastest and len(row.step_seconds) == 10
    assert row.data_wait_seconds is not None and len(row.data_wait_seconds) == 10
    assert all(0 <= wait < step for wait, step in zip(row.data_wait_seconds, row.step_seconds))
    assert row.sm_clock_mhz == [None] * 10 and row.clock_held_by == [[]] * 10  # a CPU step reads no GPU clock
    assert row.kept_startup_seconds is None and any(row.kept_startup_seconds is not None for row in rows.values())
