"""What ``autotune/`` and ``trainables/`` agree on, and nothing else.

The tuner never imports Megatron; trainables never import Optuna or Ray Tune. They meet here:
the stack a trial runs on, and what a trainable can honour. (Later: the burst's records.)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Mapping

from pydantic import BaseModel, ConfigDict

from autotune.knobs import KNOBS, Value, get_knob

Accelerator = Literal["cpu", "h100", "h200", "b200", "gb200"]


class StackCapabilities(BaseModel):
    """The software and hardware a trial runs on; a campaign states assumptions, the probe measures.

    Versions are strings as the packages report them; ``None`` means "not installed".
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    accelerator: Accelerator
    megatron_core: str | None = None
    transformer_engine: str | None = None
    deep_ep: bool = False
    hybrid_ep: bool = False

    @property
    def has_cuda(self) -> bool:
        return self.accelerator != "cpu"


@dataclass(frozen=True, slots=True)
class TrainableSupport:
    """The knob values a trainable honours for real; the rules engine rejects the rest before launch.

    ``allowed`` maps a knob to the values it accepts (for set-valued knobs: the elements, with
    ``()`` standing for the empty set). Knobs not listed are honoured in full. A trainable never silently ignores a knob.
    """

    name: str
    requires_cuda: bool = False
    allowed: Mapping[str, frozenset[Value]] = field(default_factory=dict)
    cuda_only: Mapping[str, frozenset[Value]] = field(default_factory=dict)
    """Values honoured only on a CUDA device (e.g. graphs), checked against the stack."""

    def __post_init__(self) -> None:
        for name in (*self.allowed, *self.cuda_only):
            get_knob(name)

    def unsupported(self, knob: str, value: Value, stack: StackCapabilities) -> str | None:
        """Why ``value`` of ``knob`` cannot run here, or ``None`` if it can."""
        if value is None:
            return None
        # Set-valued knobs are checked element by element; the empty set (a whole-layer graph
        # scope) is checked as the element ``()``.
        items = (value or ((),)) if isinstance(value, tuple) else (value,)
        if knob in self.allowed:
            bad = [item for item in items if item not in self.allowed[knob]]
            if bad:
                accepted = ", ".join(sorted(KNOBS[knob].format(v) for v in self.allowed[knob]))
                return (
                    f"the {self.name} trainable cannot honour {knob}="
                    f"{KNOBS[knob].format(value)} (it honours {accepted})"
                )
        if knob in self.cuda_only and not stack.has_cuda:
            bad = [item for item in items if item in self.cuda_only[knob]]
            if bad:
                return f"{knob}={KNOBS[knob].format(value)} needs a CUDA device; this stack is {stack.accelerator}"
        return None
