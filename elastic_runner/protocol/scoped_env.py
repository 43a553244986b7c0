"""Setting environment variables for a block and restoring them after it (the agent sets what
its workers inherit while it starts them)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping


@contextlib.contextmanager
def environment(values: Mapping[str, str | None] | None = None, /, **variables: str | None
                ) -> Iterator[None]:
    """Set ``values`` and ``variables`` in ``os.environ`` for the ``with`` block (None: unset
    the variable), then put back what each was before (unset where it was unset), also when
    the block raises.

    Example: ``with environment({INPLACE_ENV: location}, OMP_NUM_THREADS="4"): ...``
    """
    wanted = {**(values or {}), **variables}
    saved = {name: os.environ.get(name) for name in wanted}
    _apply(wanted)
    try:
        yield
    finally:
        _apply(saved)


def _apply(values: Mapping[str, str | None]) -> None:
    for name, value in values.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
