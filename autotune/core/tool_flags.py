"""How Megatron-Bridge and Megatron-LM spell a config: Bridge's Hydra overrides and Megatron-LM's flags,
written and read back.

The spellings follow what the target tools need, as their own sources state it (megatron-core
0.16.1–0.19, Megatron-LM's ``megatron/training/arguments.py``, Megatron-Bridge 0.3 and 0.6):

- names follow the megatron-core version: ``cuda_graph_scope`` is ``cuda_graph_modules`` from
  0.18, and a Bridge recipe that still sets the old field gets ``model.cuda_graph_scope=null`` (set
  together they fail megatron-core's check); a full-iteration graph is ``cuda_graph_impl=local``
  with scope ``[full_iteration]`` before 0.18 (``megatron_graph_settings``);
- companion settings the tools demand of a knob value: the NaN check off for full-iteration graphs;
  Transformer Engine's RNG tracker for any CUDA graph in Bridge (Megatron-LM turns it on itself for
  graphs; Bridge does not, and TE's attention then refuses the capture: "Unsupported RNG states
  tracker", measured with Bridge 0.6.2 on the H200);
  for Megatron-LM's torch FSDP2 no gradient-accumulation fusion and untied embeddings; for
  Megatron-FSDP the distributed optimizer and ``fsdp_dtensor`` checkpoints (in Bridge too, whose
  ``validate()`` asserts the format, and Bridge's ``dist.use_megatron_fsdp``, which it ORs with
  ``ddp.use_megatron_fsdp``); local graphs with
  expert parallelism on Megatron-LM before 0.18 need padded experts;
- Bridge's Qwen3-VL MoE provider freezes the language model by default: our bursts train it, so the
  override says ``model.freeze_language_model=false``; FP8 goes through ``mixed_precision``: its
  fields for Bridge 0.3, a preset name for Bridge 0.6, whose recipes hold the precision as one;
- what a tool cannot express is refused with its reason (:class:`ExportRefused`): Megatron-LM has no
  flag that freezes the vision projection; Megatron-Bridge 0.6 (which pins megatron-core 0.19)
  runs ``cuda_graph_impl=local`` only as full-iteration graphs and has no preset for some FP8
  format/scaling pairs.

It lives in the shared core because two sides apply the same spelling: the export a user pastes,
and the ``bridge`` trainable, whose trials run the user's recipe with exactly those overrides (so a
winner's export is what its trial ran).
"""

from __future__ import annotations

from typing import Collection

from packaging.version import Version

from autotune.core.errors import AutotuneError
from autotune.core.knobs import KNOBS, Config, megatron_graph_settings, parse_bridge_overrides, parse_megatron_lm_args

GRAPH_KNOBS = ("cuda_graph_impl", "cuda_graph_scope")
BRIDGE_LOCAL_ONLY_FULL_ITERATION = Version("0.19.0")
"""Megatron-Bridge 0.6, the release on megatron-core 0.19, accepts ``cuda_graph_impl="local"`` only
for full-iteration graphs (``utils/cuda_graph.py``); 0.3 (megatron-core 0.16) accepts per-layer ones."""
BRIDGE_PRECISION_PRESETS = Version("0.19.0")
"""Megatron-Bridge 0.6's recipes name their precision by preset (``cfg.mixed_precision = "bf16_mixed"``),
so ``mixed_precision.fp8=…`` cannot be overridden there (Hydra: "Could not override"); 0.3's
recipes hold a ``MixedPrecisionConfig`` whose fields can."""
BRIDGE_PRECISION_PRESET = {  # (fp8, fp8_recipe) → Bridge 0.6's registered bf16 preset
    ("none", None): "bf16_mixed",
    ("hybrid", "delayed"): "bf16_with_fp8_delayed_scaling_mixed",
    ("hybrid", "tensorwise"): "bf16_with_fp8_current_scaling_mixed",
    ("hybrid", "blockwise"): "bf16_with_fp8_subchannel_scaling_mixed",
    ("e4m3", "mxfp8"): "bf16_with_mxfp8_mixed",
}
PRECISION_KNOBS = ("fp8", "fp8_recipe")
PADDED_EXPERTS_NOT_NEEDED = Version("0.18.0")
"""Megatron-LM before 0.18 asserts ``--moe-pad-experts-for-cuda-graph-inference`` for local graphs
with expert parallelism."""

