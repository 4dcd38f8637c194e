"""Rank processes forked from a zygote: a process that imported torch and the trainables once,
listens on a Unix socket, and forks a child for each rank it is asked for.

Why: a rank started from scratch pays Python's start, torch's and the trainable's imports before it
builds anything, 2.3-2.6 s of the CPU demo's 5 s outside a burst's steps (issue 24). A fork of a
process that holds them pays none of that, and each child is still a new process: its own heap,
globals and allocator, and a CUDA context made after the fork. A burst that crashes, runs out of
memory or is killed leaves nothing behind for the next one, exactly as with a cold start.

Who starts one: the launcher starts its own the first time a process needs ranks and keeps it for
the life of that process (the first burst is a cold start); a campaign starts one per node that
outlives its trials (``autotune.engine.warm_ranks``) and hands its socket to each trial. The zygote
never initialises CUDA, so forking it is safe on GPU nodes: before its imports it makes torch
answer ``torch.cuda.is_available()`` from NVML (which needs no CUDA context), and it checks
afterwards that no import initialised CUDA. A child takes the requesting process's environment,
working directory and import path, so the GPUs Ray gave the trial (``CUDA_VISIBLE_DEVICES``) are
the child's. A child dies with the process that asked for it and with the zygote; the zygote dies
with the process that started it. A child still on a GPU that another process now asks a rank for
(Ray gave a stopped trial's GPU to the next trial before the stopped burst's rank had ended) is
ended before the new one is forked: two ranks never share a GPU's memory.

A request may ask for a *kept* rank (``ForkRequest.keep_as``): once its run ends healthy, the child
does not exit but waits for the next request with the same key on the same GPUs, and runs it in the
same process, with its CUDA context, loaded kernels, allocator and caches warm (torch.compile's
variants are compiled again, from its caches: :func:`trainables.launch._forget_compiled_code`).
Why: on an H100 with TE a new rank's first step took 13-20 s more than its steady steps, and the
same config's first step run again in the process that had run another one took 0.4 s more (eager;
torch.compile's fusions add about 19 s more to a new process's first step:
``bench/results/h100_startup_20261205/``).
The target returns the check that says whether its process may be kept (see
:func:`trainables.launch._rank_main`), or ``None``: the child tells the zygote its run is done (its
requester is released at once), runs the check (a full garbage collection, the device memory's),
then says it is kept; a failed check, or none, ends it as before. A kept child whose requester dies
mid-run dies with it. The zygote keeps at most one idle child per key, slot (a burst's rank) and
GPU set; a request for those GPUs under another key ends the idle ones.

Protocol, one connection per request: the requester sends the child's end of its relay (one file
descriptor) and then a pickled :class:`ForkRequest`; the zygote answers with the child's pid and
whether it was kept from an earlier run, and later with its exit code (negative: the signal that
ended it), or 0 once a kept child has ended its run and waits for the next.

  python -m trainables.zygote SOCKET_PATH READY_FD [MODULE ...] [--where-installed MODULE ...]
  # writes "ready" to READY_FD once it listens
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import importlib
import logging
import os
import pickle
import select
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

PRELOAD = ("trainables.native.burst", "torch._dynamo")
"""What every child finds imported: torch, the native trainable and our data code, and
``torch._dynamo``, which torch's optimizers import on first construction (0.76 s of a CPU demo
rank's build)."""
READY = b"ready\n"
WHERE_INSTALLED = "--where-installed"
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ForkRequest:
    """What a child runs, in the requester's environment: ``target(relay, *args)``."""

    target: str
    """``module:function``."""
    args: tuple[Any, ...]
    requester_pid: int
    keep_as: str | None = None
    """Keep the child after a healthy run for the next request with this key and slot on the same
    GPUs (``None``: it exits after its run). Requests that share a key must be runnable in one process."""
    slot: int = 0
    """Which of a burst's processes (its rank): its other slots' idle children stay while it runs."""
    environ: dict[str, str] = field(default_factory=lambda: dict(os.environ))
    cwd: str = field(default_factory=os.getcwd)
    sys_path: list[str] = field(default_factory=lambda: list(sys.path))


