"""cluster/local_head.sh: a real loopback Ray head that accepts `ray job submit` with its token only."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from autotune.engine.rundir import RunDir
from conftest import OOM_CAP_GIB, OOM_SPACE, campaign_file

ROOT = Path(__file__).resolve().parent.parent
RAY = str(Path(sys.executable).parent / "ray")
DASHBOARD = "http://127.0.0.1:8265"


@pytest.fixture
def local_head():
    started = subprocess.run([str(ROOT / "cluster/local_head.sh"), "start", "2"], capture_output=True, text=True,
                             timeout=180)
    assert started.returncode == 0, started.stderr[-2000:]
    try:
        yield
    finally:
        subprocess.run([str(ROOT / "cluster/local_head.sh"), "stop"], capture_output=True, timeout=120)


def submit(*entrypoint: str, token: bool) -> subprocess.CompletedProcess:
    env = {**os.environ, "RAY_ADDRESS": DASHBOARD}
    env.pop("RAY_AUTH_MODE", None)
    if token:
        env["RAY_AUTH_MODE"] = "token"
    return subprocess.run([RAY, "job", "submit", "--working-dir", str(ROOT), "--", *entrypoint],
                          capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)


def test_job_submit_runs_autotune_on_the_loopback_head(local_head) -> None:
    refused = submit("python", "-c", "print(1)", token=False)
    assert refused.returncode != 0 and "authentication token" in (refused.stdout + refused.stderr)
    result = submit("python", "-m", "autotune", "validate", token=True)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    assert "campaign cpu-demo" in result.stdout and "succeeded" in result.stdout


def test_job_submit_runs_a_campaign_and_writes_its_outputs(local_head, tmp_path) -> None:
    path = campaign_file(tmp_path, max_trials=2, space=OOM_SPACE, cpu_memory_cap_gib=OOM_CAP_GIB)
    result = submit("python", "-m", "autotune", "run", str(path), token=True)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    (run_dir,) = (tmp_path / "runs").iterdir()
    outcomes = [entry.outcome for entry in RunDir(run_dir).trials.read()]
    assert outcomes.count("oom") == 1 and "oom_predicted" in outcomes
    assert (run_dir / "study.journal").is_file() and (run_dir / "spend.json").is_file()
    assert "no winner" in result.stdout and str(run_dir) in result.stdout
