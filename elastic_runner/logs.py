"""Per-rank logging: rank 0 logs progress to the console, other ranks only warnings and errors."""

from __future__ import annotations

import logging
import sys


def setup_logging(rank: int, verbose: bool = False) -> None:
    level = logging.DEBUG if verbose else logging.INFO
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(
        f"%(asctime)s.%(msecs)03d [rank{rank}] %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
    root = logging.getLogger("elastic_runner")
    root.handlers[:] = [handler]
    root.setLevel(level if rank == 0 else logging.WARNING)
    root.propagate = False
