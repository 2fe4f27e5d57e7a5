"""Plans: a tree turned into its layout, cached eagerly, baked into the graph while tracing.

``plan_of(tree, ...)`` flattens a tree (a plain dict of tensors without
optree: how parameters and gradients come), finds its tied tensors, and
returns the layout (``_layout.build``) with what a call needs beside it:
how to rebuild the tree and, eagerly, the buckets' pools (``_transport``)
and a lock (a user's ``fn`` may itself reduce a tree of this layout).

Eagerly, plans are cached by the leaves' signatures (and the dict's keys or
the tree's spec, the ties and the options): the commonest key is built at C
speed. While Dynamo traces, the layout comes from a function Dynamo runs for
real and treats as constant (``torch.compiler.assume_constant_result``): it
builds the layout from the signatures it traced and checks it across ranks
through the store (``_store``); the answer is baked into the graph, and
Dynamo's guards on the same shapes retrace, and so recheck, a changed layout.
No parameter tensor's identity is guarded: new tensors of the same layout
never recompile.
"""

from __future__ import annotations

import operator
import threading
from collections.abc import Sequence
from typing import Any, NamedTuple

import optree
import torch
import torch.distributed as dist

from .._caches import register
from .._torch import assume_constant_result, graph_break, is_compiling, resolve_group
from .._tree import NAMESPACE, alias_groups, flatten_in_order, paths_of, picker, tensor_values
from .._typing import TensorTree
from . import _ops, _store
from ._group import backend_of, comm_device
from ._layout import Layout, Sig, Tree, build
from ._options import Options
from ._transport import Pools
from ._wire import Spec, order_of

__all__ = ["Plan", "clear_plans", "plan_for", "plan_of"]

_CACHE_SIZE = 16
_BASE = operator.attrgetter("shape", "dtype", "device", "layout")
_IS_CONTIGUOUS = torch.Tensor.is_contiguous


def _orders(tensors: Sequence[torch.Tensor]) -> tuple[Any, ...] | None:
    """The tensors' memory orders; ``None`` where every one is contiguous (at C speed)."""
    if all(map(_IS_CONTIGUOUS, tensors)):
        return None
    return tuple(map(order_of, tensors))


def _sigs(tensors: Sequence[torch.Tensor]) -> tuple[Sig, ...]:
    """The tensors' signatures (shape, dtype, device, layout, memory order)."""
    return _signed(tuple(map(_BASE, tensors)), _orders(tensors))


def _signed(base: Sequence[Any], orders: Sequence[Any] | None) -> tuple[Sig, ...]:
    if orders is None:
        return tuple((*b, None) for b in base)
    return tuple((*b, o) for b, o in zip(base, orders))


_DICT = object()  # marks a key made from a plain dict's keys
_LOCK = threading.Lock()


class Plan:
    """A tree's layout, and what calls on it need beside it (see the module's text).

    ``pools`` and ``lock`` exist eagerly only; ``stacks`` holds, per choice,
    how a gradient step stacks the small tensors of each bucket (``_step``).
    """

    __slots__ = (
        "bare",
        "dims",
        "keys",
        "layout",
        "lock",
        "never_stack",
        "picks",
        "pools",
        "reorder",
        "spec",
        "stacks",
    )

    def __init__(
        self,
        layout: Layout,
        spec: Any,
        keys: Sequence[Any] | None,
        *,
        eager: bool,
        tensors: Sequence[Any] = (),
        pooled: bool = True,
        dims: Sequence[int] | None = None,
    ) -> None:
        self.layout = layout
        # the sparse tensors' sparse dims: what an empty one sent in their place needs
        if dims is None:
            dims = [tensors[k].sparse_dim() for k in layout.sparse] if tensors else []
        self.dims = list(dims)
        self.spec = spec
        self.keys = keys
        self.bare = layout.slot is None  # every leaf a tensor of its own
        inverse = [0] * len(layout.arrival)
        for j, k in enumerate(layout.arrival):
            inverse[k] = j
        self.reorder = picker(inverse)  # results in arrival order -> tensor order
        kept = pooled and layout.kind.kept
        self.pools = [Pools(b, layout.kind, kept=kept) for b in layout.buckets] if eager else []
        self.lock = threading.RLock() if eager else None
        self.stacks: dict[bool, Any] = {}
        self.never_stack = False  # the layout met a sparse gradient in a stack (``_backward``)
        # per bucket: its tensors out of the layout's (at C speed), and where each run's are
        self.picks: list[tuple[tuple[int, ...], Any, list[tuple[int, int]]]] = []
        for bucket in layout.buckets:
            start, bounds = 0, []
            for run in bucket.runs:
                bounds.append((start, start + run.n))
                start += run.n
            members = bucket.members
            get = operator.itemgetter(*members) if len(members) > 1 else None
            self.picks.append((members, get, bounds))

    def parts(self, b: int, tensors: Sequence[Any]) -> list[list[Any]]:
        """Bucket ``b``'s tensors out of ``tensors`` (one per tensor of the layout), one list a run."""
        members, get, bounds = self.picks[b]
        mine = get(tensors) if get is not None else [tensors[members[0]]] if members else []
        out = []
        for start, end in bounds:  # a loop, not a comprehension: no frame of its own
            out.append(list(mine[start:end]))
        return out

    def all_parts(self, tensors: Sequence[Any]) -> list[list[list[Any]]]:
        """``parts`` of every bucket, in order."""
        out = []
        for b in range(len(self.picks)):
            out.append(self.parts(b, tensors))
        return out

    def empty_sparse(self) -> list[torch.Tensor]:
        """An empty tensor for each sparse one, as a rank that sends nothing sends it."""
        out = []
        for k, dims in zip(self.layout.sparse, self.dims):
            shape, dtype, device, _, _ = self.layout.sigs[k]
            indices = torch.empty(dims, 0, dtype=torch.int64, device=device)
            values = torch.empty(0, *shape[dims:], dtype=dtype, device=device)
            out.append(torch.sparse_coo_tensor(indices, values, shape, is_coalesced=True))
        return out

    def tensors(self, leaves: Sequence[Any]) -> list[Any]:
        """The layout's tensors out of the tree's leaves (a tied one once)."""
        return list(leaves) if self.bare else [leaves[i] for i in self.layout.unique]

    def rebuild(self, leaves: Sequence[Any], results: Sequence[Any]) -> TensorTree:
        """The tree of ``results`` (one per tensor), non-tensor leaves passed through, ties kept."""
        slot = self.layout.slot
        out = (
            results if slot is None else [results[s] if s >= 0 else x for x, s in zip(leaves, slot)]
        )
        if self.keys is not None:
            return dict(zip(self.keys, out))
        return optree.tree_unflatten(self.spec, out)


