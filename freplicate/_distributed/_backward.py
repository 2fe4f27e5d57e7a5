"""The overlapped backward: a gradient step whose buckets start while the backward pass runs.

DDP's overlap without hooks on a module: the step differentiates fresh
leaves (``_autodiff``), each small run of equal-shaped tensors of a bucket
stacked into one leaf whose gradient is that run of the bucket as it stands
(one copy to pack, one hook to watch), and a hook on each leaf of every
bucket but the last starts the bucket's collective as soon as its last
gradient is computed, always in bucket order on every rank; the rest start
when the backward pass ends. A reentrant checkpoint in the call's graph
takes a full backward pass, in which a leaf's hook may fire once per pass:
no hooks then, every bucket starts at the end. A sparse gradient where the
layout planned a dense one (``nn.Embedding(sparse=True)``) cannot fill a
bucket: the buckets left are sent empty with *retry* set (``Call.retry``),
and every rank reduces its local gradients as a tree instead.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from .._autodiff import Rewind, Trees, detached, gradients, needs_full_backward, split_output
from .._leaves import PLAIN, STACK_NUMEL, Leaves, SparseInStack
from ._call import Call, Send
from ._layout import Layout
from ._plans import Plan

_LAYOUT = operator.attrgetter("layout")
_STRIDED = {torch.strided}

__all__ = ["Attempt", "Differentiated", "Stacks", "overlapped"]


class Stacks:
    """How a step differentiates a layout's tensors, bucket by bucket.

    Its ``Leaves`` come in bucket order; with ``stack``, each run of small
    equal-shaped tensors of a bucket is one stacked leaf. ``spans[b]``:
    bucket ``b``'s leaves; ``segments[b]``: per run, 0 where it is one
    stacked leaf, else its number of tensors.
    """

    __slots__ = ("leaves", "segments", "spans")

    def __init__(self, layout: Layout, stack: bool) -> None:
        groups: list[list[int]] = []
        self.spans: list[range] = []
        self.segments: list[list[int]] = []
        for bucket in layout.buckets:
            first, segments, start = len(groups), [], 0
            for run in bucket.runs:
                ids = list(bucket.members[start : start + run.n])
                start += run.n
                if stack and run.n > 1 and _numel(run.shape) <= STACK_NUMEL:
                    groups.append(ids)
                    segments.append(0)
                else:
                    groups += ([k] for k in ids)
                    segments.append(run.n)
            self.spans.append(range(first, len(groups)))
            self.segments.append(segments)
        self.leaves = Leaves(groups)

    def parts(self, b: int, grads: Sequence[torch.Tensor]) -> list[Any]:
        """Bucket ``b``'s parts (one per run) from its leaves' gradients, in span order."""
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


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def stacks_of(plan: Plan, stack: bool) -> Stacks:
    """The plan's ``Stacks``, stacking or not (never for a layout that met a sparse gradient)."""
    stack = stack and not plan.never_stack
    made = plan.stacks.get(stack)
    if made is None:
        made = plan.stacks[stack] = Stacks(plan.layout, stack)
    return made  # type: ignore[no-any-return]


class Attempt:
    """What a step's first try leaves for a retry: its random state, its own gradients.

    ``grads``: this rank's local gradients, one per tensor of the layout,
    kept before they are sent (the slow path reduces them if a rank asks
    every rank to retry); ``None`` where the backward pass did not finish.
    Kept as they came (the stacks' gradients) and split only if a retry
    reads them: most steps never do.
    """

    __slots__ = ("_grads", "_split", "rewind", "value")

    def __init__(self) -> None:
        self.rewind: Rewind | None = None
        self._grads: Sequence[torch.Tensor] | None = None
        self._split: Callable[[Sequence[torch.Tensor]], list[torch.Tensor]] | None = None
        self.value: Any = None

    def keep(
        self,
        grads: Sequence[torch.Tensor] | None,
        value: Any,
        split: Callable[[Sequence[torch.Tensor]], list[torch.Tensor]] | None = None,
    ) -> None:
        """The first try's gradients (``split`` makes them one per tensor; ``None``: not all
        kept, a retry runs ``fn`` again) and its value."""
        self._grads, self._split, self.value = grads, split, value

    @property
    def grads(self) -> list[torch.Tensor] | None:
        if self._grads is not None and self._split is not None:
            self._grads, self._split = self._split(self._grads), None
        return None if self._grads is None else list(self._grads)


class Differentiated(NamedTuple):
    """What is differentiated: ``fn``, whether it returns ``(value, aux)``, errors' ``caller``."""

    fn: Callable[..., Any]
    has_aux: bool
    caller: str


