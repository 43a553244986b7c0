"""The step vote: did any rank see a non-finite loss, did any rank get a stop signal?

Every rank must take the same decision at a step boundary (skip the update, checkpoint and stop),
so the flags are reduced over ranks. A separate one-flag all-reduce per step costs a collective's
latency and one more synchronisation of all ranks (~1 ms per step with gloo on a 2-core CPU
machine, ~7% of a digits step); instead the flags ride on DDP's own gradient all-reduce: a DDP
communication hook (``DistributedDataParallel.register_comm_hook``) appends them to the first
gradient bucket, which DDP reduces on every synchronising backward. The other buckets go through
torch's default ``allreduce_hook``, so the gradients are reduced exactly as without the hook.

Non-finite *gradients* need no vote: after the all-reduce every rank holds the same averaged
gradients, and a NaN/Inf on any rank propagates into them, so the gradient norm computed from
them is non-finite on all ranks alike.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

N_FLAGS = 2  # (non-finite loss, stop requested)


class GradientVote:
    """Reduces per-rank flags together with DDP's first gradient bucket.

    Usage per optimizer step: :meth:`arm` with this rank's flags (a float tensor of shape
    ``(2,)`` on the model's device, 0 or 1) before the synchronising (last micro-batch)
    backward, then :meth:`result` after it: the flags' mean over ranks (> 0: some rank raised
    it).
    """

    def __init__(self, ddp: DDP) -> None:
        self._flags: torch.Tensor | None = None
        self._result: torch.Tensor | None = None
        ddp.register_comm_hook(None, self._hook)

    def arm(self, flags: torch.Tensor) -> None:
        self._flags, self._result = flags, None

    def result(self) -> torch.Tensor:
        """The reduced flags of the last synchronising backward.

        Raises:
            RuntimeError: no gradient all-reduce carried armed flags since :meth:`arm`.
        """
        if self._result is None:
            raise RuntimeError("step vote: DDP reduced no gradient bucket since arm()")
        return self._result

    # no annotations: DDP's register_comm_hook checks them against the real classes, and this
    # module's postponed (string) annotations would fail that check
    def _hook(self, state, bucket):  # noqa: ANN001, ANN202
        flags = self._flags
        if bucket.index() != 0 or flags is None:
            return allreduce_hook(None, bucket)
        self._flags = None
        grads = bucket.buffer()
        # the same averaging as allreduce_hook: divide by the world size, then SUM
        packed = torch.cat([grads, flags.to(grads.dtype)]).div_(dist.get_world_size())
        future = dist.all_reduce(packed, async_op=True).get_future()

        def unpack(f: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
            reduced = f.value()[0]
            self._result = reduced[-N_FLAGS:]
            return reduced[:-N_FLAGS]

        return future.then(unpack)
