"""Bursts of the ``bridge`` trainable on one GPU, as ``campaigns/h200_bridge.yaml``'s trials run them:
Megatron-Bridge's own ``pretrain()`` on the user-style recipe file ``campaigns/recipes/qwen3_vl_energon.py``
(Qwen3-VL-30B-A3B SFT on Energon data) with the campaign's overrides, our Qwen3-VL-MoE proxy checkpoint
and our photos as a ChatML Energon dataset (made first where the campaign expects them), each config
in a fresh process.

  python bench/bridge_gpu.py --out bench/results/bridge_gpu.json --steps 12

Writes, per config: the outcome, the steady useful tokens/s with its interval and window, the per-step
records, the contract (versions, hardware, model, data, precision, shapes, the overrides the trial
applied), or the error.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from dataclasses import asdict
from pathlib import Path

from autotune.campaign import load_campaign
from autotune.core.knobs import complete_config
from autotune.core.steady import steady_state
from trainables.bridge.energon import build_chatml_energon
from trainables.bridge.hf_proxy import PROXY_SHAPES, write_qwen3_vl_moe_proxy
from trainables.launch import run_local

CAMPAIGN = Path("campaigns/h200_bridge.yaml")
CONFIGS = {
    "recipe": {"micro_batch_size": 2},
    "mbs4": {"micro_batch_size": 4},
    "mbs8": {"micro_batch_size": 8},
    "mbs4-selective": {"micro_batch_size": 4, "recompute_granularity": "selective", "recompute_modules": ["core_attn"]},
    "mbs4-te-graphs": {"micro_batch_size": 4, "cuda_graph_impl": "transformer_engine",
                       "cuda_graph_scope": ["attn", "moe_router", "moe_preprocess"]},
}


def steady(steps: list[dict], warmup_steps: int) -> dict | None:
    """The steady useful tokens/s of a burst's step records, as the campaign's promotion estimates it."""
    estimate = steady_state([step["useful_tokens"] / step["step_seconds"] for step in steps], min_warmup=warmup_steps)
    return None if estimate is None else estimate.to_dict()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--only", nargs="*", default=None, help="config names to run")
    parser.add_argument("--shape", choices=sorted(PROXY_SHAPES), default="h200", help="the proxy checkpoint's size")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)

    runs = CAMPAIGN.parent.parent / "runs"
    write_qwen3_vl_moe_proxy(runs / "hf-proxy", PROXY_SHAPES[args.shape])
    if not (runs / "energon" / ".nv-meta" / "dataset.yaml").is_file():
        build_chatml_energon(runs / "energon")
    campaign = load_campaign(CAMPAIGN)
    results = {}
    for name, values in CONFIGS.items():
        if args.only and name not in args.only:
            continue
        request = campaign.burst_request(complete_config(values, defaults=campaign.space.fixed), args.steps)
        started = time.perf_counter()
        result = run_local(request, trainable="bridge")
        wall = time.perf_counter() - started
        steps = [asdict(record) for record in result.records]
        results[name] = {"config": values, "outcome": result.outcome, "wall_seconds": wall, "error": result.error,
                         "steady": steady(steps, campaign.spec.stages.warmup_steps),
                         "records": steps, "contract": result.contract.to_json() if result.contract else None,
                         "proxy_shape": args.shape}
        print(f"{name}: {result.outcome} in {wall:.0f} s; step seconds "
              f"{[round(s['step_seconds'], 3) for s in steps]}; error {(result.error or '')[-1500:]}", flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
