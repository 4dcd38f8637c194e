"""cluster/local_head.sh: a real loopback Ray head that accepts `ray job submit` with its token only."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import ray

from autotune.engine.rundir import RunDir
from conftest import OOM_CAP_GIB, OOM_SPACE, campaign_file, free_port

ROOT = Path(__file__).resolve().parent.parent
RAY = str(Path(sys.executable).parent / "ray")


def run_head_script(command: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([str(ROOT / "cluster/local_head.sh"), *command.split()], capture_output=True, text=True,
                          timeout=180, env=env)


@contextlib.contextmanager
def loopback_head() -> Iterator[tuple[str, dict[str, str]]]:
    """A head on ports and in a folder of its own, beside any other Ray the suite runs: its job API
    and the environment that names it to the script."""
    with tempfile.TemporaryDirectory(prefix="head-", dir="/tmp") as folder:
        ports = {name: str(free_port()) for name in ("PORT", "DASHBOARD_PORT", "CLIENT_PORT", "AGENT_PORT")}
        env = {**os.environ, "LOCAL_HEAD_DIR": folder, **{f"LOCAL_HEAD_{name}": port for name, port in ports.items()}}
        started = run_head_script("start 2", env)
        assert started.returncode == 0, started.stderr[-2000:]
        try:
            yield f"http://127.0.0.1:{ports['DASHBOARD_PORT']}", env
        finally:
            run_head_script("stop", env)


@pytest.fixture
def local_head() -> Iterator[str]:
    with loopback_head() as (dashboard, _):
        yield dashboard


def submit(dashboard: str, *entrypoint: str, token: bool) -> subprocess.CompletedProcess:
    env = {**os.environ, "RAY_ADDRESS": dashboard}
    env.pop("RAY_AUTH_MODE", None)
    if token:
        env["RAY_AUTH_MODE"] = "token"
    return subprocess.run([RAY, "job", "submit", "--working-dir", str(ROOT), "--", *entrypoint],
                          capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)


def test_job_submit_runs_autotune_on_the_loopback_head(local_head) -> None:
    refused = submit(local_head, "python", "-c", "print(1)", token=False)
    assert refused.returncode != 0 and "authentication token" in (refused.stdout + refused.stderr)
    result = submit(local_head, "python", "-m", "autotune", "validate", token=True)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    assert "campaign cpu-demo" in result.stdout and "succeeded" in result.stdout


def test_job_submit_runs_a_campaign_and_writes_its_outputs(local_head, tmp_path) -> None:
    path = campaign_file(tmp_path, max_trials=2, space=OOM_SPACE, cpu_memory_cap_gib=OOM_CAP_GIB)
    result = submit(local_head, "python", "-m", "autotune", "run", str(path), token=True)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    (run_dir,) = (tmp_path / "runs").iterdir()
    outcomes = [entry.outcome for entry in RunDir(run_dir).trials.read()]
    assert outcomes.count("oom") == 1 and "oom_predicted" in outcomes
    assert (run_dir / "study.journal").is_file() and (run_dir / "spend.json").is_file()
    assert "no winner" in result.stdout and str(run_dir) in result.stdout


def test_stop_stops_this_head_and_leaves_other_ray_clusters_running(ray_local) -> None:
    """`ray stop` would also kill a campaign's own local cluster (and, in this suite, the tests'
    clusters running beside it)."""
    with loopback_head() as (_, env):
        def heads_live_processes() -> list[psutil.Process]:
            return [process for process in psutil.process_iter(["cmdline", "status"])
                    if any(env["LOCAL_HEAD_DIR"] in arg for arg in process.info["cmdline"] or [])
                    and process.info["status"] != psutil.STATUS_ZOMBIE]
        assert heads_live_processes()
        stopped = run_head_script("stop", env)
        assert stopped.returncode == 0 and "stopped the head" in stopped.stdout, stopped.stdout + stopped.stderr
        assert not heads_live_processes()
    assert ray.get(ray.remote(lambda: "alive").remote()) == "alive"