class ZygoteChild:
    """A child of a zygote as the process that asked for it sees it: what the launcher uses of
    :class:`multiprocessing.Process`. It is not this process's child, so its exit code comes
    from the zygote; its pid stays its own until then (the zygote reaps it only after)."""

    def __init__(self, connection: Connection, pid: int, kept: bool = False) -> None:
        self._connection = connection
        self.pid = pid
        self.kept = kept
        """Whether it is a kept child that has run an earlier request (see :class:`ForkRequest`)."""
        self.exitcode: int | None = None

    @property
    def sentinel(self) -> Connection:
        """Ready once the child has ended (its exit code arrived): for :func:`multiprocessing.connection.wait`."""
        return self._connection

    def is_alive(self) -> bool:
        return not self._ended(timeout=0)

    def join(self, timeout: float | None = None) -> None:
        self._ended(timeout)

    def kill(self) -> None:
        if self.is_alive():
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def _ended(self, timeout: float | None) -> bool:
        if self.exitcode is None and self._connection.poll(timeout):
            try:
                self.exitcode = self._connection.recv()
            except EOFError:  # the zygote died: its children die with it
                self.exitcode = -signal.SIGKILL
            self._connection.close()
        return self.exitcode is not None


class Zygote:
    """A running zygote, by its socket."""

    def __init__(self, address: str) -> None:
        self.address = address

    def listening(self) -> bool:
        """Whether a zygote answers at the address (its socket file outlives a zygote killed with SIGKILL)."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            try:
                sock.connect(self.address)
            except OSError:
                return False
        return True

    def fork(self, target: str, args: tuple[Any, ...], relay: Connection,
             environment: Mapping[str, str] | None = None, keep_as: str | None = None, slot: int = 0) -> ZygoteChild:
        """Fork a child that runs ``target(relay, *args)`` in this process's environment with
        ``environment`` set on top, or hand it to an idle child kept under ``keep_as`` for ``slot``; ``relay``
        is the child's end of a :func:`multiprocessing.Pipe`, which the caller may close once this
        returns."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(self.address)
        socket.send_fds(sock, [b"f"], [relay.fileno()])
        connection = Connection(sock.detach())
        connection.send(ForkRequest(target, args, requester_pid=os.getpid(), keep_as=keep_as, slot=slot,
                                    environ={**os.environ, **(environment or {})}))
        pid, kept = connection.recv()
        return ZygoteChild(connection, pid, kept)


def start(address: str, preload: Sequence[str] = PRELOAD, where_installed: Sequence[str] = ()) -> subprocess.Popen:
    """Start a zygote listening at ``address`` (a new path in a directory only we can enter) and
    wait until it has imported ``preload``, and those of ``where_installed`` that are installed (a
    trainable's stack: a rank that needs a missing one fails on its own import, with its own
    error); it ends when the calling process does."""
    ready_read, ready_write = os.pipe()
    try:
        process = subprocess.Popen([sys.executable, "-m", "trainables.zygote", address, str(ready_write), *preload,
                                    WHERE_INSTALLED, *where_installed], pass_fds=(ready_write,))
    finally:
        os.close(ready_write)
    with open(ready_read, "rb") as ready:
        if ready.read(len(READY)) != READY:
            process.wait()
            raise RuntimeError(f"the rank zygote at {address} exited with code {process.returncode} before it "
                               "listened (its error is on this process's stderr)")
    return process


