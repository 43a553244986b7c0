"""Workers forked from a process that has imported torch once: the agent's fork server.

Every worker, replacement and spare of a node runs the same Python command (``python -u -m
elastic_runner train CONFIG`` or ``python -u SCRIPT ...``), and each one started with
``subprocess.Popen`` spends its first seconds importing torch, ``torch._dynamo`` (which DDP's
constructor imports) and the runner: about 2.9 CPU seconds here (CPU, torch 2.13), more with
CUDA's libraries, on every restart, every replacement and every cold spare. The agent instead
starts one **fork server** per node (``python -m elastic_runner.agent.fork_server MODULE...``),
which imports those modules and then forks each worker on request; the child becomes the
command it was asked to run, as the interpreter would have run it: its own session (as torch's
``SubprocessHandler`` starts workers), the request's environment, working directory, standard
output and error (passed as file descriptors, ``SCM_RIGHTS``), ``sys.argv``, ``sys.path[0]``,
``-u``, and the module or script run as ``__main__`` (:mod:`runpy`); it ends through the
interpreter's own exit (threads joined, ``atexit`` run, exceptions printed, exit code 1). The
fork server reaps its children and reports each exit status (negative: the signal, as
``subprocess.Popen.returncode``); the agent holds each child as a :class:`ForkedProcess`, which
has ``Popen``'s ``pid``, ``poll``, ``wait``, ``send_signal``, ``terminate`` and ``kill``.

Why not ``multiprocessing``'s forkserver (the library mechanism): it runs a pickled function,
not a command; it closes the child's standard input, joins the parent's non-daemon children at
the parent's exit, and ends the child with ``os._exit`` (no ``atexit``): a worker would behave
differently from the one ``Popen`` starts. What this module owns is the child's set-up; the
fork, the session and the descriptor passing are the standard library's.

A request is forked only when the child could not tell the difference (:func:`forkable`): the
command is this interpreter with ``-u`` at most, then ``-m MODULE`` or a script; and its
environment equals the fork server's except for the variables torchrun and this runner set per
worker (:data:`PER_WORKER`, read when the worker runs, not when it imports). Any other request,
and every request once the fork server is gone, is started with ``subprocess.Popen`` as before.
The fork server ends when the agent closes it or dies (its socket's end of file); its children
then go on as ``Popen``'s would.

The fork server must not initialise CUDA or start threads that hold locks across a fork: it
only imports. ``import torch`` starts one native thread that a fork leaves behind harmlessly
(torch's ``DataLoader`` forks such processes every epoch).
"""

from __future__ import annotations

import contextlib
import gc
import io
import json
import logging
import os
import queue
import random
import runpy
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import setproctitle

from ..protocol.torchrun_env import PER_WORKER_NAMES, RANK
from ..protocol.torchrun_env import PER_WORKER_PREFIXES as TORCHRUN_PER_WORKER_PREFIXES

log = logging.getLogger(__name__)

# what a fork server of the runner's workers imports before it forks (its command line's
# arguments); an import that fails is left to the child, which fails as a fresh process would
PRELOAD = ("torch", "torch._dynamo", "torch.distributed", "torch.nn.parallel",
           "elastic_runner.worker", "elastic_runner.own_loop")

# variables torchrun (``LocalElasticAgent._start_workers``) and this runner set per worker or
# per attempt (and every name with one of PER_WORKER_PREFIXES); read when the worker runs, not
# when it imports, so a fork server started with other values serves them
PER_WORKER = frozenset({
    *PER_WORKER_NAMES, "TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING"})
PER_WORKER_PREFIXES = TORCHRUN_PER_WORKER_PREFIXES

MODULE = "elastic_runner.agent.fork_server"  # (as __main__ in the fork server: not __name__)
UNKNOWN_EXIT = 1  # a forked worker's exit code when the fork server died before it
# the longest wait for a fork's pid, seconds; the first includes the fork server's imports
# (about 3 s here, CUDA's libraries take longer)
FORK_TIMEOUT_S = 120.0

# signals the fork server ignores, and its children get back as a new interpreter has them:
# Slurm (scancel, --signal) and ``kill -- -PGID`` signal every process of a node's job, and a
# fork server ended by one would take its children's exit statuses with it (the agent could
# no longer tell a preempted worker, 143, from a failed one); it ends when the agent does
IGNORED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2,
           signal.SIGQUIT, signal.SIGALRM)

_HEADER = struct.Struct("!I")  # a message: its length, then JSON
_MAX_FDS = 2


# ------------------------------------------------------------------ what may be forked


