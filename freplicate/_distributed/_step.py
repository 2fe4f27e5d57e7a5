"""``Step``: what ``fr.distributed.grad_and_value`` returns, a gradient step reduced like DDP's.

A step's options are its fields; ``step(*args)``, ``step.skip(*args)`` and
``step.accumulate(tree, micro_batches)`` are its methods, each one ``Call``
(``_call``) on the *gradient layout* of the differentiated tree (its
positions, untied, sparse where the group learnt so). Every call agrees on
that layout before ``fn`` runs, so that a failure anywhere in ``fn`` is
announced in the call's own buckets. Eagerly the buckets start from the
backward pass (``_backward``); where that cannot be (an input already in an
autograd graph, sparse gradients, ``torch.compile``) the local gradients
come first and the same buckets after. A rank that asks to *retry* (a
sparse gradient where a dense one was planned) makes every rank reduce its
local gradients as a tree instead.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterable, Sized
from typing import TYPE_CHECKING, Any

import optree
import torch

from .._autodiff import differentiate
from .._checks import check_int
from .._torch import (
    any_requires_grad,
    foreach_add,
    foreach_add_,
    foreach_mul,
    is_compiling,
    transform_level,
)
from .._tree import NAMESPACE, flatten_in_order, tensor_values
from .._typing import Compress, Op, TensorTree
from ._agree import debugging, sparse_gradients
from ._backward import Attempt, Differentiated, overlapped
from ._call import Announced, Call, Redo, Request, Send, send_of
from ._collectives import collect, run
from ._group import forward_ad_level, resolve, world_size
from ._options import Options, check_weighted, reduction, weight_value
from ._plans import Plan, plan_of
from ._precision import around, precision_of, wire_compress
from ._reproducible import Grains, refuse
from ._rules import needs_rules
from ._wire import ALL_REDUCE, REDUCE_SCATTER, Spec, replaced

if TYPE_CHECKING:
    from torch.distributed.fsdp import MixedPrecisionPolicy

__all__ = ["Step", "grad_and_value"]

_CALLER = "fr.distributed.grad_and_value"
_END: Any = object()  # no micro-batch left


class Step:
    """What ``fr.distributed.grad_and_value`` returns: call it for a step, or ``skip``, ``accumulate``.

    ``step(*args)``: this rank's gradients, reduced over the group, and its value.
    ``step.skip(*args)``: this rank has no batch; it joins the reduction its
    peers run with nothing of its own. ``step.accumulate(tree, micro_batches)``:
    the gradients of several micro-batches, summed, reduced once. The
    options given to ``grad_and_value`` are the step's fields.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        op: Op = "mean",
        group: Any = None,
        bucket_cap_mb: float = 25.0,
        has_aux: bool = False,
        argnums: int = 0,
        compress: Compress = None,
        check: bool = True,
        weight: Callable[..., Any] | None = None,
        shard: bool = False,
        mp_policy: MixedPrecisionPolicy | None = None,
        grain: int | None = None,
        seed: int = 0,
    ) -> None:
        if not callable(fn):
            raise TypeError(f"{_CALLER}: fn must be callable, got {type(fn).__name__}")
        kind = REDUCE_SCATTER if shard else ALL_REDUCE
        precision = precision_of(_CALLER, mp_policy)
        wire = wire_compress(_CALLER, precision, compress)
        options = reduction(_CALLER, kind, op, bucket_cap_mb, wire)
        self.options: Options = options._replace(overlap=True)  # its buckets fill in a backward
        if isinstance(argnums, bool) or not isinstance(argnums, int):
            raise TypeError(f"{_CALLER}: argnums must be an int, got {argnums!r}")
        if weight is not None:
            if not callable(weight):
                raise TypeError(
                    f"{_CALLER}: weight must be a function of the step's arguments (e.g. "
                    f"lambda params, x, y: x.shape[0]) or None, got {type(weight).__name__}"
                )
            check_weighted(_CALLER, op)
            self.options = self.options._replace(weighted=True)
        self.fn = fn
        self.op = op
        self.group = group
        self.bucket_cap_mb = bucket_cap_mb
        self.has_aux = has_aux
        self.argnums = argnums
        self.compress = compress
        self.check = check
        self.weight = weight
        self.shard = shard
        self.mp_policy = mp_policy
        #: the reproducible mode's own part (``_reproducible``), or ``None``: the default
        self.grains: Grains | None = None
        if grain is not None:
            refuse(_CALLER, grain, seed, mp_policy=mp_policy, compress=compress)
            self.grains = Grains(
                grain, seed, _CALLER, op=op, argnums=argnums, has_aux=has_aux, shard=shard
            )
        #: what runs: ``fn`` as the policy has it (its casts in the graph), or ``fn`` itself
        self.run = fn if precision is None else around(fn, precision, argnums)
        # grain=: the grains see what is differentiated (ZeRO-3's check of its shards)
        run = self.run if self.grains is None else self.grains.seeing(self.run)
        self.local = differentiate(run, argnums=argnums, has_aux=has_aux, caller=_CALLER)
        self.__doc__ = getattr(fn, "__doc__", None)
        self.__name__ = f"distributed.grad_and_value({getattr(fn, '__name__', 'fn')})"

    # --- the three ways to call a step -----------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        world, group, traced = resolve(self.group, _CALLER)
        if self.grains is not None:
            grads, value, _ = self._grained(args, [(args, kwargs)], world)
            return grads, value
        if world <= 1:
            return self.local(*args, **kwargs)
        if _ruled(args, kwargs, traced):  # transformed, or a graph to keep: local, then the rules
            with Announced(self.group, world, _CALLER) as scope:  # a failure meets the peers' call
                scope.call = self._agreed(args, world)
                grads, value = self.local(*args, **kwargs)
                w = self._weigh(args, kwargs)
            return collect(grads, self._spec(world), weight=w), value
        return self._step(args, kwargs, world, None, group, traced)

    def skip(self, *args: Any) -> tuple[Any, None]:
        """This rank has no batch this step: ``(grads, None)``, its peers' reduced gradients.

        Collective: it runs the same reduction as its peers' ``step(...)``,
        sending zeros and, in a weighted mean, weight 0. With ``weight=None``
        and ``op="mean"`` the gradients are the others' sum divided by the
        world size, as DDP under ``Join`` (``divide_by_initial_world_size=True``);
        with a ``weight``, the weighted mean over the ranks that had a batch.
        Every rank then holds the same gradients, and applies the same update.

        Args:
            *args: the step's positional arguments, or at least as many as
                reach the differentiated one (``args[argnums]``: its layout,
                not its values, matters); the others are not used.

        Returns:
            ``(grads, None)``; without a process group or with one rank, zeros.

        Raises:
            TypeError: ``args`` does not reach ``args[argnums]``.
            ValueError: a layout that differs from the peers' (on every rank).
        """
        self._refuse_grains("skip")
        if not -len(args) <= self.argnums < len(args):
            raise TypeError(
                f"{_CALLER}: skip(*args) needs the differentiated argument args[{self.argnums}] "
                f"(argnums={self.argnums}), got {len(args)} positional argument(s)"
            )
        tree = args[self.argnums % len(args)]
        world = world_size(self.group, _CALLER)
        none = 0.0 if self.weight is not None else None  # a weighted mean: weight 0
        if world <= 1:
            return optree.tree_map(_zeros, tree, namespace=NAMESPACE), None
        if _ruled((tree,), {}):  # zeros in the tree's graph: this rank's rules run as its peers'
            zeros = optree.tree_map(_zeros_of, tree, namespace=NAMESPACE)
            return collect(zeros, self._spec(world), weight=none), None
        with Announced(self.group, world, _CALLER) as scope:
            plan, leaves, _ = self._plan(tree, world)
            with plan.lock or contextlib.nullcontext():
                call = scope.call = Call(self._request(plan, world))
                nothing = Send(sending=False, weight=none)
                results = run(
                    call, plan, plan.tensors(leaves), nothing, checksums=self._checksums(tree)
                )
            return plan.rebuild(leaves, results), None

    def accumulate(
        self, tree: Any, micro_batches: Iterable[Any], *, count: int | None = None
    ) -> tuple[Any, list[Any]]:
        """The gradients of several micro-batches, reduced once: DDP's ``no_sync``.

        Micro-batches are drawn one at a time, in order, exactly as a
        ``no_sync`` loop draws them (fetch one, differentiate it, fetch the
        next), so that a generator that fetches a batch, or draws random
        numbers, when asked sees the same order as DDP. Every micro-batch
        but the last runs ``fr.grad_and_value`` locally, no communication,
        and their gradients are summed; the last one runs the overlapped
        backward with that sum added into each bucket before it is
        launched, so the one reduction overlaps the last backward pass. The
        last one is known from ``len(micro_batches)`` (a list, a sized
        iterable) or from ``count``, never by reading ahead; without either,
        every micro-batch runs locally and the sum is reduced after the last
        (the same reduction, not overlapped). The result equals DDP's with
        ``no_sync()`` around all micro-batches but the last: gradients
        summed over the micro-batches, then averaged over the ranks
        (``op="mean"``), bit for bit on two ranks. With a ``weight``, it is
        the weighted mean over every micro-batch of every rank instead,
        ``sum w * grad / sum w``. No micro-batch at all: ``skip``.

        Args:
            tree: the differentiated argument (``args[argnums]``), the same for
                every micro-batch.
            micro_batches: an iterable of tuples, each a micro-batch's other
                positional arguments in order (``(x, y)`` for ``fn(params, x, y)``).
            count: how many micro-batches the iterable yields, where it has no
                ``len()``; at most that many are drawn.

        Returns:
            ``(grads, values)``: the reduced gradients and the list of the
            micro-batches' values (``(value, aux)`` each, with ``has_aux``).

        Raises:
            TypeError: a micro-batch that is not a tuple; ``count`` not an int.
            ValueError: the iterable yields fewer micro-batches than ``count``
                (on every rank); ``count`` negative.
        """
        known = _count(micro_batches, count)
        world = world_size(self.group, _CALLER)
        if self.grains is not None:
            return self._accumulated_grains(tree, micro_batches, known, world)
        if world <= 1:
            return self._accumulated_here(tree, micro_batches, known)
        with Announced(self.group, world, _CALLER):  # decided by the tree and the first batch
            drawn, ruled = self._first(tree, _draw(micro_batches, known))
        if ruled:  # transformed, or a graph to keep: the local sum, through the rules
            with Announced(self.group, world, _CALLER):
                total, got, weight = self._summed(tree, drawn, known)
            if total is None:  # no micro-batch on this rank: zeros, weight 0
                total = optree.tree_map(_zeros_of, tree, namespace=NAMESPACE)
            return collect(total, self._spec(world), weight=weight, presummed=True), got
        acc = _Sum()
        values: list[Any] = []
        with Announced(self.group, world, _CALLER) as scope:
            plan, leaves, key = self._plan(tree, world)
            with plan.lock or contextlib.nullcontext():
                request = self._request(plan, world)
                call = scope.call = Call(request)
                call.begin(self._checksums(tree))
                for i, batch in enumerate(drawn):
                    args = _micro_args(self.argnums, tree, batch)
                    if i and _ruled(args, {}):
                        raise ValueError(
                            f"{_CALLER}: accumulate's micro-batch {i} carries an autograd graph "
                            "(or runs under a torch.func transform) where the first did not; pass "
                            "micro-batches alike (a graph to keep is decided by the first)"
                        )
                    if i == (known or 0) - 1:  # the last: its reduction overlaps its backward
                        return self._last(call, key, args, leaves, acc, values, world)
                    grads, value = self.local(*args)
                    acc.add(grads, self._weigh(args, {}))
                    values.append(value)
                _check_count(len(values), known)
                if not values:  # no micro-batch on this rank: as skip
                    none = 0.0 if self.weight is not None else None
                    send = Send(sending=False, weight=none)
                    results = run(call, plan, plan.tensors(leaves), send, begun=True)
                else:  # the last one is known only now: the sum, reduced after it
                    assert acc.leaves is not None
                    send = send_of(request)
                    if self.weight is not None:  # weighted already
                        send = Send(weight=acc.weight)
                    results = run(call, plan, acc.leaves, send, begun=True)
                return plan.rebuild(leaves, results), values

    # --- one step ----------------------------------------------------------------------------

    def _step(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        world: int,
        acc: _Sum | None,
        group: Any,
        traced: bool,
    ) -> tuple[Any, Any]:
        """One step's gradients on ``group`` (``self.group``, resolved: ``resolve``); ``traced``:
        whether Dynamo traces it."""
        attempt = Attempt()
        with Announced(group, world, _CALLER) as scope:
            n = _position(self.argnums, args)
            if n is None:
                self.local(*args, **kwargs)  # raises its own error (out of range)
            tree = args[n]  # type: ignore[index]
            plan, leaves, key = self._plan(tree, world, group, traced)
            with plan.lock or contextlib.nullcontext():
                request = self._request(plan, world, group)
                call = scope.call = Call(request)
                call.begin(self._checksums(tree, traced))
                # the user's code: after the call has its layout
                w = None if self.weight is None else self._weigh(args, kwargs)
                send = send_of(request, weight=w)
                try:
                    results, value = self._backward(call, send, args, kwargs, n, leaves, attempt)  # type: ignore[arg-type]
                    return plan.rebuild(leaves, results), value
                except Redo:
                    pass
        return self._redo(key, args, kwargs, world, attempt, acc, w)

    def _last(
        self,
        call: Call,
        key: int,
        args: tuple[Any, ...],
        leaves: list[Any],
        acc: _Sum,
        values: list[Any],
        world: int,
    ) -> tuple[Any, list[Any]]:
        """An accumulated step's last micro-batch: its backward with the sum so far added in."""
        w = self._weigh(args, {})
        send = send_of(call.request, weight=w)
        if acc.leaves is not None:
            send = replaced(send, acc=acc.leaves, alpha=1.0 if w is None else w)
        if w is not None:  # the sum is weighted already; the last one is weighted as it is added
            send = replaced(
                send, scale=None if acc.leaves is not None else w, weight=acc.weight + w
            )
        attempt = Attempt()
        n = self.argnums % len(args)
        try:
            results, value = self._backward(call, send, args, {}, n, leaves, attempt)
        except Redo:
            grads, value = self._redo(key, args, {}, world, attempt, acc, w)
            values.append(value)
            return grads, values
        values.append(value)
        return call.request.plan.rebuild(leaves, results), values

    def _backward(
        self,
        call: Call,
        send: Send,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        n: int,
        leaves: list[Any],
        attempt: Attempt,
    ) -> tuple[list[torch.Tensor], Any]:
        """The step's gradients into ``call``'s buckets: from the backward pass where it can."""
        plan = call.request.plan
        if call.transport.eager and _overlaps(plan):
            what = Differentiated(self.run, self.has_aux, _CALLER)
            return overlapped(what, call, send, args, kwargs, n, leaves, attempt)
        grads, value = self.local(*args, **kwargs)
        flat = _leaves_of(grads)
        attempt.keep(flat, value)
        expected = plan.layout.sigs
        if any(
            (g.layout == torch.sparse_coo) != (s[3] == torch.sparse_coo)
            for g, s in zip(flat, expected)
        ):
            call.retry()  # gradients sparse where the layout planned them dense: reduce as a tree
        parts = plan.all_parts(flat)
        call.launch_rest(parts, send, [flat[k] for k in plan.layout.sparse])
        return call.finish(), value

    def _redo(
        self,
        key: int,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        world: int,
        attempt: Attempt,
        acc: _Sum | None,
        w: float | None,
    ) -> tuple[Any, Any]:
        """A rank asked every rank to retry: this rank's local gradients, reduced as a tree."""
        if attempt.grads is None:
            if attempt.rewind is not None:
                attempt.rewind.restore()  # the same random numbers as the first try
            with Announced(self.group, world, _CALLER):
                grads, value = self.local(*args, **kwargs)
        else:
            grads = _tree_like(args[self.argnums % len(args)], attempt.grads)
            value = attempt.value
        weight = w
        summed = acc is not None and acc.leaves is not None
        if summed:
            acc.add(grads, w)  # type: ignore[union-attr]
            grads, weight = acc.tree(), (acc.weight if w is not None else None)  # type: ignore[union-attr]
        reduced = collect(grads, self._spec(world), weight=weight, presummed=summed)
        flat = _leaves_of(grads)
        sparse = {k: g.sparse_dim() for k, g in enumerate(flat) if g.layout != torch.strided}
        if sparse:  # later calls of this layout reduce after the backward pass, on every rank
            sparse_gradients(self.group)[key] = sparse
        return reduced, value

    # --- what every way of calling shares ---------------------------------------------------

    def _accumulated_grains(
        self, tree: Any, micro_batches: Iterable[Any], known: int | None, world: int
    ) -> tuple[Any, list[Any]]:
        """``accumulate`` in the reproducible mode: every micro-batch drawn first, their grains
        one block of the step's (as one call on the micro-batches' rows concatenated)."""
        batches: list[Any] = []
        failed: BaseException | None = None
        try:  # a rank whose micro-batches fail tells its peers in the call, not by a timeout
            batches = [
                (_micro_args(self.argnums, tree, b), {}) for b in _draw(micro_batches, known)
            ]
            _check_count(len(batches), known)
            if not batches:
                raise ValueError(
                    f"{_CALLER}: accumulate with grain= needs at least one micro-batch (a rank "
                    "without a batch has no grains, and every rank must hold as many)"
                )
        except Exception as err:
            failed = err
        grads, _, values = self._grained(
            batches[0][0] if batches else (tree,), batches, world, failed
        )
        return grads, values

    def _grained(
        self,
        args: tuple[Any, ...],
        batches: list[Any],
        world: int,
        failed: BaseException | None = None,
    ) -> tuple[Any, Any, list[Any]]:
        """The reproducible mode (``_reproducible.Grains``) on these batches' grains (``failed``:
        this rank's error before them, announced in the call)."""
        n = _position(self.argnums, args)
        return self.grains(  # type: ignore[misc]
            self.local, batches, group=self.group, world=world, weight=self.weight,
            checksums=None if n is None else self._checksums(args[n]), failed=failed,
        )  # fmt: skip

    def _refuse_grains(self, method: str) -> None:
        if self.grains is not None:
            raise NotImplementedError(
                f"{_CALLER}: grain= (reproducible across world sizes) has no {method}() yet: "
                "give every rank a batch of the same number of grains and call the step"
            )

    def _first(self, tree: Any, batches: Iterable[Any]) -> tuple[Iterable[Any], bool]:
        """The micro-batches again, and whether the rules reduce them: the tree or the first
        micro-batch carries a graph, or a transform is active (drawn now, as a loop would)."""
        batches = iter(batches)
        first = next(batches, _END)
        if first is _END:
            return (), _ruled((tree,), {})
        args = _micro_args(self.argnums, tree, first)
        return itertools.chain((first,), batches), _ruled(args, {})

    def _agreed(self, args: tuple[Any, ...], world: int) -> Call | None:
        """Eagerly, outside transforms: the call the rules will make on the gradients, agreed
        before ``fn`` runs, so that a failure in ``fn`` is sent in that call's own buckets (its
        layout is the differentiated tree's: the gradients have its leaves' signatures)."""
        n = _position(self.argnums, args)
        if n is None or is_compiling() or transform_level() is not None or debugging():
            return None  # (in the debug mode every rank probes first: a failure meets that)
        tree = args[n]
        plan, _ = plan_of(tree, self.options, self.group, world, _CALLER, check=self.check)
        call = Call(self._request(plan, world))
        call.begin(self._checksums(tree))
        return call

    def _request(self, plan: Plan, world: int, group: Any = None) -> Request:
        """The call of ``plan`` on ``group`` (the step's own where ``None``)."""
        return Request(plan, self.group if group is None else group, world, _CALLER, self.check)

    def _spec(self, world: int) -> Spec:
        """The step's collective, for a tree the rules or a retry reduce (paths filled in)."""
        return Spec(self.options, self.group, world, _CALLER, self.check, ())

    def _summed(
        self, tree: Any, micro_batches: Iterable[Any], known: int | None
    ) -> tuple[Any, list[Any], float | None]:
        """The micro-batches' gradients summed here (weighted), their values, the weights' sum."""
        acc = _Sum()
        values: list[Any] = []
        for batch in _draw(micro_batches, known):
            args = _micro_args(self.argnums, tree, batch)
            grads, value = self.local(*args)
            acc.add(grads, self._weigh(args, {}))
            values.append(value)
        _check_count(len(values), known)
        weight = acc.weight if self.weight is not None else None
        return (None if acc.leaves is None else acc.tree()), values, weight

    def _weigh(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """This rank's weight for these arguments (``None`` unweighted); a number, eagerly."""
        if self.weight is None:
            return None
        w = self.weight(*args, **kwargs)
        if is_compiling() and isinstance(w, torch.Tensor):
            return w  # read back it cannot be while tracing: used as a tensor
        return weight_value(_CALLER, w, "weight(*args)")

    def _plan(
        self, tree: Any, world: int, group: Any = None, traced: bool | None = None
    ) -> tuple[Plan, list[Any], int]:
        """The gradient layout of ``tree``, its leaves, and the key the group learns sparsity by.

        The gradients of a tree come one per position (untied, as torch.func
        gives them), sparse where the group (``group``, resolved, or the
        step's own) learnt so (keyed by the dense layout's fingerprint). ``traced``: whether
        Dynamo traces, where the caller asked already.
        """
        if traced is None:
            traced = is_compiling()
        plan, leaves = plan_of(
            tree, self.options, self.group, world, _CALLER, check=self.check, traced=traced
        )
        if not plan.bare:
            plan, leaves = self._stand_in(plan, leaves, {}, world)
        key = plan.layout.fingerprint
        on = self.group if group is None else group
        known = {} if traced else sparse_gradients(on).get(key, {})
        if known:
            plan, leaves = self._stand_in(plan, leaves, known, world)
        return plan, leaves, key

    def _stand_in(
        self, plan: Plan, leaves: list[Any], sparse: dict[int, int], world: int
    ) -> tuple[Plan, list[Any]]:
        like = _gradient_like(leaves, sparse)
        tree = (
            dict(zip(plan.keys, like))
            if plan.keys is not None
            else optree.tree_unflatten(plan.spec, like)
        )
        return plan_of(tree, self.options, self.group, world, _CALLER, check=self.check)

    def _checksums(self, tree: Any, traced: bool | None = None) -> Callable[[], list[int]] | None:
        """A checksum of each differentiated tensor, for the layout's first call (``_agree``)."""
        if not self.check or (is_compiling() if traced is None else traced):
            return None
        return lambda: [_checksum(t) for t in _leaves_of(tree) if isinstance(t, torch.Tensor)]

    def _accumulated_here(
        self, tree: Any, micro_batches: Iterable[Any], known: int | None
    ) -> tuple[Any, list[Any]]:
        """``accumulate`` without other ranks: the sum (the weighted mean) of the micro-batches."""
        total, values, weight = self._summed(tree, micro_batches, known)
        if total is None:
            return optree.tree_map(_zeros, tree, namespace=NAMESPACE), values
        if weight is not None:
            total = optree.tree_map(lambda t: t / weight if weight else torch.zeros_like(t), total)
        return total, values


class _Sum:
    """Gradients summed over micro-batches (``w * grad`` each, when weighted), and the weights'.

    The first micro-batch's gradients are kept as they come; later ones are
    added in fused passes, into tensors of our own only: in DDP's order
    (``g0 + g1 + ...``), so that the sum is DDP's bit for bit.
    """

    __slots__ = ("leaves", "owned", "spec", "weight")

    def __init__(self) -> None:
        self.leaves: list[torch.Tensor] | None = None
        self.spec: Any = None
        self.owned = False
        self.weight = 0.0

    def add(self, grads: TensorTree, weight: float | None) -> None:
        leaves, spec = flatten_in_order(grads)
        alpha = 1.0 if weight is None else weight
        self.weight += alpha
        # foreach kernels have no batching rule, and an in-place sum would rewrite a graph
        plain = transform_level() is None and not any(t.requires_grad for t in leaves)
        dense = plain and all(t.layout == torch.strided for t in leaves)
        if self.leaves is None:
            self.spec = spec
            if alpha == 1:
                self.leaves = leaves
            else:
                self.leaves = foreach_mul(leaves, alpha) if dense else [t * alpha for t in leaves]
                self.owned = True
            return
        if self.owned and dense:
            foreach_add_(self.leaves, leaves, alpha=alpha)
        elif dense and all(t.layout == torch.strided for t in self.leaves):
            self.leaves = foreach_add(self.leaves, leaves, alpha=alpha)
        else:  # sparse gradients, a transform, a graph: one by one, out of place
            self.leaves = [a.add(b, alpha=alpha) for a, b in zip(self.leaves, leaves)]
        self.owned = True

    def tree(self) -> TensorTree:
        assert self.leaves is not None
        return optree.tree_unflatten(self.spec, self.leaves)


def _zeros(x: Any) -> Any:
    return torch.zeros_like(x) if isinstance(x, torch.Tensor) else x


def _zeros_of(x: Any) -> Any:
    """Zeros that stay in ``x``'s graph (autograd's, a transform's): a skipping rank's rules
    then run the collectives its peers' do."""
    if not isinstance(x, torch.Tensor):
        return x
    off = torch.zeros((), dtype=torch.bool, device=x.device)
    return torch.where(off, x, torch.zeros((), dtype=x.dtype, device=x.device))


def _count(micro_batches: Any, count: Any) -> int | None:
    if count is not None:
        check_int(_CALLER, "count", count)
        if count < 0:
            raise ValueError(f"{_CALLER}: count must be >= 0, got {count}")
        return count  # type: ignore[no-any-return]
    return len(micro_batches) if isinstance(micro_batches, Sized) else None


def _draw(micro_batches: Iterable[Any], known: int | None) -> Iterable[Any]:
    """The micro-batches one at a time, at most ``known`` of them (never one more)."""
    if known is None:
        yield from micro_batches
        return
    if known == 0:
        return
    for i, batch in enumerate(micro_batches):
        yield batch
        if i == known - 1:
            return


def _position(argnums: int, args: tuple[Any, ...]) -> int | None:
    return argnums % len(args) if -len(args) <= argnums < len(args) else None


def _micro_args(argnums: int, tree: Any, batch: Any) -> tuple[Any, ...]:
    """A micro-batch's full positional arguments: ``tree`` put in at ``argnums``."""
    if not isinstance(batch, (tuple, list)):
        raise TypeError(
            f"{_CALLER}: accumulate's micro_batches must yield tuples of the arguments that "
            f"follow the differentiated one (e.g. (x, y)), got {type(batch).__name__}; wrap a "
            "single tensor as (x,)"
        )
    k = argnums if argnums >= 0 else len(batch) + 1 + argnums
    return (*batch[:k], tree, *batch[k:])


def _leaves_of(tree: Any) -> list[Any]:
    values = tensor_values(tree)
    return values if values is not None else flatten_in_order(tree)[0]


def _tree_like(tree: Any, flat: list[torch.Tensor]) -> Any:
    """The gradient tree (the differentiated tree's structure) of ``flat``."""
    values = tensor_values(tree)
    if values is not None:
        return dict(zip(tree, flat))
    return optree.tree_unflatten(flatten_in_order(tree)[1], flat)


def _gradient_like(leaves: list[Any], sparse: dict[int, int]) -> list[Any]:
    """Leaves of the layout as the gradients come: untied; empty sparse tensors where known."""
    out = []
    for k, t in enumerate(leaves):
        if not isinstance(t, torch.Tensor):
            out.append(t)
        elif k in sparse:  # as the gradient comes: its sparse dimensions, the rest dense
            dims = sparse[k]
            empty = torch.empty(dims, 0, dtype=torch.int64, device=t.device)
            values = torch.empty(0, *t.shape[dims:], dtype=t.dtype, device=t.device)
            out.append(torch.sparse_coo_tensor(empty, values, t.shape, is_coalesced=True))
        else:
            out.append(t.detach())  # a tensor object of its own: untied
    return out


def _ruled(args: tuple[Any, ...], kwargs: dict[str, Any], traced: bool | None = None) -> bool:
    """Whether a step on these arguments goes through the collectives' rules (``_rules``).

    ``needs_rules`` on every tensor of the arguments, without building their
    list where they need not be read (no transform, grad mode off), and at C
    speed for a plain dict of tensors.
    """
    if traced is None:
        traced = is_compiling()
    if traced or transform_level() is not None or not torch.is_grad_enabled():
        return needs_rules((), _CALLER, traced)
    if forward_ad_level():
        return True
    # grad mode on, no transform, not tracing: whether any tensor requires grad
    for tree in (*args, *kwargs.values()):
        if type(tree) is dict and not tree:  # (an empty dict of frozen parameters, often)
            continue
        values = tensor_values(tree)
        if values is None:
            values = [t for t in flatten_in_order(tree)[0] if isinstance(t, torch.Tensor)]
        if any_requires_grad(values):
            return True
    return False


def _overlaps(plan: Plan) -> bool:
    """Whether the step's buckets can start from its backward pass (see the module's text)."""
    layout = plan.layout
    return not (layout.sparse or not layout.buckets or torch.is_inference_mode_enabled())


def _checksum(t: torch.Tensor) -> int:
    """The tensor's bits summed as integers: the same on every rank for the same values.

    Integer sums do not depend on the order they are taken in (threads,
    devices), unlike float ones; two different initialisations differ.
    """
    x = t.detach()
    if x.is_complex():
        x = torch.view_as_real(x)
    x = x.contiguous().view(-1)
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()]
    return int(x.view(ints).to(torch.int64).sum())