def serve(address: str, ready_fd: int, preload: Sequence[str], where_installed: Sequence[str] = ()) -> None:
    """The zygote's loop: fork on request (or hand a request to a kept child), report each child's
    exit or kept end, end with the parent."""
    parent = os.pidfd_open(os.getppid())
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
    for module in preload:
        importlib.import_module(module)
    for module in where_installed:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            log.info("the rank zygote did not preload %s: %s", module, exc)
    imported = ", ".join([*preload, *where_installed])
    if "torch" in sys.modules and sys.modules["torch"].cuda.is_initialized():
        raise RuntimeError(f"importing {imported} initialised CUDA; its children could not use it")
    # What the imports made lives as long as any child: out of the collector's sight, a child's
    # full collection (a kept rank's after each burst) scans only its own objects (0.09 s less on
    # this box's CPU zygote) and leaves the shared pages unwritten.
    gc.freeze()
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    children: dict[int, _Child] = {}
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(address)
    listener.listen(64)
    os.write(ready_fd, READY)
    os.close(ready_fd)
    try:
        with selectors.DefaultSelector() as selector:
            selector.register(listener, selectors.EVENT_READ)
            selector.register(wake_read, selectors.EVENT_READ)
            selector.register(parent, selectors.EVENT_READ)
            while True:
                for key, _ in selector.select():
                    if key.fileobj == parent:
                        return
                    if key.fileobj == wake_read:
                        os.read(wake_read, 4096)
                        _report_exits(children)
                    elif key.fileobj == listener:
                        _serve_request(listener, children, selector,
                                       closed_in_child=(listener.fileno(), wake_read, wake_write, parent))
                    else:
                        _kept_child_spoke(key.fileobj, key.data, children, selector)
    finally:
        Path(address).unlink(missing_ok=True)
        with contextlib.suppress(OSError):  # the folder is ours alone unless other zygotes share it
            Path(address).parent.rmdir()


@dataclass
class _Child:
    """A live child, as the zygote keeps it: where its exit code goes, and whose GPUs it holds."""

    connection: Connection | None
    """The requester's connection (``None``: a kept child waiting for its next request)."""
    requester_pid: int | None
    gpus: frozenset[str]
    """Its ``CUDA_VISIBLE_DEVICES`` (empty: none named, a CPU rank)."""
    keep_as: str | None = None
    slot: int = 0
    control: socket.socket | None = None
    """A kept child's channel: the zygote's end (next requests out, "done" and "kept" back)."""
    ready: bool = False
    """A kept child that passed its check after its last run and waits for the next request."""


MAX_REQUEST_BYTES = 1 << 20
"""The largest pickled request a kept child is handed (a burst's is tens of kilobytes)."""
DONE, KEPT = b"done", b"kept"
CHECK_WAIT_SECONDS = 30.0


def _gpus(environ: Mapping[str, str]) -> frozenset[str]:
    return frozenset(gpu for gpu in environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if gpu.strip())


def _report_exits(children: dict[int, _Child]) -> None:
    while children:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            return
        _report_exit(children, pid, status)


def _report_exit(children: dict[int, _Child], pid: int, status: int) -> None:
    child = children.pop(pid, None)
    if child is None:
        return
    if child.connection is not None:
        _answer(child.connection, os.waitstatus_to_exitcode(status))
        child.connection.close()


def _answer(connection: Connection, message: object) -> None:
    try:
        connection.send(message)
    except OSError:  # the requester is gone
        pass


def _kept_child_spoke(control: socket.socket, pid: int, children: dict[int, _Child],
                      selector: selectors.BaseSelector) -> None:
    """A kept child's run is done (its requester hears exit code 0), or it passed its check and
    waits for the next request, or its channel closed (it exited: the exit is reported on SIGCHLD).

    Never waits: the event may be stale. Serving a request in the same pass of the zygote's loop
    may have read what the child said already (:func:`_wait_for_checks`) or closed its channel; a
    blocking read then waited for the child's next word, which comes only once its new run ends.
    Where that run was a burst's first rank, the zygote could not serve the second rank's request,
    and the first rank waited for it until it gave up (CI, 2026-12-08, three times in two runs:
    rank 0 waited 120 s for rank 1, which then ran alone)."""
    if control.fileno() == -1:  # closed while a request was served
        return
    try:
        message = control.recv(len(KEPT), socket.MSG_DONTWAIT)
    except BlockingIOError:  # read while a request was served
        return
    except OSError:
        message = b""
    child = children.get(pid)
    if child is not None and message == DONE and child.connection is not None:
        _answer(child.connection, 0)
        child.connection.close()
        child.connection, child.requester_pid = None, None
        return
    if (child is None or message != KEPT or child.connection is not None
            or _idle_kept(children, child.keep_as, child.slot, child.gpus) is not None):
        # Gone, or one idle child per key is enough: this one exits once its channel is closed.
        selector.unregister(control)
        control.close()
        if child is not None:
            child.control = None
        return
    child.ready = True


