"""Start a burst's ranks on this machine: in-process for one rank of a trainable that allows it,
processes over gloo (CPU) or NCCL (one GPU each) otherwise. Rank processes fork from a zygote
(:mod:`trainables.zygote`) that has already imported torch and the trainables, so a burst does not
pay those imports (seconds per rank): the node's, which a campaign keeps warm across its trials, or
one this process starts on its first burst and keeps. A campaign's zygote keeps a burst's healthy rank
processes for its next burst of the same trainable (kept ranks, :func:`_rank_main` says which are
healthy) unless the trainable needs fresh processes. The launching process itself (a trial's) does
not import torch at all unless it runs the rank in-process. A Ray Train worker group starts ranks
instead and calls the same rank runner (:func:`trainables.rank_runner`)."""

from __future__ import annotations

import contextlib
import functools
import logging
import multiprocessing as mp
import os
import pickle
import signal
import tempfile
import time
import traceback
import uuid
from dataclasses import replace
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, Mapping, TypeVar

from autotune.core.contract import BurstRequest, BurstResult, RankStart, RanksStarted, Reporter, StepReport, TimedPart
from autotune.core.errors import AutotuneError
from autotune.core.registry import rank_runner, start_rank_zygote, trainable_support
from trainables import kept_groups
from trainables.zygote import Zygote, ZygoteChild

if TYPE_CHECKING:
    import subprocess

    import torch

BurstResultOrReport = TypeVar("BurstResultOrReport", BurstResult, StepReport)

RANK_TIMEOUT = timedelta(minutes=5)
RENDEZVOUS_TIMEOUT = timedelta(minutes=2)
"""How long a burst's ranks may take to all join its process group. They start within a second of
each other (forked from a zygote that holds their imports, or kept); a GPU rank makes its CUDA
context first (seconds). A rank that has not joined by then never will, and its peers say which
it is rather than wait out :data:`RANK_TIMEOUT`."""
log = logging.getLogger(__name__)
STRAGGLER_GRACE_SECONDS = 10.0
"""Once one rank has exited, how long the others may take before they are presumed stuck in a
collective with it (after an OOM on one rank, say) and killed."""


def device_for(rank: int) -> torch.device:
    import torch

    if torch.cuda.is_available():
        return torch.device("cuda", rank % torch.cuda.device_count())
    return torch.device("cpu")