BRIDGE_COMPANION_KEYS = frozenset({
    "rerun_state_machine.check_for_nan_in_loss", "model.freeze_language_model", "dist.use_megatron_fsdp",
    "train.global_batch_size", "checkpoint.ckpt_format", "rng.te_rng_tracker",
})
MEGATRON_LM_COMPANION_FLAGS = {  # flag → how many operands it takes
    "--no-check-for-nan-in-loss-and-grad": 0, "--moe-pad-experts-for-cuda-graph-inference": 0,
    "--no-gradient-accumulation-fusion": 0, "--untie-embeddings-and-output-weights": 0,
    "--use-distributed-optimizer": 0, "--ckpt-format": 1, "--global-batch-size": 1,
}


class ExportRefused(AutotuneError):
    """The target tool rejects this config in any spelling; the message is the tool's reason."""


def _older(version: str | None, than: Version) -> bool:
    return version is not None and Version(version) < than


def _full_iteration(config: Config) -> bool:
    return config.cuda_graph_impl == "full_iteration"


def _bridge_presets(version: str | None) -> bool:
    return not _older(version, BRIDGE_PRECISION_PRESETS)


def _precision_preset(config: Config) -> str:
    recipe = None if config.fp8 == "none" else config.fp8_recipe
    if (config.fp8, recipe) not in BRIDGE_PRECISION_PRESET:
        raise ExportRefused(
            f"Megatron-Bridge 0.6 recipes set precision by preset name and none is fp8 {config.fp8} with "
            f"{recipe} scaling (its bf16 presets: {', '.join(BRIDGE_PRECISION_PRESET.values())}); "
            "export for megatron-core 0.16 to target Bridge 0.3, whose recipes take the fields")
    return BRIDGE_PRECISION_PRESET[(config.fp8, recipe)]


def emitted_knobs(config: Config, tuned: Collection[str] | None) -> list[str]:
    """The active knobs a flag format writes: those the campaign tuned and the knobs they switch
    on (``recompute_method`` under a tuned ``recompute_granularity=full``), so a paste changes
    nothing in the user's recipe that the campaign did not choose; every active knob when
    ``tuned`` is ``None`` (``--all``, or a document that does not say)."""
    active = config.explicit()
    if tuned is None:
        return list(active)
    return [name for name in active if name in tuned
            or (KNOBS[name].active_when is not None and KNOBS[name].active_when.parent in tuned)]


def bridge_overrides(config: Config, megatron_core_version: str | None,
                     tuned: Collection[str] | None = None) -> list[str]:
    """Hydra overrides for a Bridge recipe, e.g. ``model.recompute_granularity=selective``, for the
    knobs :func:`emitted_knobs` picks, then the companion settings their values need (module docstring)."""
    names = emitted_knobs(config, tuned)
    impl, scope = megatron_graph_settings(config, megatron_core_version)
    if impl == "local" and not _full_iteration(config) and not _older(megatron_core_version,
                                                                      BRIDGE_LOCAL_ONLY_FULL_ITERATION):
        raise ExportRefused(
            'Megatron Bridge 0.6 supports model.cuda_graph_impl="local" only for full-iteration CUDA graphs; '
            'use "transformer_engine" for scoped capture (export for megatron-core 0.16 to target Bridge 0.3)')
    presets = _bridge_presets(megatron_core_version)
    overrides = [KNOBS[name].bridge_override(config[name], megatron_core_version)
                 for name in names if name not in GRAPH_KNOBS and not (presets and name in PRECISION_KNOBS)]
    if presets and any(name in PRECISION_KNOBS for name in names):
        overrides.append(f"mixed_precision={_precision_preset(config)}")
    scope_knob = KNOBS["cuda_graph_scope"]
    if "cuda_graph_impl" in names:
        overrides.append(f"{KNOBS['cuda_graph_impl'].bridge_key}={impl}")
        if scope is not None:
            overrides.append(f"{scope_knob.bridge_key_for(megatron_core_version)}=[{','.join(scope)}]")
        if scope_knob.bridge_key_for(megatron_core_version) != scope_knob.bridge_key:
            overrides.append(f"{scope_knob.bridge_key}=null")  # recipes still set the deprecated field
        if impl != "none":
            overrides.append("rng.te_rng_tracker=true")
        if _full_iteration(config):
            overrides.append("rerun_state_machine.check_for_nan_in_loss=false")
    if "use_megatron_fsdp" in names:
        overrides.append(f"dist.use_megatron_fsdp={str(config.use_megatron_fsdp).lower()}")
        if config.use_megatron_fsdp:
            overrides.append("checkpoint.ckpt_format=fsdp_dtensor")
    overrides.append("model.freeze_language_model=false")
    return overrides


