"""The training-step loop every trainable's burst shares."""

from __future__ import annotations

from typing import Callable

from autotune.core.contract import Outcome, StepRecord


def run_steps(steps: int, train_step: Callable[[int], tuple[StepRecord, bool]], records: list[StepRecord]) -> Outcome:
    """Run up to ``steps`` steps; ``train_step(step)`` returns the step's record and whether the
    caller said stop. Records go into the caller's ``records`` as they finish, so a burst that
    fails mid-way still reports every step it completed. ``pruned`` when told to stop, else ``ok``."""
    for step in range(steps):
        record, stop = train_step(step)
        records.append(record)
        if stop:
            return "pruned"
    return "ok"
