"""The overlapped backward: fr.grad_and_value whose buckets reduce while backward runs.

Its step also ``skip``s (a rank without a batch joins its peers' reduction
with nothing of its own) and ``accumulate``s (micro-batches' gradients
summed locally, the sum added into the last one's buckets, one reduction).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import optree
import torch

from .._grad import detached, differentiate, gradients, reentrant, split_output
from .._leaves import PLAIN, STACK_NUMEL, Leaves
from .._torch import is_compiling
from .._tree import flatten_in_order
from .._typing import Compress, Op, TensorTree
from . import compiled
from .agree import OwnFailure, agree, announce_failure, mismatch, sparse_gradients
from .collectives import check_reduce_args, check_weighted, reduce_tree, run, weight_value
from .group import check_not_transformed, comm_errors, world_size
from .pipeline import Reduction
from .plan import Bucket, Plan, plan_for, rebuild_tree

__all__ = ["Step", "grad_and_value"]

_REQUIRES_GRAD = operator.attrgetter("requires_grad")
_SPARSE = object()  # ``_overlapped``'s answer when the gradients came out sparse
_END = object()  # an iterator's end
_STRIDED = operator.attrgetter("layout")
Weigh = Callable[[tuple[Any, ...], dict[str, Any]], float]


class Step:
    """What ``fr.distributed.grad_and_value`` returns: call it for a step, or ``skip``, ``accumulate``.

    ``step(*args)``: this rank's gradients, reduced over the group, and its value.
    ``step.skip(*args)``: this rank has no batch; it joins the reduction its
    peers run with nothing of its own. ``step.accumulate(tree, micro_batches)``:
    the gradients of several micro-batches, summed, reduced once.
    """

    __slots__ = ("__dict__", "_accumulate", "_call", "_skip")
    __name__: str

    def __init__(
        self,
        call: Callable[..., tuple[Any, Any]],
        skip: Callable[..., tuple[Any, None]],
        accumulate: Callable[[Any, Iterable[Any]], tuple[Any, list[Any]]],
    ) -> None:
        self._call = call
        self._skip = skip
        self._accumulate = accumulate

    def __call__(self, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        return self._call(*args, **kwargs)

    def skip(self, *args: Any) -> tuple[Any, None]:
        """This rank has no batch this step: ``(grads, None)``, its peers' reduced gradients.

        Collective: it runs the same reduction as its peers' ``step(...)``
        (the layout check knows them for one call), sending zeros and, in a
        weighted mean, weight 0. With ``weight=None`` and ``op="mean"`` the
        gradients are the others' sum divided by the world size, as DDP
        under ``Join`` (``divide_by_initial_world_size=True``); with a
        ``weight``, the weighted mean over the ranks that had a batch.
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
        return self._skip(*args)

    def accumulate(self, tree: Any, micro_batches: Iterable[Any]) -> tuple[Any, list[Any]]:
        """The gradients of several micro-batches, reduced once: DDP's ``no_sync``.

        Every micro-batch but the last runs ``fr.grad_and_value`` locally, no
        communication, and their gradients are summed; the last one runs the
        overlapped backward with that sum added into each bucket before it is
        launched, so the one reduction overlaps the last backward pass. The
        result equals DDP's with ``no_sync()`` around all micro-batches but
        the last: gradients summed over the micro-batches, then averaged over
        the ranks (``op="mean"``). With a ``weight``, it is the weighted mean
        over every micro-batch of every rank instead,
        ``sum w * grad / sum w`` (with per-micro-batch mean losses and
        ``weight`` their sizes, the exact gradient of the mean over all the
        step's examples). No micro-batch at all: ``skip``.

        Args:
            tree: the differentiated argument (``args[argnums]``), the same for
                every micro-batch.
            micro_batches: an iterable of tuples, each a micro-batch's other
                positional arguments in order (``(x, y)`` for ``fn(params, x, y)``).

        Returns:
            ``(grads, values)``: the reduced gradients and the list of the
            micro-batches' values (``(value, aux)`` each, with ``has_aux``).

        Raises:
            TypeError: a micro-batch that is not a tuple.
        """
        return self._accumulate(tree, micro_batches)


