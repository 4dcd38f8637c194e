"""Search spaces: which knobs a campaign tunes, over which values, and where it starts.

A space file (``search_spaces/*.yaml``) is data only::

    name: h200_single
    target: {model: h200_small_moe_vlm, trainable: megatron, gpus_per_trial: 1,
             stack: {accelerator: h200, megatron_core: "0.19.2"}}
    tune:   {micro_batch_size: [1, 2, 4, 8], recompute_granularity: [none, selective, full], ...}
    fixed:  {moe_token_dispatcher_type: alltoall}
    warm_start:
      - {name: bring-up, config: {micro_batch_size: 1, recompute_granularity: full}}

A cut (``cut_of: h200_te``) is another space with fewer values of some of its tuned knobs: its
``tune`` lists the values it keeps, and target and fixed values are its parent's, so it holds only
configs its parent holds (a table a device session can record, where the parent's grid would take
hours). Its warm starts are its own where it lists them, else those of its parent's that lie in it.

Knobs neither tuned nor fixed keep Megatron's default. Conditional knobs (``recompute_modules``
only under selective recompute, ``cuda_graph_scope`` only with per-layer graphs, …) are tuned only
where the registry says they apply, so the grid holds no duplicate configs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from pydantic import BaseModel, ConfigDict, Field

from autotune._paths import BUILTIN_SPACES_DIR
from autotune.core.contract import StackCapabilities
from autotune.core.errors import InputFileError, KnobError
from autotune.core.knobs import KNOBS, Config, Value, complete_config, get_knob
from autotune.resolve import resolve_model, resolve_trainable
from autotune.rules import RuleContext
from autotune.yaml_io import load_file


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SpaceTarget(_Strict):
    """What the space was written for; ``space show`` evaluates the rules against it."""

    model: str
    model_overrides: dict[str, Any] = Field(default_factory=dict)
    trainable: str
    gpus_per_trial: int = Field(ge=1)
    stack: StackCapabilities


class WarmStartEntry(_Strict):
    name: str
    why: str = ""
    config: dict[str, Any]


class Reachable(_Strict):
    """What this family of configs is known to reach, with where that figure comes from: the
    bound a campaign's workflow projects headroom from before it spends anything on the space."""

    model_tflops_per_s_per_gpu: float = Field(gt=0)
    source: str = Field(min_length=1)


class SpaceFile(_Strict):
    name: str
    description: str = ""
    cut_of: str | None = None
    """Another space (a name or a path) this one cuts: see the module's docstring."""
    target: SpaceTarget | None = None
    reachable: Reachable | None = None
    tune: dict[str, list[Any]] = Field(min_length=1)
    fixed: dict[str, Any] = Field(default_factory=dict)
    warm_start: list[WarmStartEntry] = Field(default_factory=list)


@dataclass(frozen=True)
class WarmStart:
    name: str
    why: str
    config: Config


@dataclass(frozen=True)
class SearchSpace:
    """A validated space: candidate values per tuned knob, fixed values, warm-start configs."""

    name: str
    description: str
    path: Path
    target: SpaceTarget
    reachable: Reachable | None
    tuned: dict[str, tuple[Value, ...]]
    fixed: dict[str, Value]
    warm_starts: tuple[WarmStart, ...]
    cut_of: str | None = None
    """The space this one is a cut of: every config of it is that space's."""

    def choices(self, knob: str) -> tuple[Value, ...]:
        """The values ``knob`` may take when it is active in this space."""
        if knob in self.tuned:
            return self.tuned[knob]
        if knob in self.fixed:
            return (self.fixed[knob],)
        return (KNOBS[knob].default,)

    def configs(self) -> Iterator[Config]:
        """Every distinct config of the grid (conditional knobs expanded only where active)."""
        names = list(KNOBS)

        def expand(index: int, partial: dict[str, Value]) -> Iterator[Config]:
            if index == len(names):
                yield Config(partial)
                return
            name = names[index]
            knob = KNOBS[name]
            if knob.active_when is not None and not knob.active_when.test(partial[knob.active_when.parent]):
                options: tuple[Value, ...] = (None,)
            else:
                options = self.choices(name)
            for value in options:
                partial[name] = value
                yield from expand(index + 1, partial)
            del partial[name]

        yield from expand(0, {})

    def describe(self, config: Config) -> str:
        """The tuned knobs of ``config`` that are active, as ``name=value``."""
        return " ".join(f"{name}={KNOBS[name].format(config[name])}" for name in self.tuned if KNOBS[name].is_active(config))

    def size(self) -> int:
        return sum(1 for _ in self.configs())

    def contains(self, config: Config) -> bool:
        return all(
            value is None if not KNOBS[name].is_active(config) else value in self.choices(name)
            for name, value in config.items()
        )


def builtin_space_path(name: str) -> Path:
    return BUILTIN_SPACES_DIR / f"{name}.yaml"


def resolve_space_path(reference: str, relative_to: Path) -> Path:
    """A bare name (``h200_single``) is a built-in space; anything else is a path."""
    if "/" not in reference and not reference.endswith((".yaml", ".yml")):
        return builtin_space_path(reference)
    path = Path(reference)
    return path if path.is_absolute() else relative_to / path


