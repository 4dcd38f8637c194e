"""What clusters do at night, and the campaign going on without losing what it finished: an output
directory that cannot be written stops a campaign before any trial; a disk that fills up
mid-campaign stops it cleanly with every line written before intact; a trial that stops reporting
is killed and recorded hung, its slots reused; a trial whose node dies is recorded node_lost and
runs once more elsewhere. (A driver killed with SIGKILL and resumed: tests/test_engine.py.)"""

from __future__ import annotations

import dataclasses
import errno
import json
import multiprocessing
import os
import subprocess
import sys
import time
from io import StringIO
from pathlib import Path
from typing import Any, Iterator

import pytest
from rich.console import Console

from autotune.core.errors import AutotuneError
from autotune.core.tables import append_row, load_table
from autotune.engine.driver import run_campaign
from autotune.engine.live import LiveView
from autotune.engine.rundir import TRIALS_FILE, RunDir, create_run_dir
from autotune.search_benchmark import replay_campaign
from conftest import campaign_file, join_cluster, multi_node_cluster

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


def worker_hook(name: str, **env: str) -> dict:
    """A runtime env whose workers run ``replay_hooks.<name>`` at start (tests/ on their path)."""
    tests = str(Path(__file__).resolve().parent)
    path = os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")]))
    return {"worker_process_setup_hook": f"replay_hooks.{name}", "env_vars": {"PYTHONPATH": path, **env}}


@pytest.fixture
def ray_with_stuck_bursts():
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env=worker_hook("stuck_small_batches"))
    yield
    ray.shutdown()


def test_a_trial_that_stops_reporting_is_killed_recorded_hung_and_its_slots_freed(
        small_table: Path, ray_with_stuck_bursts) -> None:
    table = load_table(small_table)
    campaign = replay_campaign(table, 0, small_table.parent / "runs")
    stages = campaign.spec.stages.model_copy(update={"hang_timeout_s": 12.0})
    campaign = dataclasses.replace(campaign, spec=campaign.spec.model_copy(update={"stages": stages}))
    run_dir = create_run_dir(campaign)
    with LiveView(Console(file=StringIO()), campaign.space, campaign.spec.objective) as view:
        run_campaign(campaign, run_dir, view)
    launched = [entry for entry in run_dir.trials.read() if entry.launched]
    hung = [entry for entry in launched if entry.outcome == "hung"]
    assert hung and all(entry.config.micro_batch_size < 4 for entry in hung)
    assert all(entry.cause == "watchdog" and "watchdog" in entry.reason and entry.steps == 0 for entry in hung)
    # the slots came back: every screening trial ran, and the best of the rest was promoted
    screened = [entry for entry in launched if entry.stage == "screen"]
    assert len(screened) == campaign.spec.budget.max_trials
    assert any(entry.stage == "promote" and entry.outcome == "ok" for entry in launched)


@dataclasses.dataclass
class NightCluster:
    """A local multi-node Ray cluster whose bursts wait for the test's go (``bursts_wait_for_go``),
    and the campaign drivers started on it. Each driver is its own process: a test that fails
    while its campaign still runs kills that process before the cluster goes, instead of leaving a
    thread in the test process calling into a Ray that has shut down (which crashed the test run
    with a segmentation fault, tests later)."""

    cluster: Any
    nodes: list[Any]
    folder: Path
    drivers: list[multiprocessing.process.BaseProcess] = dataclasses.field(default_factory=list)

    @property
    def started(self) -> Path:
        return self.folder / "burst-started"

    def go(self) -> None:
        (self.folder / "go").touch()

    def drive(self, campaign) -> tuple[RunDir, multiprocessing.process.BaseProcess]:
        """Start ``campaign``'s driver in a new process connected to this cluster."""
        run_dir = create_run_dir(campaign)
        hook = worker_hook("bursts_wait_for_go", AUTOTUNE_TEST_MARK=str(self.started),
                           AUTOTUNE_TEST_GO=str(self.folder / "go"))
        driver = multiprocessing.get_context("spawn").Process(
            target=drive_campaign, args=(self.cluster.address, hook, campaign, run_dir.path))
        driver.start()
        self.drivers.append(driver)
        return run_dir, driver


def drive_campaign(address: str, runtime_env: dict, campaign, run_dir: Path) -> None:
    join_cluster(address, runtime_env)
    with LiveView(Console(file=StringIO()), campaign.space, campaign.spec.objective) as view:
        run_campaign(campaign, RunDir(run_dir), view)


def night_cluster(folder: Path, nodes: int, cpus: int) -> Iterator[NightCluster]:
    """A head that runs nothing and ``nodes`` worker nodes of ``cpus`` CPUs; this process is
    connected to it only to read the state API (asked with the cluster's address: without one, it
    refuses when the machine runs several clusters, as when tests run side by side)."""
    import ray

    cluster = multi_node_cluster(num_cpus=0)
    night = NightCluster(cluster, [cluster.add_node(num_cpus=cpus) for _ in range(nodes)], folder)
    join_cluster(cluster.address)
    try:
        yield night
    finally:
        for driver in night.drivers:
            driver.kill()
            driver.join()
        ray.shutdown()
        cluster.shutdown()


@pytest.fixture
def two_worker_nodes(tmp_path: Path) -> Iterator[NightCluster]:
    yield from night_cluster(tmp_path, nodes=2, cpus=2)