_PLANS: dict[Any, Plan] = {}


def plan_of(
    tree: TensorTree,
    options: Options,
    group: Any,
    world: int,
    caller: str,
    *,
    check: bool = True,
    traced: bool | None = None,
) -> tuple[Plan, list[Any]]:
    """The plan of ``tree``'s layout for ``options`` over ``world`` ranks, and the tree's leaves.

    While tracing, the layout is also checked across ranks here (unless
    ``check`` is false); eagerly the call checks it (``_agree``). ``traced``:
    whether Dynamo traces, where the caller asked already (``None``: ask).
    """
    if is_compiling() if traced is None else traced:
        return _traced(tree, options, group, world, caller, check)
    values = tensor_values(tree)
    if values is not None and len(set(map(id, values))) == len(values):
        # the key at C speed: the signatures without memory orders, and the orders only where
        # some tensor is not contiguous
        base, orders = tuple(map(_BASE, values)), _orders(values)
        key: tuple[Any, ...] = (_DICT, tuple(tree), base, orders, options, world, caller)
        plan = _PLANS.get(key)
        if plan is None:
            keys = tuple(tree)
            described = Tree([f"[{k!r}]" for k in keys], _signed(base, orders))
            layout = build(described, options, world, caller, comm_device(group), backend_of(group))
            plan = _remember(key, Plan(layout, None, keys, eager=True, tensors=values))
        return plan, values
    leaves, spec = flatten_in_order(tree)
    unique, slot = alias_groups(leaves)
    bare = len(unique) == len(leaves)
    tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
    each = iter([s[4] for s in _sigs(tensors)])
    signed: tuple[Sig | None, ...] = tuple(
        (*_BASE(x), next(each)) if isinstance(x, torch.Tensor) else None for x in leaves
    )
    key = (spec, signed, None if bare else tuple(slot), options, world, caller)
    plan = _PLANS.get(key)
    if plan is None:
        described = Tree(paths_of(spec), signed, None if bare else slot)
        layout = build(described, options, world, caller, comm_device(group), backend_of(group))
        plan = _remember(
            key, Plan(layout, spec, None, eager=True, tensors=[leaves[i] for i in layout.unique])
        )
    return plan, leaves


def plan_for(spec: Spec, tensors: Sequence[torch.Tensor]) -> Plan:
    """The plan of a call of ``spec`` on ``tensors`` (distinct ones): what a rule runs.

    Its layout is that of the caller's tree, flattened: ``spec.paths`` name
    the tensors; an all-gather's full shapes are ``spec.like``'s, the dtype ``spec.dtype``.
    """
    sigs: tuple[Any, ...] = tuple(map(_traced_sig, tensors)) if is_compiling() else _sigs(tensors)
    if spec.like is not None:
        sigs = tuple((shape, *s[1:4], order) for s, (shape, order) in zip(sigs, spec.like))
    if spec.dtype is not None:  # packed into buffers of that dtype (the copy-in casts)
        sigs = tuple((s[0], spec.dtype, *s[2:]) if s[1].is_floating_point else s for s in sigs)
    whole = spec.wholes([s[0] for s in sigs])
    described = Tree(spec.paths, sigs, None, whole)
    options, world, caller = spec.options, spec.world, spec.caller
    if is_compiling():
        layout = _layout_traced(described, options, spec.group, world, caller, spec.check)
        return Plan(layout, None, None, eager=False)
    key = ("rule", spec.paths, sigs, whole, options, world, caller, spec.pooled)
    plan = _PLANS.get(key)
    if plan is None:
        group = spec.group
        layout = build(described, options, world, caller, comm_device(group), backend_of(group))
        made = Plan(layout, None, None, eager=True, tensors=tensors, pooled=spec.pooled)
        plan = _remember(key, made)
    return plan