def load_space(path: Path) -> SearchSpace:
    """Load and validate a space file; every error names the file and the field."""
    spec = load_file(path, SpaceFile)
    if spec.cut_of is not None:
        return _load_cut(path, spec, spec.cut_of)
    if spec.target is None:
        raise InputFileError(path, "target", "is required (or cut_of, naming the space this one cuts)")

    tuned = {name: _tuned_values(path, name, values) for name, values in spec.tune.items()}
    fixed: dict[str, Value] = {}
    for name, raw_value in spec.fixed.items():
        knob = _knob_at(path, f"fixed.{name}", name)
        if name in tuned:
            raise InputFileError(path, f"fixed.{name}", "is also under tune; a knob is either tuned or fixed")
        try:
            fixed[name] = knob.parse(raw_value)
        except KnobError as exc:
            raise InputFileError(path, f"fixed.{name}", exc.message) from None

    space = SearchSpace(
        name=spec.name,
        description=spec.description,
        path=path,
        target=spec.target,
        reachable=spec.reachable,
        tuned=tuned,
        fixed=fixed,
        warm_starts=(),
    )
    _check_conditions_reachable(space)
    warm_starts = tuple(_warm_start(space, index, entry) for index, entry in enumerate(spec.warm_start))
    return dataclasses.replace(space, warm_starts=warm_starts)


def _tuned_values(path: Path, name: str, values: list[Any]) -> tuple[Value, ...]:
    """The parsed candidate values of ``tune.<name>``: at least one, none repeated."""
    knob = _knob_at(path, f"tune.{name}", name)
    if not values:
        raise InputFileError(path, f"tune.{name}", "needs at least one candidate value")
    parsed: list[Value] = []
    for index, raw_value in enumerate(values):
        try:
            value = knob.parse(raw_value)
        except KnobError as exc:
            raise InputFileError(path, f"tune.{name}[{index}]", exc.message) from None
        if value in parsed:
            raise InputFileError(path, f"tune.{name}[{index}]", f"repeats the value {knob.format(value)}")
        parsed.append(value)
    return tuple(parsed)


def _load_cut(path: Path, spec: SpaceFile, parent_reference: str) -> SearchSpace:
    """A space that keeps some values of its parent's tuned knobs and the rest of its parent."""
    for field in ("target", "reachable", "fixed"):
        if getattr(spec, field):
            raise InputFileError(path, field, f"a cut takes its parent's ({parent_reference}); leave it out")
    parent_path = resolve_space_path(parent_reference, path.parent)
    if not parent_path.is_file():
        raise InputFileError(path, "cut_of", f"no space {parent_reference} ({parent_path} is not a file)")
    parent = load_space(parent_path)
    tuned = dict(parent.tuned)
    for name, values in spec.tune.items():
        if name not in parent.tuned:
            raise InputFileError(path, f"tune.{name}", f"is not tuned by {parent.name}: a cut keeps some of "
                                                       "its parent's values, it adds no knob")
        kept = _tuned_values(path, name, values)
        for index, value in enumerate(kept):
            if value not in parent.tuned[name]:
                choices = ", ".join(KNOBS[name].format(choice) for choice in parent.tuned[name])
                raise InputFileError(path, f"tune.{name}[{index}]", f"{KNOBS[name].format(value)} is not among "
                                                                    f"{parent.name}'s values ({choices})")
        tuned[name] = kept
    space = dataclasses.replace(parent, name=spec.name, description=spec.description, path=path, tuned=tuned,
                                warm_starts=(), cut_of=parent.name)
    _check_conditions_reachable(space)
    if spec.warm_start:
        warm_starts = tuple(_warm_start(space, index, entry) for index, entry in enumerate(spec.warm_start))
    else:
        warm_starts = tuple(start for start in parent.warm_starts if space.contains(start.config))
    return dataclasses.replace(space, warm_starts=warm_starts)


def _knob_at(path: Path, field: str, name: str):
    try:
        return get_knob(name)
    except KnobError as exc:
        raise InputFileError(path, field, exc.message) from None


def _check_conditions_reachable(space: SearchSpace) -> None:
    """A conditional knob given values must be switched on by at least one parent value."""
    for section, names in (("tune", space.tuned), ("fixed", space.fixed)):
        for name in names:
            condition = KNOBS[name].active_when
            if condition is None:
                continue
            if not any(condition.test(value) for value in space.choices(condition.parent)):
                raise InputFileError(
                    space.path,
                    f"{section}.{name}",
                    f"never applies: it needs {condition.text}, which no value of "
                    f"{condition.parent} in this space gives",
                )


def _warm_start(space: SearchSpace, index: int, entry: WarmStartEntry) -> WarmStart:
    """Complete a warm-start point with the space's fixed values and check it lies in the space."""
    field = f"warm_start[{index}].config"
    for name in entry.config:
        if name in space.fixed:
            raise InputFileError(space.path, f"{field}.{name}", "is fixed by the space; leave it out")
    try:
        config = complete_config(entry.config, defaults=space.fixed)
    except KnobError as exc:
        raise InputFileError(space.path, f"{field}.{exc.knob}", exc.message) from None
    for name, value in config.items():
        if KNOBS[name].is_active(config) and value not in space.choices(name):
            choices = ", ".join(KNOBS[name].format(v) for v in space.choices(name))
            raise InputFileError(
                space.path,
                f"{field}.{name}",
                f"{KNOBS[name].format(value)} is not in the space (choices: {choices})",
            )
    return WarmStart(name=entry.name, why=entry.why, config=config)


def target_context(space: SearchSpace) -> RuleContext:
    """The rule context of the space's own ``target`` (used when no campaign is given)."""
    target = space.target
    model = resolve_model(space.path, "target.model", target.model, "target.model_overrides", target.model_overrides)
    trainable = resolve_trainable(space.path, "target.trainable", target.trainable)
    return RuleContext(model=model, world_size=target.gpus_per_trial, stack=target.stack, trainable=trainable)
