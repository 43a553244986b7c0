"""A rank's expected endings: one line, an exit code, and the error file's entry (torch
elastic's ``TORCHELASTIC_ERROR_FILE``, which the agent's summary names); no traceback.

Shared by the built-in trainer's worker (``worker.py``) and a script's fault-tolerant loop
(``own_loop/loop.py``), so both end the same way. The codes are those of
:mod:`elastic_runner.exit_codes`.
"""

from __future__ import annotations

import logging

from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

from ..checkpoint.fencing import FencedOut
from ..checkpoint.storage import CheckpointError
from ..config_base import ConfigError
from ..exit_codes import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_FENCED, EXIT_PREEMPTED
from ..preempt import Preempted
from .session import TrainingFailed

_EXPECTED: dict[type[BaseException], tuple[int, int, str]] = {
    FencedOut: (EXIT_FENCED, logging.ERROR, "fenced out: "),
    ConfigError: (EXIT_BAD_INPUT, logging.ERROR, ""),
    CheckpointError: (EXIT_BAD_INPUT, logging.ERROR, ""),
    Preempted: (EXIT_PREEMPTED, logging.WARNING, ""),
    TrainingFailed: (EXIT_FAILED, logging.ERROR, "training failed: "),
}


def expected_exit(e: BaseException, log: logging.Logger) -> int | None:
    """The exit code of an expected ending, after recording ``e`` in the error file and logging
    its one line on ``log``; None when ``e`` is not one (the caller re-raises it).

    Expected: :class:`FencedOut` (3), :class:`ConfigError` and :class:`CheckpointError` (2),
    :class:`Preempted` (143, a warning), :class:`TrainingFailed` (1)."""
    for kind, (code, level, prefix) in _EXPECTED.items():
        if isinstance(e, kind):
            ErrorHandler().record_exception(e)
            log.log(level, "%s%s", prefix, e)
            return code
    return None
