"""One-process data parallelism: the seed ``nn.DataParallel`` path as functions on trees.

``scatter`` splits a batch tree along a dimension, one shard per device;
``parallel_apply`` runs one call per replica in its own thread; ``gather``
concatenates the replicas' outputs on one device; ``data_parallel`` chains
them with ``fr.replicate`` and ``fr.apply`` (the functional
``nn.parallel.data_parallel``); ``all_reduce`` sums or averages one tree per
device; ``data_parallel_grad`` is the DDP-style step in one process (per-device
gradients, all-reduced). Every transfer and reduction goes through the
coalescing engine (``_pack``), so a tree of many small tensors costs a handful
of copies; chunk, cat, stack and ``.to`` are differentiable, so all of it
composes with autograd and ``torch.func``.
"""

from .apply import parallel_apply as parallel_apply
from .composites import data_parallel as data_parallel
from .composites import data_parallel_grad as data_parallel_grad
from .reduce import all_reduce as all_reduce
from .scatter import gather as gather
from .scatter import scatter as scatter

__all__ = [
    "all_reduce",
    "data_parallel",
    "data_parallel_grad",
    "gather",
    "parallel_apply",
    "scatter",
]
