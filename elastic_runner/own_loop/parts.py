"""What a script's :class:`~elastic_runner.own_loop.loop.FaultTolerantLoop` holds besides its
session, shared with its in-place recovery (:mod:`elastic_runner.own_loop.in_place`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from ..data.loader import ElasticDataLoader
from ..dist import DistInfo
from ..observe.metrics import RankMetrics
from ..preempt import PreemptionFlag
from ..recovery.recoverable import RecoveryProfile
from ..recovery.script import ScriptProcess
from ..train.callbacks import Callback
from ..train.consensus import StepConsensus
from .script_state import StateRecord


@dataclass
class LoopParts:
    """Where the loop runs (``info``; a regroup moves it), its preemption flag, what its
    recovery may do (``profile``), this process's in-place recovery, the script's model object
    (DDP, FSDP2 or plain) and loader, how to make its step vote, what a regroup rebuilds
    for another rank (the rank-bound reporting), and its ``state=`` as rank 0 holds it."""

    info: DistInfo
    preempt: PreemptionFlag
    profile: RecoveryProfile
    process: ScriptProcess
    model: nn.Module
    loader: ElasticDataLoader
    vote: Callable[[], StepConsensus]
    closing: list[bool]  # [True] once close() checkpoints: the manifest's "finished"
    metrics: RankMetrics
    runner: Callable[[int, int], list[Callback]]  # the runner's callbacks for a rank, world size
    reporting: list[Callback]  # those of this rank now
    own_logging: bool  # the runner set up logging (a renumbered rank sets it up again)
    script_state: StateRecord  # state=, rank 0's through a replacement
