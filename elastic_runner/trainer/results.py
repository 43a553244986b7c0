"""The end of a built-in training run: the final figures (validation of the last weights, test
of the best checkpoint's), ``results.json`` (rank 0) and each rank's summary next to the
checkpoints."""

from __future__ import annotations

import json
import logging
from typing import Any, Protocol

import fsspec

from ..checkpoint import storage
from ..checkpoint.manager import CheckpointManager
from ..config import Config
from ..data.sampler import ElasticSampler
from ..dist import DistInfo, broadcast_object
from ..train.state import TrainState
from ..train.stop import StopPolicy

log = logging.getLogger("elastic_runner.train.loop")  # the step log's name (trainer/loop.py)


class Finished(Protocol):
    """What the end of a run reads of the :class:`~elastic_runner.trainer.loop.Trainer`."""

    cfg: Config
    info: DistInfo
    results: dict[str, Any]

    @property
    def state(self) -> TrainState: ...

    @property
    def stop(self) -> StopPolicy: ...

    @property
    def sampler(self) -> ElasticSampler: ...

    @property
    def checkpoints(self) -> CheckpointManager: ...

    def evaluate(self, split: str, max_batches: int | None = None) -> dict[str, float]: ...


def report_results(trainer: Finished) -> None:
    """Final validation of the last weights (unless the last step was evaluated), test
    metrics of the best checkpoint's weights when there is one (``load_best_model_at_end``,
    ``restore_best_weights``; else of the last weights), then ``results.json`` (rank 0;
    ``eval_step`` and ``test_step`` say whose weights each split's figures are from; with
    ``goodput``: the job's ``wall_seconds``, ``ettr`` and ``seconds`` by cause, as in the
    ``goodput:`` line) and each rank's summary next to the checkpoints."""
    if trainer.results.get("eval_step") != trainer.state.step:
        trainer.results.update(trainer.evaluate("val", trainer.cfg.eval.max_batches),
                               eval_step=trainer.state.step)
    test_step = _load_best_weights(trainer)
    trainer.results.update(trainer.evaluate("test"), test_step=test_step)
    trainer.results.update(step=trainer.state.step, epoch=trainer.sampler.epoch,
                           stop_reason=trainer.stop.message)
    goodput = trainer.checkpoints.state.get("goodput")
    extra: dict[str, Any] = {}
    if goodput is not None:  # one instant for the line and the file: they agree
        now = goodput.clock()
        extra["goodput"] = goodput.figures(now)
        trainer.results.update(ettr=extra["goodput"]["ettr"])
        line = goodput.summary(now)
    log.info("finished: %s", fmt_figures(trainer.results))
    if goodput is not None:
        log.info("%s", line)
    if trainer.info.is_main:
        _write_json(trainer, "results.json", {**trainer.results, **extra})
    # each rank records where it left the loop, so operators and tests can check that all
    # ranks stopped after the same step
    _write_json(trainer, f"ranks/rank-{trainer.info.rank}.json", {
        "rank": trainer.info.rank, "world_size": trainer.info.world_size, "step": trainer.state.step,
        "epoch": trainer.sampler.epoch, "stop_reason": trainer.stop.message,
        "restart_count": trainer.info.restart_count})


def _load_best_weights(trainer: Finished) -> int:
    """Load the weights of the newest valid best checkpoint into the model, on every rank
    (rank 0 names it: it committed the last one), when it is of another step than the
    last; returns the step whose weights the model now has."""
    best = None
    if trainer.info.is_main and trainer.cfg.checkpoint.keep_best:
        found = storage.latest_valid(trainer.cfg.checkpoint.dir, kind="best")
        best = (found.step, found.path) if found is not None else None
    best = broadcast_object(best)
    if best is None or best[0] == trainer.state.step:
        return trainer.state.step
    trainer.checkpoints.load_weights(best[1])
    log.info("test split on the best checkpoint's weights (%s: step %d, best %s)", best[1],
             best[0], trainer.cfg.early_stopping.metric)
    return best[0]


def _write_json(trainer: Finished, relative: str, value: dict[str, Any]) -> None:
    """Write a small JSON report next to the checkpoints (local path or fsspec URL)."""
    with fsspec.open(f"{trainer.cfg.checkpoint.dir.rstrip('/')}/{relative}", "w",
                     auto_mkdir=True) as f:
        f.write(json.dumps(value, indent=1))


def fmt_figures(d: dict[str, Any]) -> str:
    """``k=v`` pairs of a log line (floats to 4 decimals)."""
    return " ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in d.items())
