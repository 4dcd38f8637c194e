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


def bursts_wait_for_go() -> None:
    """Every burst marks that it started (file ``AUTOTUNE_TEST_MARK``) and waits until the test
    says go (file ``AUTOTUNE_TEST_GO``): a test finds the running trials and takes a node away
    however slowly the machine answers, and bursts started after that run as recorded. A burst
    that waits 5 minutes fails, so a test that never says go fails instead of hanging."""
    import os

    import trainables.replay.burst as replay

    recorded = replay.run_replay
    mark, go = os.environ["AUTOTUNE_TEST_MARK"], os.environ["AUTOTUNE_TEST_GO"]

    def waiting(request, reporter=None):
        open(mark, "a").close()
        deadline = time.monotonic() + 300
        while not os.path.exists(go):
            if time.monotonic() > deadline:
                raise RuntimeError("the test never said go")
            time.sleep(0.2)
        return recorded(request, reporter)

    replay.run_replay = waiting
