"""What clusters do at night, and the campaign going on without losing what it finished: an output
directory that cannot be written stops a campaign before any trial, and a disk that fills up
mid-campaign stops it cleanly with every line written before intact."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import subprocess
import sys
from io import StringIO
from pathlib import Path

import pytest
from rich.console import Console

from autotune.engine.driver import run_campaign
from autotune.engine.live import LiveView
from autotune.engine.rundir import TRIALS_FILE, create_run_dir
from autotune.errors import AutotuneError
from autotune.search_benchmark import replay_campaign
from autotune.tables import load_table
from conftest import campaign_file

ROOT = Path(__file__).resolve().parent.parent


def test_an_output_directory_that_cannot_be_written_stops_the_campaign_before_any_trial(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the output directory should go")
    result = subprocess.run(
        [sys.executable, "-m", "autotune", "run", str(campaign_file(tmp_path, max_trials=2)),
         "--output-dir", str(blocker / "runs")],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert "cannot write the run directory" in result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    assert "outputs in" not in result.stdout  # nothing started


def test_a_disk_that_fills_up_mid_campaign_stops_it_cleanly(small_table: Path, ray_local, monkeypatch) -> None:
    """The disk refuses the third trial line at fsync (a test double of the system call; the
    append, its roll-back and the campaign's stop are the real code): the campaign stops with a
    clear error, the two lines before are whole, and the refused line left nothing behind."""
    synced = os.fsync

    def full_disk_for_the_third_trial(fd: int) -> None:
        path = Path(os.readlink(f"/proc/self/fd/{fd}"))
        if path.name == TRIALS_FILE and path.read_text().count("\n") >= 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        synced(fd)

    monkeypatch.setattr(os, "fsync", full_disk_for_the_third_trial)
    table = load_table(small_table)
    campaign = replay_campaign(table, 0, small_table.parent / "runs")
    run_dir = create_run_dir(campaign)
    with pytest.raises(AutotuneError) as stopped:
        with LiveView(Console(file=StringIO()), campaign.space, campaign.spec.objective) as view:
            run_campaign(campaign, run_dir, view)
    message = str(stopped.value)
    assert "No space left on device" in message and f"autotune resume {run_dir.path}" in message
    lines = (run_dir.path / TRIALS_FILE).read_text().splitlines()
    assert len(lines) == 2 and all(json.loads(line)["config"] for line in lines)


@pytest.fixture
def ray_with_stuck_bursts():
    """A local Ray cluster whose workers load ``hang_hook`` (tests/ on their path)."""
    import ray

    tests = str(Path(__file__).resolve().parent)
    path = os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")]))
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"worker_process_setup_hook": "hang_hook.install", "env_vars": {"PYTHONPATH": path}})
    yield
    ray.shutdown()


def test_a_trial_that_stops_reporting_is_killed_recorded_hung_and_its_slots_freed(
        small_table: Path, ray_with_stuck_bursts) -> None:
    table = load_table(small_table)
    campaign = replay_campaign(table, 0, small_table.parent / "runs")
    stages = campaign.spec.stages.model_copy(update={"hang_timeout_s": 20.0})
    campaign = dataclasses.replace(campaign, spec=campaign.spec.model_copy(update={"stages": stages}))
    run_dir = create_run_dir(campaign)
    with LiveView(Console(file=StringIO()), campaign.space, campaign.spec.objective) as view:
        run_campaign(campaign, run_dir, view)
    launched = [entry for entry in run_dir.trials.read() if entry["launched"]]
    hung = [entry for entry in launched if entry["outcome"] == "hung"]
    assert hung and all(entry["config"]["micro_batch_size"] < 4 for entry in hung)
    assert all("watchdog" in entry["reason"] and entry["steps"] == 0 for entry in hung)
    # the slots came back: every screening trial ran, and the best of the rest was promoted
    screened = [entry for entry in launched if entry["stage"] == "screen"]
    assert len(screened) == campaign.spec.budget.max_trials
    assert any(entry["stage"] == "promote" and entry["outcome"] == "ok" for entry in launched)
