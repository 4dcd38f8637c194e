"""Gates: what stops a proposed config before it reaches a device. Each says why in one sentence;
a rejected proposal is told to the study as infeasible at no cost, so the sampler learns the region
to avoid for free. They run in order — the rules first (a config Megatron refuses is refused, whatever
its memory), then the memory gates."""

from __future__ import annotations

from typing import Literal, Protocol

from autotune.core.knobs import Config
from autotune.memory_model import MemoryModel
from autotune.rules import RuleContext, violations
from autotune.search.history import GateName, History
from autotune.search.memory import needs_at_least_as_much_memory
from autotune.space import SearchSpace


class Gate(Protocol):
    name: GateName
    outcome: Literal["invalid", "oom_predicted"]
    """What a rejection by this gate is told as."""

    def reason(self, config: Config, history: History) -> str | None:
        """Why ``config`` must not launch, or ``None``."""
        ...

    def learn(self, config: Config, outcome: str, peak_memory_bytes: int | None) -> None:
        """Take in how a launched config ended."""
        ...


class RulesGate:
    """Megatron's own rules, the stack's and ours (:mod:`autotune.rules`)."""

    name: GateName = "rules"
    outcome: Literal["invalid"] = "invalid"

    def __init__(self, context: RuleContext) -> None:
        self.context = context

    def reason(self, config: Config, history: History) -> str | None:
        found = violations(config, self.context)
        return "; ".join(f"[{v.rule}] {v.reason}" for v in found) or None

    def learn(self, config: Config, outcome: str, peak_memory_bytes: int | None) -> None:
        """Rules do not learn."""


class OutOfMemoryGate:
    """A config that surely needs at least the memory of one that ran out (same layout, larger
    micro-batch, no more recompute or freezing: :mod:`autotune.search.memory`)."""

    name: GateName = "oom_dominance"
    outcome: Literal["oom_predicted"] = "oom_predicted"

    def __init__(self, space: SearchSpace) -> None:
        self.space = space

    def reason(self, config: Config, history: History) -> str | None:
        oom = next((oom for oom in history.out_of_memory if needs_at_least_as_much_memory(config, oom)), None)
        return None if oom is None else f"needs at least the memory of {self.space.describe(oom)}, which ran out"

    def learn(self, config: Config, outcome: str, peak_memory_bytes: int | None) -> None:
        """The history keeps the configs that ran out of memory."""


class MemoryModelGate:
    """The memory model, calibrated on the peaks this campaign's trials reported, predicts the config
    over the device's memory by more than its error (:mod:`autotune.memory_model`)."""

    name: GateName = "memory_model"
    outcome: Literal["oom_predicted"] = "oom_predicted"

    def __init__(self, model: MemoryModel) -> None:
        self.model = model

    def reason(self, config: Config, history: History) -> str | None:
        return self.model.rejection(config)

    def learn(self, config: Config, outcome: str, peak_memory_bytes: int | None) -> None:
        if outcome != "oom" and peak_memory_bytes:
            self.model.observe(config, peak_memory_bytes)
