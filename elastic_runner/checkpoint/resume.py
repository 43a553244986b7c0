"""Resuming: choosing the newest checkpoint whose files verify (the same on every rank) and
loading it into a ``dict[str, Stateful]``, whole or sharded, with the checks that name what
does not fit.

Its log lines keep the manager's logger (``elastic_runner.checkpoint.manager``): operators and
the benchmarks read them by that name.
"""

from __future__ import annotations

import logging
import pickle
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.stateful import Stateful

from ..dist import (
    Place,
    all_gather_object,
    assert_same_across_ranks,
    broadcast_object,
    is_peer_failure,
    world_size,
)
from . import dcp_format
from . import storage as ckpt
from .events import CheckpointListener
from .layout import is_sharded

log = logging.getLogger("elastic_runner.checkpoint.manager")


class Resumer:
    """Loads the newest valid checkpoint of ``directory`` into ``state`` (collective).

    Args:
        directory, state, listener, after_load, migrate: as
            :class:`~.manager.CheckpointManager`'s.
        place: this process's place (rank 0 lists the checkpoints and reports the load).
        claim: rank 0 claims the fencing token with it before choosing (no older group's later
            commit can go unseen).
    """

    def __init__(self, directory: str, state: Mapping[str, Stateful], *,
                 listener: CheckpointListener,
                 after_load: Callable[[dict[str, Any]], None],
                 migrate: Callable[[dict[str, Any]], dict[str, Any]], place: Place,
                 claim: Callable[[], None]) -> None:
        self.directory, self.state, self.listener = directory, state, listener
        self.after_load, self.migrate, self.place, self.claim = after_load, migrate, place, claim
        self.resumed_from: str | None = None

    @property
    def rank(self) -> int:
        return self.place.rank

    def load_latest(self, map_location: str | torch.device = "cpu") -> dict[str, Any] | None:
        """:meth:`~.manager.CheckpointManager.load_latest` (its errors too)."""
        choice = self._choose()
        if choice is None:
            log.info("no checkpoint in %s: starting from scratch", self.directory)
            return None
        raw = self.migrate(ckpt.load_state(choice, map_location=map_location, full=False))
        self.resumed_from = choice
        self._load(raw, choice)
        return raw

    def _choose(self) -> str | None:
        """The newest checkpoint whose files verify, the same on every rank (collective). Rank 0
        lists them; every rank hashes its share of each candidate's files (a sharded
        checkpoint's are spread over the ranks, not all read by rank 0)."""
        listed = None
        if self.rank == 0:
            self.claim()  # before choosing: no older group's later commit can go unseen
            listed = [(c.path, c.reason) for c in ckpt.newest_first(self.directory)]
        rank, world = self.rank, world_size()
        for path, reason in broadcast_object(listed):
            if not reason:
                problems = all_gather_object(ckpt.verify_files(path, rank, world))
                reason = next((p for p in problems if p), "")
            if not reason:
                if self.rank == 0:
                    self.listener.checkpoint_loaded(ckpt.inspect(path))
                return path
            if self.rank == 0:
                log.warning("skipping checkpoint %s: %s", path, reason)
        return None

    def _load(self, raw: dict[str, Any], source: str) -> None:
        if ckpt.is_sharded(source):
            apply_sharded(self.state, raw, source)
        else:
            apply_whole(self.state, raw, source)
        self.after_load(raw)
        model = self.state.get("model")
        if isinstance(model, torch.nn.Module) and not is_sharded(model):
            # replicas must be identical after loading, or DDP would average diverged models
            assert_same_across_ranks(ckpt.tensors_digest(model.state_dict()),
                                     f"model parameters loaded from {source}")


def apply_whole(state: Mapping[str, Stateful], raw: dict[str, Any], source: str) -> None:
    """Load a whole (rank-0 layout) ``raw`` state from ``source`` into ``state``; a sharded
    model takes its own shards of it. Not collective.

    Raises:
        CheckpointError: a missing state key or tensors that do not fit the model (named)."""
    missing = sorted(set(state) - set(raw))
    if missing:
        raise ckpt.CheckpointError(f"checkpoint {source} has no state for "
                                   f"{', '.join(missing)} (written by another program?)")
    model = state.get("model")
    if isinstance(model, torch.nn.Module):
        ckpt.check_compatible(model.state_dict(), raw["model"], source)
    if is_sharded(model):  # a whole (rank-0) checkpoint into shards: each rank takes its own
        dcp_format.set_full_state(model, state["optimizer"], raw["model"], raw["optimizer"])
    for key, obj in state.items():
        if not (is_sharded(model) and key in dcp_format.SHARDED_KEYS):
            obj.load_state_dict(raw[key])


def apply_sharded(state: Mapping[str, Stateful], raw: dict[str, Any], source: str) -> None:
    """Load a sharded checkpoint: model and optimizer through DCP (resharded to this group,
    collective), the rest from its ``state.pt`` (``raw``).

    Raises:
        CheckpointError: a missing state key, unreadable DCP metadata or files, shapes that
            do not fit the model (named); a peer's failure is re-raised as it is."""
    missing = sorted(set(state) - set(raw) - set(dcp_format.SHARDED_KEYS))
    if missing or not all(k in state for k in dcp_format.SHARDED_KEYS):
        raise ckpt.CheckpointError(f"checkpoint {source} has no state for "
                                   f"{', '.join(missing) or 'model/optimizer'}")
    model = state["model"]
    try:
        shapes = dcp_format.model_shapes(dcp_format.read_metadata(source))
    except (OSError, pickle.UnpicklingError, EOFError) as e:
        raise ckpt.CheckpointError(f"checkpoint {source}: cannot read its DCP metadata: "
                                   f"{dcp_format.problem(e)}") from e
    ckpt.check_compatible(model.state_dict(),
                          {k: torch.empty(s, device="meta") for k, s in shapes.items()},
                          source)
    try:
        dcp_format.load_shards(source, model, state["optimizer"])
    except (Exception, CheckpointException) as e:  # DCP's is a BaseException
        if is_peer_failure(e):
            raise
        raise ckpt.CheckpointError(f"checkpoint {source}: cannot load its DCP files: "
                                   f"{dcp_format.problem(e)}") from e
    for key, obj in state.items():
        if key not in dcp_format.SHARDED_KEYS:
            obj.load_state_dict(raw[key])
