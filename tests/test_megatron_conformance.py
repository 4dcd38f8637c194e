"""Our rules against megatron-core itself (0.16.1 imports on the CPU and validates configs there).

Two directions: every config our rules accept from the shipped spaces builds megatron-core's
``TransformerConfig`` and DDP config; and every config megatron-core rejects, among a wide seeded
sample of adversarial configs, our rules reject first.
"""

from __future__ import annotations

import dataclasses
import random
import warnings
import zlib
from pathlib import Path

import pytest

pytest.importorskip("megatron.core", reason="needs the `megatron` extra (megatron-core)")

from autotune.core.knobs import KNOBS, Config, complete_config  # noqa: E402
from autotune.rules import RULES, violations  # noqa: E402
from autotune.space import load_space, target_context  # noqa: E402
from conftest import make_context  # noqa: E402
from test_rules import CASES  # noqa: E402
from trainables.probe import transformer_engine_status  # noqa: E402
from trainables.megatron.config_mapping import (  # noqa: E402
    build_ddp_config,
    build_transformer_config,
    freeze_arguments,
    installed_megatron_core_version,
)

pytestmark = pytest.mark.megatron
MCORE = installed_megatron_core_version()
TE_VERSION = transformer_engine_status()[0]
SPACES = [p for p in sorted(Path("search_spaces").glob("*.yaml")) if load_space(p).target.trainable == "megatron"]

warnings.filterwarnings("ignore", module="megatron")


