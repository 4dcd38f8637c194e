"""Exports fed to the tools users paste them into, and judged by those tools' own code.

- Megatron-LM (megatron-core 0.16.1 to 0.19.2): its ``parse_args`` and ``validate_args`` with
  ``pretrain_vlm.py``'s arguments run on the GPU machine, where ``megatron/training`` imports
  (``trainables/megatron/megatron_lm_args.py``); their verdicts and flag tables are committed under
  ``bench/results/megatron_lm_check/``. These tests recompute today's exports and hold them to
  those verdicts (an export that changed has not been checked: re-run the check) and every export
  of every accepted config to the release's flags, operand counts and choices.
- Megatron-Bridge 0.3.1 (megatron-core 0.16.1, the newest on Python 3.11) runs here, in a
  subprocess (``bridge_harness.py`` says what it stands in for on a CPU): its override parser and
  ``runtime_config_update`` (which ends in ``ConfigContainer.validate()``) on its Qwen3-VL-30B-A3B recipe.
- Megatron-Bridge 0.6.2 (megatron-core 0.19.2, Python 3.12) runs the same harness on the GPU machine;
  its verdicts and the fields its validated config holds are committed under ``bench/results/bridge_check/``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser

from autotune.core.knobs import complete_config
from autotune.core.tool_flags import ExportRefused, megatron_lm_args
from autotune.export_check import accepted_configs, control_cases, export_cases
from trainables.bridge.hf_proxy import ProxyShape, train_tokenizer

ROOT = Path(__file__).resolve().parent.parent
CHECKED = ROOT / "bench" / "results" / "megatron_lm_check"
MEGATRON_LM_VERSIONS = ("0.16.1", "0.17.1", "0.18.0", "0.19.2")
RECHECK = ("re-run the check on the GPU machine (bench/README.md, 'Exports checked by Megatron-LM') "
           "and commit bench/results/megatron_lm_check/")


def committed_check(version: str) -> dict:
    return json.loads((CHECKED / f"{version}.json").read_text())


@pytest.mark.parametrize("version", MEGATRON_LM_VERSIONS)
def test_megatron_lm_accepts_every_export(version: str) -> None:
    check = committed_check(version)
    assert check["contract"]["megatron_core"] == version
    assert_committed_check_accepts_today(f"Megatron-LM {version}", "megatron-lm", version, check, RECHECK)


def assert_committed_check_accepts_today(tool: str, fmt: str, version: str, check: dict, recheck: str) -> None:
    """The committed ``check`` rejected both controls (it can say no) and accepted every export
    written today for ``fmt`` and megatron-core ``version``, each of which it holds."""
    verdicts = {result["key"]: result["error"] for result in check["results"]}
    cases = list(export_cases(fmt, version))  # type: ignore[arg-type]
    controls = [verdicts.get(case.key) for case in control_cases(fmt)]  # type: ignore[arg-type]
    assert len(controls) == 2 and all(controls), f"{tool} took a launch it must reject: {controls}"
    unchecked = [case.key for case in cases if case.key not in verdicts]
    assert not unchecked, f"{len(unchecked)} of {len(cases)} exports are not in the committed check: {recheck}"
    rejected = [(case.key, verdicts[case.key]) for case in cases if verdicts[case.key]]
    assert not rejected, f"{tool} rejects {len(rejected)} exports, e.g. {rejected[0]}"


def _operands_fit(count: int, wanted: int | str) -> bool:
    return {"+": count >= 1, "*": True, "?": count <= 1}.get(str(wanted), count == wanted)


@pytest.mark.parametrize("version", MEGATRON_LM_VERSIONS)
def test_every_flag_of_every_accepted_config_is_megatron_lms(version: str) -> None:
    flags = committed_check(version)["flags"]
    checked = 0
    for space, _, accepted in accepted_configs():
        for config in accepted:
            try:
                argv = megatron_lm_args(config, version)
            except ExportRefused:
                continue
            flag_positions = [i for i, arg in enumerate(argv) if arg.startswith("--")] + [len(argv)]
            for start, end in zip(flag_positions, flag_positions[1:]):
                flag, operands = argv[start], argv[start + 1:end]
                assert flag in flags, f"{space.name}: Megatron-LM {version} has no {flag} ({config.describe()})"
                assert _operands_fit(len(operands), flags[flag]["operands"]), \
                    f"{flag} takes {flags[flag]['operands']} operands, the export gives {operands}"
                choices = flags[flag]["choices"]
                assert choices is None or all(o in choices for o in operands), f"{flag} {operands} not in {choices}"
            checked += 1
    assert checked > 1000


@pytest.fixture(scope="module")
def bridge_verdicts(tmp_path_factory: pytest.TempPathFactory) -> tuple[list, dict]:
    if importlib.util.find_spec("megatron.bridge") is None:
        if os.environ.get("CI"):
            pytest.fail("megatron-bridge 0.3.1 is not installed (bin/bootstrap installs it)")
        pytest.skip("megatron-bridge is not installed")
    folder = tmp_path_factory.mktemp("bridge")
    cases = [case.to_plain() for case in [*export_cases("bridge", "0.16.1"), *control_cases("bridge")]]
    (folder / "cases.json").write_text(json.dumps({"cases": cases}))
    subprocess.run([sys.executable, str(Path(__file__).parent / "bridge_harness.py"), str(folder / "cases.json"),
                    str(folder / "verdicts.json")], check=True, capture_output=True, timeout=600, cwd=ROOT)
    return cases, json.loads((folder / "verdicts.json").read_text())


@pytest.mark.megatron
def test_megatron_bridge_0_3_accepts_every_export_on_its_qwen3_vl_recipe(bridge_verdicts: tuple[list, dict]) -> None:
    cases, verdicts = bridge_verdicts
    assert verdicts["recipe_cuda_graph_scope"] == "full"  # the recipe's model sets the field the graph knobs write
    shape, tokenizer = ProxyShape(), train_tokenizer()  # the provider Bridge built from our checkpoint directory
    assert verdicts["contract"]["provider"] == {
        "num_layers": shape.decoder_layers, "hidden_size": shape.hidden_size, "num_moe_experts": shape.experts,
        "moe_router_topk": shape.experts_per_token, "vocab_size": tokenizer.get_vocab_size(),
        "image_token_id": tokenizer.token_to_id("<|image_pad|>")}
    assert len(verdicts["results"]) == len(cases) > 300
    controls = [r for case, r in zip(cases, verdicts["results"]) if case["space"] == "control"]
    assert len(controls) == 2 and all(r["error"] for r in controls), controls  # the check can say no
    rejected = [(r["key"], r["error"]) for case, r in zip(cases, verdicts["results"])
                if r["error"] and case["space"] != "control"]
    assert not rejected, f"Bridge 0.3.1 rejects {len(rejected)} exports, e.g. {rejected[0]}"


def held_values_differing_from_written(case: dict, result: dict) -> list[str]:
    """Each value ``case``'s overrides wrote that the validated Bridge config does not hold."""
    written = {o.key_or_group: o.value() for o in OverridesParser.create().parse_overrides(case["base"] + case["export"])}
    config = complete_config(case["config"])
    differing = []
    for key, value in written.items():
        held = result["fields"][key]
        if key == "model.expert_tensor_parallel_size" and value is None:
            value = config.tensor_model_parallel_size  # null: megatron-core takes the tensor-parallel size
        if key == "mixed_precision":  # Bridge 0.6's preset, resolved to its fields by runtime_config_update
            held = (held["bf16"], held["fp8"], held["fp8_recipe"] if held["fp8"] else None)
            value = (True, None if config.fp8 == "none" else config.fp8, None if config.fp8 == "none" else config.fp8_recipe)
        if held != value:
            differing.append(f"{key}: wrote {value!r}, Bridge holds {held!r}")
    return differing


