"""Per-rank logging: rank 0 logs progress to the console, other ranks only warnings and errors."""

from __future__ import annotations

import logging
import sys

_verbose = [False]  # the process's choice, kept for a rank that changes (setup_logging(rank))


def setup_logging(rank: int, verbose: bool | None = None) -> None:
    """Log as ``rank``: rank 0 at INFO (DEBUG with ``verbose``), others WARNING. Called again
    when the rank changes (an in-place regroup renumbers ranks: the new rank 0 logs progress,
    checkpoints and results); ``verbose=None`` keeps the process's earlier choice."""
    if verbose is not None:
        _verbose[0] = verbose
    level = logging.DEBUG if _verbose[0] else logging.INFO
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(
        f"%(asctime)s.%(msecs)03d [rank{rank}] %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
    root = logging.getLogger("elastic_runner")
    root.handlers[:] = [handler]
    root.setLevel(level if rank == 0 else logging.WARNING)
    root.propagate = False


def first_line(e: BaseException) -> str:
    """``Type: first line of the message`` of ``e``, for one-line log messages (torch's and
    etcd's errors carry multi-line C++ stack traces)."""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__
