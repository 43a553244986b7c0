"""The elastic data side: a DataLoader over the global-cursor sampler, for any map-style dataset.

:class:`ElasticDataLoader` iterates this rank's remaining micro-batches of the current epoch,
starting at the sampler's cursor (see ``data/sampler.py``): after a restart, at any world size, it
continues with exactly the samples no committed step has trained on. It is ``Stateful`` (its
state is the sampler's), so it can go into a checkpoint as it is. Any ``collate_fn``,
``num_workers`` and ``pin_memory`` work as with a plain DataLoader.

What was fetched: the loader reads the dataset through :class:`IndexedDataset`, whose batched
fetch (``__getitems__``, called by torch's fetcher in whatever process fetches: this one, or a
loader worker) returns the indices it actually read with the samples; the collate
(:class:`CollateWithIndices`) carries them next to the user's batch through the worker queue and
``pin_memory``, and the loader's iterator unpacks them when it hands the batch to the training
loop. The loop sees the user's batch unchanged; :meth:`ElasticDataLoader.take_fetched` gives the
indices of the micro-batches handed out since its last call (the sample trace of ``data/audit.py``
records those, not the sampler's plan).

Random transforms: with ``num_workers=0`` the dataset runs in the training process, whose
generators the session reseeds before every step, so a resumed epoch replays them exactly. Loader
worker processes have generators of their own, seeded at every ``iter()`` from
``(seed, epoch, cursor, rank)`` (the loader's generator): reproducible for a given start, but a
resumed epoch draws other values than the uninterrupted one. For exact replay with workers,
derive a sample's randomness from its index (``torch.Generator().manual_seed(hash((seed,
epoch, index)))`` in ``__getitem__``).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, default_collate

from ..dist import current_rank
from ..preempt import PreemptionFlag
from .sampler import ElasticSampler, step_seed

# micro-batches whose indices the loader keeps until a step takes them: a loop that never takes
# them (no session) holds no more; a step of more micro-batches would be recorded short, and
# its audit would fail (missing samples), not pass
HANDED_OUT_LIMIT = 1024


@dataclass
class Fetched:
    """One batched fetch as the dataset served it: ``samples[k]`` was read at dataset index
    ``indices[k]`` (Python ints)."""

    indices: list[int]
    samples: Any  # what the dataset's fetch returned: a list of samples


class IndexedDataset(Dataset):
    """``dataset`` whose batched fetch also returns the indices it read.

    ``__getitems__(indices)`` (torch's batched fetch, in the process that fetches) returns a
    :class:`Fetched`: the samples of ``dataset.__getitems__`` when it has one, else of
    ``dataset[i]`` per index. ``__getitem__`` and ``__len__`` are the dataset's."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> Any:
        return self.dataset[index]

    def __getitems__(self, indices: list[int]) -> Fetched:
        batched = getattr(self.dataset, "__getitems__", None)
        samples = batched(indices) if batched else [self.dataset[i] for i in indices]
        return Fetched([int(i) for i in indices], samples)


class CollateWithIndices:
    """The user's collate (default: ``default_collate``) applied to a :class:`Fetched`;
    returns ``(batch, indices)``, the indices a list of Python ints."""

    def __init__(self, collate_fn: Callable[[Any], Any] | None) -> None:
        self.collate_fn = collate_fn or default_collate

    def __call__(self, fetched: Fetched) -> tuple[Any, list[int]]:
        return self.collate_fn(fetched.samples), fetched.indices


Pairs = Iterator[tuple[Any, list[int]]]


class _HandOut:
    """Iterates the DataLoader's ``(batch, indices)`` pairs: calls ``before`` (the loader's
    :attr:`ElasticDataLoader.before_hand_out`), takes a new pass from ``renewed`` when it gives
    one (:meth:`ElasticDataLoader.restart`), then yields the batch and appends its indices to
    ``handed_out`` (in this process, when the loop takes the batch)."""

    def __init__(self, pairs: Pairs, handed_out: deque[list[int]], before: Callable[[], None],
                 renewed: Callable[[], Pairs | None], sampler: ElasticSampler) -> None:
        self.pairs, self.handed_out, self.before = pairs, handed_out, before
        self.renewed, self.sampler = renewed, sampler
        self.left = len(pairs)  # type: ignore[arg-type]
        self.taken = 0

    def __iter__(self) -> _HandOut:
        return self

    def _renew(self) -> None:
        pairs = self.renewed()
        if pairs is not None:
            self.pairs, self.left = pairs, len(pairs)  # type: ignore[arg-type]

    def __next__(self) -> Any:
        # the end of the pass is known before ``before`` (the next step's boundary) runs: the
        # step after the epoch's last begins with the next epoch's first batch, whether or not
        # a recovery restarted the pass in between (its RNG streams are seeded by that epoch)
        self._renew()
        if self.left <= 0:
            raise StopIteration(self._used_up() if not self.taken else None)
        self.before()
        self._renew()  # a recovery at the boundary
        batch, indices = next(self.pairs)
        self.left, self.taken = self.left - 1, self.taken + 1
        self.handed_out.append(indices)
        return batch

    def __len__(self) -> int:
        """The micro-batches this pass has left to hand out."""
        return self.left

    def _used_up(self) -> str:
        """Why a pass yields nothing (a ``for`` loop ignores it; ``next(iter(loader))``
        shows it)."""
        s = self.sampler
        return (f"epoch {s.epoch} is used up (the sampler's cursor is at sample {s.cursor} of "
                f"{s.num_samples}): loader.sampler.set_epoch({s.epoch + 1}) starts the next")


def _nothing() -> None:
    pass


class ElasticDataLoader(DataLoader):
    """A ``DataLoader`` whose batches come from an :class:`ElasticSampler`, recording the
    dataset indices each batch it hands out was fetched at (module docstring).

    Args:
        dataset: map-style dataset (``__getitem__`` and ``__len__``); the loader's ``dataset``
            attribute is its :class:`IndexedDataset` (``loader.dataset.dataset`` is it).
        sampler: the global-cursor batch sampler over ``len(dataset)`` samples.
        collate_fn, num_workers, pin_memory, ``**kwargs``: as for ``DataLoader``. Loader worker
            processes ignore SIGTERM/SIGINT (the trainer's preemption handler takes them).
    """

    def __init__(self, dataset: Dataset, sampler: ElasticSampler, *,
                 collate_fn: Callable[[list[Any]], Any] | None = None, num_workers: int = 0,
                 pin_memory: bool = False, **kwargs: Any) -> None:
        if len(dataset) != sampler.num_samples:  # type: ignore[arg-type]
            raise ValueError(f"sampler covers {sampler.num_samples} samples, the dataset has "
                             f"{len(dataset)}")  # type: ignore[arg-type]
        kwargs.setdefault("worker_init_fn",
                          PreemptionFlag.ignore_in_child if num_workers else None)
        super().__init__(IndexedDataset(dataset), batch_sampler=sampler,
                         collate_fn=CollateWithIndices(collate_fn), num_workers=num_workers,
                         pin_memory=pin_memory, generator=torch.Generator(), **kwargs)
        self._handed_out: deque[list[int]] = deque(maxlen=HANDED_OUT_LIMIT)
        self._restart = False  # the pass in progress starts again at its next batch
        # called before each batch is handed to the loop: a session's step boundary
        # (own_loop.FaultTolerantLoop checkpoints there what step_done() left pending)
        self.before_hand_out: Callable[[], None] = _nothing

    @property
    def elastic_sampler(self) -> ElasticSampler:
        return self.batch_sampler  # type: ignore[return-value]

    @property  # type: ignore[override]
    def sampler(self) -> ElasticSampler:
        """The elastic sampler too, so that a loop written for a ``DistributedSampler`` works
        unchanged (``loader.sampler.set_epoch(epoch)``); the DataLoader's per-sample sampler
        is unused (batches come from the batch sampler)."""
        return self.elastic_sampler

    @sampler.setter
    def sampler(self, value: Any) -> None:  # DataLoader.__init__ sets its default one
        self.__dict__["_sample_sampler"] = value

    def __iter__(self) -> Any:
        """A new pass from the sampler's cursor; what earlier passes handed out and no step
        took (an abandoned step's micro-batches) is forgotten."""
        self._restart = False
        return _HandOut(self._pass(), self._handed_out, lambda: self.before_hand_out(),
                        self._renewed, self.elastic_sampler)

    def __len__(self) -> int:
        """This rank's micro-batches in a whole epoch at the current world size (as a
        ``DataLoader`` over a ``DistributedSampler`` counts: ``steps_per_epoch x
        grad_accum_steps``); ``len(iter(loader))`` is what the pass from the sampler's cursor has
        left."""
        s = self.elastic_sampler
        return s.steps_per_epoch() * s.grad_accum_steps

    def _pass(self) -> Pairs:
        s = self.elastic_sampler
        self.generator.manual_seed(step_seed(s.seed, s.epoch, s.cursor, s.rank))
        self._handed_out.clear()
        return super().__iter__()

    def restart(self) -> None:
        """The pass in progress starts again at the sampler's cursor (and the sampler's rank and
        world size) at its next batch: an in-place recovery discarded the step in flight, whose
        micro-batches the loop then gets again (``own_loop.FaultTolerantLoop``)."""
        self._restart = True

    def _renewed(self) -> Pairs | None:
        if not self._restart:
            return None
        self._restart = False
        return self._pass()

    def take_fetched(self) -> list[list[int]]:
        """The dataset indices of the micro-batches handed out since the last call (or since
        the current pass began; the last :data:`HANDED_OUT_LIMIT` of them), one list of ints
        per micro-batch, in order; then forgets them."""
        taken = list(self._handed_out)
        self._handed_out.clear()
        return taken

    def steps(self) -> Iterator[list[Any]]:
        """This rank's remaining optimizer steps of the epoch, each a list of
        ``grad_accum_steps`` micro-batches: the number read as each step begins (an in-place
        recovery may change the world size, and with a kept global batch the accumulation),
        and the pass followed when a recovery restarts it."""
        batches = iter(self)
        while True:
            step = list(itertools.islice(batches, 1))
            if not step:
                return
            # the step's boundary ran in the first next(): its accumulation holds now
            step += list(itertools.islice(batches, self.elastic_sampler.grad_accum_steps - 1))
            yield step

    def state_dict(self) -> dict[str, Any]:
        return self.elastic_sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.elastic_sampler.load_state_dict(state)


def elastic_dataloader(dataset: Dataset, micro_batch_size: int, *, seed: int = 0,
                       grad_accum_steps: int = 1, shuffle: bool = True,
                       rank: int | None = None, world_size: int | None = None,
                       global_batch_size: int | None = None,
                       **loader_kwargs: Any) -> ElasticDataLoader:
    """An :class:`ElasticDataLoader` for this rank of the current process group.

    Args:
        dataset: map-style dataset.
        micro_batch_size: samples per rank per forward/backward.
        seed: the permutation of epoch ``e`` is seeded by ``(seed, e)``.
        grad_accum_steps: micro-batches per optimizer step; the global batch is
            ``world_size x micro_batch_size x grad_accum_steps`` samples.
        rank, world_size: default: the process group's (0 and 1 without one).
        global_batch_size: keep this global batch (samples) at every world size instead: the
            micro-batches per step are then ``ceil(global_batch_size / (world_size x
            micro_batch_size))``, split unevenly where that does not divide it; weight each
            micro-batch's loss by ``loader.elastic_sampler.loss_weights()`` (what
            ``FaultTolerantLoop.loss_weights`` returns), see ``data/sampler.py``.
        **loader_kwargs: ``collate_fn``, ``num_workers``, ``pin_memory``, ...

    Raises:
        ValueError: the dataset is smaller than one global batch, or the global batch cannot
            give every rank a non-empty micro-batch.
    """
    import torch.distributed as dist

    if world_size is None:
        world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    sampler = ElasticSampler(len(dataset), seed, micro_batch_size,  # type: ignore[arg-type]
                             grad_accum_steps, current_rank() if rank is None else rank,
                             world_size, shuffle=shuffle, global_batch_size=global_batch_size)
    return ElasticDataLoader(dataset, sampler, **loader_kwargs)
