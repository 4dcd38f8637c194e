"""The knob registry: one definition per knob, values and names that round-trip."""

from __future__ import annotations

import pytest

from autotune.core.errors import KnobError
from autotune.core.knobs import (
    KNOBS,
    Config,
    complete_config,
    get_knob,
    parse_bridge_overrides,
    parse_megatron_lm_args,
)
from autotune.core.knobs._domains import BoolDomain, ChoiceDomain, IntDomain, SubsetDomain

ISSUE_KNOBS = {
    "micro_batch_size", "recompute_granularity", "recompute_method", "recompute_num_layers",
    "recompute_modules", "cuda_graph_impl", "cuda_graph_scope", "tensor_model_parallel_size",
    "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size", "context_parallel_size",
    "expert_model_parallel_size", "expert_tensor_parallel_size", "sequence_parallel",
    "moe_token_dispatcher_type", "moe_flex_dispatcher_backend", "moe_grouped_gemm",
    "use_megatron_fsdp", "data_parallel_sharding_strategy", "freeze_vision_model",
    "freeze_vision_projection",
}


def sample_values(name: str) -> list:
    """Representative canonical values of a knob's domain."""
    domain = KNOBS[name].domain
    if isinstance(domain, BoolDomain):
        return [False, True]
    if isinstance(domain, ChoiceDomain):
        return list(domain.choices)
    if isinstance(domain, IntDomain):
        return [domain.minimum, domain.minimum * 2, 8]
    if isinstance(domain, SubsetDomain):
        return [(), domain.elements[:1], domain.elements[:3], domain.elements]
    raise AssertionError(f"untested domain {domain!r}")


def config_with(name: str, value) -> Config:
    """A config where ``name`` is active (its parent switched on) and set to ``value``."""
    parents = {
        "recompute_method": {"recompute_granularity": "full"},
        "recompute_num_layers": {"recompute_granularity": "full"},
        "recompute_modules": {"recompute_granularity": "selective"},
        "cuda_graph_scope": {"cuda_graph_impl": "local"},
        "virtual_pipeline_model_parallel_size": {"pipeline_model_parallel_size": 2},
        "moe_flex_dispatcher_backend": {"moe_token_dispatcher_type": "flex"},
        "data_parallel_sharding_strategy": {"use_megatron_fsdp": True},
    }
    return complete_config({**parents.get(name, {}), name: value})


def test_registry_holds_every_knob_the_issue_names() -> None:
    assert ISSUE_KNOBS <= set(KNOBS)


def test_every_knob_is_documented_and_mapped() -> None:
    for knob in KNOBS.values():
        assert knob.doc.endswith(".") and len(knob.doc) > 20, knob.name
        assert knob.bridge_key.split(".")[0] in {"model", "ddp", "dist", "train", "mixed_precision"}, knob.name
        assert knob.bridge_key.endswith(knob.name), knob.name  # canonical names are Bridge leaf names
        assert knob.parse(knob.default) == knob.default or knob.default is None


@pytest.mark.parametrize("name", list(KNOBS))
def test_values_round_trip_through_megatron_and_text(name: str) -> None:
    knob = KNOBS[name]
    for value in sample_values(name):
        try:
            knob.parse(value)
        except KnobError:
            continue  # outside the domain (an empty recompute_modules, a VPP of 1)
        assert knob.from_megatron(knob.to_megatron(value)) == value
        assert knob.parse(knob.to_megatron(value) if knob.to_megatron(value) is not None else value) == value


@pytest.mark.parametrize("name", list(KNOBS))
@pytest.mark.parametrize("version", ["0.16.1", "0.19.2"])
def test_configs_round_trip_through_bridge_overrides_and_megatron_lm_flags(name: str, version: str) -> None:
    for value in sample_values(name):
        try:
            config = config_with(name, value)
        except KnobError:
            continue  # e.g. VPP minimum is 2; sample values below it are not in the domain
        overrides = [KNOBS[k].bridge_override(v, version) for k, v in config.explicit().items()]
        assert parse_bridge_overrides(overrides) == config, overrides
        if name == "freeze_vision_projection" and value:
            continue  # Megatron-LM has no such flag: the export refuses it (tests/test_export.py)
        argv = [arg for k, v in config.explicit().items() if KNOBS[k].megatron_lm_flag is not None
                for arg in KNOBS[k].megatron_lm_args(v, version)]
        assert parse_megatron_lm_args(argv) == config, argv


