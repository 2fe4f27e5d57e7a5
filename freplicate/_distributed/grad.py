"""The overlapped backward: fr.grad_and_value whose buckets reduce while backward runs."""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import optree
import torch

from .._grad import detached, differentiate, gradients, split_output
from .._leaves import PLAIN, STACK_NUMEL, Leaves
from .._typing import Compress, Op, TensorTree
from .agree import OwnFailure, agree, announce_failure, mismatch, sparse_gradients
from .collectives import check_reduce_args, reduce_tree
from .group import check_not_transformed, comm_errors, world_size
from .pipeline import Reduction
from .plan import Bucket, Plan, plan_for, rebuild_tree

__all__ = ["grad_and_value"]

_REQUIRES_GRAD = operator.attrgetter("requires_grad")
_SPARSE = object()  # ``_overlapped``'s answer when the gradients came out sparse


class _DiffLayout:
    """How ``grad_and_value`` differentiates a plan's tensors, bucket by bucket.

    Its ``Leaves`` (``_leaves``) come in bucket order; with ``stack``, each
    run of small equal-shaped tensors of a bucket is one stacked leaf, whose
    gradient is that run of the bucket as it stands (one copy to pack, one
    hook to watch). ``spans[b]``: bucket ``b``'s leaves; ``segments[b]``:
    per run, 0 where it is one stacked leaf, else its number of tensors.
    """

    __slots__ = ("leaves", "segments", "spans")

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
) -> Callable[..., tuple[Any, Any]]:
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

    Returns:
        ``g(*args) -> (grads, value)``.

    Raises:
        TypeError: ``fn`` is not callable; ``argnums`` is not an int; bad options.
        ValueError: bad options (at once); trees that differ across ranks (on
            every rank, when ``g`` runs).
        RuntimeError: ``g`` runs under a ``torch.func`` transform, where
            collectives cannot run.

    Examples:
        >>> w = {"a": torch.tensor(2.0)}
        >>> g = fr.distributed.grad_and_value(lambda w, x: w["a"] * x)
        >>> g(w, torch.tensor(3.0))  # no process group here: the local gradient
        ({'a': tensor(3.)}, tensor(6.))
    """
    caller = "fr.distributed.grad_and_value"
    if not callable(fn):
        raise TypeError(f"{caller}: fn must be callable, got {type(fn).__name__}")
    check_reduce_args(caller, op, bucket_cap_mb, compress)
    if isinstance(argnums, bool) or not isinstance(argnums, int):
        raise TypeError(f"{caller}: argnums must be an int, got {argnums!r}")
    local = differentiate(fn, argnums=argnums, has_aux=has_aux, caller=caller)

    def wrapper(*args: Any, **kwargs: Any) -> tuple[Any, Any]:
        world = world_size(group, caller)
        if world <= 1:
            return local(*args, **kwargs)
        check_not_transformed(caller)
        if not -len(args) <= argnums < len(args):
            return local(*args, **kwargs)  # let fr.grad_and_value raise its error
        n = argnums % len(args)
        tree = args[n]
        plan, leaves = plan_for(tree, caller, op, bucket_cap_mb, compress, None)
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
            except Exception as err:
                # the peers are already in this call's reduction: meet them there, then raise
                with comm_errors(caller):
                    try:
                        announce_failure(group, world, caller, err)
                    except OwnFailure:
                        pass
                raise
            reduced = reduce_tree(grads, caller, op, group, world, bucket_cap_mb, compress, check)
            return reduced, value
        with plan.lock:
            with comm_errors(caller):
                # a rank off the expected layout mirrors it (and checks) before its forward pass
                fast = check and agree(plan, tree, group, world, caller)
            poisoned = (lambda: mismatch(plan, tree, group, caller)) if fast else None
            grads, value = _overlapped(
                fn, args, kwargs, n, has_aux, plan, leaves, op, group, world, poisoned, caller
            )
        if grads is _SPARSE:  # learnt just now: the local gradients, reduced as a tree
            local_grads, value = value
            grads = reduce_tree(
                local_grads, caller, op, group, world, bucket_cap_mb, compress, check
            )
        return grads, value

    wrapper.__doc__ = getattr(fn, "__doc__", None)
    wrapper.__name__ = f"distributed.grad_and_value({getattr(fn, '__name__', 'fn')})"
    return wrapper


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
    value))`` comes back, to be reduced as a tree; the group remembers the
    layout, whose later calls reduce after the backward pass on every rank.
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
    try:
        with torch.enable_grad():
            value, aux = split_output(fn(*new_args, **kwargs), has_aux, caller)
            grads = gradients(value, diff)
    except Exception as err:
        if ours:
            raise  # a mismatch or a peer's failure: every rank raises it
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
        sparse_gradients(group).add(plan.fingerprint)
        local = optree.tree_unflatten(plan.spec, layout.leaves.split(grads))
        return _SPARSE, (local, detached(value, aux, has_aux))  # type: ignore[return-value]
    with comm_errors(caller):
        # Buckets with an unused leaf (its hook never fired) and the last one start now, in order.
        for b in range(red.launched, nb):
            span = layout.spans[b]
            red.launch(b, layout.parts(b, grads[span.start : span.stop]))
        rest = detached(value, aux, has_aux)  # while the buckets are in flight
        grads_tree = red.finish(lambda results: rebuild_tree(plan, leaves, results))
    return grads_tree, rest
