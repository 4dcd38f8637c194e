"""Our rules against megatron-core with Transformer Engine, on the GPU (the CPU suite checks
megatron-core 0.16.1 without TE, tests/test_megatron_conformance.py).

For every config of the TE spaces that our rules accept on this machine's probed stack, build what a
burst builds before its first step: the decoder's ``TransformerConfig`` (with the trainable's fused
kernels), the DDP config, the VLM from TE layer specs on the GPU, megatron-core's DDP wrapper and,
for TE graphs, megatron-core's ``TECudaGraphHelper`` (its scope checks run there). Configs that
differ only in micro-batch size or frozen vision build the same modules, so one of each group is
built. Every rejection is recorded with megatron-core's message: a rejection our rules missed is a
rule to write.

Run on the GPU machine with TE installed (see ../shared/device):
  python bench/megatron_conformance_gpu.py --out DIR
Writes DIR/megatron_conformance_gpu.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from autotune.core.knobs import Config
from autotune.engine.probe import probed_stack
from autotune.rules import violations
from autotune.space import builtin_space_path, load_space, target_context
from trainables.probe import probe

SPACES = ("h200_te", "h200_qwen3_vl_30b_proxy")
BUILD_ONLY_FIELDS = ("micro_batch_size", "freeze_vision_model")
"""Knobs that change no module megatron-core builds (the helper's sample shapes aside)."""


def build(config: Config, model) -> None:
    """What a burst builds before step 1; raises what megatron-core raises."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.num_microbatches_calculator import (
        destroy_num_microbatches_calculator,
        init_num_microbatches_calculator,
    )
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from trainables.megatron.config_mapping import build_ddp_config, build_transformer_config
    from trainables.megatron.model import MegatronMoEVLM, decoder_kernel_fields

    decoder_config = build_transformer_config(config, model, extra=decoder_kernel_fields(True))
    ddp_config = build_ddp_config(config)
    parallel_state.initialize_model_parallel()
    try:
        graphs = config.cuda_graph_impl != "none"
        model_parallel_cuda_manual_seed(1234, te_rng_tracker=graphs, use_cudagraphable_rng=graphs,
                                        force_reset_rng=True)
        init_num_microbatches_calculator(0, None, config.micro_batch_size, config.micro_batch_size, 1)
        vlm = MegatronMoEVLM(decoder_config, model, True).cuda().bfloat16()
        wrapped = DistributedDataParallel(decoder_config, ddp_config, vlm)
        if config.cuda_graph_impl == "transformer_engine":
            from megatron.core.transformer.cuda_graphs import TECudaGraphHelper

            helper = TECudaGraphHelper(model=[wrapped], config=decoder_config, seq_length=model.seq_length,
                                       micro_batch_size=config.micro_batch_size, optimizers=[])
            if not helper.flattened_callables:
                raise AssertionError("TECudaGraphHelper found no layer to graph")
        del wrapped, vlm
    finally:
        destroy_num_microbatches_calculator()
        parallel_state.destroy_model_parallel()
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    facts = probe()
    report = {"benchmark": "megatron_conformance_gpu", "command": "python bench/megatron_conformance_gpu.py",
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "stack": facts, "spaces": {}}
    for name in SPACES:
        space = load_space(builtin_space_path(name))
        context = target_context(space)
        stack, _ = probed_stack(context.stack, [facts], uses_stack=True)
        context = dataclasses.replace(context, stack=stack)
        accepted = [c for c in space.configs() if not violations(c, context)]
        groups: dict[tuple, Config] = {}
        for config in accepted:
            key = tuple((k, v) for k, v in config.items() if k not in BUILD_ONLY_FIELDS)
            groups.setdefault(key, config)
        rejected = []
        for config in groups.values():
            try:
                build(config, context.model)
            except Exception as exc:  # noqa: BLE001 - every rejection is the finding
                rejected.append({"config": config.describe(), "error": f"{type(exc).__name__}: {exc}"[:1000],
                                 "trace_tail": traceback.format_exc().strip().splitlines()[-6:]})
        report["spaces"][name] = {"configs": space.size(), "accepted_by_rules": len(accepted),
                                  "built": len(groups), "rejected_by_megatron_core": rejected}
        print(f"{name}: {space.size()} configs, {len(accepted)} accepted by our rules, {len(groups)} built, "
              f"{len(rejected)} rejected by megatron-core", flush=True)
        for item in rejected:
            print(f"  {item['config']}: {item['error'][:300]}", flush=True)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "megatron_conformance_gpu.json").write_text(json.dumps(report, indent=2, default=str))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
