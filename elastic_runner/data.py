"""The elastic data side: a DataLoader over the global-cursor sampler, for any map-style dataset.

:class:`ElasticDataLoader` iterates this rank's remaining micro-batches of the current epoch,
starting at the sampler's cursor (see ``sampler.py``): after a restart, at any world size, it
continues with exactly the samples no committed step has trained on. It is ``Stateful`` (its
state is the sampler's), so it can go into a checkpoint as it is. Any ``collate_fn``,
``num_workers`` and ``pin_memory`` work as with a plain DataLoader.

Random transforms: with ``num_workers=0`` the dataset runs in the training process, whose
generators the session reseeds before every step, so a resumed epoch replays them exactly. Loader
worker processes have generators of their own, seeded at every ``iter()`` from
``(seed, epoch, cursor, rank)`` (the loader's generator): reproducible for a given start, but a
resumed epoch draws other values than the uninterrupted one. For exact replay with workers,
derive a sample's randomness from its index (``torch.Generator().manual_seed(hash((seed,
epoch, index)))`` in ``__getitem__``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from .dist import current_rank
from .preempt import PreemptionFlag
from .sampler import ElasticSampler
from .state import step_seed


class ElasticDataLoader(DataLoader):
    """A ``DataLoader`` whose batches come from an :class:`ElasticSampler`.

    Args:
        dataset: map-style dataset (``__getitem__`` and ``__len__``).
        sampler: the global-cursor batch sampler over ``len(dataset)`` samples.
        collate_fn, num_workers, pin_memory, **kwargs: as for ``DataLoader``. Loader worker
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
        super().__init__(dataset, batch_sampler=sampler, collate_fn=collate_fn,
                         num_workers=num_workers, pin_memory=pin_memory,
                         generator=torch.Generator(), **kwargs)

    @property
    def elastic_sampler(self) -> ElasticSampler:
        return self.batch_sampler  # type: ignore[return-value]

    def __iter__(self) -> Any:
        s = self.elastic_sampler
        self.generator.manual_seed(step_seed(s.seed, s.epoch, s.cursor, s.rank))
        return super().__iter__()

    def steps(self) -> Iterator[list[Any]]:
        """This rank's remaining optimizer steps of the epoch, each a list of
        ``grad_accum_steps`` micro-batches."""
        batches = iter(self)
        accum = self.elastic_sampler.grad_accum_steps
        for _ in range(self.elastic_sampler.steps_left_in_epoch()):
            yield [next(batches) for _ in range(accum)]

    def state_dict(self) -> dict[str, Any]:
        return self.elastic_sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.elastic_sampler.load_state_dict(state)


def elastic_dataloader(dataset: Dataset, micro_batch_size: int, *, seed: int = 0,
                       grad_accum_steps: int = 1, shuffle: bool = True,
                       rank: int | None = None, world_size: int | None = None,
                       **loader_kwargs: Any) -> ElasticDataLoader:
    """An :class:`ElasticDataLoader` for this rank of the current process group.

    Args:
        dataset: map-style dataset.
        micro_batch_size: samples per rank per forward/backward.
        seed: the permutation of epoch ``e`` is seeded by ``(seed, e)``.
        grad_accum_steps: micro-batches per optimizer step; the global batch is
            ``world_size x micro_batch_size x grad_accum_steps`` samples.
        rank, world_size: default: the process group's (0 and 1 without one).
        **loader_kwargs: ``collate_fn``, ``num_workers``, ``pin_memory``, ...

    Raises:
        ValueError: the dataset is smaller than one global batch.
    """
    import torch.distributed as dist

    if world_size is None:
        world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    sampler = ElasticSampler(len(dataset), seed, micro_batch_size,  # type: ignore[arg-type]
                             grad_accum_steps, current_rank() if rank is None else rank,
                             world_size, shuffle=shuffle)
    return ElasticDataLoader(dataset, sampler, **loader_kwargs)
