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

Protocol, one connection per child: the requester sends the child's end of its relay (one file
descriptor) and then a pickled :class:`ForkRequest`; the zygote answers with the child's pid, and
later with its exit code (negative: the signal that ended it).

  python -m trainables.zygote SOCKET_PATH READY_FD [MODULE ...] [--where-installed MODULE ...]
  # writes "ready" to READY_FD once it listens
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import logging
import os
import select
import selectors
import signal
import socket
import subprocess
import sys
import threading
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Mapping, Sequence

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
    environ: dict[str, str] = field(default_factory=lambda: dict(os.environ))
    cwd: str = field(default_factory=os.getcwd)
    sys_path: list[str] = field(default_factory=lambda: list(sys.path))


class ZygoteChild:
    """A child of a zygote as the process that asked for it sees it: what the launcher uses of
    :class:`multiprocessing.Process`. It is not this process's child, so its exit code comes
    from the zygote; its pid stays its own until then (the zygote reaps it only after)."""

    def __init__(self, connection: Connection, pid: int) -> None:
        self._connection = connection
        self.pid = pid
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
             environment: Mapping[str, str] | None = None) -> ZygoteChild:
        """Fork a child that runs ``target(relay, *args)`` in this process's environment with
        ``environment`` set on top; ``relay`` is the child's end of a :func:`multiprocessing.Pipe`,
        which the caller may close once this returns."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(self.address)
        socket.send_fds(sock, [b"f"], [relay.fileno()])
        connection = Connection(sock.detach())
        connection.send(ForkRequest(target, args, requester_pid=os.getpid(),
                                    environ={**os.environ, **(environment or {})}))
        return ZygoteChild(connection, connection.recv())


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
    """The zygote's loop: fork on request, report each child's exit, end with the parent."""
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
                    else:
                        _fork_one(listener, children, closed_in_child=(listener.fileno(), wake_read,
                                                                      wake_write, parent))
    finally:
        Path(address).unlink(missing_ok=True)
        with contextlib.suppress(OSError):  # the folder is ours alone unless other zygotes share it
            Path(address).parent.rmdir()


@dataclass(frozen=True)
class _Child:
    """A live child, as the zygote keeps it: where its exit code goes, and whose GPUs it holds."""

    connection: Connection
    requester_pid: int
    gpus: frozenset[str]
    """Its ``CUDA_VISIBLE_DEVICES`` (empty: none named, a CPU rank)."""


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
    try:
        child.connection.send(os.waitstatus_to_exitcode(status))
    except OSError:  # the requester is gone
        pass
    child.connection.close()


def _end_ranks_left_on(gpus: frozenset[str], requester_pid: int, children: dict[int, _Child]) -> None:
    """Kill, and wait for, every child of another requester still holding one of ``gpus``.

    Why: Ray gives a trial's GPUs to the next trial once it has stopped the trial, while the
    stopped burst's rank may still be finishing its step and releasing its memory; a new rank on
    the same GPU then ran out of memory at its build because of it (an H100, 2026-12-05: "Process
    6334 has 62.87 GiB memory in use", the previous stage's last pruned screen). Such a rank has
    nothing left to report: the stopped trial's steps are in. A CPU rank names no GPU and is
    never ended here (CPU trials share the node's cores)."""
    if not gpus:
        return
    for pid, child in list(children.items()):
        if child.requester_pid != requester_pid and child.gpus & gpus:
            log.warning("rank %d of process %d still holds GPU %s, now given to process %d: ending it", pid,
                        child.requester_pid, ",".join(sorted(child.gpus & gpus)), requester_pid)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            try:
                _, status = os.waitpid(pid, 0)  # its device memory is free once it has exited
            except ChildProcessError:  # reaped already: it had ended by itself
                status = signal.SIGKILL
            _report_exit(children, pid, status)


def _fork_one(listener: socket.socket, children: dict[int, _Child], closed_in_child: tuple[int, ...]) -> None:
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
    _end_ranks_left_on(gpus, request.requester_pid, children)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            for fd in closed_in_child:
                os.close(fd)
            for other in children.values():
                other.connection.close()
            connection.close()
            code = _run_child(request, Connection(fds[0]))
        except BaseException:  # noqa: BLE001 - the child's error goes to its stderr, its code to the zygote
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    os.close(fds[0])
    children[pid] = _Child(connection, request.requester_pid, gpus)
    try:
        connection.send(pid)
    except OSError:
        os.kill(pid, signal.SIGKILL)


def _run_child(request: ForkRequest, relay: Connection) -> int:
    if sys.platform.startswith("linux"):  # die with the zygote
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    _die_with(request.requester_pid)
    os.environ.clear()
    os.environ.update(request.environ)
    os.chdir(request.cwd)
    sys.path[:] = request.sys_path
    module, _, name = request.target.partition(":")
    getattr(importlib.import_module(module), name)(relay, *request.args)
    return 0


def _die_with(pid: int) -> None:
    """SIGKILL this process when process ``pid`` ends (a trial killed by its scheduler, a driver
    killed with SIGKILL): no rank outlives the trial that started it."""
    try:
        requester = os.pidfd_open(pid)
    except ProcessLookupError:
        os.kill(os.getpid(), signal.SIGKILL)
        return

    def watch() -> None:
        select.select([requester], [], [])
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="die-with-requester", daemon=True).start()


if __name__ == "__main__":
    modules = sys.argv[3:]
    split = modules.index(WHERE_INSTALLED) if WHERE_INSTALLED in modules else len(modules)
    serve(sys.argv[1], int(sys.argv[2]), modules[:split], modules[split + 1:])
