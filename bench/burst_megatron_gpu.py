"""The megatron-core trainable on one CUDA GPU: named configs (or a campaign's winner) against the
bring-up config, each on real photos and on image-free mock data (benchmark-only).

Run on the GPU machine (see ../shared/device):
  python bench/burst_megatron_gpu.py --steps 30 --out DIR [--winner RUN_DIR/winner.yaml] [--memory-cap 0.25]
Writes DIR/burst_megatron_gpu.json: per burst the steady useful tokens/s with its interval,
model TFLOP/s and MFU per GPU, peak memory, stage split, evidence and the measurement contract.
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
from autotune.export import load_document

H200_DENSE_BF16_PEAK = 0.989e15
"""The H200's dense bf16 peak (NVIDIA's figure), the denominator of MFU."""
BRING_UP = {"micro_batch_size": 1, "recompute_granularity": "full", "recompute_method": "uniform",
            "recompute_num_layers": 1, "cuda_graph_impl": "none"}
SAFE_SCOPE = {"cuda_graph_impl": "local", "cuda_graph_scope": ["attn", "moe_router", "moe_preprocess"]}
CONFIGS = {
    "bring-up (MBS 1, full recompute, no graphs)": BRING_UP,
    "MBS 2, selective core_attn, graphs attn+moe_router+moe_preprocess": {
        "micro_batch_size": 2, "recompute_granularity": "selective", "recompute_modules": ["core_attn"], **SAFE_SCOPE},
    "MBS 4, no recompute, graphs attn+moe_router+moe_preprocess, frozen vision": {
        "micro_batch_size": 4, **SAFE_SCOPE, "freeze_vision_model": True},
    "MBS 8, no recompute, no graphs": {"micro_batch_size": 8},
    "full recompute with local graphs (megatron-core rejects)": {**BRING_UP, **SAFE_SCOPE},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--workers", type=int, default=6)
    parser.add_argument("--preset", default="h200_small_moe_vlm")
    parser.add_argument("--memory-cap", type=float, default=None, help="per-process GPU memory fraction")
    parser.add_argument("--winner", type=Path, help="a campaign's winner.yaml: measure it against bring-up")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    assert torch.cuda.is_available(), "this benchmark needs a CUDA device"
    model = model_preset(args.preset)
    folder = data_folder("builtin_photos", None, Path.cwd())
    if args.winner:
        winner, _, _ = load_document(args.winner)
        configs = {"bring-up": BRING_UP, "campaign winner": winner.explicit()}
        mock_of = list(configs)
    else:
        configs = CONFIGS
        mock_of = list(CONFIGS)[:2]
    runs = [(name, values, "real") for name, values in configs.items()]
    runs += [(name, configs[name], "mock") for name in mock_of]
    results = []
    for name, values, realism in runs:
        config = complete_config({"moe_token_dispatcher_type": "alltoall", **values})
        request = BurstRequest(config=config, model=model, data=DataSpec(str(folder), realism), steps=args.steps,
                               world_size=1, data_workers=args.workers, memory_cap_fraction=args.memory_cap)
        summary = summarize(request, run_burst("megatron", request), min_warmup=3)
        steady = summary.get("steady") or {}
        if steady:
            steady["model_tflops_per_s_per_gpu"] = steady["model_flops_per_s_per_worker"] / 1e12
            steady["mfu"] = steady["model_flops_per_s_per_worker"] / H200_DENSE_BF16_PEAK
        print(f"{name} [{realism}]: {summary['outcome']} {steady.get('mean', 0):.0f} tok/s "
              f"±{100 * steady.get('relative_half_width', 0):.1f}% {steady.get('model_tflops_per_s_per_gpu', 0):.1f} "
              f"TFLOP/s peak {steady.get('peak_memory_bytes', 0) / 2**30:.1f} GiB "
              f"stages {steady.get('stage_share')} evidence {summary['evidence'].get('checks')} "
              f"{(summary['error'] or '')[-600:]}", flush=True)
        results.append({"name": name} | summary)
    by_key = {(r["name"], r["data_realism"]): r for r in results}

    def mean(name: str, realism: str) -> float | None:
        steady = by_key.get((name, realism), {}).get("steady")
        return steady["mean"] if steady else None

    first, best = list(configs)[0], list(configs)[1]
    ratios = {
        "mock_over_real_tokens_per_s": {name: (mean(name, "mock") / mean(name, "real"))
                                        if mean(name, "mock") and mean(name, "real") else None for name in mock_of},
        f"{best} over {first} (real)": (mean(best, "real") / mean(first, "real"))
        if mean(best, "real") and mean(first, "real") else None,
    }
    report = {
        "benchmark": "burst_megatron_gpu",
        "command": "python bench/burst_megatron_gpu.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None and k != "out"),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "cuda": torch.version.cuda,
                    "python": platform.python_version()},
        "mfu_peak_flops": H200_DENSE_BF16_PEAK,
        "ratios": ratios,
        "mock_note": "mock (image-free) figures are benchmark-only, never a throughput result",
        "results": results,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "burst_megatron_gpu.json").write_text(json.dumps(report, indent=2, default=str))
    print(json.dumps(ratios, indent=1))


if __name__ == "__main__":
    main()