def cpu_threads_per_rank(world_size: int) -> int:
    return max(1, (os.cpu_count() or 1) // world_size)


class _RelayedReporter:
    """Rank 0's reporter in a rank process: sends each report to the launcher and waits for its
    verdict, so a stop decided by the caller takes effect at exactly the step it saw."""

    def __init__(self, relay: Connection) -> None:
        self.relay = relay
        self.last_verdict_at: float | None = None
        """When the last verdict came (``time.perf_counter()``): the burst's end starts there."""

    def __call__(self, report: StepReport) -> bool:
        self.relay.send(report)
        verdict = self.relay.recv()
        self.last_verdict_at = time.perf_counter()
        return verdict


_own_zygote: tuple[Zygote, subprocess.Popen] | None = None


def _this_process_zygote(trainable: str) -> tuple[Zygote, RankStart]:
    """This process's own zygote, started on its first burst (of ``trainable``, whose stack it
    imports): that burst's ranks start cold."""
    global _own_zygote
    if _own_zygote is not None and _own_zygote[1].poll() is None:
        return _own_zygote[0], "warm"
    address = str(Path(tempfile.mkdtemp(prefix="ranks-"), "zygote"))
    _own_zygote = Zygote(address), start_rank_zygote(address, trainable)
    return _own_zygote[0], "cold"


KEPT_OUTCOMES = ("ok", "pruned", "invalid")
"""A rank process whose burst ended so may run the next one (a kept rank, :mod:`trainables.zygote`);
one that ran out of memory, failed or was killed is replaced: its CUDA context may be poisoned
(a device-side assert), its allocator fragmented."""
KEPT_ALLOCATED_SLACK_BYTES = 128 * 2**20
"""How much more device memory than at its first burst's start a kept rank may hold once a burst's
objects are collected: workspaces libraries keep for the process's life. Measured: 65.0 MiB left
after two megatron bursts on an H100 without TE, with no CUDA tensor or module of theirs alive
(``bench/results/h100_leak_fix_20261206/``): torch's cuBLAS keeps a workspace per handle and
stream, and the step's thread and autograd's have a handle each; TE keeps 32 MiB ones of its own
(the megatron trainable's release frees both since: nothing left after a TE-graph burst,
``bench/results/h100_kept_ranks_te_20261206/``).
A model, its gradients or optimizer states left behind are gigabytes, and leaks add up against the
first burst's start."""
_allocated_at_first_start: int | None = None


def _rank_main(
    relay: Connection, trainable: str, rank: int, world_size: int, request: BurstRequest, out_dir: str,
    relayed: bool,
) -> Callable[[], bool] | None:
    """One rank of a burst in this process; its result goes to ``out_dir``, where its ranks also
    meet (:func:`_rendezvous_store`). Returns the check that
    says whether the process may run another burst (a kept rank), which its zygote runs once the
    launcher has the result, or ``None`` where it may not: the burst did not end ok, pruned or
    invalid."""
    global _allocated_at_first_start
    import torch

    with _stack_on_signal(out_dir, rank):
        try:
            torch.set_num_threads(cpu_threads_per_rank(world_size))
            device = device_for(rank)
            if device.type == "cuda":
                torch.cuda.set_device(device)
                if _allocated_at_first_start is None:
                    _allocated_at_first_start = torch.cuda.memory_allocated(device)
            _join_process_group("nccl" if device.type == "cuda" else "gloo", out_dir, rank, world_size)
            outcome = None
            try:
                reporter = _RelayedReporter(relay) if relayed and rank == 0 else None
                called_at = time.perf_counter()
                result = rank_runner(trainable)(request, device, reporter)
                returned_at = time.perf_counter()
                outcome = result.outcome
            finally:
                ended = _end_process_groups(keep_world=world_size == 1 or outcome in BALANCED_OUTCOMES)
            # The burst's end begins at the last verdict, or, out of memory before a step, where the
            # trainable timed the out of memory (its parts add up from its call).
            end_began_at = (reporter.last_verdict_at if reporter is not None and reporter.last_verdict_at is not None
                            else called_at + sum(part.seconds for part in result.before_first_step)
                            if result.before_first_step else None)
            if end_began_at is not None:
                result = replace(result, teardown=(*_trainables_end(returned_at - end_began_at, result.release),
                                                   TimedPart(ended, round(time.perf_counter() - returned_at, 4))))
        except Exception:  # noqa: BLE001 - a rank that cannot start reports why instead of an exit code
            result = BurstResult(outcome="failed", error=f"rank {rank} could not start:\n{traceback.format_exc()}")
        Path(out_dir, f"rank{rank}.pkl").write_bytes(pickle.dumps(result))
    return functools.partial(_clean_after_burst, rank, device) if result.outcome in KEPT_OUTCOMES else None


STACK_SIGNAL = signal.SIGUSR1
"""What makes a rank write its threads' Python stacks (``faulthandler``) before it is killed."""
STACK_WAIT_SECONDS = 3.0
"""How long stragglers get to write their stacks before they are killed anyway."""
STACK_SETTLE_SECONDS = 0.25
"""A stack file counts as written once it has stopped growing this long: ``faulthandler`` writes it
piece by piece from its signal handler and tells no one when it is done, and a rank killed as soon
as its file had a first line left half its stack (a CI run on a loaded 2-core box, 2026-12-07)."""


@contextlib.contextmanager
def _stack_on_signal(out_dir: str, rank: int) -> Iterator[None]:
    """While the block runs, :data:`STACK_SIGNAL` makes this process write every thread's stack to
    ``rank{rank}.stack`` in ``out_dir``: a rank killed as a straggler (:func:`_end_stragglers`)
    leaves no other trace of where it was stuck."""
    import faulthandler

    with Path(out_dir, f"rank{rank}.stack").open("w") as stacks:
        faulthandler.register(STACK_SIGNAL, file=stacks, all_threads=True)
        try:
            yield
        finally:
            faulthandler.unregister(STACK_SIGNAL)


def _rank_stack(out_dir: str, rank: int) -> str:
    path = Path(out_dir, f"rank{rank}.stack")
    return path.read_text().strip() if path.exists() else ""


def _end_stragglers(processes: list[ZygoteChild], out_dir: str) -> set[int]:
    """Kill the ranks still running, each once it has written its stacks (up to
    :data:`STACK_WAIT_SECONDS`); the ranks killed."""
    stuck = {rank: process for rank, process in enumerate(processes) if process.is_alive()}
    for process in stuck.values():
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, STACK_SIGNAL)
    sizes = {rank: 0 for rank in stuck}
    grew_at = dict.fromkeys(stuck, time.monotonic())
    deadline = time.monotonic() + STACK_WAIT_SECONDS
    while time.monotonic() < deadline:
        now = time.monotonic()
        for rank in stuck:
            size = len(_rank_stack(out_dir, rank))
            if size != sizes[rank]:
                sizes[rank], grew_at[rank] = size, now
        if all(sizes[rank] and now - grew_at[rank] >= STACK_SETTLE_SECONDS for rank in stuck):
            break
        time.sleep(0.05)
    for process in stuck.values():
        process.kill()
    return set(stuck)


