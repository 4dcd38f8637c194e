"""Start a burst's ranks on this machine: in-process for one rank of a trainable that allows it,
processes over gloo (CPU) or NCCL (one GPU each) otherwise. Rank processes fork from a forkserver
that has already imported torch and the native trainable, so a burst does not pay their import
(seconds per rank) each time; the launching process itself (a trial's) does not import torch
at all unless it runs the rank in-process. A Ray Train worker group starts ranks instead and calls
the same rank runner (:func:`trainables.rank_runner`)."""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import pickle
import queue
import signal
import socket
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

from autotune.core.contract import BurstRequest, BurstResult, Reporter, StepReport
from autotune.core.registry import rank_runner, trainable_support

if TYPE_CHECKING:
    import torch

RANK_TIMEOUT = timedelta(minutes=5)
STRAGGLER_GRACE_SECONDS = 10.0
"""Once one rank has exited, how long the others may take before they are presumed stuck in a
collective with it (after an OOM on one rank, say) and killed."""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def device_for(rank: int) -> torch.device:
    import torch

    if torch.cuda.is_available():
        return torch.device("cuda", rank % torch.cuda.device_count())
    return torch.device("cpu")


def cpu_threads_per_rank(world_size: int) -> int:
    return max(1, (os.cpu_count() or 1) // world_size)


class _RelayedReporter:
    """Rank 0's reporter in a spawned rank: sends each record to the launcher and waits for its
    verdict, so a stop decided by the caller takes effect at exactly the step it saw."""

    def __init__(self, records: mp.Queue, verdicts: mp.Queue) -> None:
        self.records, self.verdicts = records, verdicts

    def __call__(self, report: StepReport) -> bool:
        self.records.put(report)
        return self.verdicts.get()


_CONTEXT = mp.get_context("forkserver")
_CONTEXT.set_forkserver_preload(["trainables.native.burst"])


def _die_with_parent() -> None:
    """Linux: this rank gets SIGKILL when its parent (the forkserver, which exits with the
    launching process) dies, so no rank outlives a trial killed by its scheduler or a driver
    killed with SIGKILL."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _rank_main(
    trainable: str, rank: int, world_size: int, port: int, request: BurstRequest, out_dir: str,
    reporter: Reporter | None,
) -> None:
    _die_with_parent()
    if os.getppid() == 1:  # orphaned before the signal was armed
        return
    import torch
    import torch.distributed as dist

    try:
        torch.set_num_threads(cpu_threads_per_rank(world_size))
        device = device_for(rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size, timeout=RANK_TIMEOUT
        )
        try:
            result = rank_runner(trainable)(request, device, reporter if rank == 0 else None)
        finally:
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - a rank that cannot start reports why instead of an exit code
        result = BurstResult(outcome="failed", error=f"rank {rank} could not start:\n{traceback.format_exc()}")
    Path(out_dir, f"rank{rank}.pkl").write_bytes(pickle.dumps(result))


def run_local(request: BurstRequest, reporter: Reporter | None = None, trainable: str = "native") -> BurstResult:
    """Run a burst of ``trainable`` on ``request.world_size`` local ranks; merge the ranks' outcomes.

    ``reporter`` is called here, in the caller's process, with every step's report (rank 0's
    aggregate); returning ``False`` stops every rank after that step (outcome ``pruned``). One
    uncapped rank runs in the caller's process unless the trainable needs a fresh process.
    """
    if (request.world_size == 1 and request.cpu_memory_cap_bytes is None
            and not trainable_support(trainable).fresh_process):
        import torch

        torch.set_num_threads(cpu_threads_per_rank(1))
        return rank_runner(trainable)(request, device_for(0), reporter)
    # More ranks, a CPU memory cap (it bounds the address space a process *adds*, and the
    # caller's heap may hold freed memory the burst would reuse uncounted), or a trainable with
    # process-global state: the ranks start in fresh processes.
    with tempfile.TemporaryDirectory(prefix="burst-") as out_dir:
        reports, verdicts = _CONTEXT.Queue(), _CONTEXT.Queue()
        relay = _RelayedReporter(reports, verdicts) if reporter is not None else None
        port = _free_port()
        processes = [
            _CONTEXT.Process(
                target=_rank_main, args=(trainable, rank, request.world_size, port, request, out_dir, relay)
            )
            for rank in range(request.world_size)
        ]
        stragglers: set[int] = set()
        try:
            for process in processes:
                process.start()
            stragglers = _supervise(processes, reports, verdicts, reporter)
        finally:
            for process in processes:
                if process.pid is None:  # never started
                    continue
                if process.is_alive():
                    process.kill()
                process.join()
        results = []
        for rank, process in enumerate(processes):
            path = Path(out_dir, f"rank{rank}.pkl")
            if path.exists():
                results.append(pickle.loads(path.read_bytes()))
            elif rank not in stragglers:
                results.append(BurstResult(outcome="failed", error=_exit_reason(rank, process.exitcode)))
    return merge_rank_results(results)


def _exit_reason(rank: int, exitcode: int | None) -> str:
    if exitcode == -signal.SIGKILL:
        return f"rank {rank} was killed with SIGKILL (the kernel's OOM killer, or an operator)"
    return f"rank {rank} exited with code {exitcode} before reporting"


def _supervise(processes: list, reports: mp.Queue, verdicts: mp.Queue, reporter: Reporter | None) -> set[int]:
    """Relay rank 0's reports to ``reporter`` until every rank exits; kill ranks left stuck
    after another one exited (they wait in a collective for a rank that is gone) and return them."""
    first_exit: float | None = None
    stragglers: set[int] = set()
    while any(process.is_alive() for process in processes):
        if reporter is None:
            time.sleep(0.2)
        else:
            try:
                verdicts.put(bool(reporter(reports.get(timeout=0.2))))
            except queue.Empty:
                pass
        if first_exit is None and any(not process.is_alive() for process in processes):
            first_exit = time.monotonic()
        if first_exit is not None and time.monotonic() - first_exit > STRAGGLER_GRACE_SECONDS:
            for rank, process in enumerate(processes):
                if process.is_alive():
                    process.kill()
                    stragglers.add(rank)
    return stragglers


def merge_rank_results(results: list[BurstResult]) -> BurstResult:
    """The first reporting rank's records and contract (rank 0's unless it was killed), with the
    outcome that explains the others: an OOM or an invalid config on one rank makes its peers
    fail in their next collective, so those causes outrank ``failed``."""
    cause = ["ok", "pruned", "failed", "invalid", "oom"]
    worst = max(results, key=lambda r: cause.index(r.outcome))
    primary = results[0]
    if worst.outcome == primary.outcome:
        return primary
    return BurstResult(outcome=worst.outcome, records=primary.records, contract=primary.contract,
                       error=worst.error, evidence=primary.evidence)
