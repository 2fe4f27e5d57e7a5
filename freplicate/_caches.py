"""The registry behind ``fr.clear_caches()``: every cache freplicate keeps, in one list.

Each cache module registers its clearing function here when it is imported;
nothing outside freplicate is touched. ``clear_caches`` empties them all.
"""

from __future__ import annotations

import gc
from collections.abc import Callable

__all__ = ["clear_caches", "register"]

_CLEARERS: list[Callable[[], None]] = []


def register(clear: Callable[[], None]) -> Callable[[], None]:
    """Add ``clear`` to what ``clear_caches`` calls; returns it (usable as a decorator)."""
    _CLEARERS.append(clear)
    return clear


def clear_caches() -> None:
    """Release every cache and buffer pool freplicate holds.

    freplicate keeps small caches so that repeated calls on the same module
    or tree layout are fast: ``fr.apply``'s module skeletons, the stacking
    layouts of ``fr.grad_and_value``, and ``fr.distributed``'s plans and
    flat communication buffers. They are bounded and weakly keyed; this
    frees them at once (e.g. between two models, or before measuring
    memory). Results already returned are never affected; the next call
    rebuilds what it needs.

    Returns:
        None.

    >>> import freplicate as fr
    >>> fr.clear_caches()
    """
    for clear in _CLEARERS:
        clear()
    gc.collect()