def _trainables_end(seconds: float, release: tuple[TimedPart, ...]) -> tuple[TimedPart, ...]:
    """The trainable's end, from the burst's end to its return: its release part by part where it
    timed it (``release``), and the rest (its result)."""
    if not release:
        return (TimedPart("the trainable's end (its result, release)", round(max(0.0, seconds), 4)),)
    rest = seconds - sum(part.seconds for part in release)
    return (*(TimedPart(f"release: {part.name}", part.seconds) for part in release),
            TimedPart("the trainable's end, besides its release", round(max(0.0, rest), 4)))


WORLD_KEPT = "the burst's own process groups destroyed, the world's kept"
WORLD_DESTROYED = "process group destroyed"
BALANCED_OUTCOMES = ("ok", "pruned")
"""How a burst of several ranks ends with every rank out of the same collectives (a pruned burst's
ranks leave at the same step, :func:`trainables.steps._rank_zero_says`): its world may serve the
next burst of the same processes. After another end, a rank may have left a peer inside a
collective whose messages would meet the next burst's."""
_world_id: str | None = None
"""Which world this process's default process group is, for a world of several ranks: drawn by
rank 0 of the burst that made it. Ranks that all hold the same one are the processes that made it
and have run every burst since together (a rank that ran a burst with another peer made a new one)."""


def _join_process_group(backend: str, folder: str, rank: int, world_size: int) -> None:
    """Make this burst's process group, its ranks meeting in ``folder``, or, in kept ranks, take the
    one an earlier burst made where every rank of this burst made it together. Destroying an NCCL
    world took 0.95 s of each trial's end on an H100 (a world of one, the median trial of
    ``bench/results/h100_kept_ranks_te_20261206/``), and a new one pays its communicators' set-up
    again at its first collectives. A world of one has no peer that could have been replaced since;
    a world of more is kept only where all of this burst's ranks hold the same world, at the same
    rank: one new process among them (a peer replaced after an out of memory) and all make a new one.

    The ranks agree on that through files (:func:`_all_ranks_hold`): a store is made only for a
    new world, once the old one is gone, and a kept world runs no store's server for the agreement.
    """
    global _world_id
    import torch.distributed as dist

    held = dist.is_initialized() and dist.get_backend() == backend and dist.get_world_size() == world_size
    if held and world_size == 1:
        return
    if _all_ranks_hold(folder, rank, world_size, _world_id if held and dist.get_rank() == rank else None):
        return
    if dist.is_initialized():
        dist.destroy_process_group()
        kept_groups.forget()  # they went with the world
    store = _rendezvous_store(folder, rank, world_size)
    if rank == 0:
        store.set("world", uuid.uuid4().hex)
    _world_id = store.get("world").decode()
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=RANK_TIMEOUT)


def _all_ranks_hold(folder: str, rank: int, world_size: int, world: str | None) -> bool:
    """Whether every rank of the burst holds ``world`` (this rank's, ``None``: none to offer), each
    rank's answer a file in ``folder`` (the burst's own, on this machine); the same answer on every
    rank. A rank whose file has not come within :data:`RENDEZVOUS_TIMEOUT` is named."""
    _write_whole(Path(folder, f"rank{rank}.holds"), world or "")
    deadline = time.monotonic() + RENDEZVOUS_TIMEOUT.total_seconds()
    answers = [Path(folder, f"rank{peer}.holds") for peer in range(world_size)]
    while missing := [peer for peer, answer in enumerate(answers) if not answer.exists()]:
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank(s) {', '.join(map(str, missing))} of {world_size} did not come to the "
                               f"burst within {RENDEZVOUS_TIMEOUT.total_seconds():.0f} s")
        time.sleep(0.005)
    return world is not None and all(answer.read_text() == world for answer in answers)


