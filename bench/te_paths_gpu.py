"""The Transformer Engine paths of the megatron-core trainable on one CUDA GPU, each with what the
burst observed of it: TE-scoped CUDA graphs per scope (graphs captured and replayed), grouped GEMM,
FP8 per recipe, TE's fused MoE kernels, and local graphs with grouped GEMM (with
``CUDA_LAUNCH_BLOCKING=1``, so a device-side failure names its kernel).

Run on the GPU machine with TE installed (see ../shared/device):
  python bench/te_paths_gpu.py --steps 16 --memory-cap 0.25 --out DIR
Writes DIR/te_paths_gpu.json (bench/results/te_paths_gpu.json holds two runs of 2026-12-02): per config the outcome, steady useful tokens/s with its interval,
peak memory, the evidence (its checks and observations), the first lines of any error, and the
measurement contract. The rules are not applied: each config runs as given, so a path the rules
reject shows here what the stack does with it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from autotune.bursts import data_folder, run_burst, summarize
from autotune.core.contract import BurstRequest, DataSpec
from autotune.core.knobs import complete_config
from autotune.core.model import model_preset
from trainables.probe import probe

SAFE_SCOPE = ["attn", "moe_router", "moe_preprocess"]
MBS4 = {"micro_batch_size": 4, "recompute_granularity": "selective", "recompute_modules": ["core_attn"],
        "freeze_vision_model": True}
GROUPED = {**MBS4, "moe_grouped_gemm": True}
FUSED = {"moe_permute_fusion": True, "moe_router_fusion": True, "cross_entropy_loss_fusion": True}
CONFIGS: dict[str, dict] = {
    "bring-up: MBS 1, full recompute, vision trained": {
        "micro_batch_size": 1, "recompute_granularity": "full"},
    "MBS 4 selective core_attn, frozen vision, no grouped GEMM": MBS4,
    "MBS 4 + grouped GEMM": GROUPED,
    "MBS 4 + grouped GEMM + fused permute/router/cross entropy": {**GROUPED, **FUSED},
    "MBS 4 + grouped GEMM + TE graphs [attn]": {
        **GROUPED, "cuda_graph_impl": "transformer_engine", "cuda_graph_scope": ["attn"]},
    "MBS 4 + grouped GEMM + TE graphs [moe_router moe_preprocess]": {
        **GROUPED, "cuda_graph_impl": "transformer_engine", "cuda_graph_scope": ["moe_router", "moe_preprocess"]},
    "MBS 4 + grouped GEMM + TE graphs [attn moe_router moe_preprocess]": {
        **GROUPED, "cuda_graph_impl": "transformer_engine", "cuda_graph_scope": SAFE_SCOPE},
    "MBS 4 no grouped GEMM + fp8 hybrid tensorwise": {**MBS4, "fp8": "hybrid", "fp8_recipe": "tensorwise"},
    "MBS 4 + grouped GEMM + fp8 hybrid delayed": {**GROUPED, "fp8": "hybrid", "fp8_recipe": "delayed"},
    "MBS 4 + grouped GEMM + fp8 hybrid tensorwise": {**GROUPED, "fp8": "hybrid", "fp8_recipe": "tensorwise"},
    "MBS 4 + grouped GEMM + fp8 hybrid blockwise": {**GROUPED, "fp8": "hybrid", "fp8_recipe": "blockwise"},
    "MBS 4 + grouped GEMM + fp8 tensorwise + TE graphs [attn moe_router moe_preprocess] + fused": {
        **GROUPED, **FUSED, "fp8": "hybrid", "fp8_recipe": "tensorwise", "cuda_graph_impl": "transformer_engine",
        "cuda_graph_scope": SAFE_SCOPE},
    "MBS 8 selective core_attn moe_act + grouped GEMM + TE graphs [attn moe_router moe_preprocess] + fused": {
        **GROUPED, **FUSED, "micro_batch_size": 8, "recompute_modules": ["core_attn", "moe_act"],
        "cuda_graph_impl": "transformer_engine", "cuda_graph_scope": SAFE_SCOPE},
    "MBS 4 + grouped GEMM + local graphs [attn moe_router moe_preprocess] (blocking launches)": {
        **GROUPED, "cuda_graph_impl": "local", "cuda_graph_scope": SAFE_SCOPE},
    "MBS 4 + grouped GEMM + local graphs [moe_router moe_preprocess] (blocking launches)": {
        **GROUPED, "cuda_graph_impl": "local", "cuda_graph_scope": ["moe_router", "moe_preprocess"]},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--workers", type=int, default=6)
    parser.add_argument("--preset", default="h200_small_moe_vlm")
    parser.add_argument("--memory-cap", type=float, default=None, help="per-process GPU memory fraction")
    parser.add_argument("--only", action="append", default=None,
                        help="run only the configs whose name contains this text (repeatable)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    assert torch.cuda.is_available(), "this benchmark needs a CUDA device"
    model = model_preset(args.preset)
    folder = data_folder("builtin_photos", None, Path.cwd())
    args.out.mkdir(parents=True, exist_ok=True)
    report = {
        "benchmark": "te_paths_gpu",
        "command": "python bench/te_paths_gpu.py " + " ".join(
            f"--{k.replace('_', '-')} {shlex.quote(str(v))}" for k, values in vars(args).items()
            if values is not None and k != "out" for v in (values if isinstance(values, list) else [values])),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "cuda": torch.version.cuda,
                    "python": platform.python_version()},
        "stack": probe(),
        "results": [],
    }
    for name, values in CONFIGS.items():
        if args.only and not any(part in name for part in args.only):
            continue
        if "blocking launches" in name and os.environ.get("CUDA_LAUNCH_BLOCKING") != "1":
            # Only this config runs with blocking launches: a child process of this script runs it
            # with the variable set (ranks take the environment of the process that launches them).
            report["results"].append(_run_blocking(name, args))
            (args.out / "te_paths_gpu.json").write_text(json.dumps(report, indent=2, default=str))
            continue
        config = complete_config({"moe_token_dispatcher_type": "alltoall", **values})
        request = BurstRequest(config=config, model=model, data=DataSpec(str(folder), "real"), steps=args.steps,
                               world_size=1, data_workers=args.workers, memory_cap_fraction=args.memory_cap)
        summary = summarize(request, run_burst("megatron", request), min_warmup=3)
        steady = summary.get("steady") or {}
        error = summary["error"] or ""
        row = {"name": name, "config": config.describe(), "outcome": summary["outcome"],
               "useful_tokens_per_s": steady.get("mean"), "relative_half_width": steady.get("relative_half_width"),
               "peak_memory_gib": steady.get("peak_memory_bytes", 0) / 2**30 or None,
               "stage_share": steady.get("stage_share"), "evidence": summary["evidence"],
               "error_head": "\n".join(error.strip().splitlines()[-12:]) or None,
               "contract": summary.get("contract"), "steps": summary["steps"]}
        report["results"].append(row)
        print(f"{name}: {row['outcome']} {row['useful_tokens_per_s'] or 0:.0f} tok/s "
              f"checks {summary['evidence'].get('checks')} "
              f"te {({k: v for k, v in summary['evidence'].items() if k.startswith('te_') or k == 'fp8'})} "
              f"{(row['error_head'] or '')[-800:]}", flush=True)
        (args.out / "te_paths_gpu.json").write_text(json.dumps(report, indent=2, default=str))


def _run_blocking(name: str, args: argparse.Namespace) -> dict:
    """The config ``name`` run by this script in a child process with ``CUDA_LAUNCH_BLOCKING=1``."""
    with tempfile.TemporaryDirectory() as folder:
        command = [sys.executable, __file__, "--only", name, "--steps", str(args.steps), "--workers",
                   str(args.workers), "--preset", args.preset, "--out", folder]
        if args.memory_cap is not None:
            command += ["--memory-cap", str(args.memory_cap)]
        subprocess.run(command, env=os.environ | {"CUDA_LAUNCH_BLOCKING": "1"}, check=False)
        written = Path(folder) / "te_paths_gpu.json"
        results = json.loads(written.read_text())["results"] if written.is_file() else []
    return results[0] if results else {"name": name, "outcome": "harness_failed", "error_head": "no result written"}


if __name__ == "__main__":
    main()
