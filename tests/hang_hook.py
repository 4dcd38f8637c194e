"""Loaded into every Ray worker of tests/test_faults.py's hung-trial test (a worker setup hook):
replayed bursts of micro-batch size 1 or 2 report no step for 4 minutes, as a burst stuck in a collective
on a lost peer does. Every other burst replays as recorded."""

from __future__ import annotations

import threading


def install() -> None:
    import trainables.replay.burst as replay

    recorded = replay.run_replay

    def stuck_for_small_batches(request, reporter=None):
        if request.config.micro_batch_size < 4:
            # Longer than any watchdog of the test waits; without one the burst then fails (and
            # the test with it) instead of hanging the test run.
            threading.Event().wait(240)
            raise RuntimeError("stuck burst: no watchdog killed it")
        return recorded(request, reporter)

    replay.run_replay = stuck_for_small_batches
