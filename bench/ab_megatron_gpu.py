"""A/B of two checkouts on one GPU: the same megatron bursts (bring-up and a campaign's winner, 20
steps, memory cap 0.25) with the code before and after a change, alternated (before, after, before,
after), so a difference is told from the machine's run-to-run spread. Each burst runs in its own
interpreter with that checkout first on the path.

  git archive BEFORE autotune trainables bench/results/burst_megatron_gpu_winner.yaml | tar -x --one-top-level=.ab/old
  python bench/ab_megatron_gpu.py --before .ab/old --out DIR     # on a GPU machine (.dev bundle on PYTHONPATH)

Writes ``DIR/ab_megatron_gpu.json``: per round, each config's steady useful tokens/s with its interval
and every step's seconds.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

BURSTS = r'''
import json
from pathlib import Path
try:
    from autotune.core.contract import BurstRequest, DataSpec
    from autotune.core.knobs import complete_config
    from autotune.core.model import model_preset
except ImportError:  # a checkout from before autotune/core
    from autotune.contract import BurstRequest, DataSpec
    from autotune.knobs import complete_config
    from autotune.model import model_preset
from autotune.bursts import data_folder, run_burst, summarize
from autotune.export import load_document
winner, _, _ = load_document(Path("bench/results/burst_megatron_gpu_winner.yaml"))
configs = {"bring-up": {"micro_batch_size": 1, "recompute_granularity": "full", "recompute_method": "uniform",
                        "recompute_num_layers": 1}, "winner": winner.explicit()}
folder = data_folder("builtin_photos", None, Path.cwd())
out = {}
for name, values in configs.items():
    config = complete_config({"moe_token_dispatcher_type": "alltoall", **values})
    request = BurstRequest(config=config, model=model_preset("h200_small_moe_vlm"), data=DataSpec(str(folder)), steps=20,
                           world_size=1, data_workers=6, memory_cap_fraction=0.25)
    s = summarize(request, run_burst("megatron", request), min_warmup=3)
    steady = s.get("steady") or {}
    out[name] = {"outcome": s["outcome"], "mean": steady.get("mean"), "ci": [steady.get("ci_low"), steady.get("ci_high")],
                 "step_seconds": [r["step_seconds"] for r in s["records"]]}
print("RESULT " + json.dumps(out))
'''


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", type=Path, required=True, help="a checkout of the earlier code")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    extra = os.environ.get("PYTHONPATH", "")
    rounds = []
    for code in ("before", "after") * args.rounds:
        root = args.before.resolve() if code == "before" else Path.cwd()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(root), extra])))
        done = subprocess.run([sys.executable, "-c", BURSTS], cwd=root, env=env, capture_output=True, text=True)
        line = next((line for line in done.stdout.splitlines() if line.startswith("RESULT ")), None)
        result = json.loads(line.removeprefix("RESULT ")) if line else {"error": done.stderr[-3000:]}
        print(code, {name: burst.get("mean") for name, burst in result.items() if isinstance(burst, dict)}, flush=True)
        rounds.append({"code": code, **result})
    import torch

    report = {
        "benchmark": "ab_megatron_gpu",
        "command": f"python bench/ab_megatron_gpu.py --before {args.before} --rounds {args.rounds}",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "cuda": torch.version.cuda},
        "workload": "h200_small_moe_vlm, real photos, 20 steps, warm-up >= 3, memory cap 0.25, one GPU",
        "rounds": rounds,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "ab_megatron_gpu.json").write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
