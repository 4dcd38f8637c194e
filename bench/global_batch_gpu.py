"""The megatron trainable under a fixed global batch on one CUDA GPU: ``h200_single`` (its workload:
GBS 8, the ViT trained, cap 0.25) at MBS 2 (4 micro-batches a step) and MBS 8 (1), full recompute,
5 steps each — the gradient-accumulation path of ``get_forward_backward_func`` on real data.

Run on the GPU machine (see ../shared/device):  python bench/global_batch_gpu.py --out DIR
Writes DIR/global_batch_gpu.json: per MBS the outcome, the error's tail, wall seconds, each step's
(seconds, samples, useful tokens, loss, peak GiB) and the contract's shapes, with the machine.
"""

from __future__ import annotations

import argparse
import datetime
import json
import time
from pathlib import Path

import torch

from autotune.bursts import run_burst
from autotune.campaign import load_campaign


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    campaign = load_campaign(Path("campaigns/h200_single.yaml"))
    results = {}
    for micro_batch_size in (2, 8):
        config = next(c for c in campaign.space.configs() if c.micro_batch_size == micro_batch_size
                      and c.recompute_granularity == "full" and c.cuda_graph_impl == "none")
        started = time.time()
        result = run_burst("megatron", campaign.burst_request(config, 5))
        results[micro_batch_size] = {
            "outcome": result.outcome, "error": (result.error or "")[-800:], "wall": time.time() - started,
            "records": [(r.step_seconds, r.samples, r.useful_tokens, r.loss, r.peak_memory_bytes / 2**30)
                        for r in result.records],
            "shapes": result.contract.shapes.model_dump() if result.contract else None,
        }
        print(micro_batch_size, json.dumps(results[micro_batch_size]), flush=True)
    report = {"benchmark": "global_batch_gpu", "command": "python bench/global_batch_gpu.py --out DIR",
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "cuda": torch.version.cuda},
              "results": results}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "global_batch_gpu.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