def _write_whole(path: Path, text: str) -> None:
    """Write ``path`` so that a reader finds it whole or not at all."""
    written = path.with_suffix(".partial")
    written.write_text(text)
    written.rename(path)


STORE_PORT_FILE = "store_port"


def _rendezvous_store(folder: str, rank: int, world_size: int) -> torch.distributed.TCPStore:
    """The burst's store, once every rank has joined it: rank 0 serves it on a port the system gives
    it as it binds, and writes the port in ``folder`` (the burst's own, on this machine), where the
    other ranks read it.

    Why not a port picked free before the ranks start: it is free when picked, not when rank 0
    binds it, and any process of the node may take it in between; the ranks then never meet. A CI
    run on 2026-12-06 saw a kept burst's rank 0 wait 301 s for a peer that never joined; what held
    the peer was not seen, so a peer that does not come is also named, within
    :data:`RENDEZVOUS_TIMEOUT`."""
    import torch.distributed as dist

    path = Path(folder, STORE_PORT_FILE)
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, timeout=RENDEZVOUS_TIMEOUT,
                              wait_for_workers=False)
        _write_whole(path, str(store.port))
        joined = [f"rank {peer} joined" for peer in range(1, world_size)]
        try:
            store.wait(joined, RENDEZVOUS_TIMEOUT)
        except dist.DistStoreError:
            missing = [peer for peer, key in enumerate(joined, start=1) if not store.check([key])]
            raise TimeoutError(f"rank(s) {', '.join(map(str, missing))} of {world_size} did not join the burst's "
                               f"process group within {RENDEZVOUS_TIMEOUT.total_seconds():.0f} s") from None
    else:
        deadline = time.monotonic() + RENDEZVOUS_TIMEOUT.total_seconds()
        while not path.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank 0 did not serve the burst's store within "
                                   f"{RENDEZVOUS_TIMEOUT.total_seconds():.0f} s")
            time.sleep(0.005)
        store = dist.TCPStore("127.0.0.1", int(path.read_text()), world_size, is_master=False,
                              timeout=RENDEZVOUS_TIMEOUT)
        store.set(f"rank {rank} joined", "")
    store.set_timeout(RANK_TIMEOUT)
    return store


def _end_process_groups(keep_world: bool) -> str:
    """End what the burst made of the process groups; what was done, for the teardown's part.

    A kept world (``keep_world``) stays for the process's next burst (a kept rank), and so do the
    groups the trainable keeps for its next burst there (:mod:`trainables.kept_groups`); the other
    groups it made in it do not: kept, they would add up burst after burst, each NCCL one with its
    communicator."""
    global _world_id
    import torch.distributed as dist

    if not dist.is_initialized():  # the trainable ended it itself
        kept_groups.forget()
        _world_id = None
        return WORLD_DESTROYED
    if keep_world:
        try:
            spared = kept_groups.kept()
            for group in list(dist.distributed_c10d._world.pg_map):
                if group is not dist.GroupMember.WORLD and group not in spared:
                    dist.destroy_process_group(group)
            return WORLD_KEPT
        except Exception:  # noqa: BLE001 - the burst's result stands; the world goes as it did before
            log.warning("a process group the burst made could not be destroyed: destroying the world instead",
                        exc_info=True)
    dist.destroy_process_group()
    kept_groups.forget()
    _world_id = None
    return WORLD_DESTROYED


def _clean_after_burst(rank: int, device: torch.device) -> bool:
    """Whether the process is clean after its burst: on CUDA, the device memory allocated back
    where it was before its first burst. First it forgets what torch.compile compiled, so that the
    next burst compiles what a new process would (:func:`_forget_compiled_code`)."""
    import gc

    _forget_compiled_code()
    allocated = allocated_after_burst(device)
    left = None if allocated is None else allocated - (_allocated_at_first_start or 0)
    if left is not None and left > KEPT_ALLOCATED_SLACK_BYTES:
        log.warning("rank %d left %.0f MiB of device memory allocated after its burst: its process is replaced",
                    rank, left / 2**20)
        return False
    # What is left lives on (modules the burst imported): the next burst's collections skip it.
    # Only a clean process's: frozen, a leak could not be collected even once its holder let go.
    gc.freeze()
    return True


