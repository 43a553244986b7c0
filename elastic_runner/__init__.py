"""elastic-runner: fault-tolerant elastic DDP training on torchrun.

Use it whole (``elastic-runner run CONFIG``: the built-in trainer) or in your own loop
(:func:`fault_tolerant`, see ``examples/own_loop.py``). The parts, one module per concern, each
usable alone:

==========================  ====================================================================
``checkpointing``           :class:`CheckpointManager` over ``dict[str, Stateful]``: cadence,
                            atomic commit (``checkpoint``: storage format), async save
                            (``async_save``), best, retention, resume, rollback
``data``, ``sampler``       :func:`elastic_dataloader`, :class:`ElasticDataLoader`,
                            :class:`ElasticSampler`: the global cursor, any world size
``consensus``               :class:`StepConsensus` (``should_commit``): the per-step vote on the
                            DDP comm hook or a plain all-reduce
``stop``                    :class:`StopPolicy`, :class:`StopReason`; ``early_stop``: the
                            patience rule, decided on rank 0
``engine``                  :class:`StepEngine`: forward/backward, accumulation, autocast,
                            clipping, optimizer and scheduler steps
``batches``                 how a tensor, tuple or mapping batch reaches the model and its loss
                            (``model(**batch)``, ``outputs.loss``); :func:`to_device`
``session``                 :class:`TrainingSession`: the step protocol composing the above
``callbacks``, ``reporting``  :class:`Callback` events; metrics, TensorBoard, progress bar,
                            sample trace, watchdog heartbeat, fault injection
``own_loop``                :func:`fault_tolerant`: the session for a user's own loop
``rank_session``            one rank's session with its checkpoints and reporting, assembled
                            the same way for the built-in trainer and a user's own loop
``loop``, ``build``         the built-in :class:`Trainer` and its assembly from a config
``dist``, ``preempt``,      process groups per attempt, SIGTERM, hang watchdog, straggler,
``watchdog``, ``straggler`` per-rank metrics (``metrics``, ``health``, ``agent_metrics``)
``compat``                  every reliance on torch internals, with the supported torch range
``tasks``, ``hf``           the task interface (``tasks.base``), built-in tasks; export and
                            ``generate()`` of transformers models
``config``, ``cli``,        typed config, command line, the agent (``launch``), the worker
``launch``, ``worker``
==========================  ====================================================================

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
    "fault_tolerant": "own_loop",
    "FaultTolerantLoop": "own_loop",
    "init_distributed": "recovery.script",
    "DistInfo": "dist",
    "Trainer": "trainer.loop",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'elastic_runner' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{module}", __name__), name)
