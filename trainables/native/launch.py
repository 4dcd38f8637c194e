"""Start a burst's ranks on this machine: in-process for one rank, spawned processes over gloo
(CPU) or NCCL (one GPU each) for more. The campaign engine starts ranks through Ray instead and
calls :func:`~trainables.native.burst.run_rank` the same way."""

from __future__ import annotations

import os
import pickle
import queue
import socket
import tempfile
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from autotune.contract import BurstRequest, BurstResult, StepRecord
from trainables.native.burst import Reporter, run_rank

RANK_TIMEOUT = timedelta(minutes=5)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def device_for(rank: int) -> torch.device:
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

    def __call__(self, record: StepRecord) -> bool:
        self.records.put(record)
        return self.verdicts.get()


def _rank_main(
    rank: int, world_size: int, port: int, request: BurstRequest, out_dir: str, reporter: Reporter | None
) -> None:
    torch.set_num_threads(cpu_threads_per_rank(world_size))
    device = device_for(rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size, timeout=RANK_TIMEOUT
    )
    try:
        result = run_rank(request, device, reporter if rank == 0 else None)
    finally:
        dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.pkl").write_bytes(pickle.dumps(result))


def run_local(request: BurstRequest, reporter: Reporter | None = None) -> BurstResult:
    """Run the burst on ``request.world_size`` local ranks; merge the ranks' outcomes.

    ``reporter`` is called here, in the caller's process, with every step's record (rank 0's
    aggregate); returning ``False`` stops every rank after that step (outcome ``pruned``).
    """
    if request.world_size == 1:
        torch.set_num_threads(cpu_threads_per_rank(1))
        return run_rank(request, device_for(0), reporter)
    with tempfile.TemporaryDirectory(prefix="burst-") as out_dir:
        context = mp.get_context("spawn")
        records, verdicts = context.Queue(), context.Queue()
        relay = _RelayedReporter(records, verdicts) if reporter is not None else None
        port = _free_port()
        processes = [
            context.Process(target=_rank_main, args=(rank, request.world_size, port, request, out_dir, relay))
            for rank in range(request.world_size)
        ]
        for process in processes:
            process.start()
        while reporter is not None and any(process.is_alive() for process in processes):
            try:
                record = records.get(timeout=0.5)
            except queue.Empty:
                continue
            verdicts.put(bool(reporter(record)))
        for process in processes:
            process.join()
        results = []
        for rank, process in enumerate(processes):
            path = Path(out_dir, f"rank{rank}.pkl")
            if path.exists():
                results.append(pickle.loads(path.read_bytes()))
            else:
                results.append(BurstResult(outcome="failed", error=f"rank {rank} exited with code {process.exitcode}"))
    return merge_rank_results(results)


def merge_rank_results(results: list[BurstResult]) -> BurstResult:
    """Rank 0's records and contract, with the worst outcome any rank saw."""
    severity = ["ok", "pruned", "invalid", "oom", "failed"]
    worst = max(results, key=lambda r: severity.index(r.outcome))
    primary = results[0]
    if worst.outcome == primary.outcome:
        return primary
    return BurstResult(outcome=worst.outcome, records=primary.records, contract=primary.contract,
                       error=worst.error, evidence=primary.evidence)