def test_cuda_graph_scope_renamed_in_megatron_core_0_18() -> None:
    knob = get_knob("cuda_graph_scope")
    assert knob.megatron_field_for("0.17.1") == "cuda_graph_scope"
    assert knob.megatron_field_for("0.18.0") == "cuda_graph_modules"
    assert knob.bridge_key_for("0.19.2") == "model.cuda_graph_modules"
    assert knob.megatron_lm_flag_for("0.16.1") == "--cuda-graph-scope"
    assert knob.megatron_lm_flag_for("0.19.0") == "--cuda-graph-modules"
    # Both spellings read back to the canonical knob.
    assert parse_bridge_overrides(["model.cuda_graph_impl=local", "model.cuda_graph_modules=[attn]"]) == \
        parse_bridge_overrides(["model.cuda_graph_impl=local", "model.cuda_graph_scope=[attn]"])


def test_set_valued_knobs_are_order_free() -> None:
    a = complete_config({"cuda_graph_impl": "local", "cuda_graph_scope": ["moe_router", "attn"]})
    b = complete_config({"cuda_graph_impl": "local", "cuda_graph_scope": "attn moe_router"})
    assert a == b and hash(a) == hash(b)
    assert a.cuda_graph_scope == ("attn", "moe_router")


def test_conditional_knobs_are_none_when_switched_off() -> None:
    config = complete_config({"recompute_granularity": "selective"})
    assert config.recompute_modules == ("core_attn",)  # Megatron's None means [core_attn]
    assert config.recompute_method is None and config.recompute_num_layers is None
    assert config.cuda_graph_scope is None
    assert complete_config({}).replace(recompute_granularity="full").recompute_method == "uniform"


def test_value_for_a_switched_off_knob_is_an_error_naming_the_condition() -> None:
    with pytest.raises(KnobError, match="recompute_modules: only applies when recompute_granularity=selective"):
        complete_config({"recompute_granularity": "full", "recompute_modules": ["core_attn"]})


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"micro_batch_sise": 2}, "unknown knob .*did you mean micro_batch_size"),
        ({"micro_batch_size": 0}, "micro_batch_size: expected an integer >= 1, got 0"),
        ({"micro_batch_size": True}, "expected an integer"),
        ({"sequence_parallel": "yes"}, "sequence_parallel: expected true or false"),
        ({"cuda_graph_impl": "te"}, "cuda_graph_impl: expected one of none, local, transformer_engine, full_iteration"),
        ({"recompute_granularity": "selective", "recompute_modules": ["attn"]}, r"unknown element\(s\) \['attn'\]"),
        ({"cuda_graph_impl": "local", "cuda_graph_scope": ["attn", "attn"]}, "repeated element"),
        ({"recompute_granularity": "selective", "recompute_modules": []}, "recompute_modules: expected at least one"),
    ],
)
def test_bad_values_name_the_knob(values: dict, message: str) -> None:
    with pytest.raises(KnobError, match=message):
        complete_config(values)


def test_config_is_immutable() -> None:
    config = complete_config({})
    with pytest.raises(AttributeError):
        config.micro_batch_size = 4  # type: ignore[misc]
    assert config.replace(micro_batch_size=4).micro_batch_size == 4 and config.micro_batch_size == 1


def test_megatron_lm_export_omits_megatron_defaults() -> None:
    assert KNOBS["recompute_granularity"].megatron_lm_args("none", "0.19.2") == []
    assert KNOBS["sequence_parallel"].megatron_lm_args(False, "0.19.2") == []
    assert KNOBS["sequence_parallel"].megatron_lm_args(True, "0.19.2") == ["--sequence-parallel"]
    assert KNOBS["recompute_modules"].megatron_lm_args(("core_attn", "moe"), "0.19.2") == [
        "--recompute-modules", "core_attn", "moe"]
    assert KNOBS["virtual_pipeline_model_parallel_size"].megatron_lm_args(2, "0.19.2") == [
        "--num-virtual-stages-per-pipeline-rank", "2"]
