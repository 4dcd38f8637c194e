"""A config as the user pastes it: Megatron-Bridge Hydra overrides, Megatron-LM flags, YAML, JSON.

The flag spellings are the shared core's (:mod:`autotune.core.tool_flags`, where the ``bridge``
trainable reads them too); this module renders them with the header that says what the figure
depends on, and reads the YAML/JSON documents back. Every format reads back to the same
:class:`~autotune.core.knobs.Config` (the tests hold it so).
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any, Literal

import yaml

from autotune.core.errors import InputFileError, KnobError
from autotune.core.knobs import FREEZE_KNOBS_BY_PART, KNOBS, Config, complete_config
from autotune.core.tool_flags import bridge_overrides, emitted_knobs, megatron_lm_args
from autotune.yaml_io import load_yaml_mapping

Format = Literal["bridge", "megatron-lm", "yaml", "json"]
FORMATS: tuple[Format, ...] = ("bridge", "megatron-lm", "yaml", "json")

TARGETS: dict[str, tuple[Format, str]] = {
    "bridge-0.3": ("bridge", "0.16.1"),
    "bridge-0.6": ("bridge", "0.19.2"),
    "megatron-lm-0.16": ("megatron-lm", "0.16.1"),
    "megatron-lm-0.17": ("megatron-lm", "0.17.1"),
    "megatron-lm-0.18": ("megatron-lm", "0.18.0"),
    "megatron-lm-0.19": ("megatron-lm", "0.19.2"),
}
"""``autotune export --target``: a release users run, as the flag format and megatron-core version
whose spelling it takes (Megatron-Bridge 0.3 runs on megatron-core 0.16, 0.6 on 0.19; Megatron-LM
releases with megatron-core). Each is checked by that release's own parser (tests/test_export_tools.py)."""

PRETRAIN_VLM_FSDP_NOTE = (
    "# note: Megatron-LM's pretrain_vlm.py asserts --ckpt-format torch, which validate_args refuses with FSDP "
    "(torch FSDP2: torch_dist or torch_dcp; Megatron-FSDP: fsdp_dtensor): launch this from a VLM script that "
    "saves in those formats")
"""Megatron-LM's own VLM script cannot run an FSDP winner (its model provider, which no parser check
reaches, asserts the legacy checkpoint format): said above the flags rather than refused, since the
flags are right for Megatron-LM's other entry points."""


