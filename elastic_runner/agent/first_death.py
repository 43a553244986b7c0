"""The one line that names the worker that died first, when the workers all restart.

torch's poll names a failure by the error file's timestamp in whole seconds; a worker killed
by a signal writes none, and the agent stops the rest of a failed group itself (SIGTERM,
the restart budget's patch, ``agent/restart_budget.py``) before torch's poll sees them: torch's log then named a
survivor it had stopped (``exitcode: -15 local_rank: 0``), and the survivors' gloo tracebacks
followed. The agent looks at its workers' exit codes before it stops the rest; of the ranks
that had exited then, this module names the likeliest cause in one line.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Collection, Mapping
from typing import Any

from ..exit_codes import EXIT_PEER_LOST

log = logging.getLogger(__name__)

STOPPED = -15  # SIGTERM: how torch's agent stops the workers left after the first failure


def cause_rank(exitcode: int) -> int:
    """Orders failed ranks by how likely they hold the cause: 0 a rank that failed on its own,
    1 one that lost a peer (exit 4), 2 one the agent stopped after the first failure (SIGTERM)."""
    return {EXIT_PEER_LOST: 1, STOPPED: 2}.get(exitcode, 0)


def exited(handlers: Mapping[int, Any]) -> set[int]:
    """The local ranks of ``handlers`` (torch's ``SubprocessHandler`` by local rank) that have
    exited with a failure (not 0) by now."""
    return {lr for lr, h in handlers.items() if h.proc.poll() not in (None, 0)}


def first_death(failures: Mapping[int, Any], seen: Collection[int] = ()) -> tuple[int, Any]:
    """The failure (``failures``: global rank -> torch's ``ProcessFailure``) that most likely
    came first: a local rank in ``seen`` (exited before the agent stopped the rest) before
    others; then one that failed on its own before one that lost a peer (exit 4) or was
    stopped (SIGTERM); a signal (killed from outside, no word said) before an exit code
    (a survivor raising about the dead peer); then the earlier timestamp, the lower rank.

    Raises:
        ValueError: ``failures`` is empty.
    """
    def order(item: tuple[int, Any]) -> tuple[bool, int, bool, int, int]:
        rank, f = item
        return (f.local_rank not in seen, cause_rank(f.exitcode), f.exitcode >= 0,
                f.timestamp, rank)

    return min(failures.items(), key=order)


def describe(rank: int, failure: Any) -> str:
    """``rank R (local_rank L, pid P) was killed by SIGNAME`` or ``... exited with code C``."""
    who = f"rank {rank} (local_rank {failure.local_rank}, pid {failure.pid})"
    if failure.exitcode < 0:
        try:
            name = signal.Signals(-failure.exitcode).name
        except ValueError:
            name = f"signal {-failure.exitcode}"
        return f"{who} was killed by {name}"
    return f"{who} exited with code {failure.exitcode}"


def log_first_death(failures: Mapping[int, Any], seen: Collection[int],
                    restarting: bool) -> None:
    """Log the first death of a failed attempt (:func:`first_death`) and what follows:
    every worker restarts (``restarting``) or none does. Nothing when ``failures`` is
    empty."""
    if not failures:
        return
    line = describe(*first_death(failures, seen))
    if restarting:
        log.warning("%s; restarting every worker", line)
    else:
        log.error("%s; not restarting", line)
