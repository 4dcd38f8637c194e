"""Native-trainable bursts on this CPU box: useful tokens/s and data-wait share for three configs.

Run:  .venv/bin/python bench/burst_cpu.py [--steps 24] [--out bench/results/burst_cpu.json]
Writes one JSON with each burst's steady estimate, stage split, per-step records and contract.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
from pathlib import Path

from autotune.bursts import data_folder, run_burst, summarize
from autotune.campaign import builtin_campaign_path, load_campaign
from autotune.core.contract import BurstRequest, DataSpec
from autotune.core.knobs import complete_config

CONFIGS = {
    "bring-up (MBS 1, full recompute, vision trainable)": {
        "micro_batch_size": 1, "recompute_granularity": "full"},
    "MBS 4, selective core_attn, frozen vision": {
        "micro_batch_size": 4, "recompute_granularity": "selective", "recompute_modules": ["core_attn"],
        "freeze_vision_model": True},
    "MBS 4, EP 2, no recompute, frozen vision": {
        "micro_batch_size": 4, "expert_model_parallel_size": 2, "freeze_vision_model": True},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--workers", type=int, default=1, help="DataLoader workers per rank")
    parser.add_argument("--out", type=Path, default=Path("bench/results/burst_cpu.json"))
    args = parser.parse_args()
    campaign = load_campaign(builtin_campaign_path("cpu_demo"))
    context = campaign.rule_context
    folder = data_folder(campaign.spec.data.source, campaign.spec.data.path, campaign.path.parent)
    results = []
    for name, values in CONFIGS.items():
        config = complete_config(values, defaults=campaign.space.fixed)
        request = BurstRequest(config=config, model=context.model, data=DataSpec(str(folder)), steps=args.steps,
                               world_size=context.world_size, data_workers=args.workers)
        summary = summarize(request, run_burst(context.trainable.name, request), min_warmup=3)
        steady = summary.get("steady") or {}
        print(f"{name}: {summary['outcome']}, {steady.get('mean', 0):.0f} useful tokens/s "
              f"(±{100 * steady.get('relative_half_width', 0):.1f}%), data wait "
              f"{100 * steady.get('data_wait_share', 0):.2f}% of step time")
        results.append({"name": name} | summary)
    best = max((r for r in results if r.get("steady")), key=lambda r: r["steady"]["mean"])
    report = {
        "benchmark": "burst_cpu",
        "command": f"python bench/burst_cpu.py --steps {args.steps} --workers {args.workers}",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "campaign": str(campaign.path),
        "best": {"name": best["name"], "useful_tokens_per_s": best["steady"]["mean"],
                 "data_wait_share": best["steady"]["data_wait_share"]},
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2, default=str))
    print(f"best: {best['name']} — data wait {100 * best['steady']['data_wait_share']:.2f}% · wrote {args.out}")


if __name__ == "__main__":
    main()
