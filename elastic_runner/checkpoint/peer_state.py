"""Peer-state I/O for in-place recovery: loading a live peer's whole state, and taking or
loading this rank's own part of a sharded state (what a peer keeps for it,
``recovery/peer_copies.py``). None of it is collective."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch.distributed.checkpoint.stateful import Stateful

from . import dcp_format
from . import storage as ckpt
from .layout import rest_state
from .resume import apply_whole


class PeerState:
    """The peer-state I/O of ``state`` (``extra``: the plain values saved beside it;
    ``sharded``: the sharded layout)."""

    def __init__(self, state: Mapping[str, Stateful], extra: Mapping[str, Any],
                 sharded: bool) -> None:
        self.state, self.extra, self.sharded = state, extra, sharded

    def load_from_peer(self, raw: dict[str, Any], peer: int) -> None:
        """Load ``raw`` (rank ``peer``'s whole state) into ``state``; the model's tensors are
        checked first.

        Raises:
            CheckpointError: a sharded state, a missing state key or tensors that do not fit
                the model."""
        if self.sharded:
            raise ckpt.CheckpointError("a sharded model's state is not held whole by any peer")
        apply_whole(self.state, raw, f"rank {peer}'s state")

    def local_copy(self, to_cpu: bool = True) -> dict[str, Any]:
        """This rank's local model and optimizer shards (on the CPU unless ``to_cpu`` is
        False; on a CPU device the parameters' own storage, so copy it before the next step)
        and the rest (:meth:`~.manager.CheckpointManager.local_copy`)."""
        sharded = dcp_format.sharded_state(self.state["model"], self.state["optimizer"])
        return {"shards": dcp_format.local_shards(sharded, to_cpu),
                "rest": rest_state(self.state, self.extra)}

    def load_local_copy(self, raw: dict[str, Any], source: str) -> None:
        """Load :meth:`local_copy`'s ``raw`` (taken on this rank's position of a mesh of the
        same shape) into ``state``.

        Raises:
            CheckpointError: a missing key, or shards that do not fit (named)."""
        missing = sorted(set(self.state) - set(raw["rest"]) - set(dcp_format.SHARDED_KEYS))
        if missing:
            raise ckpt.CheckpointError(f"{source} has no state for {', '.join(missing)}")
        try:
            dcp_format.load_local_shards(self.state["model"], self.state["optimizer"],
                                         raw["shards"])
        except ValueError as e:
            raise ckpt.CheckpointError(f"{source}: {e}") from e
        for key, obj in self.state.items():
            if key not in dcp_format.SHARDED_KEYS:
                obj.load_state_dict(raw["rest"][key])