def _forget_compiled_code() -> None:
    """Drop torch.compile's compiled variants and their guards, as a new process has none; what it
    compiled stays in its caches on disk and in memory, so that compiling again is quicker.

    Why: torch.compile compiles at most 8 variants of a function per process (``recompile_limit``)
    and runs it uncompiled for inputs past them, and megatron-core compiles its fusions
    (``jit_fuser`` is ``torch.compile``) once per input shape and stride. In the kept ranks of an
    H100 table's kept pass (2026-12-07), ``bias_dropout_add_fused_train`` reached the limit once some
    two dozen configs had run in one process, and from there kept bursts ran it uncompiled where a
    new process compiles it; where a function reaches the limit within one burst
    (``weighted_swiglu``, 2026-12-06), a kept process that raised the limit instead would have
    compiled more variants than a new one. Either way a kept burst's steps would not be a new
    process's, and a user's run is one."""
    import torch._dynamo

    torch._dynamo.reset()


def allocated_after_burst(device: torch.device) -> int | None:
    """Collect what a burst left in this process (its model and optimizer hold each other: only the
    cycle collector frees them), then the device memory still allocated (``None`` off CUDA)."""
    import gc

    import torch

    gc.collect()
    if device.type != "cuda":
        return None
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated(device)


def run_local(request: BurstRequest, reporter: Reporter | None = None, trainable: str = "native",
              warm_ranks: str | None = None) -> BurstResult:
    """Run a burst of ``trainable`` on ``request.world_size`` local ranks; merge the ranks' outcomes.

    ``reporter`` is called here, in the caller's process, with every step's report (rank 0's
    aggregate); returning ``False`` stops every rank after that step (outcome ``pruned``). One
    uncapped rank runs in the caller's process unless the trainable needs a process of its own.
    ``warm_ranks`` is the socket of a zygote that outlives this process (a campaign's, on this
    node). A caller that names one never runs a rank in its own process (a campaign's trial
    process runs trial after trial): every rank forks from that zygote where it listens, from this
    process's own otherwise. The contract says how the ranks started (``rank_start``).
    """
    warm = Zygote(warm_ranks) if warm_ranks is not None else None
    if (warm is None and request.world_size == 1 and request.cpu_memory_cap_bytes is None
            and not request.environment and not trainable_support(trainable).own_process):
        import torch

        torch.set_num_threads(cpu_threads_per_rank(1))
        return _with_rank_start(rank_runner(trainable)(request, device_for(0), reporter), "in_process", {})
    # More ranks, a CPU memory cap (it bounds the address space a process *adds*, and the
    # caller's heap may hold freed memory the burst would reuse uncounted), a trainable that needs
    # a process of its own, or a warm zygote: the ranks start in processes of their own.
    source, start = (warm, "warm") if warm is not None and warm.listening() else _this_process_zygote(trainable)
    # A campaign's zygote keeps healthy ranks for its next bursts, unless the trainable leaves
    # process-global state behind, a CPU memory cap would count what the last burst left in the heap, or
    # the burst asks for new processes (a promotion run).
    keep = (source is warm and request.cpu_memory_cap_bytes is None and not request.new_rank_processes
            and _may_keep_ranks_of(trainable))
    with tempfile.TemporaryDirectory(prefix="burst-") as out_dir:
        processes: list[ZygoteChild] = []
        relays: list[Connection] = []
        stragglers: set[int] = set()
        last_verdict_at: float | None = None
        forked_at = time.perf_counter()
        try:
            for rank in range(request.world_size):
                ours, theirs = mp.Pipe()
                relays.append(ours)
                with theirs:
                    processes.append(source.fork(
                        "trainables.launch:_rank_main",
                        (trainable, rank, request.world_size, request, out_dir, reporter is not None), theirs,
                        request.environment, keep_as=_kept_rank_key(trainable, request) if keep else None, slot=rank,
                    ))
            if processes and all(process.kept for process in processes):
                start = "kept"
            stragglers, last_verdict_at = _supervise(processes, relays[0], reporter, start, request.environment, out_dir)
            exited_at = time.perf_counter()
        finally:
            for process in processes:
                process.kill()
                process.join()
            for relay in relays:
                relay.close()
        results = []
        for rank, process in enumerate(processes):
            path = Path(out_dir, f"rank{rank}.pkl")
            if path.exists():
                results.append(pickle.loads(path.read_bytes()))
            elif rank not in stragglers:
                results.append(BurstResult(outcome="failed", error=_exit_reason(rank, process.exitcode)))
        if len(processes) < request.world_size:  # a rank could not be forked: its peers wait for it in vain
            results.append(BurstResult(outcome="failed", error=f"rank {len(processes)} could not be started"))
        stuck = "\n".join(f"rank {rank} was still running {STRAGGLER_GRACE_SECONDS:.0f} s after another rank had "
                          f"ended and was killed; its stacks then:\n{_rank_stack(out_dir, rank) or '(none written)'}"
                          for rank in sorted(stragglers))
    merged = merge_rank_results(results)
    if stuck and merged.outcome in ("ok", "pruned"):
        log.warning("%s", stuck)
    elif stuck:
        merged = replace(merged, error=f"{merged.error}\n{stuck}")
    if last_verdict_at is not None and merged.teardown:
        # From here the last verdict left to the last rank's exit, less what rank 0 timed itself:
        # the verdict's way, the result file, the process's end (on CUDA, its context's), the zygote's word.
        exit_seconds = exited_at - last_verdict_at - sum(part.seconds for part in merged.teardown)
        merged = replace(merged, teardown=(*merged.teardown, TimedPart("the ranks' exit", round(max(0.0, exit_seconds), 4))))
    elif merged.before_first_step and merged.teardown:
        # Out of memory before a step: no verdict came, so from the fork, less all the rank timed.
        rest = exited_at - forked_at - sum(part.seconds for part in (*merged.before_first_step, *merged.teardown))
        merged = replace(merged, teardown=(*merged.teardown, TimedPart("the ranks' start and exit", round(max(0.0, rest), 4))))
    return _with_rank_start(merged, start, request.environment)


