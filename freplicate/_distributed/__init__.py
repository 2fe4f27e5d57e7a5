"""Data parallelism across processes: the functional DDP and ZeRO, written once for eager and compiled.

The functional counterpart of DistributedDataParallel, of the composable
``replicate`` and of ZeRO's sharded optimizer state: instead of hooks on a
module and a reducer hidden in it, collective functions on trees, built on
``torch.distributed`` itself (gloo on CPU, NCCL on CUDA). The layers, from
the ground up (arrows point down only):

* ``_group``: the process group, and the protocol's error types;
* ``_options``, ``_flags``: a call's options; the words that ride in its buckets;
* ``_layout``: pure: a tree's signatures -> buckets, fingerprint, mismatch text;
* ``_transport``: eager (pools, async work) and traced (functional collectives);
* ``_copy``: copy-in and copy-out of buckets, the same in both;
* ``_agree`` (eager) and ``_store`` (traced): the cross-rank agreement;
* ``_plans``: a tree -> its layout, cached eagerly, baked in while tracing;
* ``_call``: one call through a transport, and the failure protocol;
* ``_collectives``, ``_step``, ``_backward``, ``_join``, ``_carry``, ``_shard``: the public
  functions.
"""

from ._collectives import all_gather as all_gather
from ._collectives import all_reduce as all_reduce
from ._collectives import broadcast as broadcast
from ._collectives import reduce_scatter as reduce_scatter
from ._collectives import shard as shard
from ._collectives import sync_buffers as sync_buffers
from ._dcp import load_sharded as load_sharded
from ._dcp import save_sharded as save_sharded
from ._join import join as join
from ._materialize import materialize as materialize
from ._shard import clip_grad_norm as clip_grad_norm
from ._sharded import apply_sharded as apply_sharded
from ._step import Step as Step
from ._step import grad_and_value as grad_and_value

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