def overlapped(
    what: Differentiated,
    call: Call,
    send: Send,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    n: int,
    leaves: list[Any],
    attempt: Attempt,
) -> tuple[list[torch.Tensor], Any]:
    """The step's backward pass, each bucket launched from gradient hooks; the results and value.

    ``args[n]`` is the differentiated tree, ``leaves`` its leaves (one per
    tensor of the call's layout); ``send`` what this rank's buckets carry;
    ``attempt`` keeps what a retry needs.
    """
    fn, has_aux, caller = what
    plan = call.request.plan
    tensors = plan.tensors(leaves)
    stacks = stacks_of(plan, set(map(type, tensors)) <= PLAIN)  # plain tensors only: stacks
    made = _made(stacks, tensors, args, n, caller)
    if made is None:  # a tensor to stack is not contiguous: one leaf a tensor
        stacks = stacks_of(plan, False)
        made = _made(stacks, tensors, args, n, caller)
        assert made is not None
    diff, fresh = made
    # a retry runs fn again from this random state: the gradients launched from hooks are
    # let go as their bucket is packed, so a retry cannot reuse them
    attempt.rewind = Rewind(tensors)
    new_args = list(args)
    new_args[n] = plan.rebuild(leaves, fresh)
    layout = plan.layout
    watch = _Watch(call, send, stacks, len(layout.buckets))
    grad = torch.is_grad_enabled()
    torch._C._set_grad_enabled(True)  # ``enable_grad`` at C speed
    try:
        value, aux = split_output(fn(*new_args, **kwargs), has_aux, caller)
        full = needs_full_backward(value, diff, caller)
        if not full:
            watch.hooks(diff)
        try:
            grads = gradients(value, diff, full=full)
        except SparseInStack:
            plan.never_stack = True  # this layout's gradients may be sparse: never stack it
            call.retry()
        finally:
            # the hooks stay on this call's fresh leaves, which go with it; one that a caller
            # kept and differentiates again does nothing (``done``): no Python call a hook
            watch.done = True
    finally:
        torch._C._set_grad_enabled(grad)
    rest = detached(value, aux, has_aux)
    attempt.keep(None if watch.freed else grads, rest, stacks.leaves.split)
    if watch.sparse or set(map(_LAYOUT, grads)) - _STRIDED:  # (at C speed: no frame a leaf)
        call.retry()
    for b in range(call.launched, len(layout.buckets)):
        span = stacks.spans[b]
        call.launch(b, stacks.parts(b, watch.held(b, grads[span.start : span.stop])), send)
    return call.finish(), rest


def _made(
    stacks: Stacks, tensors: Sequence[torch.Tensor], args: tuple[Any, ...], n: int, caller: str
) -> tuple[list[torch.Tensor], list[torch.Tensor]] | None:
    try:
        return stacks.leaves.make(tensors)
    except RuntimeError:
        Trees(args, [n]).check_differentiable(caller)  # names a leaf autograd cannot take
        raise


class _Watch:
    """The hooks that launch each bucket but the last as soon as its gradients are all computed."""

    __slots__ = ("call", "done", "freed", "missing", "nb", "ready", "send", "sparse", "stacks")

    def __init__(self, call: Call, send: Send, stacks: Stacks, nb: int) -> None:
        self.call = call
        self.send = send
        self.stacks = stacks
        self.nb = nb
        self.ready: list[list[torch.Tensor | None]] = []
        self.missing: list[int] = []
        for span in stacks.spans:  # (a loop: a comprehension is a Python call of its own)
            self.ready.append([None] * len(span))
            self.missing.append(len(span))
        self.sparse: list[int] = []  # buckets that met a sparse gradient
        self.freed = False  # a hook gave autograd a stand-in: the gradients it returns are not all
        self.done = False  # the call's backward pass is over: its hooks do nothing

    def hooks(self, diff: Sequence[torch.Tensor]) -> None:
        # The last bucket can only start once the backward pass is over: no hooks there.
        for b, span in enumerate(self.stacks.spans[:-1]):
            for j, d in enumerate(span):
                # a partial, not a closure made by a call: no Python call a hook to make it
                diff[d].register_hook(functools.partial(self._hook, b, j))

    def _hook(self, b: int, j: int, grad: torch.Tensor) -> torch.Tensor | None:
        """Gradient ``j`` of bucket ``b`` is computed: kept, and the bucket launched if full."""
        if self.done:  # a later backward through a leaf the caller kept: not this call's
            return None
        if grad.layout != torch.strided:
            self.sparse.append(b)  # its bucket, and every later one, waits for the end
            return None
        self.ready[b][j] = grad
        self.missing[b] -= 1
        if self.missing[b] == 0:
            self._launch_ready()
        # autograd keeps what a hook returns until the backward pass ends: a stand-in of no
        # memory, so that each gradient lives only until its bucket is packed (FSDP2 and
        # DDP's gradient_as_bucket_view let theirs go too)
        self.freed = True
        return grad.new_zeros(()).expand(grad.shape)

    def held(self, b: int, grads: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Bucket ``b``'s gradients after the backward pass: the hooks' where they kept them."""
        kept = self.ready[b]
        return [g if kept[j] is None else kept[j] for j, g in enumerate(grads)]  # type: ignore[misc]

    def _launch_ready(self) -> None:
        # Buckets start in bucket order on every rank, whatever order their gradients come in.
        call = self.call
        while call.launched < self.nb - 1 and self.missing[call.launched] == 0 and not self.sparse:
            b = call.launched
            call.launch(b, self.stacks.parts(b, self.ready[b]), self.send)  # type: ignore[arg-type]
            self.ready[b] = [None] * len(self.ready[b])  # packed: let them go