def megatron_rejects(config: Config, model) -> str | None:
    try:
        build_transformer_config(config, model)
        build_ddp_config(config)
    except (ValueError, AssertionError, KeyError, TypeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def test_megatron_spaces_are_all_checked() -> None:
    assert {p.stem for p in SPACES} == {"h200_single", "h200_dual", "h200_te", "h200_te_grid",
                                        "h200_qwen3_vl_30b_proxy", "fsdp_first", "parallel_3d"}


@pytest.mark.parametrize("space_path", SPACES, ids=lambda p: p.stem)
def test_every_accepted_config_builds_in_megatron(space_path: Path) -> None:
    space = load_space(space_path)
    context = target_context(space)
    # Judge with the installed megatron-core's version-dependent rules.
    context = dataclasses.replace(context, stack=context.stack.model_copy(update={"megatron_core": MCORE}))
    accepted = [c for c in space.configs() if not violations(c, context)]
    assert accepted
    # megatron-core checks TE's fused permute and FP8 by asking TE (importing it, reading its
    # version): without TE here, those fields are left to the GPU conformance script
    # (bench/megatron_conformance_gpu.py) and everything else is built.
    built = [c.replace(moe_permute_fusion=False, fp8="none", fp8_recipe=None) if TE_VERSION is None else c
             for c in accepted]
    failures = [(c.describe(), err) for c in built if (err := megatron_rejects(c, context.model))]
    assert failures == []


def _adversarial_configs(seed: int, count: int) -> list[Config]:
    """Seeded random configs over values that Megatron's own checks care about."""
    rng = random.Random(seed)
    choices = {
        "tensor_model_parallel_size": [1, 2, 3, 4],
        "sequence_parallel": [False, True],
        "expert_model_parallel_size": [1, 2, 4],
        "expert_tensor_parallel_size": [None, 1, 2],
        "recompute_granularity": ["none", "selective", "full"],
        "recompute_method": ["uniform", "block", None],
        "recompute_num_layers": [1, 2, None],
        "recompute_modules": [["core_attn"], ["moe_act"], ["mlp"], ["moe"], ["shared_experts"], ["mla_up_proj"],
                              ["layernorm", "core_attn"]],
        "cuda_graph_impl": ["none", "local", "transformer_engine", "full_iteration"],
        "cuda_graph_scope": [[], ["attn"], ["moe_preprocess"], ["moe_router", "moe_preprocess"], ["moe", "moe_router"],
                             ["moe"], ["mlp"], ["attn", "moe_router", "moe_preprocess"]],
        "moe_token_dispatcher_type": ["allgather", "alltoall", "flex"],
        "moe_flex_dispatcher_backend": ["deepep", "hybridep"],
        "moe_grouped_gemm": [False, True],
    }
    configs = []
    while len(configs) < count:
        values = {name: rng.choice(options) for name, options in choices.items()}
        # Drop values for knobs their parent switches off, as a space would.
        resolved = {}
        for name in KNOBS:
            if name not in values:
                continue
            resolved[name] = values[name]
            knob = KNOBS[name]
            if knob.active_when is not None:
                parent = complete_config({k: v for k, v in resolved.items() if k != name})[knob.active_when.parent]
                if not knob.active_when.test(parent):
                    del resolved[name]
        configs.append(complete_config(resolved))
    return configs


MODEL_VARIANTS = {
    "dropless": {},
    "dropout": {"attention_dropout": 0.1, "hidden_dropout": 0.1},
    "drop_and_pad": {"moe_expert_capacity_factor": 1.0, "moe_pad_expert_input_to_capacity": True},
    "capacity_only": {"moe_expert_capacity_factor": 1.25},
    "dense_first_shared": {"first_k_dense_layers": 1, "moe_shared_expert_intermediate_size": 1024,
                           "moe_shared_expert_overlap": True},
}


@pytest.mark.parametrize("variant", MODEL_VARIANTS)
def test_megatron_rejections_are_caught_by_our_rules_first(variant: str) -> None:
    context = make_context(world_size=8, model_overrides=MODEL_VARIANTS[variant], megatron_core=MCORE)
    rejected_by_megatron = 0
    missed = []
    # zlib.crc32, not hash(): string hashes are salted per process, so the sample would change every run
    for config in _adversarial_configs(seed=zlib.crc32(variant.encode()) % 1000, count=600):
        reason = megatron_rejects(config, context.model)
        if reason is None:
            continue
        rejected_by_megatron += 1
        if not violations(config, context):
            missed.append((config.describe(), reason))
    assert missed == []
    assert rejected_by_megatron > 50, "the sample must exercise Megatron's checks"


# Rules whose violation megatron-core's config constructors themselves raise on, so the test can
# hold each to a real Megatron rejection. The others are enforced later by Megatron (parallel
# state, layer building, training arguments), by the stack, or are ours (no-op duplicates).
ENFORCED_BY_MEGATRON_CONFIG = {
    "heads_divisible_by_tp",
    "sequence_parallel_needs_tp",
    "full_recompute_needs_method_and_layers",
    "moe_act_recompute_needs_grouped_gemm",
    "mla_up_proj_recompute_needs_mla",
    "shared_experts_recompute_excludes_overlap",
    "full_recompute_needs_full_iteration_graphs",
    "graphed_attention_recompute_needs_no_attention_dropout",
    "graphed_mlp_recompute_needs_no_hidden_dropout",
    "moe_and_moe_router_scopes_exclusive",
    "moe_scope_needs_drop_and_pad",
    "moe_preprocess_scope_excludes_capacity_alltoall",
    "mlp_scope_needs_dense_layers",
    "te_graphs_moe_recompute_excludes_moe_router_scope",
    "deepep_excludes_pad_to_capacity",
    "shared_expert_overlap_needs_alltoall",
}


def test_config_enforced_rules_name_real_rules() -> None:
    assert ENFORCED_BY_MEGATRON_CONFIG <= set(RULES)
    for name in ENFORCED_BY_MEGATRON_CONFIG:
        assert RULES[name].source == "megatron-core"


@pytest.mark.parametrize(
    "case", [c for c in CASES if c.rule in ENFORCED_BY_MEGATRON_CONFIG], ids=lambda c: c.rule
)
def test_megatron_config_rejects_what_the_rule_rejects(case) -> None:
    context = make_context(**{**case.context, "megatron_core": MCORE})
    assert megatron_rejects(complete_config(case.rejected), context.model) is not None
    assert megatron_rejects(complete_config(case.accepted), context.model) is None


def test_registry_fields_exist_in_installed_megatron() -> None:
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields = {
        "transformer": {f.name for f in dataclasses.fields(TransformerConfig)},
        "ddp": {f.name for f in dataclasses.fields(DistributedDataParallelConfig)},
    }
    for knob in KNOBS.values():
        if knob.megatron_target in fields:
            assert knob.megatron_field_for(MCORE) in fields[knob.megatron_target], knob.name


def test_llava_freeze_arguments_match_megatron() -> None:
    import inspect

    from megatron.core.models.multimodal.llava_model import LLaVAModel

    parameters = set(inspect.signature(LLaVAModel.freeze).parameters) - {"self"}
    assert set(freeze_arguments(complete_config({"freeze_vision_model": True}))) == parameters


def test_full_iteration_graph_encoding_per_version() -> None:
    from trainables.megatron.config_mapping import knob_fields

    config = complete_config({"cuda_graph_impl": "full_iteration"})
    old = knob_fields(config, "0.16.1", "transformer")
    assert old["cuda_graph_impl"] == "local" and old["cuda_graph_scope"] == ["full_iteration"]
    new = knob_fields(config, "0.19.2", "transformer")
    assert new["cuda_graph_impl"] == "full_iteration" and "cuda_graph_modules" not in new
    scoped = knob_fields(complete_config({"cuda_graph_impl": "local", "cuda_graph_scope": ["attn"]}), "0.19.2", "transformer")
    assert scoped["cuda_graph_modules"] == ["attn"]
