"""Data parallelism across processes: broadcast, bucketed all-reduce, a DDP-style gradient.

The functional counterpart of DistributedDataParallel and of the composable
``replicate``: instead of hooks on a module and a reducer hidden in it, three
collective functions on trees, built on ``torch.distributed`` itself (gloo on
CPU, NCCL on CUDA). ``plan`` turns a tree layout into buckets, ``agree``
checks it across ranks, ``pipeline`` moves the buckets through their
collectives, ``collectives``, ``grad`` and ``join`` are the public functions
(``carry``: what rides in a reduction for ``join``).
"""

from .collectives import all_reduce as all_reduce
from .collectives import broadcast as broadcast
from .collectives import sync_buffers as sync_buffers
from .grad import Step as Step
from .grad import grad_and_value as grad_and_value
from .join import join as join

__all__ = ["Step", "all_reduce", "broadcast", "grad_and_value", "join", "sync_buffers"]