class _Sum:
    """Gradients summed over micro-batches (``w * grad`` each, when weighted), and the weights'.

    The first micro-batch's gradients are kept as they come; later ones are
    added in fused passes, into tensors of our own only.
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
        dense = all(t.layout == torch.strided for t in leaves)
        if self.leaves is None:
            self.spec = spec
            if alpha == 1:
                self.leaves = leaves
            else:
                self.leaves = (
                    list(torch._foreach_mul(leaves, alpha))
                    if dense
                    else [t * alpha for t in leaves]
                )
                self.owned = True
            return
        if self.owned and dense:
            torch._foreach_add_(self.leaves, leaves, alpha=alpha)
        elif dense and all(t.layout == torch.strided for t in self.leaves):
            self.leaves = list(torch._foreach_add(self.leaves, leaves, alpha=alpha))
        else:  # sparse gradients: one by one, out of place
            self.leaves = [a.add(b, alpha=alpha) for a, b in zip(self.leaves, leaves)]
        self.owned = True

    def tree(self) -> TensorTree:
        assert self.leaves is not None
        return optree.tree_unflatten(self.spec, self.leaves)


class _DiffLayout:
    """How ``grad_and_value`` differentiates a plan's tensors, bucket by bucket.

    Its ``Leaves`` (``_leaves``) come in bucket order; with ``stack``, each
    run of small equal-shaped tensors of a bucket is one stacked leaf, whose
    gradient is that run of the bucket as it stands (one copy to pack, one
    hook to watch). ``spans[b]``: bucket ``b``'s leaves; ``segments[b]``:
    per run, 0 where it is one stacked leaf, else its number of tensors.
    ``proven``: whether a backward pass has gone through its stacks (a stack
    cannot take a sparse gradient, and nothing tells before the backward).
    """

    __slots__ = ("leaves", "proven", "segments", "spans")

    def __init__(self, buckets: Sequence[Bucket], stack: bool) -> None:
        groups: list[list[int]] = []
        self.spans: list[range] = []
        self.segments: list[list[int]] = []
        for bucket in buckets:
            first, segments, start = len(groups), [], 0
            for shape, count in bucket.results.runs:
                ids = bucket.members[start : start + count]
                start += count
                if stack and count > 1 and shape.numel() <= STACK_NUMEL:
                    groups.append(ids)
                    segments.append(0)
                else:
                    groups += ([k] for k in ids)
                    segments.append(count)
            self.spans.append(range(first, len(groups)))
            self.segments.append(segments)
        self.leaves = Leaves(groups)
        self.proven = not any(0 in segments for segments in self.segments)

    def parts(self, b: int, grads: Sequence[torch.Tensor]) -> list[Any]:
        """``FlatPool.pack``'s parts of bucket ``b`` from its leaves' gradients, in span order."""
        parts: list[Any] = []
        i = 0
        for n in self.segments[b]:
            if n == 0:
                parts.append(grads[i])
                i += 1
            else:
                parts.append(grads[i : i + n])
                i += n
        return parts


def _diff_layout(plan: Plan, stack: bool) -> _DiffLayout:
    layout = plan.diff.get(stack)
    if layout is None:
        layout = plan.diff[stack] = _DiffLayout(plan.buckets, stack)
    return layout


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
) -> Step:
    """``fr.grad_and_value`` whose gradients come back all-reduced over ``group``, as DDP's.

    ``g(*args) -> (grads, value)``: ``grads`` equals
    ``fr.distributed.all_reduce(fr.grad_and_value(fn)(*args)[0], op=op, ...)``,
    ``value`` (with ``has_aux``, ``(value, aux)``) is this rank's. Buckets are
    cut in the reverse order of the leaves of ``args[argnums]`` (the order
    their gradients become ready), and each bucket's all-reduce starts from a
    hook on this call's own fresh leaves as soon as its last gradient is
    computed, while the backward pass goes on (DDP's overlap); the remaining
    buckets start when it ends, always in the same order on every rank.
    No module is touched and no hook outlives the call. When an input
    already carries an autograd graph, it computes ``fr.grad_and_value``
    then ``all_reduce``.

    ``weight``, a function of the step's arguments (``lambda params, x, y:
    x.shape[0]``), makes ``op="mean"`` a weighted mean,
    ``sum_r w_r * grads_r / sum_r w_r``: the weights travel in the gradients'
    own first bucket, at no collective more. With per-rank mean losses and
    each rank's number of examples as its weight, that is the exact gradient
    of the mean loss over all the examples of the step, however unevenly the
    ranks' batches are sized (DDP has no such option: it averages over ranks).

    ``g.skip(*args)``: a rank without a batch (its data ran out, see
    ``fr.distributed.join``) still takes part, with zeros and weight 0, and
    gets the same gradients as its peers. ``g.accumulate(tree,
    micro_batches)``: gradient accumulation with one reduction, overlapped
    with the last micro-batch's backward pass (DDP's ``no_sync``).

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
        check: ``False`` skips the cross-rank layout check, and with it the promise
            that ranks that part ways raise instead of hanging (pass it alike on
            every rank).
        weight: ``weight(*args)`` -> this rank's weight (a number >= 0, or a
            one-element tensor, read back to the host), for a weighted mean
            (``op="mean"`` only); give one on every rank or on none.

    Returns:
        ``g(*args) -> (grads, value)``, with the methods ``g.skip(*args) ->
        (grads, None)`` and ``g.accumulate(tree, micro_batches) -> (grads,
        values)`` (see ``Step``). Without a process group or with one rank,
        ``g`` returns the local gradients (``weight`` is not called).

    Raises:
        TypeError: ``fn`` or ``weight`` is not callable; ``argnums`` is not
            an int; bad options; ``weight(*args)`` is not a number (when
            ``g`` runs, on every rank).
        ValueError: bad options (at once); a ``weight`` with ``op="sum"``;
            trees that differ across ranks (on every rank, when ``g`` runs).
        RuntimeError: ``g`` runs under a ``torch.func`` transform, where
            collectives cannot run.

    Examples:
        >>> w = {"a": torch.tensor(2.0)}
        >>> g = fr.distributed.grad_and_value(lambda w, x: w["a"] * x)
        >>> g(w, torch.tensor(3.0))  # no process group here: the local gradient
        ({'a': tensor(3.)}, tensor(6.))
        >>> g.skip(w)  # no batch on this rank: nothing to add
        ({'a': tensor(0.)}, None)
        >>> g.accumulate(w, [(torch.tensor(3.0),), (torch.tensor(4.0),)])  # summed
        ({'a': tensor(7.)}, [tensor(6.), tensor(8.)])
    """
    caller = "fr.distributed.grad_and_value"
    if not callable(fn):
        raise TypeError(f"{caller}: fn must be callable, got {type(fn).__name__}")
    check_reduce_args(caller, op, bucket_cap_mb, compress)
    if isinstance(argnums, bool) or not isinstance(argnums, int):
        raise TypeError(f"{caller}: argnums must be an int, got {argnums!r}")
    if weight is not None:
        if not callable(weight):
            raise TypeError(
                f"{caller}: weight must be a function of the step's arguments (e.g. "
                f"lambda params, x, y: x.shape[0]) or None, got {type(weight).__name__}"
            )
        check_weighted(caller, op)
    local = differentiate(fn, argnums=argnums, has_aux=has_aux, caller=caller)
    weigh: Weigh | None = None
    if weight is not None:
        user_weight = weight

        def weigh(args: tuple[Any, ...], kwargs: dict[str, Any]) -> float:
            return weight_value(caller, user_weight(*args, **kwargs), "weight(*args)")

    def wrapper(*args: Any, **kwargs: Any) -> tuple[Any, Any]:
        if weight is None and is_compiling():  # made outside the compiled region, called in it
            return compiled.grad_and_value(
                local,
                args,
                kwargs,
                argnums,
                op=op,
                group=group,
                bucket_cap_mb=bucket_cap_mb,
                compress=compress,
                check=check,
            )
        world = world_size(group, caller)
        if world <= 1:
            return local(*args, **kwargs)
        check_not_transformed(caller)
        if not -len(args) <= argnums < len(args):
            return local(*args, **kwargs)  # let fr.grad_and_value raise its error
        return reduced(args, kwargs, world, None)

    def reduced(
        args: tuple[Any, ...], kwargs: dict[str, Any], world: int, acc: _Sum | None
    ) -> tuple[Any, Any]:
        """A step over ``world`` > 1 ranks; ``acc``: micro-batches' gradients to add in."""
        n = argnums % len(args)
        tree = args[n]
        plan, leaves = plan_for(tree, caller, op, bucket_cap_mb, compress, None, weight is not None)
        rest: list[Any] = optree.tree_leaves((args[:n], args[n + 1 :], kwargs))  # type: ignore[arg-type]
        if (
            not plan.bare  # non-tensor or tied leaves: let fr.grad_and_value deal with them
            or not plan.unique
            or plan.fingerprint in sparse_gradients(group)  # reduced after the backward pass
            or any(map(_REQUIRES_GRAD, leaves))
            or any(isinstance(t, torch.Tensor) and t.requires_grad for t in rest)
        ):
            # an outer autograd graph, which torch.func keeps: its gradient, then reduce
            try:
                grads, value = local(*args, **kwargs)
                w = None if weigh is None else weigh(args, kwargs)
            except Exception as err:
                # the peers are already in this call's reduction: meet them there, then raise
                announce(world, err)
                raise
            return reduce_local(grads, w, world, acc), value
        with plan.lock:
            with comm_errors(caller):
                # a rank off the expected layout mirrors it (and checks) before its forward pass
                fast = check and agree(plan, tree, group, world, caller)
            poisoned = (lambda: mismatch(plan, tree, group, caller)) if fast else None
            grads, value = _overlapped(
                fn,
                args,
                kwargs,
                n,
                has_aux,
                plan,
                leaves,
                op,
                group,
                world,
                poisoned,
                caller,
                weigh,
                acc,
            )
        if grads is _SPARSE:  # learnt just now: the local gradients, reduced as a tree
            local_grads, value, w, rng = value
            if local_grads is None:  # a stack refused a sparse gradient: again, locally
                try:
                    if rng is not None:
                        torch.set_rng_state(rng)  # the same random numbers as the first try
                    local_grads, value = local(*args, **kwargs)
                except Exception as err:
                    announce(world, err)
                    raise
            flat = flatten_in_order(local_grads)[0]
            sparse = {k: g.sparse_dim() for k, g in enumerate(flat) if g.layout != torch.strided}
            if sparse:  # later calls reduce after the backward pass (a reentrant one: overlapped)
                sparse_gradients(group)[plan.fingerprint] = sparse
            grads = reduce_local(local_grads, w, world, acc)
        return grads, value

    def reduce_local(grads: TensorTree, w: float | None, world: int, acc: _Sum | None) -> Any:
        """Reduce local gradients (plus ``acc``'s) as a tree, with their weight."""
        scale = None
        if acc is not None:
            acc.add(grads, w)
            grads, scale = acc.tree(), 1.0
            if w is not None:
                w = acc.weight
        return reduce_tree(
            grads, caller, op, group, world, bucket_cap_mb, compress, check, weight=w, scale=scale
        )

    def announce(world: int, err: BaseException) -> None:
        """This rank failed before its reduction: meet the peers' first collective, flagged."""
        with comm_errors(caller):
            try:
                announce_failure(group, world, caller, err)
            except OwnFailure:
                pass

    def skip(*args: Any) -> tuple[Any, None]:
        if not -len(args) <= argnums < len(args):
            raise TypeError(
                f"{caller}: skip(*args) needs the differentiated argument args[{argnums}] "
                f"(argnums={argnums}), got {len(args)} positional argument(s)"
            )
        if weight is None and is_compiling():  # the same buckets as the peers' compiled step
            return compiled.skip(
                args[argnums % len(args)],
                op=op,
                group=group,
                bucket_cap_mb=bucket_cap_mb,
                compress=compress,
                check=check,
            )
        return skipped(args[argnums % len(args)])

    def skipped(tree: Any) -> tuple[Any, None]:
        world = world_size(group, caller)
        if world <= 1:
            zeros = optree.tree_map(
                lambda t: torch.zeros_like(t) if isinstance(t, torch.Tensor) else t, tree
            )
            return zeros, None
        check_not_transformed(caller)
        like = _gradient_like(tree, group, (op, bucket_cap_mb, compress, weight is not None))
        plan, leaves = plan_for(like, caller, op, bucket_cap_mb, compress, None, weight is not None)
        if not plan.unique:  # nothing to reduce; the check still catches a rank that has tensors
            if check:
                with comm_errors(caller):
                    agree(plan, like, group, world, caller)
            return like, None
        w = None if weight is None else 0.0
        grads = run(plan, like, leaves, op, group, world, check, caller, send=False, weight=w)
        return grads, None

    def accumulate(tree: Any, micro_batches: Iterable[Any]) -> tuple[Any, list[Any]]:
        world = world_size(group, caller)
        if world > 1:
            check_not_transformed(caller)
        acc = _Sum()
        values: list[Any] = []
        args: tuple[Any, ...] = ()
        try:  # local work only: a failure here meets the peers' reduction, flagged
            batches = iter(micro_batches)
            current = next(batches, _END)
            while current is not _END:
                args = _micro_args(caller, argnums, tree, current)
                following = next(batches, _END)
                if following is _END and world > 1:
                    break  # the last micro-batch: in the reduction
                grads, value = local(*args)
                acc.add(grads, None if weigh is None else weigh(args, {}))
                values.append(value)
                current = following
        except Exception as err:
            if world > 1:
                announce(world, err)
            raise
        if not args:  # no micro-batch on this rank
            return skipped(tree)[0], values
        if world <= 1:
            total = acc.tree()
            if weigh is not None:
                total = optree.tree_map(
                    lambda t: t / acc.weight if acc.weight else torch.zeros_like(t), total
                )
            return total, values
        grads, value = reduced(args, {}, world, acc)
        values.append(value)
        return grads, values

    step = Step(wrapper, skip, accumulate)
    step.__doc__ = getattr(fn, "__doc__", None)
    step.__name__ = f"distributed.grad_and_value({getattr(fn, '__name__', 'fn')})"
    return step


