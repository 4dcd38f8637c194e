"""Shipped spaces load and mean what they say; malformed space files get errors naming the field."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from autotune.core.errors import InputFileError
from autotune.space import load_space, target_context
from autotune.survey import check_warm_starts, survey_space

SHIPPED = sorted(Path("search_spaces").glob("*.yaml"))
REQUIRED = {"fsdp_first", "parallel_3d", "h200_single", "h200_dual", "cpu_demo"}


def test_the_required_spaces_ship() -> None:
    assert REQUIRED <= {p.stem for p in SHIPPED}


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_shipped_space_loads_with_accepted_warm_starts(path: Path) -> None:
    space = load_space(path)
    context = target_context(space)
    check_warm_starts(space, context)
    assert space.warm_starts, "every shipped space starts from the seed's known configs"
    survey = survey_space(space, context)
    assert survey.accepted, "a shipped space must hold configs its own target can run"
    configs = list(space.configs())
    assert len(configs) == len(set(configs)) == survey.total
    assert all(space.contains(c) for c in configs)
    assert path.read_text().lstrip().startswith("#"), "comments say where the values come from"


def test_h200_single_grid_counts() -> None:
    space = load_space(Path("search_spaces/h200_single.yaml"))
    # MBS 4 x recompute (none, 3 selective sets, full) 5 x graphs (none, local with the fixed scope) 2 x frozen 2
    assert space.size() == 80
    survey = survey_space(space, target_context(space))
    # full recompute with per-layer graphs: 4 MBS x 2 frozen = 8, Megatron's rule
    assert survey.rejected_by_rule == {"full_recompute_needs_full_iteration_graphs": 8}


def test_conditional_knobs_expand_only_where_active() -> None:
    space = load_space(Path("search_spaces/cpu_demo.yaml"))
    for config in space.configs():
        if config.recompute_granularity != "selective":
            assert config.recompute_modules is None
        else:
            assert config.recompute_modules in space.tuned["recompute_modules"]
    # 4 MBS x (none + 3 selective + full) x EP 2 x FSDP2 2 x frozen 2
    assert space.size() == 4 * 5 * 2 * 2 * 2


def test_cpu_demo_rejects_fsdp2_with_expert_parallel() -> None:
    space = load_space(Path("search_spaces/cpu_demo.yaml"))
    survey = survey_space(space, target_context(space))
    assert survey.rejected_by_rule == {"torch_fsdp2_needs_pp1_ep1": 40}
    for config in survey.accepted:
        assert not (config.use_torch_fsdp2 and config.expert_model_parallel_size > 1)


MINIMAL = """\
name: t
target: {model: h200_small_moe_vlm, trainable: megatron, gpus_per_trial: 1, stack: {accelerator: h200}}
tune:
  micro_batch_size: [1, 2]
"""

CUT = """\
name: c
cut_of: h200_te
tune:
  micro_batch_size: [2, 4]
  moe_grouped_gemm: [true]