def command(argv: Sequence[str]) -> tuple[bool, str | None, str | None, list[str]] | None:
    """``argv`` as this interpreter would run it: (``-u`` given, the module of ``-m`` or None,
    the script or None, the arguments after it); None when it is another program or has other
    interpreter options."""
    if not argv or os.path.realpath(argv[0]) != os.path.realpath(sys.executable):
        return None
    rest, unbuffered = list(argv[1:]), False
    if rest[:1] == ["-u"]:
        rest, unbuffered = rest[1:], True
    if len(rest) >= 2 and rest[0] == "-m":
        return unbuffered, rest[1], None, rest[2:]
    if rest and not rest[0].startswith("-"):
        return unbuffered, None, rest[0], rest[1:]
    return None


def per_worker(name: str) -> bool:
    """Whether the variable ``name`` is one that differs between a node's workers."""
    return name in PER_WORKER or name.startswith(PER_WORKER_PREFIXES)


def forkable(argv: Sequence[str], env: Mapping[str, str], server_env: Mapping[str, str]) -> bool:
    """Whether a fork server started with ``server_env`` can start ``argv`` with ``env`` as a
    fresh interpreter would: this interpreter's command (:func:`command`), and every variable
    other than the per-worker ones (:func:`per_worker`) the same, since the interpreter,
    OpenMP and torch read some at start-up (``PYTHON*``, ``OMP_NUM_THREADS``, ...)."""
    if command(argv) is None:
        return False
    names = {n for n in (*env, *server_env) if not per_worker(n)}
    return all(env.get(n) == server_env.get(n) for n in names)


# ------------------------------------------------------------------ messages


def _send(sock: socket.socket, message: dict[str, Any], fds: Sequence[int] = ()) -> None:
    data = json.dumps(message).encode()
    payload = _HEADER.pack(len(data)) + data
    if fds:
        sent = socket.send_fds(sock, [payload], list(fds))
        payload = payload[sent:]
    sock.sendall(payload)


def _recv_exact(sock: socket.socket, n: int, fds: list[int]) -> bytes | None:
    out = b""
    while len(out) < n:
        data, got, _, _ = socket.recv_fds(sock, n - len(out), _MAX_FDS)
        fds.extend(got)
        if not data:
            return None
        out += data
    return out


def _recv(sock: socket.socket) -> tuple[dict[str, Any], list[int]] | None:
    """One message and the file descriptors that came with it; None at end of file."""
    fds: list[int] = []
    head = _recv_exact(sock, _HEADER.size, fds)
    if head is None:
        return None
    body = _recv_exact(sock, _HEADER.unpack(head)[0], fds)
    return (json.loads(body), fds) if body is not None else None


# ------------------------------------------------------------------ the fork server


