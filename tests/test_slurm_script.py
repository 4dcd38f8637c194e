"""cluster/slurm_ray.sbatch run against a recording Slurm: which node each Ray process starts on,
with which GPUs and NVLink-domain label, in the container or not, for a plain and a heterogeneous
job. Slurm's `srun` and `scontrol`, `ray` and `nvidia-smi` are small scripts that record their
arguments; everything else is the script itself, run by bash."""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from autotune.engine.placement import NVLINK_DOMAIN_LABEL

SCRIPT = Path(__file__).resolve().parent.parent / "cluster" / "slurm_ray.sbatch"
# Two NVL72 racks: n1 and n2 in one clique of one fabric, n3 in another; c1 is a CPU node.
FABRIC = {"n1": ("4b1f6c2e-0000-4000-8000-00000000aa01", "7"),
          "n2": ("4b1f6c2e-0000-4000-8000-00000000aa01", "7"),
          "n3": ("4b1f6c2e-0000-4000-8000-00000000aa01", "8")}

SRUN = r'''#!/usr/bin/env python3
"""Records the step, then runs `bash -c` commands (Ray starts) as the node would, answers
`hostname`, and succeeds at everything else (health checks, the join wait, job submit)."""
import json, os, subprocess, sys
args = sys.argv[1:]
options, command, i = [], [], 0
while i < len(args):
    if args[i] == "-w":
        options += args[i:i + 2]; i += 2
    elif args[i].startswith("-"):
        options.append(args[i]); i += 1
    else:
        command = args[i:]; break
node = options[options.index("-w") + 1]
with open(os.environ["FAKE_SLURM_LOG"], "a") as log:
    log.write(json.dumps({"kind": "srun", "node": node, "options": options, "command": command}) + "\n")
if command[0] == "hostname":
    print("10.0.0." + node[1:])
elif command[0] == "bash":
    sys.exit(subprocess.run(command, env={**os.environ, "FAKE_NODE": node}).returncode)
'''
SCONTROL = '''#!/usr/bin/env bash
# scontrol show hostnames LIST (LIST comma-separated here)
tr ',' '\\n' <<< "$3"
'''
RAY = '''#!/usr/bin/env python3
import json, os, sys
with open(os.environ["FAKE_SLURM_LOG"], "a") as log:
    log.write(json.dumps({"kind": "ray", "node": os.environ.get("FAKE_NODE"), "args": sys.argv[1:]}) + "\\n")
'''


@dataclass(frozen=True)
class RayStart:
    node: str
    head: bool
    gpus: int
    domain: str | None


@dataclass(frozen=True)
class Recorded:
    steps: list[dict]
    starts: list[RayStart]

    def step_on(self, node: str, first_word: str) -> list[dict]:
        return [s for s in self.steps if s["node"] == node and s["command"][:1] == [first_word]]


def nvidia_smi(tmp_path: Path) -> str:
    lines = ["#!/usr/bin/env bash", 'case "$FAKE_NODE" in']
    for node, (uuid, clique) in FABRIC.items():
        lines.append(f'  {node}) printf "    Fabric\\n        ClusterUUID    : {uuid}\\n        CliqueId   : {clique}\\n" ;;')
    lines.append('  *) printf "    Fabric\\n        ClusterUUID    : N/A\\n        CliqueId   : N/A\\n" ;;')
    lines.append("esac")
    return "\n".join(lines) + "\n"


def run_script(tmp_path: Path, slurm_env: dict[str, str], container: str | None = None,
               srun: str = SRUN) -> subprocess.CompletedProcess:
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    for name, text in {"srun": srun, "scontrol": SCONTROL, "ray": RAY, "nvidia-smi": nvidia_smi(tmp_path)}.items():
        (fake_bin / name).write_text(text)
        (fake_bin / name).chmod(0o755)
    log = tmp_path / "slurm.log"
    env = {"PATH": f"{fake_bin}:{os.environ['PATH']}", "HOME": str(tmp_path / "home"), "FAKE_SLURM_LOG": str(log),
           "SLURM_SUBMIT_DIR": str(tmp_path), "JOIN_TIMEOUT_S": "5", **slurm_env}
    if container:
        env["CONTAINER_IMAGE"] = container
    return subprocess.run(["bash", str(SCRIPT), "campaigns/overnight.yaml"], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)


