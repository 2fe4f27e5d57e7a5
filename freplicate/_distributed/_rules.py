"""Collectives as primitives: one plain run, and the rules that make them compose.

``apply(spec, tensors)`` runs one collective (``_wire.Spec``: its kind,
options, group and the tensors' paths) and is what every public collective
and every rule calls. It decides by types, never by an error's text:

* plainly (``plain``: one ``Call`` on the tensors' layout), when nothing
  can differentiate or batch through it: no ``torch.func`` transform is
  active (the functorch interpreter stack is empty), no forward-mode level
  is open, and no tensor requires grad where grad mode is on;
* otherwise through ``Primitive``, a functorch-aware ``autograd.Function``
  whose forward is that same plain run, and whose ``backward``, ``jvp`` and
  ``vmap`` are the kind's rules (``Kind.transpose``, ``tangent``,
  ``batch``), written with ``apply`` itself: a cotangent that carries a
  graph (double backward) or is batched (``jacrev``) goes through the rules
  again, so transforms nest as they do on any torch op.

Under ``torch.compile`` no ``autograd.Function`` is traced: the traced call
packs its buckets with differentiable ops and moves them with the functional
collectives, whose own autograd formulas (registered by torch: all-reduce's
transpose an all-reduce, all-gather's a reduce-scatter, sums) are the kinds'
transposes, so a graph-carrying input keeps its graph in one compiled graph,
forward and backward (a tensor held whole through an all-gather takes
``_ops``' ``held`` op, whose backward all-reduces). Inside a ``torch.func``
transform or a forward-mode level, which Dynamo traces through an
``autograd.Function`` into a graph without the collective's rules (measured
on torch 2.13: a ``vmap``'s collective dropped on one rank, a ``jvp``'s
tangent zero), a call is refused with a ``RuntimeError`` that says to run it
eagerly.

Every rank must apply the same transforms to the same calls: a rule's
collectives are calls like any other, checked across ranks, and a rank
whose loss does not reach a collective's results never runs its transpose.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from .._torch import any_requires_grad, is_compiling, transform_level
from ._agree import OwnFailure
from ._call import Announced, Call, Request, send_of
from ._group import forward_ad_level, refuse_traced_transforms
from ._plans import plan_for
from ._wire import KINDS, Spec, order_of, replaced

__all__ = [
    "Pending",
    "Primitive",
    "apply",
    "as_rule",
    "failed",
    "held",
    "needs_rules",
    "plain",
    "transposed",
]



def apply(spec: Spec, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The collective ``spec`` of ``tensors`` (distinct ones), through its rules where they apply."""
    if needs_rules(tensors, spec.caller):
        return list(Primitive.apply(spec, *tensors))
    return plain(spec, tensors)


def needs_rules(tensors: Sequence[Any], caller: str, traced: bool | None = None) -> bool:
    """Whether a call on ``tensors`` must go through its rules (see the module's text).

    While Dynamo traces, never (the traced call is differentiable itself).
    ``traced``: whether it does, where the caller asked already (``None``: ask).

    Raises:
        RuntimeError: while Dynamo traces inside a ``torch.func`` transform
            or a forward-mode level.
    """
    if is_compiling() if traced is None else traced:
        refuse_traced_transforms(caller)
        return False
    if transform_level() is not None or forward_ad_level():
        return True
    return torch.is_grad_enabled() and any_requires_grad(tensors)