def serve(sock: socket.socket) -> dict[str, Any] | None:
    """Fork one child per request on ``sock`` and report each child's exit status, until end
    of file (returns None); in a child, return its request (the caller runs it)."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler: the wake-up fd hears SIGCHLD
    while True:
        ready, _, _ = select.select([sock, wake_r], [], [])
        if wake_r in ready:
            os.read(wake_r, 4096)
            _reap(sock)
        if sock not in ready:
            continue
        got = _recv(sock)
        if got is None:
            return None
        request, fds = got
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            signal.set_wakeup_fd(-1)
            for fd in (wake_r, wake_w):
                os.close(fd)
            _become(request, fds, sock)
            return request
        for fd in fds:
            os.close(fd)
        with contextlib.suppress(OSError):  # the agent is gone: the next read says so
            _send(sock, {"pid": pid})


def _reap(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        with contextlib.suppress(OSError):
            _send(sock, {"exit": pid, "code": os.waitstatus_to_exitcode(status)})


def _become(request: dict[str, Any], fds: list[int], sock: socket.socket) -> None:
    """In the child: the session, signals, descriptors, directory and environment a fresh
    worker would have had."""
    os.setsid()  # as torch's SubprocessHandler (start_new_session): killpg reaches it alone
    for sig in (signal.SIGCHLD, *IGNORED):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sock.close()
    fds = list(fds)
    for target, wanted in ((1, request.get("stdout")), (2, request.get("stderr"))):
        if wanted:
            fd = fds.pop(0)
            os.dup2(fd, target)
            os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    _reseed()
    unbuffered = request["unbuffered"] or bool(request["env"].get("PYTHONUNBUFFERED"))
    sys.stdout = sys.__stdout__ = _stdio(1, sys.stdout, unbuffered)
    sys.stderr = sys.__stderr__ = _stdio(2, sys.stderr, True)
    setproctitle.setproctitle(title(request["argv"], request["env"]))


def title(argv: Sequence[str], env: Mapping[str, str]) -> str:
    """A forked worker's process title (``ps``, ``/proc/PID/cmdline``): its command line, and
    its rank (its ``/proc/PID/environ`` is the fork server's), or ``(spare)``."""
    rank = env.get(RANK, "-1")
    return " ".join(argv) + (" (spare)" if rank == "-1" else f" (rank {rank})")


def _reseed() -> None:
    """Seed what a fresh interpreter seeds from the OS (Python's and numpy's global generators,
    torch's CPU generator): forked, every child would draw the fork server's numbers. (The hash
    seed of ``str`` stays the fork server's: it is fixed when the interpreter starts.)"""
    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    if "torch" in sys.modules:
        sys.modules["torch"].random.default_generator.seed()


def _stdio(fd: int, old: io.TextIOWrapper, unbuffered: bool) -> io.TextIOWrapper:
    """A text stream on ``fd`` as the interpreter makes one (``-u``: no buffer)."""
    raw = io.FileIO(fd, "w", closefd=False)
    buffered: Any = raw if unbuffered else io.BufferedWriter(raw)
    return io.TextIOWrapper(buffered, encoding=old.encoding, errors=old.errors,
                            line_buffering=not unbuffered and raw.isatty(),
                            write_through=unbuffered)


def run_child(request: dict[str, Any]) -> None:
    """Run the child's module or script as ``__main__`` with its ``sys.argv`` and
    ``sys.path[0]``, as ``python [-u] -m MODULE ...`` or ``python [-u] SCRIPT ...`` would."""
    module, script, args = request["module"], request["script"], request["args"]
    if module is not None:
        sys.path[0] = os.getcwd()
        sys.argv = [module, *args]  # runpy puts the module's file first
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        sys.path[0] = os.path.dirname(os.path.abspath(script))
        sys.argv = [script, *args]
        runpy.run_path(script, run_name="__main__")


def main(fd: int, preload: Sequence[str]) -> dict[str, Any] | None:
    """The fork server's process (``python -m elastic_runner.agent.fork_server FD MODULE...``):
    import ``preload``, then serve the socket ``fd``; in a child, its request."""
    # its title, set before any child changes its environment: setproctitle finds the room
    # for a title (the command line and the environment after it) at its first call
    setproctitle.setproctitle(f"{sys.executable} -m {MODULE} (fork server)")
    for sig in IGNORED:
        signal.signal(sig, signal.SIG_IGN)
    for name in preload:
        with contextlib.suppress(Exception):
            __import__(name)
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        # a child could not use CUDA (torch refuses it after a fork); the agent starts its
        # workers with Popen when the fork server ends before its first fork
        print("elastic-runner: fork server: an import initialised CUDA; not forking",
              file=sys.stderr, flush=True)
        return None
    gc.freeze()  # the imports' objects: no collection in a child touches (copies) their pages
    return serve(socket.socket(fileno=fd))


# ------------------------------------------------------------------ the agent's side


class ForkedProcess:
    """A child of the fork server, in the shape of ``subprocess.Popen`` (``pid``, ``args``,
    ``returncode``, ``poll``, ``wait``, ``send_signal``, ``terminate``, ``kill``); its exit
    status comes from the fork server (negative: the signal that ended it). Should the fork
    server die before the child, the child's end is still seen (a pidfd), with exit code
    :data:`UNKNOWN_EXIT` and a warning."""

    def __init__(self, pid: int, args: Sequence[str], server_gone: threading.Event) -> None:
        self.pid, self.args = pid, list(args)
        self.returncode: int | None = None
        self._ended, self._server_gone = threading.Event(), server_gone
        try:
            self._pidfd: int | None = os.pidfd_open(pid)
        except (OSError, AttributeError):  # ended and reaped already; or no pidfd (Linux < 5.3)
            self._pidfd = None

    def _exited(self, code: int) -> None:
        self.returncode = code
        self._ended.set()
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None

    def poll(self) -> int | None:
        if self.returncode is None and self._server_gone.is_set() and self._pidfd is not None \
                and select.select([self._pidfd], [], [], 0)[0]:
            log.warning("fork server: gone before worker pid %d, which has ended; its exit code "
                        "is unknown (%d)", self.pid, UNKNOWN_EXIT)
            self._exited(UNKNOWN_EXIT)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Raises:
            subprocess.TimeoutExpired: still running after ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            self._ended.wait(0.1 if left is None else min(left, 0.1))
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """The agent's client of one fork server: :meth:`popen` forks a request it can start as a
    fresh interpreter would (:func:`forkable`), or starts it with ``subprocess.Popen``.

    The fork server starts at the first forkable request, with that request's environment,
    and preloads ``preload``; its exit statuses are read by a daemon thread. Thread-safe."""

    def __init__(self, preload: Sequence[str] = PRELOAD) -> None:
        self._preload = list(preload)
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._sock: socket.socket | None = None
        self._env: dict[str, str] = {}
        # each fork's child, registered by the reader before its exit status can come
        self._forked: queue.Queue[ForkedProcess | None] = queue.Queue()
        self._children: dict[int, ForkedProcess] = {}
        self._gone = False  # no more forks (closed, or the fork server ended)
        self._ended = threading.Event()  # the fork server's exit statuses stopped coming

    def popen(self, argv: Sequence[str], env: Mapping[str, str], stdout: Any = None,
              stderr: Any = None) -> ForkedProcess | subprocess.Popen[bytes]:
        """Start ``argv`` with ``env`` (the whole environment) in a session of its own, its
        standard output and error to ``stdout`` and ``stderr`` (files, or None: the agent's).

        Raises:
            OSError: ``Popen``'s, for a request it starts itself.
        """
        argv = [str(a) for a in argv]
        with self._lock:
            child = self._fork(argv, dict(env), stdout, stderr)
        if child is not None:
            return child
        return subprocess.Popen(argv, env=dict(env), stdout=stdout, stderr=stderr,
                                start_new_session=True)

    def _fork(self, argv: list[str], env: dict[str, str], stdout: Any,
              stderr: Any) -> ForkedProcess | None:
        if self._gone or command(argv) is None \
                or any(f is not None and not hasattr(f, "fileno") for f in (stdout, stderr)):
            return None
        if self._sock is None and not self._start(env):
            return None
        if not forkable(argv, env, self._env):
            log.debug("fork server: %s's environment differs; started with Popen", argv)
            return None
        unbuffered, module, script, args = command(argv)  # type: ignore[misc]
        fds = [f.fileno() for f in (stdout, stderr) if f is not None]
        request = {"argv": argv, "cwd": os.getcwd(), "env": env, "unbuffered": unbuffered,
                   "module": module, "script": script, "args": args,
                   "stdout": stdout is not None, "stderr": stderr is not None}
        try:
            assert self._sock is not None
            _send(self._sock, request, fds)
            child = self._forked.get(timeout=FORK_TIMEOUT_S)
        except (OSError, queue.Empty):
            child = None
        if child is None:
            log.warning("fork server: gone or not answering within %.0f s; workers start with "
                        "Popen from now on", FORK_TIMEOUT_S)
            self._end()  # (a fork it had not answered for must not come after the Popen)
            return None
        child.args = argv
        return child

    def _start(self, env: dict[str, str]) -> bool:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", MODULE, str(theirs.fileno()), *self._preload],
                env=env, stdin=subprocess.DEVNULL, pass_fds=(theirs.fileno(),),
                start_new_session=True)
        except OSError as e:
            log.warning("fork server: could not start (%s); workers start with Popen", e)
            self._gone = True
            return False
        finally:
            theirs.close()
        self._sock, self._env = ours, env
        threading.Thread(target=self._read, name="fork-server", daemon=True).start()
        return True

    def _read(self) -> None:
        sock = self._sock
        assert sock is not None
        try:
            while (got := _recv(sock)) is not None:
                message, _ = got
                if "pid" in message:
                    child = ForkedProcess(message["pid"], [], self._ended)
                    self._children[child.pid] = child
                    self._forked.put(child)
                elif (child := self._children.pop(message["exit"], None)) is not None:
                    child._exited(message["code"])
        except (OSError, ValueError) as e:  # a connection reset, a message cut short
            log.warning("fork server: its messages stopped (%s)", e)
        finally:
            self._gone = True
            self._ended.set()
            self._forked.put(None)

    def close(self) -> None:
        """End the fork server (its children go on, as ``Popen``'s would) and wait for it."""
        with self._lock:
            self._end()

    def _end(self) -> None:
        self._gone = True
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)
        if self._proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=10)
            if self._proc.poll() is None:
                self._proc.kill()
                self._proc.wait()


if __name__ == "__main__":
    child = main(int(sys.argv[1]), sys.argv[2:])
    if child is None:
        sys.exit(0)
    run_child(child)  # at the top level: the child ends as an interpreter does