def recorded_run(tmp_path: Path, slurm_env: dict[str, str], container: str | None = None) -> Recorded:
    done = run_script(tmp_path, slurm_env, container)
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in (tmp_path / "slurm.log").read_text().splitlines()]
    starts = []
    for record in records:
        if record["kind"] == "ray" and record["args"][:1] == ["start"]:
            args = record["args"]
            labels = [a.split("=", 1)[1] for a in args if a.startswith("--labels=")]
            domain = labels[0].split("=", 1)[1] if labels else None
            if labels:
                assert labels[0].split("=", 1)[0] == NVLINK_DOMAIN_LABEL
            gpus = int(next(a for a in args if a.startswith("--num-gpus=")).split("=")[1])
            starts.append(RayStart(record["node"], "--head" in args, gpus, domain))
        elif record["kind"] == "srun" and record["command"][:2] == ["ray", "start"]:  # a start outside `bash -c`
            args = record["command"]
            gpus = int(next(a for a in args if a.startswith("--num-gpus=")).split("=")[1])
            starts.append(RayStart(record["node"], "--head" in args, gpus, None))
    return Recorded([r for r in records if r["kind"] == "srun"], sorted(starts, key=lambda s: s.node))


def rack(node: str) -> str:
    return ".".join(FABRIC[node])


def test_a_plain_job_puts_the_head_on_the_first_tray_with_its_gpus_and_label(tmp_path: Path) -> None:
    recorded = recorded_run(tmp_path, {"SLURM_JOB_NODELIST": "n1,n2,n3"})
    assert recorded.starts == [RayStart("n1", True, 4, rack("n1")), RayStart("n2", False, 4, rack("n2")),
                               RayStart("n3", False, 4, rack("n3"))]
    assert rack("n1") == rack("n2") != rack("n3")
    submit = recorded.step_on("n1", "env")
    assert len(submit) == 1 and "ray job submit" in " ".join(submit[0]["command"])
    assert not any(o.startswith("--container") or o.startswith("--het-group")
                   for step in recorded.steps for o in step["options"])


def test_a_heterogeneous_job_keeps_the_head_on_the_cpu_node_without_gpus(tmp_path: Path) -> None:
    recorded = recorded_run(tmp_path, {"SLURM_HET_SIZE": "2", "SLURM_JOB_NODELIST": "c1,n1,n2",
                                     "SLURM_JOB_NODELIST_HET_GROUP_0": "c1",
                                     "SLURM_JOB_NODELIST_HET_GROUP_1": "n1,n2"})
    assert recorded.starts == [RayStart("c1", True, 0, None), RayStart("n1", False, 4, rack("n1")),
                               RayStart("n2", False, 4, rack("n2"))]
    for step in recorded.steps:
        assert ("--het-group=0" if step["node"] == "c1" else "--het-group=1") in step["options"]
    assert recorded.step_on("c1", "env") and not recorded.step_on("n1", "env")


def test_in_a_container_every_step_runs_in_it_with_the_submit_directory_and_home(tmp_path: Path) -> None:
    recorded = recorded_run(tmp_path, {"SLURM_JOB_NODELIST": "n1,n2"}, container="nvcr.io#acme/autotune:0.1.0")
    for step in recorded.steps:
        options = step["options"]
        assert "--container-image=nvcr.io#acme/autotune:0.1.0" in options and "--container-name=autotune" in options
        mounts = next(o for o in options if o.startswith("--container-mounts=")).split("=", 1)[1].split(",")
        home = tmp_path / "home"
        assert mounts == [f"{tmp_path}:{tmp_path}", f"{home}:{home}"]  # the submit directory, $HOME
        assert f"--container-workdir={tmp_path}" in options
    assert [s.node for s in recorded.starts] == ["n1", "n2"]


def test_a_head_that_never_answers_stops_the_job_with_a_sentence(tmp_path: Path) -> None:
    unhealthy = SRUN.replace('elif command[0] == "bash":',
                             'elif command[:2] == ["ray", "health-check"]:\n    sys.exit(1)\nelif command[0] == "bash":')
    done = run_script(tmp_path, {"SLURM_JOB_NODELIST": "n1,n2"}, srun=unhealthy)
    assert done.returncode == 1 and "the Ray head on n1 did not come up in 5s" in done.stderr
