"""The rules engine: every config is checked here before anything launches.

Importing this package registers every rule; :data:`RULES` maps rule names to rules.
"""

from autotune.rules import cuda_graphs, dispatch, fsdp, parallelism, recompute, stack  # noqa: F401  (registration)
from autotune.rules._base import RULES, Rule, RuleContext, RuleSource, Violation, violations

__all__ = ["RULES", "Rule", "RuleContext", "RuleSource", "Violation", "violations"]
