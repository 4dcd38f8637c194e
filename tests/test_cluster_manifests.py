"""cluster/: the KubeRay manifest, the Slurm script and the runtime env, checked at the schema level
and against what the placement code reads."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import yaml

from autotune.engine.placement import NVLINK_DOMAIN_LABEL

CLUSTER = Path(__file__).resolve().parent.parent / "cluster"
GPUS_PER_POD = 4


def raycluster() -> dict:
    return yaml.safe_load((CLUSTER / "gb200_raycluster.yaml").read_text())


def containers(group: dict) -> list[dict]:
    return group["template"]["spec"]["containers"]


def test_raycluster_has_its_required_fields() -> None:
    manifest = raycluster()
    assert manifest["apiVersion"] == "ray.io/v1" and manifest["kind"] == "RayCluster"
    assert manifest["metadata"]["name"]
    spec = manifest["spec"]
    major, minor, _ = map(int, spec["rayVersion"].split("."))
    assert (major, minor) >= (2, 52)  # token authentication
    assert spec["authOptions"] == {"mode": "token"}
    groups = [spec["headGroupSpec"], *spec["workerGroupSpecs"]]
    for group in groups:
        assert group["rayStartParams"] is not None and containers(group)
        for container in containers(group):
            assert container["image"] and container["resources"]["limits"] == container["resources"]["requests"]


def test_the_head_holds_no_gpu_and_listens_on_loopback() -> None:
    head = raycluster()["spec"]["headGroupSpec"]
    assert head["rayStartParams"]["num-gpus"] == "0"
    assert head["rayStartParams"]["dashboard-host"] == "127.0.0.1"
    assert all("nvidia.com/gpu" not in c["resources"]["limits"] for c in containers(head))


def test_gpu_groups_are_racks_labelled_as_placement_reads() -> None:
    groups = raycluster()["spec"]["workerGroupSpecs"]
    domains = []
    for group in groups:
        assert group["replicas"] == group["minReplicas"] == group["maxReplicas"] > 0
        assert int(group["rayStartParams"]["num-gpus"]) == GPUS_PER_POD
        assert all(c["resources"]["limits"]["nvidia.com/gpu"] == GPUS_PER_POD for c in containers(group))
        domain = group["labels"][NVLINK_DOMAIN_LABEL]
        assert group["template"]["spec"]["nodeSelector"][NVLINK_DOMAIN_LABEL] == domain  # the pods sit in the rack
        domains.append(domain)
        assert group["replicas"] * GPUS_PER_POD <= 72  # an NVL72 rack's NVLink domain
    assert len(set(domains)) == len(domains) >= 2


def test_every_pod_mounts_the_shared_volume_where_the_cache_points() -> None:
    spec = raycluster()["spec"]
    for group in [spec["headGroupSpec"], *spec["workerGroupSpecs"]]:
        claims = {v["name"]: v["persistentVolumeClaim"]["claimName"]
                  for v in group["template"]["spec"]["volumes"] if "persistentVolumeClaim" in v}
        for container in containers(group):
            mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
            cache = {e["name"]: e["value"] for e in container["env"]}["AUTOTUNE_CACHE"]
            assert any(cache.startswith(mounts[name]) for name in claims)


def test_slurm_script_is_valid_bash_and_labels_as_placement_reads() -> None:
    script = CLUSTER / "slurm_ray.sbatch"
    checked = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stderr
    text = script.read_text()
    assert f"label_key={NVLINK_DOMAIN_LABEL}" in text and "--labels=$label_key=" in text
    assert "--dashboard-host=127.0.0.1" in text and "export RAY_AUTH_MODE=token" in text
    assert re.search(r"--head .*--num-gpus=0", text)


def test_runtime_env_leaves_data_outputs_and_environments_behind() -> None:
    env = yaml.safe_load((CLUSTER / "runtime_env.yaml").read_text())
    assert set(env) <= {"excludes", "env_vars", "working_dir", "pip", "py_modules"}
    for path in ("runs/", "bench/data/", ".venv/", ".git/"):
        assert path in env["excludes"]
    ignored = (CLUSTER.parent / ".rayignore").read_text().split()
    assert {"runs/", "bench/data/", ".venv/"} <= set(ignored)
