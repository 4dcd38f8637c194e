"""The knob registry and the :class:`Config` it describes.

A :class:`Config` holds a value for every registered knob, with conditional knobs set to ``None``
when their parent switches them off, so two configs that launch the same training are equal.
"""

from __future__ import annotations

import difflib
from typing import Annotated, Any, Iterator, Mapping

import yaml
from packaging.version import Version
from pydantic import PlainSerializer, PlainValidator, WithJsonSchema

from autotune.core.errors import KnobError
from autotune.core.knobs._base import Condition, Knob, MegatronTarget
from autotune.core.knobs._domains import BoolDomain, IntDomain, SubsetDomain, Value
from autotune.core.knobs._registry import CUDA_GRAPH_SCOPES, KNOBS, PER_LAYER_GRAPH_IMPLS, RECOMPUTE_MODULES

__all__ = [
    "CUDA_GRAPH_SCOPES",
    "KNOBS",
    "PER_LAYER_GRAPH_IMPLS",
    "RECOMPUTE_MODULES",
    "Condition",
    "Config",
    "ConfigField",
    "Knob",
    "MegatronTarget",
    "Value",
    "complete_config",
    "expert_tensor_parallel",
    "get_knob",
    "megatron_graph_settings",
    "parse_bridge_overrides",
    "parse_megatron_lm_args",
]


def get_knob(name: str) -> Knob:
    """The registered knob ``name``; an unknown name gets the closest known names as a hint."""
    try:
        return KNOBS[name]
    except KeyError:
        close = difflib.get_close_matches(name, KNOBS, n=3)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise KnobError(name, f"unknown knob{hint}; known knobs: {', '.join(KNOBS)}") from None


class Config(Mapping[str, Value]):
    """An immutable, hashable, complete assignment of every knob. Build with :func:`complete_config`.

    Knob values read as attributes: ``config.micro_batch_size``.
    """

    __slots__ = ("_values", "_hash")

    def __init__(self, values: Mapping[str, Value]) -> None:
        missing = [name for name in KNOBS if name not in values]
        if missing or len(values) != len(KNOBS):
            raise KnobError(",".join(missing) or "?", "a Config needs exactly the registered knobs")
        object.__setattr__(self, "_values", {name: values[name] for name in KNOBS})
        object.__setattr__(self, "_hash", hash(tuple(self._values.items())))

    def __getitem__(self, name: str) -> Value:
        return self._values[name]

    def __getattr__(self, name: str) -> Value:
        if name.startswith("_"):
            raise AttributeError(name)
        try:
            return self._values[name]
        except KeyError:
            raise AttributeError(name) from None

    def __reduce__(self):
        return (Config, (self._values,))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("Config is immutable; use replace()")

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Config) and self._values == other._values

    def __repr__(self) -> str:
        return f"Config({self.describe()})"

    def replace(self, **changes: Any) -> "Config":
        """A new config with ``changes`` applied and conditional knobs re-resolved."""
        return complete_config({**self.explicit(), **changes})

    def explicit(self) -> dict[str, Value]:
        """Only the knobs that are active (conditional knobs switched off are left out)."""
        return {name: value for name, value in self._values.items() if KNOBS[name].is_active(self)}

    def to_plain(self) -> dict[str, Any]:
        """JSON/YAML friendly dict of every knob (tuples become lists)."""
        return {name: list(v) if isinstance(v, tuple) else v for name, v in self._values.items()}

    def describe(self, baseline: Mapping[str, Value] | None = None) -> str:
        """Compact ``name=value`` text of the active knobs that differ from ``baseline`` (defaults)."""
        base = baseline if baseline is not None else _DEFAULTS
        parts = [
            f"{name}={KNOBS[name].format(value)}"
            for name, value in self.explicit().items()
            if base.get(name, object()) != value
        ]
        return " ".join(parts) or "defaults"


def complete_config(values: Mapping[str, Any], defaults: Mapping[str, Value] | None = None) -> Config:
    """Parse ``values`` (raw YAML/JSON values by canonical knob name) into a full :class:`Config`.

    Knobs not given take ``defaults`` (already canonical, e.g. a space's fixed values), else
    Megatron's default. A conditional knob whose condition does not hold is set to ``None``;
    giving it a value anyway is an error that names the condition, because a silently dropped
    setting is a setting the user believes in but never ran.
    """
    for name in (*values, *(defaults or {})):
        get_knob(name)
    resolved: dict[str, Value] = {}
    for name, knob in KNOBS.items():
        if knob.active_when is not None and not knob.active_when.test(resolved[knob.active_when.parent]):
            if name in values and values[name] is not None:
                raise KnobError(name, f"only applies when {knob.active_when.text}")
            resolved[name] = None
        elif name in values:
            resolved[name] = knob.parse(values[name])
        elif defaults is not None and name in defaults:
            resolved[name] = defaults[name]
        else:
            resolved[name] = knob.default
    return Config(resolved)


_DEFAULTS: dict[str, Value] = dict(complete_config({}))


def expert_tensor_parallel(config: Config) -> int:
    """ETP as Megatron resolves it: ``expert_tensor_parallel_size: null`` means the same as TP."""
    etp = config.expert_tensor_parallel_size
    return config.tensor_model_parallel_size if etp is None else etp


FREEZE_KNOBS_BY_PART: dict[str, str] = {
    name.removeprefix("freeze_"): name for name, knob in KNOBS.items() if knob.megatron_target == "llava_freeze"
}
"""Each model part a training may freeze (``vision_model``, ``vision_projection``) and the knob that
freezes it: the knobs ``LLaVAModel.freeze`` takes."""