def _micro_args(caller: str, argnums: int, tree: Any, batch: Any) -> tuple[Any, ...]:
    """A micro-batch's full positional arguments: ``tree`` put in at ``argnums``."""
    if not isinstance(batch, (tuple, list)):
        raise TypeError(
            f"{caller}: accumulate's micro_batches must yield tuples of the arguments that "
            f"follow the differentiated one (e.g. (x, y)), got {type(batch).__name__}; wrap a "
            "single tensor as (x,)"
        )
    k = argnums if argnums >= 0 else len(batch) + 1 + argnums
    return (*batch[:k], tree, *batch[k:])


def _gradient_like(tree: Any, group: Any, options: tuple[Any, ...]) -> Any:
    """A tree of ``tree``'s layout as the peers' gradients come (a ``skip``'s stand-in).

    Gradients are never tied (each position has its own); those the group
    knows to come out sparse are empty sparse tensors. Only their layout is
    read: a ``skip`` sends nothing of its own.
    """
    op, cap, compress, weighted = options
    plan, leaves = plan_for(
        tree, "fr.distributed.grad_and_value", op, cap, compress, None, weighted
    )
    sparse = sparse_gradients(group).get(plan.fingerprint, {})
    if plan.bare and not sparse:
        return tree  # the gradients' plan is this tree's own
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
    return optree.tree_unflatten(plan.spec, out)


