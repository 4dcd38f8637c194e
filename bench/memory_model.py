"""The memory model's error on a recorded table, online as a campaign meets it: rows in a seeded
random order, each finished row predicted from the peaks before it, then observed. With a limit
(the table's GPU memory cap, or the counted device memory a CPU table's rows ran with), also how many out-of-memory rows it would have rejected before
launch, and how many rows that fit it would have rejected wrongly. And what a single peak would
allow (``one_peak_scaling``): every finished row's peak scaled to every other row by the ratio of
their activation counts (``autotune.memory_model.scale_peak``, what the model does only between
micro-batch sizes of one config), and at each margin how many rows that ran out of memory, and
how many that fit, such a prediction would reject.

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
from autotune.core.tables import RecordedTable, load_table
from autotune.memory_model import MemoryModel, scale_peak
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
        "one_peak_scaling": None if limit is None else one_peak_scaling(campaign.memory_model(limit), table, limit),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


ONE_PEAK_MARGINS = (0.25, 0.5, 1.0)


def one_peak_scaling(model: MemoryModel, table: RecordedTable, limit: float) -> dict:
    """Every ordered pair of an ok row (the one peak) and another row: the scaled prediction
    against the other row's peak, and the rejections it would make at each margin."""
    finished = [(config, row) for config, row in table.rows.items() if row.outcome in ("ok", "oom")]
    pairs = [(scale_peak(model.terms(other), model.terms(config), row.peak_memory_gib * 2**30), other_row)
             for config, row in finished if row.outcome == "ok"
             for other, other_row in finished if other != config]
    over_peak = sorted(predicted / (other.peak_memory_gib * 2**30) for predicted, other in pairs if other.outcome == "ok")
    return {
        "pairs": len(pairs),
        "predicted_over_peak_of_fitting_rows": {"min": over_peak[0], "median": statistics.median(over_peak),
                                                "max": over_peak[-1]},
        "by_margin": {str(margin): {
            "oom_pairs_rejected": sum(predicted * (1 - margin) > limit for predicted, other in pairs if other.outcome == "oom"),
            "oom_pairs": sum(other.outcome == "oom" for _, other in pairs),
            "fitting_pairs_rejected": sum(predicted * (1 - margin) > limit for predicted, other in pairs
                                          if other.outcome == "ok"),
            "fitting_pairs": len(over_peak),
        } for margin in ONE_PEAK_MARGINS},
    }


if __name__ == "__main__":
    main()
