"""Data parallelism across processes: the functional DistributedDataParallel, and ZeRO-1/2.

``fr.distributed`` works on an initialised ``torch.distributed`` process group
(``torchrun`` or ``init_process_group``; gloo on CPU, NCCL on CUDA). Every
function is collective: all ranks call it, in the same order. The code lives
in the private package ``freplicate/_distributed/``; this module only publishes it.
"""

from ._distributed import Step as Step
from ._distributed import all_gather as all_gather
from ._distributed import all_reduce as all_reduce
from ._distributed import apply_sharded as apply_sharded
from ._distributed import broadcast as broadcast
from ._distributed import clip_grad_norm as clip_grad_norm
from ._distributed import grad_and_value as grad_and_value
from ._distributed import join as join
from ._distributed import load_sharded as load_sharded
from ._distributed import materialize as materialize
from ._distributed import reduce_scatter as reduce_scatter
from ._distributed import save_sharded as save_sharded
from ._distributed import shard as shard
from ._distributed import sync_buffers as sync_buffers

__all__ = [
    "Step",
    "all_gather",
    "all_reduce",
    "apply_sharded",
    "broadcast",
    "clip_grad_norm",
    "grad_and_value",
    "join",
    "load_sharded",
    "materialize",
    "reduce_scatter",
    "save_sharded",
    "shard",
    "sync_buffers",
]
