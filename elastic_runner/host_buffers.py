"""One pool of host buffers, reused across checkpoints and peer copies.

Copying a state into freshly allocated host memory costs as much as writing it (the pages are
touched for the first time; ``checkpoint/async_save.py`` has the numbers), so the async
checkpoint's staging (``checkpoint/async_save.py``) and the peer copies
(``recovery/peer_copies.py``) copy into buffers of this pool, allocated once and reused. A
buffer is pinned (page-locked) only when asked, which its users do when the state it takes
lives on a GPU (its device-to-host copy is then asynchronous) and CUDA is there at all: on the
CPU pinning is pointless, and without a CUDA driver it fails.

Two ways to hold one:

- by key (:meth:`HostBuffers.at`): the buffer of a key path in a state, kept until the same
  key asks for another shape, dtype or pinning (a checkpoint's staging: one buffer a tensor);
- flat, taken and given back (:meth:`HostBuffers.take`, :meth:`HostBuffers.give_back`): ``uint8``
  buffers of a size (a peer copy's bytes), the given-back ones reused by the next take of
  their size; a take no spare fits keeps only the newest :attr:`HostBuffers.spares` of them.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable

import torch


def host_buffer(size: int, pinned: bool = False) -> torch.Tensor:
    """A new flat host buffer of ``size`` bytes (``uint8``), page-locked when ``pinned``."""
    return _new((size,), torch.uint8, pinned)


def _new(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, pinned: bool) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="cpu",
                       pin_memory=pinned and torch.cuda.is_available())


# a buffer with the pinning it was asked with: asking the driver each time costs a call a tensor
_Held = tuple[torch.Tensor, bool]


def _fits(held: _Held, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, pinned: bool
          ) -> bool:
    return held[0].shape == shape and held[0].dtype == dtype and held[1] == pinned


class HostBuffers:
    """The pool (module docstring). ``spares``: how many given-back flat buffers of another
    size a take that none fits keeps."""

    def __init__(self, spares: int = 2) -> None:
        self._keyed: dict[Hashable, _Held] = {}
        self._spare: list[_Held] = []
        self.spares = spares
        self.bytes = 0  # the keyed buffers' total size

    def at(self, key: Hashable, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype,
           pinned: bool = False) -> torch.Tensor:
        """The buffer of ``key``: the one it had when that has ``shape``, ``dtype`` and the
        pinning asked for, else a new one (which replaces it)."""
        held = self._keyed.get(key)
        if held is None or not _fits(held, shape, dtype, pinned):
            old = 0 if held is None else held[0].nbytes
            held = self._keyed[key] = (_new(shape, dtype, pinned), pinned)
            self.bytes += held[0].nbytes - old
        return held[0]

    def keyed(self) -> list[torch.Tensor]:
        """The buffers held by key."""
        return [buf for buf, _ in self._keyed.values()]

    def take(self, size: int, pinned: bool = False) -> torch.Tensor:
        """A flat ``uint8`` buffer of ``size`` bytes: a given-back one of that size and
        pinning, else a new one."""
        for i, held in enumerate(self._spare):
            if _fits(held, (size,), torch.uint8, pinned):
                return self._spare.pop(i)[0]
        self._spare = self._spare[-self.spares:] if self.spares else []  # another size's
        return host_buffer(size, pinned)

    def give_back(self, buffers: Iterable[torch.Tensor]) -> None:
        """``buffers`` (from :meth:`take`, or any flat host buffer) are no longer in use: the
        next takes may reuse them."""
        self._spare += [(buf, buf.is_pinned()) for buf in buffers]
