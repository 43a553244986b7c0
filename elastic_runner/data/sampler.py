"""Elastic data sampler with a global cursor.

Epoch ``e`` visits one permutation ``P(seed, e)`` of the dataset indices, the same on every rank.
Progress is the *cursor*: how many indices of that permutation have been consumed by completed
optimizer steps. Each optimizer step takes the next ``G = world_size * micro_batch_size *
grad_accum_steps`` indices and splits them between ranks: micro-batch ``m`` of rank ``r`` is
``P[c + m*W*b + r*b : c + m*W*b + (r+1)*b]``. Because the cursor counts samples, not per-rank
batches, a restart at another world size continues with exactly the remaining indices.

A kept global batch (``global_batch_size``: the job's, at any world size) that ``W * b`` does
not divide is split unevenly: ``K = ceil(G / (W * b))`` micro-batches on every rank (the same
number of backward passes everywhere, as DDP needs), and the ``K * W`` slots, ordered by
micro-batch then rank, take ``G // (K * W)`` samples each, the first ``G % (K * W)`` one more
(:func:`slot_sizes`); slot ``j`` starts where slot ``j - 1`` ended. No micro-batch exceeds
``b`` and any two differ by at most one sample; at an even split this is the layout above.
:meth:`ElasticSampler.loss_weights` weights each micro-batch's mean loss so that the update is
the mean over the ``G`` samples, as at an even split.

Epoch tail rule (drop_last per global batch): the last ``N mod G`` indices of each permutation are
not trained on in that epoch. The permutation changes every epoch, so no sample is excluded
systematically.

The cursor advances only through :meth:`ElasticSampler.advance`, called by the training loop after
an optimizer step; DataLoader prefetching does not move it.

:func:`step_seed` derives one seed from ``(seed, epoch, position, rank)``: the session reseeds a
step's generators from it (``train/session.py``), the loader its workers' (``data/loader.py``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from ..dist import Place, Placed


class ElasticSampler(Placed):
    """Batch sampler yielding this rank's micro-batches (lists of dataset indices) for one epoch.

    Args:
        num_samples: dataset length.
        seed: base seed; the permutation of epoch ``e`` is seeded by ``(seed, e)``.
        micro_batch_size: samples per rank per forward/backward.
        grad_accum_steps: micro-batches per optimizer step.
        rank, world_size: this process's place in the group (a :class:`~elastic_runner.dist.
            Place` of its own until :meth:`follow` gives it the process's).
        shuffle: ``False`` visits indices in order (evaluation, debugging).
        global_batch_size: the global batch to keep at every world size (samples; None:
            ``world_size x micro_batch_size x grad_accum_steps``); ``grad_accum_steps`` is then
            derived from it (module docstring).

    Raises:
        ValueError: the dataset is smaller than one global batch, or the kept global batch is
            smaller than one sample per micro-batch of every rank.
    """

    def __init__(self, num_samples: int, seed: int, micro_batch_size: int, grad_accum_steps: int,
                 rank: int, world_size: int, shuffle: bool = True,
                 global_batch_size: int | None = None) -> None:
        self.num_samples = num_samples
        self.seed = seed
        self.micro_batch_size = micro_batch_size
        self.kept_global_batch = global_batch_size
        self.grad_accum_steps = grad_accum_steps
        self.place = Place(rank, world_size)
        self.shuffle = shuffle
        self.epoch = 0
        self.cursor = 0
        # (world_size, micro_batch_size, grad_accum_steps, global batch) of the step that
        # reached the cursor: after a regroup it is the old group's, until this sampler's first
        # step
        self.committed_geometry = self.geometry
        check_split(self.global_batch_size, world_size, self.grad_accum_steps)
        # where the previous epoch's cursor stopped (samples; None: not known, see
        # previous_epoch_end): its last steps may have had another world size than the others
        self.epoch_end: int | None = None
        self._perm: tuple[tuple[int, int], np.ndarray] | None = None
        if self.steps_per_epoch() == 0:
            raise ValueError(
                f"dataset of {num_samples} samples is smaller than one global batch of "
                f"{self.global_batch_size} samples (world_size {world_size} x micro-batch "
                f"{micro_batch_size} x accumulation {grad_accum_steps})"
            )

    def follow(self, place: Place) -> None:
        """Split for ``place`` from now on (the process's, which a regroup moves).

        Raises:
            ValueError: ``place`` is another rank or world size than this sampler's.
        """
        if (place.rank, place.world_size) != (self.rank, self.world_size):
            raise ValueError(f"the sampler splits for rank {self.rank} of {self.world_size}; "
                             f"the process is {place}")
        self.place = place

    @property
    def grad_accum_steps(self) -> int:
        """Micro-batches per optimizer step on each rank: derived from the kept global batch
        at this world size (``ceil(G / (world_size x micro_batch_size))``), else as given."""
        if self.kept_global_batch is None:
            return self._accum
        return -(-self.kept_global_batch // (self.world_size * self.micro_batch_size))

    @grad_accum_steps.setter
    def grad_accum_steps(self, steps: int) -> None:
        self._accum = steps

    @property
    def global_batch_size(self) -> int:
        if self.kept_global_batch is not None:
            return self.kept_global_batch
        return self.world_size * self.micro_batch_size * self.grad_accum_steps

    @property
    def geometry(self) -> tuple[int, int, int, int]:
        """(world_size, micro_batch_size, grad_accum_steps, global batch) now."""
        return (self.world_size, self.micro_batch_size, self.grad_accum_steps,
                self.global_batch_size)

    def loss_weights(self) -> list[float]:
        """This rank's factor for each micro-batch's mean loss in a step at the current world
        size: ``n_m x world_size / G`` for micro-batch ``m`` of ``n_m`` samples, so that the
        averaged gradient (DDP and FSDP2 divide the sum by the world size) is the mean over the
        ``G`` samples; ``1 / K`` each at an even split. Exact for a loss that is a mean over
        samples; a loss that is a mean over tokens weights samples by their token count at an
        even split as here only if every sample has as many tokens."""
        sizes = slot_sizes(self.global_batch_size, self.world_size, self.grad_accum_steps)
        w, r = self.world_size, self.rank
        return [sizes[m * w + r] * w / self.global_batch_size
                for m in range(self.grad_accum_steps)]

    @property
    def even(self) -> bool:
        """Whether every micro-batch of the step has ``micro_batch_size`` samples."""
        return self.global_batch_size == (self.world_size * self.micro_batch_size
                                          * self.grad_accum_steps)

    def steps_per_epoch(self) -> int:
        return self.num_samples // self.global_batch_size

    def steps_left_in_epoch(self) -> int:
        return (self.num_samples - self.cursor) // self.global_batch_size

    def permutation(self, epoch: int) -> np.ndarray:
        """The order of epoch ``epoch`` (int64 array of ``num_samples`` indices); cached."""
        if self._perm is None or self._perm[0] != (self.seed, epoch):
            order = (np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
                     if self.shuffle else np.arange(self.num_samples))
            self._perm = ((self.seed, epoch), order)
        return self._perm[1]

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its beginning (a no-op for the epoch being resumed); moving on
        to the next epoch records where this one stopped."""
        if epoch != self.epoch:
            self.epoch_end = self.cursor if epoch == self.epoch + 1 else None
            self.epoch, self.cursor = epoch, 0

    def advance(self) -> None:
        """Mark one optimizer step's global batch as trained."""
        self.cursor += self.global_batch_size
        self.committed_geometry = self.geometry

    def previous_epoch_end(self) -> int:
        """Where the previous epoch's cursor ended (samples; the rest is its dropped tail): as
        recorded by :meth:`set_epoch`, or, for a state saved before it was recorded, its whole
        global batches at the geometry its last step was committed with (wrong when the world
        size changed within that epoch: 1744 + one step of 32 ends at 1776, not 1792)."""
        if self.epoch_end is not None:
            return self.epoch_end
        size = self.committed_geometry[3]
        return self.num_samples // size * size

    def last_step(self, rank: int | None = None) -> tuple[int, int, list[int]]:
        """(epoch, world_size, indices of ``rank``) of the step that ended at the current
        position (the cursor, or the end of the previous epoch at an epoch's start), split as
        that step was: at the world size and accumulation it was committed with, which differ
        from this sampler's after a regroup. ``rank`` defaults to this rank."""
        world_size, _, accum, size = self.committed_geometry
        if self.cursor >= size:
            epoch, start = self.epoch, self.cursor - size
        else:
            epoch, start = self.epoch - 1, self.previous_epoch_end() - size
        perm = self.permutation(epoch)
        r = self.rank if rank is None else rank
        return epoch, world_size, [i for part in _split(perm, start, size, world_size, accum, r)
                                   for i in part]

    def step_indices(self, cursor: int, epoch: int | None = None) -> list[list[int]]:
        """This rank's micro-batches of the optimizer step that starts at ``cursor`` of
        ``epoch`` (default: the current epoch)."""
        perm = self.permutation(self.epoch if epoch is None else epoch)
        return self._split(perm, cursor)

    def _split(self, perm: np.ndarray, cursor: int) -> list[list[int]]:
        return _split(perm, cursor, self.global_batch_size, self.world_size,
                      self.grad_accum_steps, self.rank)

    def __iter__(self) -> Iterator[list[int]]:
        perm = self.permutation(self.epoch)
        start = self.cursor  # snapshot: advance() moves self.cursor while this iterates
        for step in range(self.steps_left_in_epoch()):
            yield from self._split(perm, start + step * self.global_batch_size)

    def __len__(self) -> int:
        return self.steps_left_in_epoch() * self.grad_accum_steps

    def state_dict(self) -> dict[str, Any]:
        # the cursor alone is the position; the geometry of the step that reached it lets a
        # peer-fed replacement or a regrouped trainer name that step's samples (last_step)
        world_size, b, _, size = self.committed_geometry
        return {"seed": self.seed, "epoch": self.epoch, "cursor": self.cursor,
                "num_samples": self.num_samples, "world_size": world_size,
                "micro_batch_size": b, "global_batch_size": size,
                "previous_epoch_end": self.epoch_end}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["num_samples"] != self.num_samples:
            raise ValueError(
                f"sampler state is for a dataset of {state['num_samples']} samples, "
                f"this one has {self.num_samples}"
            )
        self.seed, self.epoch, self.cursor = state["seed"], state["epoch"], state["cursor"]
        self.epoch_end = state.get("previous_epoch_end")  # absent before it was recorded
        # checkpoints before the micro-batch size was stored: the per-rank share as one
        world_size = state.get("world_size", self.world_size)
        size = state.get("global_batch_size", self.global_batch_size)
        share = size // world_size
        b = state.get("micro_batch_size",
                      self.micro_batch_size if share % self.micro_batch_size == 0 else share)
        self.committed_geometry = (world_size, b, -(-size // (world_size * b)), size)


def slot_sizes(global_batch: int, world_size: int, accum: int) -> list[int]:
    """Samples in each of a step's ``accum x world_size`` micro-batches, ordered by micro-batch
    then rank: ``global_batch`` split as evenly as it goes (module docstring)."""
    slots = accum * world_size
    base, extra = divmod(global_batch, slots)
    return [base + (j < extra) for j in range(slots)]


def check_split(global_batch: int, world_size: int, accum: int) -> None:
    """Raises ValueError when a micro-batch of the split would be empty."""
    if global_batch < world_size * accum:
        raise ValueError(f"a global batch of {global_batch} samples cannot give each of "
                         f"{world_size} ranks {accum} non-empty micro-batch(es)")


def _split(perm: np.ndarray, cursor: int, global_batch: int, world_size: int, accum: int,
           rank: int) -> list[list[int]]:
    """Rank ``rank``'s micro-batches of the step that starts at ``cursor``."""
    sizes = slot_sizes(global_batch, world_size, accum)
    starts = np.concatenate([[0], np.cumsum(sizes)])
    out = []
    for m in range(accum):
        j = m * world_size + rank
        start = cursor + int(starts[j])
        out.append(perm[start:start + sizes[j]].tolist())
    return out


def shard_indices(num_samples: int, rank: int, world_size: int) -> list[int]:
    """Evaluation shard of ``rank``: indices ``rank, rank+W, ...``; no padding, so sums over ranks
    cover every sample exactly once."""
    return list(range(rank, num_samples, world_size))


_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    """SplitMix64's finaliser (Steele, Lea & Flood, "Fast splittable pseudorandom number
    generators", OOPSLA 2014): a bijective mix of a 64-bit integer."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def step_seed(seed: int, epoch: int, step: int, rank: int) -> int:
    """A 63-bit seed derived from (seed, epoch, step, rank) by chaining SplitMix64 over the four
    values: distinct inputs give independent-looking seeds, in ~2 us of pure Python (numpy's
    SeedSequence took 10-90 us per step, measured with ``bench.overhead``)."""
    h = 0
    for v in (seed, epoch, step, rank):
        h = _splitmix64(h ^ (v & _MASK64))
    return h >> 1