"""

BAD_SPACES = [
    ("tune: [", "line", "invalid YAML"),
    ("- just\n- a list\n", "-", "expected a mapping"),
    (MINIMAL.replace("name: t\n", ""), "name", "Field required"),
    (MINIMAL + "colour: blue\n", "colour", "unknown field"),
    (MINIMAL.replace("micro_batch_size", "micro_batch_sise"), "tune.micro_batch_sise", "did you mean micro_batch_size"),
    (MINIMAL.replace("[1, 2]", "[1, 0]"), r"tune.micro_batch_size\[1\]", "expected an integer >= 1, got 0"),
    (MINIMAL.replace("[1, 2]", "[1, 1]"), r"tune.micro_batch_size\[1\]", "repeats the value 1"),
    (MINIMAL.replace("[1, 2]", "[]"), "tune.micro_batch_size", "at least one"),
    (MINIMAL + "fixed: {micro_batch_size: 4}\n", "fixed.micro_batch_size", "also under tune"),
    (MINIMAL + "  recompute_modules: [[core_attn]]\n", "tune.recompute_modules",
     "never applies: it needs recompute_granularity=selective"),
    (MINIMAL + "fixed: {cuda_graph_impl: cuda}\n", "fixed.cuda_graph_impl", "expected one of none, local"),
    (MINIMAL + "warm_start:\n  - {name: w, config: {micro_batch_size: 8}}\n",
     r"warm_start\[0\].config.micro_batch_size", "8 is not in the space"),
    (MINIMAL + "warm_start:\n  - {name: w, config: {recompute_modules: [moe]}}\n",
     r"warm_start\[0\].config.recompute_modules", "only applies when recompute_granularity=selective"),
    (MINIMAL.replace("gpus_per_trial: 1", "gpus_per_trial: 0"), "target.gpus_per_trial", "greater than or equal to 1"),
    (MINIMAL.replace("accelerator: h200", "accelerator: tpu"), "target.stack.accelerator", "Input should be"),
]

BAD_CUTS = [
    (CUT.replace("[2, 4]", "[2, 3]"), r"tune.micro_batch_size\[1\]", "3 is not among h200_te's values"),
    (CUT + "  context_parallel_size: [1]\n", "tune.context_parallel_size", "not tuned by h200_te"),
    (CUT + "fixed: {fp8: hybrid}\n", "fixed", "a cut takes its parent's"),
    (CUT.replace("cut_of: h200_te", "cut_of: h200_tee"), "cut_of", "no space h200_tee"),
    (MINIMAL.replace("target: {model: h200_small_moe_vlm, trainable: megatron, gpus_per_trial: 1, "
                     "stack: {accelerator: h200}}\n", ""), "target", "is required"),
]


@pytest.mark.parametrize(("text", "field", "message"), BAD_SPACES + BAD_CUTS)
def test_bad_space_files_name_file_and_field(tmp_path: Path, text: str, field: str, message: str) -> None:
    path = tmp_path / "space.yaml"
    path.write_text(text)
    with pytest.raises(InputFileError) as info:
        load_space(path)
    error = str(info.value)
    assert error.startswith(f"{path}: ")
    assert re.search(field, info.value.field), (info.value.field, error)
    assert re.search(message, error), error


def test_a_cut_holds_only_its_parents_configs_and_the_warm_starts_that_lie_in_it(tmp_path: Path) -> None:
    """A cut keeps the parent's other knobs and values, so it can replace it in a table nobody can
    record whole, and an export of any of its configs is one of the parent's."""
    path = tmp_path / "cut.yaml"
    path.write_text(CUT)
    cut, parent = load_space(path), load_space(Path("search_spaces/h200_te.yaml"))
    assert cut.cut_of == "h200_te" and cut.target == parent.target and cut.fixed == parent.fixed
    assert cut.tuned["micro_batch_size"] == (2, 4) and cut.tuned["fp8"] == parent.tuned["fp8"]
    configs = list(cut.configs())
    assert configs and all(parent.contains(config) for config in configs)
    assert cut.size() < parent.size()
    # bring-up (MBS 1, no grouped GEMM) lies outside; the seed's TE steady state (MBS 4, grouped GEMM) inside
    assert [start.name for start in cut.warm_starts] == ["seed-te-steady"]
    shipped = load_space(Path("search_spaces/h200_te_grid.yaml"))
    assert all(parent.contains(config) for config in shipped.configs())
    assert [start.name for start in shipped.warm_starts] == ["bring-up", "seed-te-steady"]


def test_missing_space_file(tmp_path: Path) -> None:
    with pytest.raises(InputFileError, match="file not found"):
        load_space(tmp_path / "nope.yaml")


def test_warm_start_rejected_by_rules_names_the_entry(tmp_path: Path) -> None:
    path = tmp_path / "space.yaml"
    path.write_text(
        MINIMAL
        + "  recompute_granularity: [full]\n  cuda_graph_impl: [none, local]\n"
        + "warm_start:\n  - {name: bad, config: {recompute_granularity: full, cuda_graph_impl: local}}\n"
    )
    space = load_space(path)
    with pytest.raises(InputFileError, match=r"warm_start\[0\]: 'bad' is rejected: \[full_recompute_needs_full_iteration_graphs\]"):
        check_warm_starts(space, target_context(space))


def test_unknown_target_model_names_the_field(tmp_path: Path) -> None:
    path = tmp_path / "space.yaml"
    path.write_text(MINIMAL.replace("h200_small_moe_vlm", "gpt5"))
    with pytest.raises(InputFileError, match="target.model: unknown model preset 'gpt5'"):
        target_context(load_space(path))


def test_every_knob_value_in_shipped_spaces_is_honoured_or_rejected_with_a_reason() -> None:
    # A tuned value that no accepted config uses would be dead weight in a space.
    for path in SHIPPED:
        space = load_space(path)
        accepted = survey_space(space, target_context(space)).accepted
        for name, values in space.tuned.items():
            used = {c[name] for c in accepted}
            assert set(values) <= used, (path.stem, name, set(values) - used)