def wait_until(found, what: str, seconds: float = 180):
    """Poll ``found()`` until it returns something true; fail naming ``what`` after ``seconds``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        result = found()
        if result:
            return result
        time.sleep(0.5)
    raise AssertionError(f"{what} within {seconds:.0f} s")


def finished(run_dir: RunDir, driver) -> list:
    """The launched trials of a campaign whose driver has ended well."""
    driver.join(timeout=300)
    launched = [entry for entry in run_dir.trials.read() if entry.launched]
    assert driver.exitcode == 0, (driver.exitcode, [(e.outcome, e.reason) for e in launched])
    return launched


def test_a_trial_whose_node_dies_is_recorded_node_lost_and_runs_once_more_elsewhere(
        small_table: Path, two_worker_nodes: NightCluster) -> None:
    from ray.util.state import list_actors

    night = two_worker_nodes
    campaign = replay_campaign(load_table(small_table), 0, small_table.parent / "runs")
    run_dir, driver = night.drive(campaign)

    def a_trial_in_its_burst():
        alive = [a for a in list_actors(address=night.cluster.address, filters=[("state", "=", "ALIVE")])
                 if "ImplicitFunc" in a.class_name]
        return alive[0] if alive and night.started.exists() else None

    trial = wait_until(a_trial_in_its_burst, "no trial started its burst")
    (victim,) = [node for node in night.nodes if node.node_id == trial.node_id]
    night.cluster.remove_node(victim)
    night.go()
    launched = finished(run_dir, driver)

    lost = [entry for entry in launched if entry.cause == "node_lost"]
    assert len(lost) == 1 and lost[0].outcome == "failed" and lost[0].reason.startswith("node lost: ")
    again = [entry for entry in launched if entry.retry_of is not None]
    assert len(again) == 1 and again[0].retry_of == lost[0].trial_id and again[0].outcome == "ok"
    assert (again[0].config, again[0].number, again[0].origin) == (lost[0].config, lost[0].number, lost[0].origin)
    others = [entry for entry in launched if entry not in lost]
    assert others and all(entry.outcome in ("ok", "pruned", "oom") for entry in others)
    screened = [entry for entry in launched if entry.stage == "screen"]
    assert len(screened) == campaign.spec.budget.max_trials + 1  # the lost trial's retry comes on top


def test_only_a_dead_node_reads_as_node_lost() -> None:
    from autotune.engine.faults import node_lost

    worker_lost = ("Ray Train: TrainingFailedError: worker group failed\nActorDiedError: The actor died unexpectedly\n"
                   "The actor died because its node has died. Node Id: 9c71a3")
    assert node_lost(worker_lost).startswith("node lost: The actor died because its node has died")
    assert node_lost(RuntimeError("collective failed")) is None
    assert node_lost("OutOfMemoryError: CUDA out of memory") is None
    assert node_lost(None) is None


@pytest.fixture
def one_slot_nodes(tmp_path: Path) -> Iterator[NightCluster]:
    """Four 1-CPU nodes: a ``ray_train`` trial's own process (0.01 CPU) leaves its node too little
    for one of its workers (0.995 CPU each), so its two workers always run on two other nodes."""
    yield from night_cluster(tmp_path, nodes=4, cpus=1)


def test_a_worker_group_that_loses_a_node_under_a_living_trial_is_node_lost_and_runs_once_more(
        small_table: Path, one_slot_nodes: NightCluster) -> None:
    from ray.util.state import list_actors

    night = one_slot_nodes
    # Every row runs out of memory at its first step: one screening trial (and its retry), no
    # promotion (this test is about the screen).
    table = small_table.parent / "oom_table.jsonl"
    for row in load_table(small_table).rows.values():
        append_row(table, row.model_copy(update={"outcome": "oom", "step_seconds": [], "useful_tokens_per_step": 0,
                                                 "peak_memory_gib": None, "error": "OutOfMemoryError"}))
    campaign = replay_campaign(load_table(table), 0, small_table.parent / "runs")
    hardware = campaign.spec.hardware.model_copy(update={"launcher": "ray_train"})  # a rehearsal: workers hold slots
    budget = campaign.spec.budget.model_copy(update={"max_trials": 1})
    campaign = dataclasses.replace(campaign, spec=campaign.spec.model_copy(update={"hardware": hardware, "budget": budget}))
    run_dir, driver = night.drive(campaign)

    def a_worker_group_in_its_burst():
        alive = list_actors(address=night.cluster.address, filters=[("state", "=", "ALIVE")])
        trial = next((a for a in alive if "ImplicitFunc" in a.class_name), None)
        workers = [a for a in alive if "RayTrainWorker" in a.class_name]
        return (trial, workers) if trial and len(workers) == 2 and night.started.exists() else None

    trial, workers = wait_until(a_worker_group_in_its_burst, "no ray_train trial started its burst")
    assert trial.node_id not in {w.node_id for w in workers}
    (victim,) = [node for node in night.nodes if node.node_id == workers[0].node_id]
    night.cluster.remove_node(victim)  # the trial's own process lives on; one of its workers does not
    night.go()
    launched = finished(run_dir, driver)

    lost = [entry for entry in launched if entry.cause == "node_lost"]
    assert len(lost) == 1 and lost[0].outcome == "failed", [(e.outcome, e.reason) for e in launched]
    again = [entry for entry in launched if entry.retry_of is not None]
    assert len(again) == 1 and again[0].retry_of == lost[0].trial_id and again[0].outcome == "oom"
    assert again[0].config == lost[0].config
    assert len(launched) == 2  # the budget's one trial, and its retry on top