def data_parallel(config: Config, world_size: int) -> int:
    """Data-parallel replicas of a trial: its ranks over TP·PP·CP (floored; the rules reject the rest)."""
    return world_size // (
        config.tensor_model_parallel_size * config.pipeline_model_parallel_size * config.context_parallel_size
    )


def micro_batches_per_step(config: Config, world_size: int, global_batch_size: int | None) -> int:
    """Micro-batches each replica accumulates into one optimizer step, as Megatron's calculator
    counts them: GBS / (MBS × DP). Without a global batch, one per pipeline stage (the fewest that
    fill the pipeline), so the global batch then grows with MBS."""
    if global_batch_size is None:
        return config.pipeline_model_parallel_size
    return global_batch_size // (config.micro_batch_size * data_parallel(config, world_size))


FULL_ITERATION_IMPL_VERSION = Version("0.18.0")
"""From megatron-core 0.18.0 a full-iteration graph is ``cuda_graph_impl="full_iteration"`` (the
scope field renamed ``cuda_graph_modules`` at the same release, and must then be empty); before it,
``cuda_graph_impl="local"`` with scope ``["full_iteration"]`` (0.16/0.17 accept no other spelling)."""


def megatron_graph_settings(config: Config, megatron_core_version: str | None) -> tuple[str, tuple[str, ...] | None]:
    """``config``'s CUDA graphs as that megatron-core version spells them: the implementation and
    the scope (``None``: the scope field is not set, as for no graphs or a 0.18+ full iteration)."""
    impl = config.cuda_graph_impl
    if impl == "full_iteration" and megatron_core_version is not None \
            and Version(megatron_core_version) < FULL_ITERATION_IMPL_VERSION:
        return "local", ("full_iteration",)
    return impl, config.cuda_graph_scope if KNOBS["cuda_graph_scope"].is_active(config) else None


def global_batch_misfit(config: Config, world_size: int, global_batch_size: int | None) -> str | None:
    """Why ``config`` cannot run the global batch on ``world_size`` ranks, or ``None`` when it can."""
    if global_batch_size is None:
        return None
    dp = data_parallel(config, world_size)
    per_micro_batch = config.micro_batch_size * dp
    if dp == 0 or global_batch_size % per_micro_batch:
        return (f"the global batch of {global_batch_size} samples is not a whole number of micro-batches: "
                f"micro_batch_size {config.micro_batch_size} × data-parallel {dp} = {per_micro_batch} samples each")
    return None


def _as_config(value: Any) -> Config:
    return value if isinstance(value, Config) else complete_config(value)


ConfigField = Annotated[
    Config,
    PlainValidator(_as_config),
    PlainSerializer(lambda config: config.to_plain(), return_type=dict),
    WithJsonSchema({"type": "object", "description": "canonical knob names to values"}),
]
"""A :class:`Config` as a field of a pydantic record: read from its plain form (canonical knob
names, every knob absent taking Megatron's default), written as :meth:`Config.to_plain`."""


def parse_bridge_overrides(overrides: list[str]) -> Config:
    """Inverse of the Bridge export: ``["model.recompute_granularity=selective", ...]`` → Config."""
    by_key = {}
    for knob in KNOBS.values():
        by_key[knob.bridge_key] = knob
        for first_version, _ in knob.renamed:
            by_key[knob.bridge_key_for(first_version)] = knob
    values: dict[str, Any] = {}
    for override in overrides:
        key, sep, text = override.partition("=")
        if not sep or key not in by_key:
            raise KnobError(key, f"not a Megatron-Bridge override this tool knows: {override!r}")
        knob = by_key[key]
        raw = yaml.safe_load(text)
        if raw is None and knob.none_alias is None:
            continue  # null: Megatron's default for this field
        values[knob.name] = knob.from_megatron(raw)
    return complete_config(values)


def parse_megatron_lm_args(argv: list[str]) -> Config:
    """Inverse of the Megatron-LM export: a list of flags and values → Config."""
    by_flag = {}
    for knob in KNOBS.values():
        for version in [None, "0.16.0"] + [first for first, _ in knob.renamed]:
            flag = knob.megatron_lm_flag_for(version)
            if flag is not None:
                by_flag[flag] = knob
    values: dict[str, Any] = {}
    index = 0
    while index < len(argv):
        flag = argv[index]
        if flag not in by_flag:
            raise KnobError(flag, "not a Megatron-LM flag this tool knows")
        knob = by_flag[flag]
        index += 1
        operands = []
        while index < len(argv) and not argv[index].startswith("--"):
            operands.append(argv[index])
            index += 1
        values[knob.name] = _from_flag_operands(knob, operands)
    for name, knob in KNOBS.items():
        if knob.none_alias is not None and name not in values:
            values[name] = knob.none_alias
    return complete_config(values)


def _from_flag_operands(knob: Knob, operands: list[str]) -> Value:
    if isinstance(knob.domain, BoolDomain):
        if operands:
            raise KnobError(knob.name, f"flag takes no value, got {operands}")
        return True
    if isinstance(knob.domain, SubsetDomain):
        return knob.parse(operands)
    if len(operands) != 1:
        raise KnobError(knob.name, f"flag takes one value, got {operands}")
    if isinstance(knob.domain, IntDomain):
        try:
            return knob.parse(int(operands[0]))
        except ValueError:
            raise KnobError(knob.name, f"expected an integer, got {operands[0]!r}") from None
    return knob.parse(operands[0])