def _remember(key: Any, plan: Plan) -> Plan:
    with _LOCK:
        _PLANS[key] = plan
        while len(_PLANS) > _CACHE_SIZE:
            del _PLANS[next(iter(_PLANS))]  # the oldest layout
    return plan


def clear_plans() -> None:
    """Forget every plan, and with them their pooled buffers (``fr.clear_caches``)."""
    with _LOCK:
        for plan in _PLANS.values():
            for pools in plan.pools:
                pools.clear()
        _PLANS.clear()
        _LAYOUTS.clear()


register(clear_plans)


# --- while Dynamo traces ----------------------------------------------------------------

_LAYOUTS: dict[Any, Layout] = {}


class Refused(NamedTuple):
    """What ``_layout_now`` answers instead of a layout: the error to raise, by its kind."""

    kind: str  # "type" or "value"
    message: str


_ERRORS = {"type": TypeError, "value": ValueError}


def _traced(
    tree: TensorTree, options: Options, group: Any, world: int, caller: str, check: bool
) -> tuple[Plan, list[Any]]:
    if type(tree) is dict and all(isinstance(v, torch.Tensor) for v in tree.values()):
        keys: tuple[Any, ...] | None = tuple(tree)
        leaves = list(tree.values())
        paths = tuple(f"[{k!r}]" for k in tree)
        spec = None
    else:
        accessors, leaves, spec = optree.tree_flatten_with_accessor(tree, namespace=NAMESPACE)
        keys = None
        paths = tuple(a.codify("") or "<root>" for a in accessors)
    sigs = tuple(map(_traced_sig, leaves))
    unique, slot = alias_groups(leaves)
    ties = None if len(unique) == len(leaves) else tuple(slot)
    layout = _layout_traced(Tree(paths, sigs, ties), options, group, world, caller, check)
    return Plan(layout, spec, keys, eager=False), leaves


def _layout_traced(
    tree: Tree, options: Options, group: Any, world: int, caller: str, check: bool
) -> Layout:
    """The layout, built and checked across ranks once per trace (``_layout_now``), or its error."""
    pg = dist.group.WORLD if group is None else group
    name = pg.group_name  # type: ignore[union-attr]
    whole = None if tree.whole is None else tuple(tree.whole)
    described = (tuple(tree.paths), tuple(tree.sigs), tree.slot, whole)
    fields = tuple(options)
    answer = _layout_now(caller, name, check, described, fields, world)
    if isinstance(answer, Refused):  # the layout's own error, or the check's
        graph_break(answer.message)
        raise _ERRORS[answer.kind](answer.message)
    return answer


def _traced_sig(x: Any) -> Sig | None:
    """A leaf's signature as trace-time constants (``None``: not a tensor).

    The buckets are planned from concrete sizes: a symbolic one (a retrace on
    new shapes makes them dynamic) is specialized, as ``operator.index`` does
    it, so Dynamo guards on its value and a new size retraces and replans.
    """
    if not isinstance(x, torch.Tensor):
        return None
    shape = tuple(map(operator.index, x.shape))
    order = None if x.is_contiguous() else order_of(x)
    return (shape, x.dtype, x.device, x.layout, order)


@assume_constant_result
def _layout_now(
    caller: str,
    group_name: str,
    check: bool,
    described: tuple[Any, ...],
    fields: tuple[Any, ...],
    world: int,
) -> Layout | Refused:
    """The layout, checked across ranks, or why not (``Refused``).

    Runs in plain Python while Dynamo traces (see the module's text); its
    arguments come as plain constants (``described``: a ``Tree``'s fields;
    ``fields``: the ``Options``' values).
    """
    options = Options(*fields)
    tree = Tree(*described)
    key = (described, options, world, caller)
    layout = _LAYOUTS.get(key)
    if layout is None:
        try:
            pg = resolve_group(group_name)
            layout = build(tree, options, world, caller, comm_device(pg), backend_of(pg))
        except TypeError as err:
            return Refused("type", str(err))
        if layout.sparse:
            return Refused(
                "type",
                f"{caller}: under torch.compile, sparse tensors cannot travel (the one at "
                f"{tree.paths[layout.unique[layout.sparse[0]]]}); reduce them eagerly",
            )
        _LAYOUTS[key] = layout
        while len(_LAYOUTS) > _CACHE_SIZE:
            del _LAYOUTS[next(iter(_LAYOUTS))]
    _ops.remember(group_name, caller, layout)
    if check:
        error = _store.check(caller, group_name, layout)
        if error is not None:
            return Refused("value", error)
    return layout
