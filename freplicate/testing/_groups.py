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

import torch.distributed as dist

__all__ = ["init_loopback_group"]


def init_loopback_group(store: str, rank: int, world_size: int, *, timeout: float = 30.0) -> None:
    """Join a gloo group of ``world_size`` ranks on this machine, in rank ``rank``'s process.

    ``store`` is a path every rank shares that does not exist yet (e.g. a
    name in a fresh temporary directory); ``timeout`` (seconds) bounds every
    collective, so a rank that never joins one makes the others raise instead
    of hanging. Call ``dist.destroy_process_group()`` when done.
    """
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # gloo's sockets on loopback only
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",  # no listening socket for the rendezvous
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout),
    )
