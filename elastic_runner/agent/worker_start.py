"""How the agent starts a worker process: forked from the node's fork server
(:mod:`.fork_server`), or with ``subprocess.Popen`` as torch does.

Within :func:`forking`, torch's ``SubprocessContext`` (the workers of each attempt) builds its
per-worker handlers with :func:`handler` instead of torch's ``get_subprocess_handler`` (fix 9's
internals: torch's context keeps one handler per local rank, built by that function, and
reads only their ``proc`` and ``close``); spares and replacements start through :func:`popen`.
Outside it, or where fix 9 does not apply, every process starts as torch starts it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from ..compat.agent import FIX_INPLACE
from ..compat.fix import applies
from .fork_server import ForkedProcess, ForkServer

Process = ForkedProcess | subprocess.Popen  # what ``proc`` holds: both have Popen's methods

_SERVER: list[ForkServer | None] = [None]  # the fork server of this process's agent, if any


def popen(argv: Sequence[str], env: Mapping[str, str], stdout: Any = None,
          stderr: Any = None) -> Process:
    """Start ``argv`` with the whole environment ``env`` in a session of its own (as torch's
    ``SubprocessHandler``), forked when :func:`forking` is active and the request allows it.

    Raises:
        OSError: the program cannot be started.
    """
    server = _SERVER[0]
    if server is None:
        return subprocess.Popen([str(a) for a in argv], env=dict(env), stdout=stdout,
                                stderr=stderr, start_new_session=True)
    return server.popen(argv, env, stdout, stderr)


def signal_session(proc: Process, sig: int) -> None:
    """Send ``sig`` to ``proc``'s session (its process group: the worker and what it started);
    a process that has just ended, or not yet made its session, gets it alone, or not at all."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:  # forked: ended and reaped, or before its setsid
        proc.send_signal(sig)


class Worker:
    """A worker process in the shape of torch's ``SubprocessHandler`` (``proc``,
    ``local_rank_id``, ``close``), with its standard output and error files as torch opens
    them (``stdout``, ``stderr``: paths, or None for the agent's own)."""

    def __init__(self, proc: Process, local_rank: int, files: Sequence[Any] = ()) -> None:
        self.proc, self.local_rank_id, self._files = proc, local_rank, list(files)

    @classmethod
    def start(cls, entrypoint: str, args: Sequence[Any], env: Mapping[str, str],
              stdout: str | None, stderr: str | None, local_rank: int) -> Worker:
        """Start ``entrypoint`` with ``args`` and this process's environment updated with
        ``env``, as torch's ``SubprocessHandler`` does."""
        out = open(stdout, "w") if stdout else None  # noqa: SIM115 - closed in close()
        err = open(stderr, "w") if stderr else None  # noqa: SIM115
        proc = popen([entrypoint, *map(str, args)], {**os.environ, **env}, out, err)
        return cls(proc, local_rank, [f for f in (out, err) if f is not None])

    def close(self, death_sig: signal.Signals | None = None) -> None:
        signal_session(self.proc, death_sig or signal.SIGTERM)
        for f in self._files:
            f.close()


def handler(entrypoint: str, args: tuple, env: dict[str, str], stdout: str | None,
            stderr: str | None, local_rank_id: int, numa_options: Any = None) -> Any:
    """torch's ``get_subprocess_handler`` (same arguments): a :class:`Worker`, or torch's own
    handler where a NUMA binding wraps the command."""
    if numa_options is not None:
        return _TORCH_HANDLER[0](entrypoint=entrypoint, args=args, env=env, stdout=stdout,
                                 stderr=stderr, local_rank_id=local_rank_id,
                                 numa_options=numa_options)
    return Worker.start(entrypoint, args, env, stdout, stderr, local_rank_id)


_TORCH_HANDLER: list[Any] = [None]


@contextlib.contextmanager
def forking(enabled: bool = True) -> Iterator[ForkServer | None]:
    """Within the block, this process's agent starts its workers, replacements and spares
    through one fork server (started at the first worker); yields it, or None (and changes
    nothing) when ``enabled`` is false or fix 9 does not apply. The fork server ends with the
    block; workers it forked go on until the agent stops them."""
    if not enabled or not applies(FIX_INPLACE):
        yield None
        return
    from torch.distributed.elastic.multiprocessing import api

    server = ForkServer()
    _TORCH_HANDLER[0] = api.get_subprocess_handler
    api.get_subprocess_handler = handler
    _SERVER[0] = server
    try:
        yield server
    finally:
        api.get_subprocess_handler = _TORCH_HANDLER[0]
        _SERVER[0] = None
        server.close()