def grad_and_value(
    fn: Callable[..., Any],
    *,
    op: Op = "mean",
    group: Any = None,
    bucket_cap_mb: float = 25.0,
    has_aux: bool = False,
    argnums: int = 0,
    compress: Compress = None,
    check: bool = True,
    weight: Callable[..., Any] | None = None,
    shard: bool = False,
    mp_policy: MixedPrecisionPolicy | None = None,
    grain: int | None = None,
    seed: int = 0,
) -> Step:
    """``fr.grad_and_value`` whose gradients come back all-reduced over ``group``, as DDP's.

    ``g(*args) -> (grads, value)``: ``grads`` equals
    ``fr.distributed.all_reduce(fr.grad_and_value(fn)(*args)[0], op=op, ...)``,
    ``value`` (with ``has_aux``, ``(value, aux)``) is this rank's. Buckets are
    cut in the reverse order of the leaves of ``args[argnums]`` (the order
    their gradients become ready), and each bucket's collective starts from a
    hook on this call's own fresh leaves as soon as its last gradient is
    computed, while the backward pass goes on (DDP's overlap); the remaining
    buckets start when it ends, always in the same order on every rank.
    No module is touched and no hook outlives the call. When an input
    already carries an autograd graph, or under ``torch.compile``, the local
    gradients come first and the same buckets after (compiled, Inductor
    schedules each bucket's collective as soon as its gradients exist).
    Activation checkpoints work in either mode, decided on each call's own
    graph; a ``use_reentrant=True`` one takes a full backward pass (no
    overlap then), as DDP's ``loss.backward()`` does.

    ``shard=True`` gives ZeRO-2's gradients: this rank's rows of the reduced
    gradients (``fr.distributed.reduce_scatter`` of the local ones, launched
    during the backward pass as buckets fill), for an optimizer that updates
    this rank's shard of the parameters (``fr.distributed.shard``), then
    ``fr.distributed.all_gather``.

    Every rank checks, on the first call of a layout, that the differentiated
    parameters are equal across ranks (a checksum folded into the layout's
    first check): forgetting ``fr.distributed.broadcast`` at the start is a
    ``ValueError`` naming the first leaf that differs (``check=False`` turns
    it off with the layout check). Any exception raised in ``fn`` on one
    rank, ``KeyboardInterrupt`` included, is announced to its peers before it
    propagates: every other rank raises a ``RuntimeError`` naming that rank,
    in the same step, and the group stays usable for the next one.

    ``weight``, a function of the step's arguments (``lambda params, x, y:
    x.shape[0]``), makes ``op="mean"`` a weighted mean,
    ``sum_r w_r * grads_r / sum_r w_r``: the weights travel in the gradients'
    own first bucket, at no collective more. With per-rank mean losses and
    each rank's number of examples as its weight, that is the exact gradient
    of the mean loss over all the examples of the step, however unevenly the
    ranks' batches are sized (DDP has no such option: it averages over ranks).

    ``grain=G`` makes the gradients the same bits on any world size that is
    a power of two (1, 2, 4, ...), for the same global batch, ``G`` and
    threads per process: every tensor of the arguments other than
    ``args[argnums]`` is cut along its first dimension into grains of ``G``
    samples, each grain's gradient is computed alone (its random numbers,
    dropout's, drawn from a generator seeded by ``seed``, the call's number
    and the grain's global position, never by the rank; the caller's
    generators are left as they were), and the grains' gradients are summed
    as one balanced binary tree over their global positions, pairwise within
    a rank, by recursive halving and doubling with fixed partners across
    ranks (each rank sends what a ring all-reduce sends); ``op="mean"``
    divides once, by the number of grains. That tree is the one a single
    process builds when each rank holds a power of two of grains, and the
    step refuses anything else (``ValueError``). ``fn`` is then a mean (or,
    with ``op="sum"``, a sum) over its grain's samples; BatchNorm normalises
    each grain alone. ``value`` is this rank's mean of its grains' values;
    with ``has_aux``, ``(value, [aux of each grain])``. ``g.grains.step``
    counts the calls (set it when resuming a job at a step). With ``shard``
    (ZeRO-2), each rank gets its rows of that sum by recursive halving alone
    (a ring reduce-scatter's bytes): ``fr.distributed.shard`` of the
    all-reduced gradients, bit for bit. With ``weight``, each grain's
    gradient is multiplied by ``weight(*grain_args)`` and the mean divides
    by the weights' sum, summed in the same tree. ``g.accumulate(tree,
    micro_batches)`` draws every micro-batch first and takes their grains
    as one block: the result is the call's on the micro-batches' rows
    concatenated. A ``fn`` that runs the model through ``apply_sharded`` on
    this rank's shards (ZeRO-3) gets its rows: each unit's transpose sums
    the ranks' rows grain by grain in a fixed tree (the grains in
    bit-reversed order; the mode's own bits, the same on every world size).
    Not (yet) with ``compress``, ``mp_policy``, ``skip``,
    ``torch.compile``, ``torch.func`` transforms or graph-carrying inputs:
    ``NotImplementedError`` naming them.

    ``g.skip(*args)``: a rank without a batch (its data ran out, see
    ``fr.distributed.join``) still takes part, with zeros and weight 0, and
    gets the same gradients as its peers. ``g.accumulate(tree,
    micro_batches)``: gradient accumulation with one reduction, overlapped
    with the last micro-batch's backward pass (DDP's ``no_sync``), drawing
    the micro-batches in the order a ``no_sync`` loop draws them.

    Args:
        fn: ``fn(*args) -> loss`` (a scalar tensor), or ``(loss, aux)`` with
            ``has_aux``.
        op: ``"mean"`` (DDP's) or ``"sum"``.
        group: the process group (default: the default group).
        bucket_cap_mb: the most megabytes a bucket holds.
        has_aux: whether ``fn`` returns ``(loss, aux)``.
        argnums: which positional argument is differentiated (a tree of tensors).
        compress: ``"bf16"`` or ``"fp16"`` to send floating-point buckets in
            that dtype.
        check: ``False`` skips the probe of a layout's first use (layouts,
            and the parameters' values), and with it the promise that ranks
            whose layouts differ raise before data moves (the words a warm
            call carries are checked all the same; pass it alike on every
            rank).
        weight: ``weight(*args)`` -> this rank's weight (a number >= 0, or a
            one-element tensor, read back to the host), for a weighted mean
            (``op="mean"`` only); give one on every rank or on none.
        shard: ``True`` for this rank's shards of the gradients (ZeRO-2).
        mp_policy: FSDP2's ``torch.distributed.fsdp.MixedPrecisionPolicy``
            for the step: the differentiated tree cast to ``param_dtype``
            inside the step (so ``fn`` computes in it and each gradient
            comes back in its leaf's own dtype), and the gradients reduced
            in ``reduce_dtype`` (default ``param_dtype``; float32, bfloat16
            or float16). The other arguments are left as they are (a step
            cannot tell a module's inputs from a loss's targets, so
            ``cast_forward_inputs`` is for ``fn`` to do: ``fr.apply(model,
            fr.State(p, {}), x.to(torch.bfloat16))``). With ``shard=True``
            that is FSDP2's mixed precision for a ZeRO-2 step. No
            ``output_dtype`` (a step has no module) and no ``compress`` that
            says another dtype.
        grain: samples per grain, for gradients reproducible across world
            sizes (above); ``None``, the default, for DDP's reduction.
        seed: with ``grain``, the seed of the grains' random numbers (an int,
            the same on every rank).

    Returns:
        A ``Step``: ``g(*args) -> (grads, value)``, with the methods
        ``g.skip(*args) -> (grads, None)`` and ``g.accumulate(tree,
        micro_batches, *, count=None) -> (grads, values)``. Without a process
        group or with one rank, ``g`` returns the local gradients (``weight``
        is not called).

    Raises:
        TypeError: ``fn`` or ``weight`` is not callable; ``argnums`` is not
            an int; bad options; ``weight(*args)`` is not a number (when
            ``g`` runs, on every rank).
        NotImplementedError: ``grain`` with an option or a call it does not
            take yet (named).
        ValueError: bad options (at once); a ``weight`` with ``op="sum"``;
            trees that differ across ranks, or parameters that differ on a
            layout's first call (on every rank, when ``g`` runs).
        RuntimeError: ``g`` is compiled inside a ``torch.func`` transform
            (eagerly it composes with them: docs/composing.md); another
            rank's ``fn`` raised (naming it).

    Examples:
        >>> w = {"a": torch.tensor(2.0)}
        >>> g = fr.distributed.grad_and_value(lambda w, x: w["a"] * x)
        >>> g(w, torch.tensor(3.0))  # no process group here: the local gradient
        ({'a': tensor(3.)}, tensor(6.))
        >>> g.skip(w)  # no batch on this rank: nothing to add
        ({'a': tensor(0.)}, None)
        >>> g.accumulate(w, [(torch.tensor(3.0),), (torch.tensor(4.0),)])  # summed
        ({'a': tensor(7.)}, [tensor(6.), tensor(8.)])
        >>> r = fr.distributed.grad_and_value(lambda w, x: (w["a"] * x).mean(), grain=2)
        >>> r(w, torch.tensor([1.0, 2.0, 3.0, 4.0]))  # 2 grains: ((1.5) + (3.5)) / 2
        ({'a': tensor(2.5000)}, tensor(5.))
        >>> r(w, torch.ones(6))
        Traceback (most recent call last):
        ...
        ValueError: fr.distributed.grad_and_value: grain=2 cuts this rank's batch into 3 grains; ...
    """
    return Step(
        fn,
        op=op,
        group=group,
        bucket_cap_mb=bucket_cap_mb,
        has_aux=has_aux,
        argnums=argnums,
        compress=compress,
        check=check,
        weight=weight,
        shard=shard,
        mp_policy=mp_policy,
        grain=grain,
        seed=seed,
    )


def _check_count(drawn: int, known: int | None) -> None:
    """``ValueError`` where ``accumulate``'s micro-batches fell short of ``count``."""
    if known is not None and drawn < known:
        raise ValueError(
            f"{_CALLER}: accumulate's micro_batches yielded {drawn} micro-batch(es), count={known}"
        )
