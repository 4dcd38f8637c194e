"""Search: Optuna over a space, with the rules and every outcome as feedback; screening decisions."""

from typing import Literal

SamplerName = Literal["tpe", "random"]
"""``tpe``: multivariate TPE with constant liar and constraints; ``random``."""
