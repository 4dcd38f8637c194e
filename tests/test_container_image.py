"""cluster/Dockerfile built on a small base of NVIDIA's container layout (cluster/check_image.sh):
the layer installs, keeps the base's torch and megatron-core, and runs. Needs root, a Docker
daemon, debootstrap and a CPU torch wheel for Debian's Python (several minutes); skipped where the
machine has none of them, as CI's has no Docker daemon."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TORCH_WHEEL = Path("/opt/wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl")


def missing() -> str | None:
    if os.geteuid() != 0 or shutil.which("debootstrap") is None:
        return "needs root and debootstrap"
    if shutil.which("docker") is None or subprocess.run(["docker", "info"], capture_output=True).returncode != 0:
        return "no Docker daemon"
    if not TORCH_WHEEL.exists():
        return f"no CPU torch wheel for Python 3.11 at {TORCH_WHEEL}"
    return None


@pytest.mark.container
@pytest.mark.skipif(missing() is not None, reason=str(missing()))
def test_the_layer_installs_on_a_base_of_nvidias_layout_and_keeps_its_packages() -> None:
    done = subprocess.run(["bash", "cluster/check_image.sh", str(TORCH_WHEEL)], cwd=ROOT,
                          capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "base packages kept" in done.stdout and "torch==2.13.0+cpu" in done.stdout
    assert "== image layer: ok" in done.stdout