def _may_keep_ranks_of(trainable: str) -> bool:
    """Whether the trainable's bursts may run in kept rank processes; an unknown trainable's ranks
    report it themselves (``could not start``)."""
    try:
        return trainable_support(trainable).kept_ranks
    except AutotuneError:
        return False


def _kept_rank_key(trainable: str, request: BurstRequest) -> str:
    """What a kept rank process must share with the next burst it runs (the zygote adds its rank,
    hence its device, and the GPUs): the trainable it imported and the environment it was started with."""
    return f"{trainable} {sorted(request.environment.items())}"


def _with_rank_start(result: BurstResultOrReport, start: RanksStarted,
                     environment: Mapping[str, str]) -> BurstResultOrReport:
    """``result`` (a burst's, or a step's report) with how its ranks started, and the environment
    they were given, in its contract, if it has one; a burst's result says how they started anyway."""
    if isinstance(result, BurstResult):
        result = replace(result, rank_start=start)
    if result.contract is None:
        return result
    return replace(result, contract=result.contract.model_copy(
        update={"rank_start": start, "environment": dict(environment) or None}))


def _exit_reason(rank: int, exitcode: int | None) -> str:
    if exitcode == -signal.SIGKILL:
        return f"rank {rank} was killed with SIGKILL (the kernel's OOM killer, or an operator)"
    return f"rank {rank} exited with code {exitcode} before reporting"


def _supervise(processes: list[ZygoteChild], relay: Connection, reporter: Reporter | None, start: RanksStarted,
               environment: Mapping[str, str], out_dir: str) -> tuple[set[int], float | None]:
    """Relay rank 0's reports to ``reporter`` until every rank exits; kill ranks left stuck
    after another one exited (they wait in a collective for a rank that is gone, or never joined
    it), their stacks written to ``out_dir`` first. Returns them,
    and when the last verdict was sent (``time.perf_counter()``; ``None``: no report came).
    It wakes on a report or an exit as it comes: the burst ends as soon as its last rank has."""
    first_exit: float | None = None
    stragglers: set[int] = set()
    last_verdict_at: float | None = None
    while alive := [process for process in processes if process.is_alive()]:
        ready = wait([process.sentinel for process in alive] + ([relay] if reporter is not None else []), timeout=0.2)
        if reporter is not None and relay in ready:
            try:
                report: StepReport = relay.recv()
            except EOFError:  # rank 0 ended
                reporter = None
                continue
            relay.send(bool(reporter(_with_rank_start(report, start, environment))))
            last_verdict_at = time.perf_counter()
        if first_exit is None and any(not process.is_alive() for process in processes):
            first_exit = time.monotonic()
        if first_exit is not None and time.monotonic() - first_exit > STRAGGLER_GRACE_SECONDS:
            stragglers |= _end_stragglers(processes, out_dir)
    return stragglers, last_verdict_at


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
                       error=worst.error, evidence=primary.evidence, before_first_step=worst.before_first_step)
