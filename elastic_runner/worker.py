"""``elastic-runner train``: the per-rank entry point that torchrun starts (or a user, alone).

Each rank: set up logging, join the process group (namespaced per attempt, see ``dist.py``),
build the trainer, load the newest valid checkpoint, train, and always destroy the process group.
Errors are written to torch elastic's error file (``TORCHELASTIC_ERROR_FILE``) so the agent can
name the failing rank's root cause.
"""

from __future__ import annotations

import logging
import os

from torch.distributed.elastic.multiprocessing.errors import ErrorHandler, record

from .checkpoint import CheckpointError
from .config import ConfigError, load_config
from .dist import destroy_distributed, init_distributed
from .logs import setup_logging
from .loop import TrainingFailed, build_trainer
from .preempt import EXIT_PREEMPTED, Preempted

log = logging.getLogger("elastic_runner.worker")

EXIT_BAD_INPUT = 2


def main(config_path: str, overrides: list[str], resume: bool = True, verbose: bool = False
         ) -> int:
    """Train one rank; returns the process exit code (2 for bad config or checkpoint)."""
    setup_logging(int(os.environ.get("RANK", 0)), verbose)
    try:
        return _train(config_path, overrides, resume)
    except (ConfigError, CheckpointError) as e:
        ErrorHandler().record_exception(e)
        log.error("%s", e)
        return EXIT_BAD_INPUT
    except Preempted as e:
        ErrorHandler().record_exception(e)
        log.warning("%s", e)
        return EXIT_PREEMPTED
    except TrainingFailed as e:
        ErrorHandler().record_exception(e)
        log.error("training failed: %s", e)
        return 1


@record
def _train(config_path: str, overrides: list[str], resume: bool) -> int:
    cfg = load_config(config_path, overrides)
    info = init_distributed(cfg.distributed.backend, cfg.distributed.timeout_seconds)
    trainer = None
    try:
        trainer = build_trainer(cfg, info)
        trainer.preempt.install()
        if resume and cfg.checkpoint.resume:
            trainer.resume()
        trainer.fit()
    finally:
        if trainer is not None and trainer.watchdog is not None:
            trainer.watchdog.close()
        destroy_distributed()
    return 0
