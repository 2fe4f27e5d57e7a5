"""A gloo process group for tests on one machine, reachable over loopback only.

The test spawners, the property-test rank pool and the benchmark all start
their ranks this way, and so can a user testing ``fr.distributed`` code:
the ranks meet through a file store (nothing listens on a port for the
rendezvous, which torch's TCP store would do on every interface) and gloo's
own sockets are pinned to the loopback interface.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import torch.distributed as dist

__all__ = ["check_int", "check_seconds", "check_world_size", "init_loopback_group"]


def init_loopback_group(
    store: str | os.PathLike[str], rank: int, world_size: int, *, timeout: float = 30.0
) -> None:
    """Join a gloo group of ``world_size`` ranks on this machine, in rank ``rank``'s process.

    Args:
        store: a path every rank shares that does not exist yet (e.g. a name
            in a fresh temporary directory): the ranks meet through this file.
        rank: this process's rank, from 0 to ``world_size - 1``.
        world_size: how many ranks join, at least 1.
        timeout: seconds that bound every collective, so that a rank that
            never joins one makes the others raise instead of hanging.

    Raises:
        TypeError: ``rank`` or ``world_size`` is not an int, or ``timeout``
            not a number.
        ValueError: ``world_size`` below 1, ``rank`` outside
            ``[0, world_size)``, or ``timeout`` not positive.

    Call ``dist.destroy_process_group()`` when done.

    >>> init_loopback_group("/tmp/store", rank=2, world_size=2)
    Traceback (most recent call last):
    ...
    ValueError: fr.testing.init_loopback_group: rank must be in [0, world_size) = [0, 2), got rank=2
    """
    _check(store, rank, world_size, timeout)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # gloo's sockets on loopback only
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",  # no listening socket for the rendezvous
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout),
    )


def _check(store: Any, rank: int, world_size: int, timeout: float) -> None:
    fn = "fr.testing.init_loopback_group"
    if not isinstance(store, (str, os.PathLike)):
        raise TypeError(f"{fn}: store must be a file path, got {type(store).__name__}")
    check_int(fn, "rank", rank)
    check_world_size(fn, world_size)
    if not 0 <= rank < world_size:
        raise ValueError(
            f"{fn}: rank must be in [0, world_size) = [0, {world_size}), got rank={rank}"
        )
    check_seconds(fn, "timeout", timeout)


def check_int(fn: str, name: str, value: Any) -> None:
    """``TypeError`` naming ``fn`` and ``name`` unless ``value`` is an int (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{fn}: {name} must be an int, got {value!r}")


def check_world_size(fn: str, world_size: Any) -> None:
    """``TypeError`` or ``ValueError`` naming ``fn`` unless ``world_size`` is an int >= 1."""
    check_int(fn, "world_size", world_size)
    if world_size < 1:
        raise ValueError(f"{fn}: world_size must be at least 1, got world_size={world_size}")


def check_seconds(fn: str, name: str, value: Any) -> None:
    """``TypeError`` or ``ValueError`` naming ``fn`` and ``name`` unless ``value`` is positive."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{fn}: {name} must be a number of seconds, got {value!r}")
    if not value > 0:  # nan too
        raise ValueError(f"{fn}: {name} must be a positive number of seconds, got {value!r}")
