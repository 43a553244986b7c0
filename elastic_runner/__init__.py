"""elastic-runner: fault-tolerant elastic training with DDP and FSDP2 on torchrun.

Use it whole (``elastic-runner run CONFIG``: the built-in trainer) or in your own loop
(:func:`fault_tolerant`, see ``examples/own_loop.py``). The package, one subpackage per concern:

===============  ==========================================================================
``checkpoint``   :class:`CheckpointManager` over ``dict[str, Stateful]``: atomic commit with a
                 sha256 manifest (``storage``), asynchronous save (``async_save``), sharded DCP
                 checkpoints (``dcp_format``), fencing of stale writers, retention, resume
``data``         :func:`elastic_dataloader`, :class:`ElasticDataLoader`,
                 :class:`ElasticSampler` (the global cursor, any world size), batches
                 (:func:`to_device`, :func:`batch_loss`), the sample audit trace
``train``        the step protocol: :class:`TrainingSession`, the step vote
                 (:class:`StepConsensus`), stop and early stopping, :class:`Callback` events,
                 the straggler exchange, fault injection
``trainer``      the built-in :class:`Trainer`, its :class:`StepEngine` and its assembly from a
                 config (``build``)
``own_loop``     :func:`fault_tolerant`: the session for a user's own loop, in place too
``parallel``     DDP and FSDP2 (``fully_shard``, HSDP) behind one strategy interface
``recovery``     in-place recovery: the recovery store and its protocol, group formation, the
                 state handed to a replacement (``state_transfer``), FSDP peer copies,
                 membership changes
``agent``        ``elastic-runner run``'s agent on torchrun's: warm spares, replacement of a
                 dead worker, nodes leaving and joining, the restart budget, hang checks
``observe``      per-rank and per-node Prometheus metrics, health endpoints, goodput,
                 reporting (logs, TensorBoard, progress bar), the hang watchdog
``tasks``        the task interface (``tasks.base``) and the built-in tasks; export and
                 ``generate()`` of transformers models
top level        typed config (``config``), the command line (``cli``), the worker, process
                 groups (``dist``), SIGTERM (``preempt``), exit codes, and ``compat/``: every
                 reliance on torch internals, with the supported torch range
===============  ==========================================================================

Importing the package is cheap; the names below load their module (and torch) on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "CheckpointManager": "checkpoint.manager",
    "ElasticDataLoader": "data.loader",
    "elastic_dataloader": "data.loader",
    "ElasticSampler": "data.sampler",
    "StepConsensus": "train.consensus",
    "StepDecision": "train.consensus",
    "make_consensus": "train.consensus",
    "StopPolicy": "train.stop",
    "StopReason": "train.stop",
    "StepEngine": "trainer.engine",
    "to_device": "data.batches",
    "batch_loss": "data.batches",
    "TrainingSession": "train.session",
    "TrainingFailed": "train.session",
    "Callback": "train.callbacks",
    "StepEnd": "train.callbacks",
    "LogEvent": "train.callbacks",  # what Callback.on_log receives
    "fault_tolerant": "own_loop",
    "FaultTolerantLoop": "own_loop",
    "init_distributed": "own_loop.joining",
    "DistInfo": "dist",
    "Trainer": "trainer.loop",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'elastic_runner' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{module}", __name__), name)