def plain(spec: Spec, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The collective itself: one ``Call`` on the layout of ``tensors``; no autograd graph."""
    with Announced(spec.group, spec.world, spec.caller) as scope:
        plan = plan_for(spec, tensors)
        layout = plan.layout
        with plan.lock or contextlib.nullcontext():
            request = Request(plan, spec.group, spec.world, spec.caller, spec.check)
            call = scope.call = Call(request)
            call.begin()
            parts = plan.all_parts(tensors)
            sparse = [tensors[k] for k in layout.sparse]
            call.launch_rest(parts, send_of(request), sparse)
            return call.finish(local=held(spec, [tensors[k] for k in layout.local]))


def failed(spec: Spec, tensors: Sequence[torch.Tensor], error: BaseException) -> None:
    """``plain``'s call, made by a rank whose own code failed: every bucket sent with nothing of
    its own and *failed* set, so that the peers, in that call, raise naming it. Returns once
    every rank knows (the caller raises ``error``)."""
    plan = plan_for(spec, tensors)
    call = Call(Request(plan, spec.group, spec.world, spec.caller, spec.check))
    call.begin()
    try:
        call.fail(error)
    except OwnFailure:
        pass


def _differentiable(t: torch.Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


def held(spec: Spec, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Tensors an all-gather leaves where they are (held whole): new ones all the same.

    Traced, in autograd's graph, through ``_ops``' ``held`` op, whose
    backward is their transpose, an all-reduce (``spec``'s op); eagerly a
    copy (the rules' transpose reduces them).
    """
    if not (is_compiling() and torch.is_grad_enabled()):
        return [t.clone() for t in tensors]
    pg = dist.group.WORLD if spec.group is None else spec.group
    name, op, world = pg.group_name, spec.options.op, spec.world  # type: ignore[union-attr]
    return [torch.ops.freplicate.held(t, op, world, name) for t in tensors]


class Primitive(torch.autograd.Function):
    """A collective with its rules: transpose, tangent and batching, each the kind's."""

    generate_vmap_rule = False

    @staticmethod
    def forward(spec: Spec, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        return tuple(plain(spec, tensors))

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        spec, *tensors = inputs
        ctx.spec = spec
        # the rules' view of the inputs: shapes and memory orders, which tensors can carry
        # a derivative (an integer one is sent all the same, and gets none)
        ctx.inputs = [(tuple(t.shape), order_of(t)) for t in tensors]
        ctx.metas = [(t.dtype, t.device) for t in tensors]
        ctx.live = [k for k, t in enumerate(tensors) if _differentiable(t)]
        ctx.mark_non_differentiable(*(o for o in output if not _differentiable(o)))

    @staticmethod
    def backward(ctx: Any, *cts: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        """The transpose of the live tensors' cotangents (zeros where a result was not used)."""
        return (None, *transposed(ctx.spec, cts, ctx.inputs, ctx.live))

    @staticmethod
    def vmap(info: Any, in_dims: tuple[Any, ...], spec: Spec, *tensors: torch.Tensor) -> Any:  # type: ignore[override]
        """The batched tensors as a whole, in one collective (the kind's ``batch``)."""
        outs, dims = KINDS[spec.options.kind].batch(spec, tensors, in_dims[1:], apply)
        return tuple(outs), tuple(dims)


    @staticmethod
    def jvp(ctx: Any, _spec: Any, *tangents: Any) -> tuple[Any, ...]:  # type: ignore[override]
        live = ctx.live
        out: list[Any] = [None] * len(tangents)
        if live:
            spec = _subset(as_rule(ctx.spec, "tangent"), live)
            given = [_tangent(tangents[k], ctx.inputs[k][0], *ctx.metas[k]) for k in live]
            for k, t in zip(live, KINDS[spec.options.kind].tangent(spec, given, apply)):
                out[k] = t
        return tuple(out)


def as_rule(spec: Spec, rule: str) -> Spec:
    """``spec`` as its rule's call: its own function name, so that ranks tell it from a forward
    call (a rank's backward beside another rank's next call raises, naming both)."""
    return replaced(spec, caller=f"{spec.caller} ({rule})")


def _tangent(t: Any, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Any:
    """A tangent, zeros where none came: every rank sends all of a call's tensors."""
    return torch.zeros(shape, dtype=dtype, device=device) if t is None else t


def transposed(
    spec: Spec, cts: Sequence[torch.Tensor], inputs: Sequence[Any], ks: Sequence[int]
) -> list[Any]:
    """The cotangents of the inputs ``ks`` of a call of ``spec`` (``inputs``: every input's shape
    and memory order), through its kind's transpose, in one call; ``None`` for the others."""
    grads: list[Any] = [None] * len(cts)
    if ks:
        sub = _subset(as_rule(spec, "backward"), ks)
        picked = [inputs[k] for k in ks]
        got = KINDS[sub.options.kind].transpose(sub, [cts[k] for k in ks], picked, apply)
        for k, g in zip(ks, got):
            grads[k] = g
    return grads


def _subset(spec: Spec, ks: Sequence[int]) -> Spec:
    """``spec`` for the tensors ``ks`` of its call only (all of them: ``spec`` itself)."""
    if len(ks) == len(spec.paths):
        return spec
    whole = None if spec.whole is None else tuple(spec.whole[k] for k in ks)
    like = None if spec.like is None else tuple(spec.like[k] for k in ks)
    return replaced(spec, paths=tuple(spec.paths[k] for k in ks), whole=whole, like=like)


class Pending:
    """A plain collective started now, its results taken later: a prefetch.

    Its buckets are in flight from ``__init__`` (agreed and launched, every
    rank alike); ``finish`` waits and hands out the results, as ``plain``
    would have. No autograd: a caller that differentiates wraps the results
    (``_sharded``). Between the two, the rank may run anything but another
    call of this plan's layout from another thread.
    """

    __slots__ = ("call", "finished", "plan", "spec", "tensors")

    def __init__(self, spec: Spec, tensors: Sequence[torch.Tensor]) -> None:
        self.spec = spec
        self.tensors = tensors
        self.finished = False
        with Announced(spec.group, spec.world, spec.caller) as scope:
            self.plan = plan = plan_for(spec, tensors)
            layout = plan.layout
            request = Request(plan, spec.group, spec.world, spec.caller, spec.check)
            self.call = scope.call = Call(request)
            self.call.begin()
            parts = plan.all_parts(tensors)
            self.call.launch_rest(parts, send_of(request), [tensors[k] for k in layout.sparse])

    def finish(self) -> list[torch.Tensor]:
        """The results (once): ``plain``'s."""
        assert not self.finished, "a pending collective finished twice"
        self.finished = True
        with Announced(self.spec.group, self.spec.world, self.spec.caller) as scope:
            scope.call = self.call
            local = held(self.spec, [self.tensors[k] for k in self.plan.layout.local])
            return self.call.finish(local=local)
