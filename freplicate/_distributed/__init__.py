"""Data parallelism across processes: the functional DDP and ZeRO, written once for eager and compiled.

The functional counterpart of DistributedDataParallel, of the composable
``replicate``, of ZeRO's sharded optimizer state and of FSDP: instead of
hooks on a module and a reducer hidden in it, collective functions on trees,
built on ``torch.distributed`` itself (gloo on CPU, NCCL on CUDA), each a
primitive with JAX's rules, so that they compose with autograd and torch.func.

The layers, from the ground up (arrows point down only)::

    _group     the process group; the protocol's error types; collective(): torch's errors named
    _wire      THE WIRE FORMAT: each kind (ALL_REDUCE, BROADCAST, REDUCE_SCATTER, ALL_GATHER) an
               object owning its chunks, cells, buffer sizes, copy-in/out, eager and traced
               starts, and its rules (transpose, tangent, batch); Spec: one call but its data
    _options   a call's options (every rank must pass them alike)
    _flags     the words that ride at the end of a call's buckets (the check, failed, retry)
    _layout    pure: a tree's signatures -> buckets (DDP's rule), fingerprint, mismatch text
    _transport where buffers come from and how a kind's collective runs: Eager | Traced
    _agree     the cross-rank agreement: a probe on a layout's first use (every call in the
               debug mode), the exchange that names what differs, the announcement of a failure
    _store     the same while tracing, once per trace, through the group's store
    _plans     a tree (or a rule's tensors) -> its layout, cached eagerly, baked in traced
    _call      Call(Request): agree, launch buckets in order without waiting (what each
               carries: a Send), finish and verify the words on the device; the failure
               protocol; it issues no collective itself
    _rules     apply(): a call plainly, or through a functorch-aware autograd.Function whose
               backward / jvp / vmap are the kind's rules; Pending: a call started, finished later
    _collectives, _step, _backward, _join, _carry, _shard, _sharded, _dcp, _materialize
               the public functions

One call, eagerly (``all_reduce(tree)``; ``broadcast``, ``reduce_scatter``,
``all_gather`` alike, their kind deciding every step below the Call)::

    all_reduce(tree)
      -> _options.reduction                      checked options (kind, op, cap, compress)
      -> _collectives.collect
           plan_of(tree)                         layout from the leaves' signatures (cached)
           needs_rules(tensors)?  -- no -->  Call(Request(plan, ...))
                                              .begin()      _agree.agree: a probe on first use only
                                              .launch_rest  kind.pack -> Eager.start (async, pooled)
                                              .finish()     wait, assert the words, kind.views
                  -- yes (a transform, a forward-AD level, an input requiring grad) -->
                                         _rules.apply -> Primitive.apply(spec, *tensors)
                                              forward   = the same plain Call
                                              backward  = kind.transpose(...)   via apply again
                                              jvp       = kind.tangent(...)     via apply again
                                              vmap      = kind.batch(...)       via apply again
      -> plan.rebuild                            the tree of results (views of the buckets)

The same call while ``torch.compile`` traces::

    all_reduce(tree)
      -> collect -> plan_of -> _plans._traced
           _layout_now (assume_constant_result: runs for real, once per trace)
                -> build the layout, _store.check it across ranks -> baked into the graph
      -> Call(Request) with the Traced transport
           begin: in the debug mode only, the probe (a fixed-size MAX all-reduce of the
                  fingerprint, read by an op the first bucket's words depend on)
           kind.joined: the send buffer as one cat of the parts (rank-major where rowed)
           kind.start_traced -> torch.ops._c10d_functional.*  (in the graph; wait_tensor at finish,
                  then the words asserted in the graph: torch._assert_async)
      kind.joined: the buffer built of differentiable ops, so that a graph-carrying input keeps
      its graph: the functional collectives' own autograd is the kinds' transposes (one graph,
      forward and AOT's backward); inside a torch.func transform: refused (Dynamo would trace
      an autograd.Function's rules without their collectives)

A gradient step (``grad_and_value(fn)(params, ...)``, a ``Step``) is one Call
on the gradients' layout: eagerly its buckets start from hooks on fresh
leaves as the backward pass fills them (``_backward``, DDP's overlap); with a
graph-carrying input, under a transform, or compiled, the local gradients
come first (``fr.grad_and_value``) and the same buckets after, through the
rules where they apply. ZeRO-3 (``_sharded.apply_sharded``) gathers each unit
through ``ALL_GATHER`` just before it runs (the next one ``Pending``
meanwhile) and again in the backward pass; the gather's transpose is the
gradient's reduce-scatter.
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