def _idle_kept(children: dict[int, _Child], keep_as: str, slot: int, gpus: frozenset[str]) -> int | None:
    return next((pid for pid, child in children.items() if child.ready and child.control is not None
                 and (child.keep_as, child.slot, child.gpus) == (keep_as, slot, gpus)), None)


def _wait_for_checks(children: dict[int, _Child], keep_as: str, slot: int, gpus: frozenset[str],
                     selector: selectors.BaseSelector) -> None:
    """Let a kept child of the key that is still checking itself after its run say whether it is
    kept, rather than end it or fork another: the check takes a fraction of a second."""
    deadline = time.monotonic() + CHECK_WAIT_SECONDS
    for pid, child in list(children.items()):
        while (child.control is not None and child.connection is None and not child.ready
               and (child.keep_as, child.slot, child.gpus) == (keep_as, slot, gpus)):
            ready, _, _ = select.select([child.control], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                return
            _kept_child_spoke(child.control, pid, children, selector)


def _end_ranks_left_on(gpus: frozenset[str], requester_pid: int, children: dict[int, _Child],
                       keep_as: str | None = None) -> None:
    """Kill, and wait for, every child of another requester still holding one of ``gpus``, and every
    idle kept child on them but those kept under ``keep_as`` on exactly these GPUs (the one about to
    run the request, and the burst's other ranks').

    Why: Ray gives a trial's GPUs to the next trial once it has stopped the trial, while the
    stopped burst's rank may still be finishing its step and releasing its memory; a new rank on
    the same GPU then ran out of memory at its build because of it (an H100, 2026-12-05: "Process
    6334 has 62.87 GiB memory in use", the previous stage's last pruned screen). Such a rank has
    nothing left to report: the stopped trial's steps are in. An idle kept child holds its CUDA
    context and cached kernels there. A CPU rank names no GPU and is never ended here (CPU trials
    share the node's cores)."""
    if not gpus:
        return
    for pid, child in list(children.items()):
        spared = keep_as is not None and child.connection is None and (child.keep_as, child.gpus) == (keep_as, gpus)
        if not spared and child.requester_pid != requester_pid and child.gpus & gpus:
            log.warning("rank %d of process %s still holds GPU %s, now given to process %d: ending it", pid,
                        child.requester_pid or "none (idle, kept)", ",".join(sorted(child.gpus & gpus)),
                        requester_pid)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            try:
                _, status = os.waitpid(pid, 0)  # its device memory is free once it has exited
            except ChildProcessError:  # reaped already: it had ended by itself
                status = signal.SIGKILL
            _report_exit(children, pid, status)


def _serve_request(listener: socket.socket, children: dict[int, _Child], selector: selectors.BaseSelector,
                   closed_in_child: tuple[int, ...]) -> None:
    sock, _ = listener.accept()
    try:
        _, fds, _, _ = socket.recv_fds(sock, 1, 1)
        if len(fds) != 1:  # a probe, or a requester gone before its request
            sock.close()
            return
        connection = Connection(sock.detach())
        request: ForkRequest = connection.recv()
    except (OSError, EOFError):  # the requester went away mid-request
        sock.close()
        return
    gpus = _gpus(request.environ)
    kept = None
    if request.keep_as is not None:
        _wait_for_checks(children, request.keep_as, request.slot, gpus, selector)
        kept = _idle_kept(children, request.keep_as, request.slot, gpus)
    _end_ranks_left_on(gpus, request.requester_pid, children, request.keep_as)
    if kept is not None and _hand_over(children[kept], request, fds[0]):
        children[kept].connection, children[kept].requester_pid = connection, request.requester_pid
        children[kept].ready = False
        os.close(fds[0])
        _answer(connection, (kept, True))
        return
    control, child_control = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET) \
        if request.keep_as is not None else (None, None)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            for fd in closed_in_child:
                os.close(fd)
            for other in children.values():
                if other.connection is not None:
                    other.connection.close()
                if other.control is not None:
                    other.control.close()
            connection.close()
            if control is not None:
                control.close()
            code = _run_child(request, Connection(fds[0]), child_control)
        except BaseException:  # noqa: BLE001 - the child's error goes to its stderr, its code to the zygote
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    os.close(fds[0])
    children[pid] = _Child(connection, request.requester_pid, gpus, request.keep_as, request.slot, control)
    if control is not None:
        child_control.close()
        selector.register(control, selectors.EVENT_READ, pid)
    try:
        connection.send((pid, False))
    except OSError:
        os.kill(pid, signal.SIGKILL)


