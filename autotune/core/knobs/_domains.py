"""Value domains of knobs: how a raw YAML/CLI value becomes a canonical value and back.

Canonical values are plain, hashable Python values: ``int``, ``bool``, ``str``, ``None`` (unset,
or "not applicable" for a conditional knob whose parent switched it off) and ``tuple[str, ...]``
for set-valued knobs such as ``recompute_modules``. Hashable values let configs be deduplicated
and used as Optuna categorical choices.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Hashable

Value = Hashable


class Domain(ABC):
    """What values a knob may take. ``parse`` raises ``ValueError`` with a plain sentence."""

    @abstractmethod
    def parse(self, raw: Any) -> Value:
        """Turn a YAML/JSON value into the canonical value, or raise ``ValueError``."""

    @abstractmethod
    def describe(self) -> str:
        """One phrase naming what is accepted, for error messages and ``space show``."""

    def format(self, value: Value) -> str:
        """Human and Hydra friendly text of a canonical value."""
        if value is None:
            return "null"
        if isinstance(value, bool):
            return "true" if value else "false"
        return str(value)


@dataclass(frozen=True, slots=True)
class IntDomain(Domain):
    minimum: int = 1
    optional: bool = False
    """``None`` allowed (Megatron's "unset", e.g. ETP ``None`` means "same as TP")."""

    def parse(self, raw: Any) -> Value:
        if raw is None and self.optional:
            return None
        if isinstance(raw, bool) or not isinstance(raw, int):
            raise ValueError(f"expected {self.describe()}, got {raw!r}")
        if raw < self.minimum:
            raise ValueError(f"expected {self.describe()}, got {raw!r}")
        return raw

    def describe(self) -> str:
        text = f"an integer >= {self.minimum}"
        return f"{text} or null" if self.optional else text


@dataclass(frozen=True, slots=True)
class BoolDomain(Domain):
    def parse(self, raw: Any) -> Value:
        if not isinstance(raw, bool):
            raise ValueError(f"expected true or false, got {raw!r}")
        return raw

    def describe(self) -> str:
        return "true or false"


@dataclass(frozen=True, slots=True)
class ChoiceDomain(Domain):
    choices: tuple[str, ...]
    optional: bool = False

    def parse(self, raw: Any) -> Value:
        if raw is None and self.optional:
            return None
        if raw not in self.choices:
            raise ValueError(f"expected {self.describe()}, got {raw!r}")
        return raw

    def describe(self) -> str:
        text = "one of " + ", ".join(self.choices)
        return f"{text} or null" if self.optional else text


@dataclass(frozen=True, slots=True)
class SubsetDomain(Domain):
    """A set of named elements, kept as a tuple in the declared element order.

    Order is canonicalised so ``[moe_router, attn]`` and ``[attn, moe_router]`` are one config.
    A space-separated string is accepted too, as Megatron-LM flags are written.
    """

    elements: tuple[str, ...]
    empty_means: str | None = None
    """What the empty set means (``"the whole layer"``); ``None`` when it is not allowed."""

    def parse(self, raw: Any) -> Value:
        if isinstance(raw, str):
            raw = raw.split()
        if not isinstance(raw, (list, tuple)):
            raise ValueError(f"expected a list drawn from {', '.join(self.elements)}, got {raw!r}")
        unknown = [item for item in raw if item not in self.elements]
        if unknown:
            raise ValueError(
                f"unknown element(s) {unknown}; expected a list drawn from {', '.join(self.elements)}"
            )
        if len(set(raw)) != len(raw):
            raise ValueError(f"repeated element in {list(raw)}")
        if not raw and self.empty_means is None:
            raise ValueError(f"expected at least one of {', '.join(self.elements)}")
        return tuple(e for e in self.elements if e in raw)

    def describe(self) -> str:
        text = "a list drawn from " + ", ".join(self.elements)
        return f"{text} (empty: {self.empty_means})" if self.empty_means else text

    def format(self, value: Value) -> str:
        if value is None:
            return "null"
        return "[" + ",".join(value) + "]"