@pytest.mark.megatron
def test_the_validated_bridge_config_holds_every_value_the_export_wrote(bridge_verdicts: tuple[list, dict]) -> None:
    cases, verdicts = bridge_verdicts
    pairs = [(case, result) for case, result in zip(cases, verdicts["results"]) if case["space"] != "control"]
    differing = [d for case, result in pairs for d in held_values_differing_from_written(case, result)]
    assert not differing, differing[:5]
    assert sum("model.cuda_graph_impl=transformer_engine" in case["export"] for case, _ in pairs) > 20


def test_megatron_bridge_0_6_accepts_every_export_and_holds_its_values() -> None:
    """Bridge 0.6.2 (megatron-core 0.19.2) needs Python 3.12: its verdicts come from the GPU machine
    (bench/README.md, 'Exports checked by Megatron-Bridge'), held here to today's exports."""
    check = json.loads((ROOT / "bench" / "results" / "bridge_check" / "0.6.2.json").read_text())
    assert (check["contract"]["megatron_bridge"], check["contract"]["megatron_core"]) == ("0.6.2", "0.19.2")
    assert check["recipe_cuda_graph_scope"] == "full"  # the recipe sets what cuda_graph_modules cannot sit beside
    assert_committed_check_accepts_today("Megatron-Bridge 0.6.2", "bridge", "0.19.2", check,
                                         "re-run it on the GPU machine (bench/README.md) and commit "
                                         "bench/results/bridge_check/")
    verdicts = {result["key"]: result for result in check["results"]}
    cases = [case.to_plain() for case in export_cases("bridge", "0.19.2")]
    differing = [d for case in cases for d in held_values_differing_from_written(case, verdicts[case["key"]])]
    assert not differing, differing[:5]
    assert sum("model.cuda_graph_impl=transformer_engine" in case["export"] for case in cases) > 20