def _hand_over(child: _Child, request: ForkRequest, relay_fd: int) -> bool:
    """Send an idle kept child its next request and relay; ``False`` if it cannot take it (it has
    just exited, or the request is too large for one message): a new child is forked instead."""
    try:
        socket.send_fds(child.control, [pickle.dumps(request)], [relay_fd])
    except OSError:
        return False
    return True


def _run_child(request: ForkRequest, relay: Connection, control: socket.socket | None) -> int:
    """Run the request; a kept child then says it is done, checks itself with the check the target
    returned, and while that passes waits for the next request on ``control``; it exits when the
    zygote closes the channel."""
    if sys.platform.startswith("linux"):  # die with the zygote
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    while True:
        with _dying_with(request.requester_pid):
            os.environ.clear()
            os.environ.update(request.environ)
            os.chdir(request.cwd)
            sys.path[:] = request.sys_path
            module, _, name = request.target.partition(":")
            check: Callable[[], bool] | None = getattr(importlib.import_module(module), name)(relay, *request.args)
        relay.close()
        if control is None or check is None:
            return 0
        try:
            control.send(DONE)
            if not check():
                return 0
            control.send(KEPT)
            message, fds, _, _ = socket.recv_fds(control, MAX_REQUEST_BYTES, 1)
        except OSError:
            return 0
        if not message or len(fds) != 1:  # the zygote ended this child
            return 0
        request, relay = pickle.loads(message), Connection(fds[0])


@contextlib.contextmanager
def _dying_with(pid: int) -> Iterator[None]:
    """SIGKILL this process if process ``pid`` ends while the block runs (a trial killed by its
    scheduler, a driver killed with SIGKILL): no rank outlives the trial that started it. A kept
    child outlives it once its run has ended."""
    try:
        requester = os.pidfd_open(pid)
    except ProcessLookupError:
        os.kill(os.getpid(), signal.SIGKILL)
        return
    done_read, done_write = os.pipe()

    def watch() -> None:
        ready, _, _ = select.select([requester, done_read], [], [])
        if requester in ready:
            os.kill(os.getpid(), signal.SIGKILL)

    watcher = threading.Thread(target=watch, name="die-with-requester", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        os.write(done_write, b"x")
        watcher.join()
        for fd in (requester, done_read, done_write):
            os.close(fd)


if __name__ == "__main__":
    modules = sys.argv[3:]
    split = modules.index(WHERE_INSTALLED) if WHERE_INSTALLED in modules else len(modules)
    serve(sys.argv[1], int(sys.argv[2]), modules[:split], modules[split + 1:])
