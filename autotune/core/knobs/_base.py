"""The :class:`Knob` record: everything we know about one tunable setting, in one place."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Literal, Mapping

from packaging.version import Version

from autotune.core.errors import KnobError
from autotune.core.knobs._domains import BoolDomain, Domain, SubsetDomain, Value

MegatronTarget = Literal["transformer", "ddp", "llava_freeze", "training"]
"""Where megatron-core reads a knob: ``TransformerConfig`` (including its ``ModelParallelConfig``
base), ``DistributedDataParallelConfig``, the arguments of ``LLaVAModel.freeze``, or only the
training loop (micro-batch size, torch FSDP2 wrapping)."""


@dataclass(frozen=True, slots=True)
class Condition:
    """When a conditional knob applies, as a test on its parent knob's value."""

    parent: str
    test: Callable[[Value], bool]
    text: str
    """How ``space show`` and error messages state the condition, e.g. ``recompute_granularity=full``."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Knob:
    """One tunable knob, defined once; spaces, rules, export and trainables all read it.

    Canonical names are Megatron-Bridge's leaf names because users already know them.
    """

    name: str
    domain: Domain
    default: Value
    """Megatron's own default (for a conditional knob: its value once the condition holds)."""
    doc: str
    megatron_target: MegatronTarget
    megatron_field: str | None
    """Field name in the oldest supported megatron-core (0.16); ``None`` for training-loop knobs."""
    bridge_key: str
    """Megatron-Bridge Hydra override key in the oldest supported release."""
    megatron_lm_flag: str | None
    """Megatron-LM command-line flag; ``None`` where Megatron-LM has none."""
    renamed: tuple[tuple[str, str], ...] = ()
    """``(first megatron-core version, new leaf name)``: the field, Bridge key and flag follow it."""
    none_alias: str | None = None
    """Canonical value that Megatron spells ``None`` (``recompute_granularity: none``)."""
    active_when: Condition | None = None

    # -- values -------------------------------------------------------------------------------
    def parse(self, raw: Any) -> Value:
        """Canonical value of ``raw``; raises :class:`KnobError` naming this knob."""
        try:
            return self.domain.parse(raw)
        except ValueError as exc:
            raise KnobError(self.name, str(exc)) from None

    def format(self, value: Value) -> str:
        return self.domain.format(value)

    def is_active(self, config: Mapping[str, Value]) -> bool:
        return self.active_when is None or self.active_when.test(config[self.active_when.parent])

    def to_megatron(self, value: Value) -> Any:
        """The value megatron-core expects in :attr:`megatron_field`."""
        if value is None or (self.none_alias is not None and value == self.none_alias):
            return None
        if isinstance(self.domain, SubsetDomain):
            return list(value)
        return value

    def from_megatron(self, value: Any) -> Value:
        if value is None and self.none_alias is not None:
            return self.none_alias
        return self.parse(value)

    # -- names across versions -----------------------------------------------------------------
    def _leaf_for(self, megatron_core_version: str | None) -> str | None:
        """The field's leaf name in that megatron-core version (newest name when unknown)."""
        leaf = self.megatron_field
        for first_version, new_leaf in self.renamed:
            if megatron_core_version is None or Version(megatron_core_version) >= Version(first_version):
                leaf = new_leaf
        return leaf

    def megatron_field_for(self, megatron_core_version: str | None) -> str | None:
        return self._leaf_for(megatron_core_version)

    def bridge_key_for(self, megatron_core_version: str | None) -> str:
        if not self.renamed:
            return self.bridge_key
        section = self.bridge_key.rsplit(".", 1)[0]
        return f"{section}.{self._leaf_for(megatron_core_version)}"

    def megatron_lm_flag_for(self, megatron_core_version: str | None) -> str | None:
        if not self.renamed or self.megatron_lm_flag is None:
            return self.megatron_lm_flag
        return "--" + str(self._leaf_for(megatron_core_version)).replace("_", "-")

    # -- export renderings -----------------------------------------------------------------------
    def bridge_override(self, value: Value, megatron_core_version: str | None) -> str:
        """A Megatron-Bridge Hydra override, e.g. ``model.recompute_modules=[core_attn,moe_act]``."""
        rendered = "null" if self.to_megatron(value) is None else self.format(value)
        return f"{self.bridge_key_for(megatron_core_version)}={rendered}"

    def megatron_lm_args(self, value: Value, megatron_core_version: str | None) -> list[str]:
        """Megatron-LM flags for ``value``; empty where Megatron's default already means it."""
        flag = self.megatron_lm_flag_for(megatron_core_version)
        if flag is None:
            raise KnobError(self.name, "Megatron-LM has no flag for this knob")
        megatron_value = self.to_megatron(value)
        if megatron_value is None or megatron_value == []:
            return []
        if isinstance(self.domain, BoolDomain):
            return [flag] if value else []
        if isinstance(megatron_value, list):
            return [flag, *megatron_value]
        return [flag, str(megatron_value)]