def document(config: Config, megatron_core_version: str | None, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The YAML/JSON form: canonical knob names, the target version, and whatever else is attached
    (the winner's measurement contract and steady estimate)."""
    return {"config": config.to_plain(), "megatron_core": megatron_core_version, **(extra or {})}


def trial_overrides(extra: dict[str, Any] | None, megatron_core_version: str | None) -> list[str] | None:
    """The overrides a ``bridge`` trial applied to the user's recipe (its contract's), when the export
    targets the megatron-core version it ran on: printed as they ran, companions included (an
    Energon dataset's micro-batch size), so the paste is exactly the measured run."""
    contract = (extra or {}).get("contract") or {}
    ran = contract.get("recipe_overrides")
    ran_on = (contract.get("versions") or {}).get("megatron_core")
    if ran is None or megatron_core_version not in (None, ran_on):
        return None
    return list(ran)


def render(config: Config, fmt: Format, megatron_core_version: str | None, extra: dict[str, Any] | None = None,
           every_knob: bool = False) -> str:
    """``config`` in ``fmt``. A ``bridge`` winner's Bridge export is its trial's overrides, as they ran
    (:func:`trial_overrides`). Otherwise the flag formats write the knobs ``extra["tuned"]`` names (every
    active knob with ``every_knob`` or when it names none) and the workload's global batch when
    ``extra`` holds one (a tuned MBS holds only under the global batch it was measured at). Raises
    :class:`~autotune.core.tool_flags.ExportRefused` where the target tool cannot take the config."""
    global_batch = ((extra or {}).get("workload") or {}).get("global_batch_size")
    tuned = None if every_knob else (extra or {}).get("tuned")
    ran = trial_overrides(extra, megatron_core_version)
    if fmt == "bridge" and ran is not None and not every_knob:
        return " ".join(shlex.quote(o) for o in ran)
    if fmt == "bridge":
        overrides = bridge_overrides(config, megatron_core_version, tuned)
        overrides += [] if global_batch is None else [f"train.global_batch_size={global_batch}"]
        return " ".join(shlex.quote(o) for o in overrides)
    if fmt == "megatron-lm":
        args = megatron_lm_args(config, megatron_core_version, tuned)
        args += [] if global_batch is None else ["--global-batch-size", str(global_batch)]
        return " ".join(shlex.quote(a) for a in args)
    if fmt == "yaml":
        return yaml.safe_dump(document(config, megatron_core_version, extra), sort_keys=False)
    return json.dumps(document(config, megatron_core_version, extra), indent=2)


def header(config: Config, fmt: Format, megatron_core_version: str | None, extra: dict[str, Any],
           every_knob: bool = False) -> list[str]:
    """Comment lines above a flag export: where the config comes from, what it measured, the
    version it targets, and what the gain depends on (the knobs it does not write included)."""
    objective = extra.get("objective") or {}
    workload = extra.get("workload") or {}
    precision = ((extra.get("contract") or {}).get("precision")) or \
        ("bf16" if config.fp8 == "none" else f"fp8 {config.fp8} ({config.fp8_recipe} scaling)")
    target = {"bridge": "Megatron-Bridge overrides", "megatron-lm": "Megatron-LM flags"}[fmt]
    lines = [f"# {target} for megatron-core {megatron_core_version or '(newest)'}"
             + (f", from campaign {extra['campaign']}" if extra.get("campaign") else "")]
    if objective.get("mean") is not None:
        lines.append(f"# measured: {objective['mean']:,.0f} {objective.get('metric', '')} "
                     f"({100 * objective.get('confidence', 0.95):.0f} % "
                     f"{objective['ci_low']:,.0f}–{objective['ci_high']:,.0f}, "
                     f"{objective.get('steady_steps')} steady steps)")
    frozen = [knob for knob in FREEZE_KNOBS_BY_PART.values() if config[knob]]
    lines.append(f"# depends on: global batch {workload.get('global_batch_size') or 'not fixed'}; precision {precision}; "
                 f"frozen: {', '.join(frozen) or 'nothing'}"
                 + ("; freezing the workload does not declare: " + ", ".join(extra["frozen_beyond_workload"])
                    if extra.get("frozen_beyond_workload") else ""))
    tuned = None if every_knob else extra.get("tuned")
    if tuned is not None:
        kept = set(emitted_knobs(config, tuned))
        assumed = [f"{name}={KNOBS[name].format(value)}" for name, value in config.explicit().items()
                   if name not in kept and value != KNOBS[name].default]
        if assumed:
            lines.append("# also measured with (not written; --all writes them): " + " ".join(assumed))
    contract = extra.get("contract") or {}
    if fmt == "bridge" and contract.get("recipe"):
        applied = "as the winning trial applied them" if trial_overrides(extra, megatron_core_version) is not None \
            and not every_knob else "re-spelled for this version (the trial's own are in the winner's contract)"
        lines.append(f"# append to your launch of {contract['recipe']}, after your own overrides; {applied}")
    if fmt == "megatron-lm" and (config.use_torch_fsdp2 or config.use_megatron_fsdp):
        lines.append(PRETRAIN_VLM_FSDP_NOTE)
    return lines


def load_document(path: Path) -> tuple[Config, str | None, dict[str, Any]]:
    """Read a YAML/JSON config document (``winner.yaml``): the config, its version, the rest."""
    data = load_yaml_mapping(path)
    if not isinstance(data.get("config"), dict):
        raise InputFileError(path, "config", "expected a mapping of knob names to values")
    try:
        config = complete_config(data["config"])
    except KnobError as exc:
        raise InputFileError(path, f"config.{exc.knob}", exc.message) from None
    rest = {key: value for key, value in data.items() if key not in ("config", "megatron_core")}
    return config, data.get("megatron_core"), rest
