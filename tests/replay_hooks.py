"""Worker setup hooks for tests/test_faults.py (loaded into every Ray worker of one test's cluster):
replayed bursts that misbehave as real ones do on a bad night."""

from __future__ import annotations

import threading
import time


def stuck_small_batches() -> None:
    """Bursts of micro-batch size 1 or 2 report no step for 4 minutes, as a burst stuck in a
    collective on a lost peer does. Longer than any watchdog of the tests waits; without one the
    burst then fails (and the test with it) instead of hanging the test run."""
    import trainables.replay.burst as replay

    recorded = replay.run_replay

    def stuck(request, reporter=None):
        if request.config.micro_batch_size < 4:
            threading.Event().wait(240)
            raise RuntimeError("stuck burst: no watchdog killed it")
        return recorded(request, reporter)

    replay.run_replay = stuck


def slow_start() -> None:
    """Every burst takes 4 s to start, long enough for a test to take its node away."""
    import trainables.replay.burst as replay

    recorded = replay.run_replay

    def slow(request, reporter=None):
        time.sleep(4)
        return recorded(request, reporter)

    replay.run_replay = slow


def first_bursts_wait() -> None:
    """Bursts that start within 15 s of the first one wait until then (every rank of the first
    trial does: they start together), long enough for a test to find the trial's workers and take
    a node away; later bursts run as recorded. The first burst's time is a file's (``AUTOTUNE_TEST_MARK``)."""
    import os

    import trainables.replay.burst as replay

    recorded = replay.run_replay
    mark = os.environ["AUTOTUNE_TEST_MARK"]

    def waiting(request, reporter=None):
        try:
            os.close(os.open(mark, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            pass
        time.sleep(max(0.0, os.stat(mark).st_mtime + 15 - time.time()))
        return recorded(request, reporter)

    replay.run_replay = waiting
