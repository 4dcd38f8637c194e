"""The native trainable on one CUDA GPU: CUDA-graph scopes, recompute and MBS, real against mock.

Run on the GPU machine (see ../shared/device): python bench/burst_native_gpu.py --out DIR
Writes DIR/burst_native_gpu.json with each burst's steady estimate, evidence and contract.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
from pathlib import Path

import torch

from autotune.bursts import data_folder, run_burst, summarize
from autotune.core.contract import BurstRequest, DataSpec
from autotune.core.knobs import complete_config
from autotune.core.model import model_preset

GRAPHS_ALL = {"cuda_graph_impl": "local", "cuda_graph_scope": ["attn", "moe_router", "moe_preprocess"]}
CONFIGS = {
    "MBS 2, no recompute, no graphs": {"micro_batch_size": 2},
    "MBS 2, graphs attn": {"micro_batch_size": 2, "cuda_graph_impl": "local", "cuda_graph_scope": ["attn"]},
    "MBS 2, graphs attn+moe_router+moe_preprocess": {"micro_batch_size": 2, **GRAPHS_ALL},
    "MBS 2, selective core_attn, graphs attn+router": {
        "micro_batch_size": 2, "recompute_granularity": "selective", "recompute_modules": ["core_attn"], **GRAPHS_ALL},
    "MBS 1, full recompute (bring-up)": {"micro_batch_size": 1, "recompute_granularity": "full"},
    "MBS 4, frozen vision, graphs attn+router": {"micro_batch_size": 4, "freeze_vision_model": True, **GRAPHS_ALL},
}
MOCK_OF = "MBS 2, graphs attn+moe_router+moe_preprocess"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--workers", type=int, default=6)
    parser.add_argument("--preset", default="h200_small_moe_vlm")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    assert torch.cuda.is_available(), "this benchmark needs a CUDA device"
    model = model_preset(args.preset)
    folder = data_folder("builtin_photos", None, Path.cwd())
    runs = [(name, values, "real") for name, values in CONFIGS.items()] + [(MOCK_OF + " [mock]", CONFIGS[MOCK_OF], "mock")]
    results = []
    for name, values, realism in runs:
        config = complete_config({"moe_token_dispatcher_type": "alltoall", **values})
        request = BurstRequest(config=config, model=model, data=DataSpec(str(folder), realism), steps=args.steps,
                               world_size=1, data_workers=args.workers)
        summary = summarize(request, run_burst("native", request), min_warmup=3)
        steady = summary.get("steady") or {}
        peak = steady.get("peak_memory_bytes", 0) / 2**30
        print(f"{name}: {summary['outcome']} {steady.get('mean', 0):.0f} tok/s ±{100 * steady.get('relative_half_width', 0):.1f}% "
              f"data wait {100 * steady.get('data_wait_share', 0):.1f}% peak {peak:.1f} GiB "
              f"graphs {summary['evidence'].get('cuda_graph_units')}/{summary['evidence'].get('cuda_graph_replays')} "
              f"{(summary['error'] or '')[-400:]}", flush=True)
        torch.cuda.reset_peak_memory_stats()
        results.append({"name": name} | summary)
    real = next(r for r in results if r["name"] == MOCK_OF)
    mock = next(r for r in results if r["name"] == MOCK_OF + " [mock]")
    report = {
        "benchmark": "burst_native_gpu",
        "command": f"python bench/burst_native_gpu.py --steps {args.steps} --workers {args.workers} --preset {args.preset}",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "cuda": torch.version.cuda,
                    "python": platform.python_version()},
        "mock_over_real_tokens_per_s": (mock["steady"]["mean"] / real["steady"]["mean"])
        if mock.get("steady") and real.get("steady") else None,
        "mock_note": "mock (image-free) figures are benchmark-only, never a throughput result",
        "results": results,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "burst_native_gpu.json").write_text(json.dumps(report, indent=2, default=str))
    print("mock/real useful tokens/s:", report["mock_over_real_tokens_per_s"])


if __name__ == "__main__":
    main()
