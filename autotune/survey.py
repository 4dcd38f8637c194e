"""What a space holds under a rule context: how many configs, how many rejected, and why."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from autotune.core.errors import InputFileError
from autotune.core.knobs import Config
from autotune.rules import RuleContext, Violation, violations
from autotune.space import SearchSpace


@dataclass
class SpaceSurvey:
    total: int = 0
    accepted: list[Config] = field(default_factory=list)
    rejected_by_rule: Counter[str] = field(default_factory=Counter)
    """Configs each rule rejects (a config breaking two rules counts under both)."""
    rejected: int = 0
    example: dict[str, str] = field(default_factory=dict)
    """One reason per rule, as the rule worded it for the first config it rejected."""


def survey_space(space: SearchSpace, context: RuleContext) -> SpaceSurvey:
    result = SpaceSurvey()
    for config in space.configs():
        result.total += 1
        found = violations(config, context)
        if not found:
            result.accepted.append(config)
            continue
        result.rejected += 1
        for violation in found:
            result.rejected_by_rule[violation.rule] += 1
            result.example.setdefault(violation.rule, violation.reason)
    return result


def check_warm_starts(space: SearchSpace, context: RuleContext) -> None:
    """A warm start the rules reject is a mistake in the space file: say which one and why."""
    for index, warm in enumerate(space.warm_starts):
        found: list[Violation] = violations(warm.config, context)
        if found:
            reasons = "; ".join(f"[{v.rule}] {v.reason}" for v in found)
            raise InputFileError(space.path, f"warm_start[{index}]", f"{warm.name!r} is rejected: {reasons}")