def megatron_lm_args(config: Config, megatron_core_version: str | None,
                     tuned: Collection[str] | None = None) -> list[str]:
    """Megatron-LM flags for the knobs :func:`emitted_knobs` picks where they differ from its
    defaults, then the companions."""
    if config.freeze_vision_projection:
        raise ExportRefused("Megatron-LM has no flag that freezes the vision projection: pretrain_vlm.py freezes "
                            "only the language model and the ViT (--freeze-LM, --freeze-ViT)")
    names = emitted_knobs(config, tuned)
    args = [arg for name in names if name not in GRAPH_KNOBS and KNOBS[name].megatron_lm_flag is not None
            for arg in KNOBS[name].megatron_lm_args(config[name], megatron_core_version)]
    impl, scope = megatron_graph_settings(config, megatron_core_version)
    if impl != "none" and "cuda_graph_impl" in names:
        args += ["--cuda-graph-impl", impl]
        args += [KNOBS["cuda_graph_scope"].megatron_lm_flag_for(megatron_core_version), *scope] if scope else []
    if _full_iteration(config) and "cuda_graph_impl" in names:
        args.append("--no-check-for-nan-in-loss-and-grad")
    if impl == "local" and config.expert_model_parallel_size > 1 and "cuda_graph_impl" in names \
            and _older(megatron_core_version, PADDED_EXPERTS_NOT_NEEDED):
        args.append("--moe-pad-experts-for-cuda-graph-inference")
    if config.use_torch_fsdp2 and "use_torch_fsdp2" in names:
        args += ["--no-gradient-accumulation-fusion", "--untie-embeddings-and-output-weights"]
    if config.use_megatron_fsdp and "use_megatron_fsdp" in names:
        args += ["--use-distributed-optimizer", "--ckpt-format", "fsdp_dtensor"]
    return args


def read_bridge_overrides(overrides: list[str]) -> Config:
    """Inverse of :func:`bridge_overrides`: companions dropped, a pre-0.18 full iteration read as one."""
    knob_overrides = [o for o in overrides if o.partition("=")[0] not in BRIDGE_COMPANION_KEYS
                      and o != f"{KNOBS['cuda_graph_scope'].bridge_key}=null"]
    legacy = {f"{KNOBS['cuda_graph_impl'].bridge_key}=local",
              f"{KNOBS['cuda_graph_scope'].bridge_key}=[full_iteration]"}
    if legacy <= set(knob_overrides):
        knob_overrides = [o for o in knob_overrides if o not in legacy]
        knob_overrides.append(f"{KNOBS['cuda_graph_impl'].bridge_key}=full_iteration")
    presets = {f"mixed_precision={preset}": values for values, preset in BRIDGE_PRECISION_PRESET.items()}
    for override in [o for o in knob_overrides if o in presets]:
        knob_overrides.remove(override)
        fp8, recipe = presets[override]
        knob_overrides.append(f"{KNOBS['fp8'].bridge_key}={fp8}")
        knob_overrides += [] if recipe is None else [f"{KNOBS['fp8_recipe'].bridge_key}={recipe}"]
    return parse_bridge_overrides(knob_overrides)


def read_megatron_lm_args(argv: list[str]) -> Config:
    """Inverse of :func:`megatron_lm_args`: companions dropped, a pre-0.18 full iteration read as one."""
    knob_args: list[str] = []
    index = 0
    while index < len(argv):
        if argv[index] in MEGATRON_LM_COMPANION_FLAGS:
            index += 1 + MEGATRON_LM_COMPANION_FLAGS[argv[index]]
            continue
        knob_args.append(argv[index])
        index += 1
    scope = knob_args.index("--cuda-graph-scope") if "--cuda-graph-scope" in knob_args else None
    if scope is not None and knob_args[scope + 1:scope + 2] == ["full_iteration"]:
        del knob_args[scope:scope + 2]
        knob_args[knob_args.index("--cuda-graph-impl") + 1] = "full_iteration"
    return parse_megatron_lm_args(knob_args)