def _overlapped(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    argnums: int,
    has_aux: bool,
    plan: Plan,
    leaves: list[Any],
    op: Op,
    group: Any,
    world: int,
    poisoned: Callable[[], None] | None,
    caller: str,
    weigh: Weigh | None = None,
    acc: _Sum | None = None,
) -> tuple[TensorTree, Any]:
    """The backward pass with each bucket's all-reduce launched from gradient hooks.

    On the fast path of the layout check (``poisoned`` given), the first
    bucket's flags are read just before the second bucket starts (from a
    later hook, or once the backward pass is over), so it rarely blocks.
    When ``fn`` (or its backward pass) raises, this rank still launches the
    buckets left, flagged *failed*, so that every rank learns it and raises
    (``Reduction.fail``); this rank then raises ``fn``'s own error. Sparse
    gradients (``nn.Embedding(sparse=True)``) cannot fill a bucket: their
    bucket and the later ones are held back, then sent empty (every rank does
    the same, on the same gradients), and ``(_SPARSE, (local gradients,
    value, weight, None))`` comes back, to be reduced as a tree; the group
    remembers the layout, whose later calls reduce after the backward pass on
    every rank. A sparse gradient that a stacked leaf's backward refuses, or
    a reentrant checkpoint met by ``.grad()``, drains the buckets alike, and
    ``(_SPARSE, (None, None, weight, the random state fn started from))``
    asks the caller to differentiate again, locally. A reentrant activation
    checkpoint known as such is differentiated by a full backward pass (the
    hooks fire there as well).
    ``weigh``: the call's weight, evaluated before ``fn``; ``acc``: earlier
    micro-batches' gradients, added into each bucket as it is packed. With
    sparse gradients, ``(_SPARSE, ...)`` as above.
    """
    layout = _diff_layout(plan, set(map(type, leaves)) <= PLAIN)  # plain tensors only: stacks
    made = layout.leaves.make(leaves)
    if made is None:  # a tensor to stack is not contiguous: one leaf a tensor
        layout = _diff_layout(plan, False)
        made = layout.leaves.make(leaves)
    assert made is not None
    diff, fresh = made
    new_args = list(args)
    new_args[argnums] = optree.tree_unflatten(plan.spec, fresh)
    red = Reduction(plan, op, group, world, poisoned, caller)
    if acc is not None:
        red.acc = acc.leaves
    nb = len(plan.buckets)
    ready: list[list[torch.Tensor | None]] = [[None] * len(span) for span in layout.spans]
    missing = [len(span) for span in layout.spans]
    handles = []
    ours: list[BaseException] = []  # an error of the collectives, raised in a hook
    sparse: list[int] = []  # the buckets of a sparse gradient

    def launch_ready() -> None:
        # Buckets start in plan order on every rank, whatever order their gradients come in.
        while red.launched < nb and missing[red.launched] == 0:
            b = red.launched
            red.launch(b, layout.parts(b, ready[b]))  # type: ignore[arg-type]

    def hook_for(b: int, j: int) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            if grad.layout != torch.strided:
                sparse.append(b)  # its bucket, and every later one, waits for the end
                return
            ready[b][j] = grad
            missing[b] -= 1
            if missing[b] == 0:
                try:
                    with comm_errors(caller):
                        launch_ready()
                except BaseException as err:
                    ours.append(err)
                    raise

        return hook

    # The last bucket can only start once the backward pass is over: no hooks there.
    for b, span in enumerate(layout.spans[:-1]):
        for j, d in enumerate(span):
            handles.append(diff[d].register_hook(hook_for(b, j)))
    weight = None
    rng = None if layout.proven else torch.get_rng_state()
    try:
        if weigh is not None:  # before any bucket is packed: it scales them
            weight = weigh(args, kwargs)
            red.scale = weight
            red.weight = weight if acc is None else acc.weight + weight
        with torch.enable_grad():
            value, aux = split_output(fn(*new_args, **kwargs), has_aux, caller)
            grads = gradients(value, diff, full=reentrant(fn, value, diff, caller))
        layout.proven = True
    except Exception as err:
        if ours:
            raise  # a mismatch or a peer's failure: every rank raises it
        if isinstance(err, RuntimeError) and (
            "use_reentrant=True" in str(err) or (not layout.proven and "sparse" in str(err).lower())
        ):
            # The engine refused, as on every rank: a stack a sparse gradient (nn.Embedding(
            # sparse=True) among dense tensors of its shape), or .grad() a reentrant checkpoint
            # (fr.grad_and_value learns it by fn's code: a closure's twin may fool it once).
            # Drain the buckets, then differentiate locally.
            with comm_errors(caller):
                red.drain()
            return _SPARSE, (None, None, weight, rng)  # type: ignore[return-value]
        with comm_errors(caller):
            try:
                red.fail(err)
            except OwnFailure:
                pass
        raise
    finally:
        for h in handles:
            h.remove()
    last = layout.spans[-1]
    if sparse or any(g.layout != torch.strided for g in grads[last.start : last.stop]):
        with comm_errors(caller):
            red.drain()
        local = optree.tree_unflatten(plan.spec, layout.leaves.split(grads))
        return _SPARSE, (local, detached(value, aux, has_aux), weight, None)  # type: ignore[return-value]
    with comm_errors(caller):
        # Buckets with an unused leaf (its hook never fired) and the last one start now, in order.
        for b in range(red.launched, nb):
            span = layout.spans[b]
            red.launch(b, layout.parts(b, grads[span.start : span.stop]))
        rest = detached(value, aux, has_aux)  # while the buckets are in flight
        grads_tree = red.finish(lambda results: rebuild_tree(plan, leaves, results))
    return grads_tree, rest
