"""The memory model's error on a recorded table, online as a campaign meets it: rows in a seeded
random order, each finished row predicted from the peaks before it, then observed. With a limit
(the table's GPU memory cap, or the counted device memory a CPU table's rows ran with), also how many out-of-memory rows it would have rejected before
launch, and how many rows that fit it would have rejected wrongly.

  python bench/memory_model.py --table bench/data/cpu_native_vlm.jsonl --out bench/results/memory_model_cpu.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import random
import statistics
from pathlib import Path

from autotune.campaign import load_campaign
from autotune.core.tables import load_table
from autotune.search_benchmark import recorded_counted_memory, recorded_workload


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--table", type=Path, required=True)
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    table = load_table(args.table)
    first = next(iter(table.rows.values()))
    campaign = load_campaign(Path(first.contract["campaign"]), recorded_workload(table))
    device_memory = (first.contract.get("stack") or {}).get("device_memory_bytes")
    cap = first.contract.get("memory_cap_fraction")
    limit = recorded_counted_memory(table) or (cap * device_memory if cap and device_memory else None)
    errors, rejected_oom, rejected_fit, ooms = [], 0, 0, 0
    for seed in range(args.seeds):
        model = campaign.memory_model(limit)
        rows = list(table.rows.items())
        random.Random(seed).shuffle(rows)
        for config, row in rows:
            if row.outcome not in ("ok", "oom"):
                continue
            reason = model.rejection(config)
            if row.outcome == "oom":
                ooms += 1
                rejected_oom += reason is not None
                continue
            rejected_fit += reason is not None
            predicted = model.predict(config)
            peak = row.peak_memory_gib * 2**30
            if predicted is not None:
                errors.append(abs(predicted - peak) / peak)
            model.observe(config, peak)
    result = {
        "benchmark": "memory_model",
        "command": f"python bench/memory_model.py --table {args.table} --seeds {args.seeds} --out {args.out}",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"python": platform.python_version(), "platform": platform.platform()},
        "recorded_on": first.contract.get("stack"),
        "peak_measure": "torch.cuda.max_memory_allocated on CUDA; on the CPU the rank's tensors counted against its "
                        "device memory where the table's rows had one, else its max resident set",
        "limit_bytes": limit,
        "predictions": len(errors),
        "relative_error": {
            "median": statistics.median(errors) if errors else None,
            "p90": statistics.quantiles(errors, n=10)[-1] if len(errors) >= 10 else None,
            "max": max(errors) if errors else None,
        },
        "oom_rows_seen": ooms,
        "oom_rows_rejected_before_launch": rejected_oom,
        "fitting_rows_rejected_wrongly": rejected_fit,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
