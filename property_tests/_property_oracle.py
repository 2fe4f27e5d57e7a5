"""The stateful oracle for gradients: the same module, its values loaded, driven by autograd.

The functional side is what a user writes: ``fr.apply`` on a ``State`` bound
into a loss, differentiated with ``fr.grad_and_value``, ``torch.autograd.grad``
or ``.backward()``. The stateful side is a deep copy of the module with the
same values put in with ``load_state_dict``, run forward and backward as a
stateful training loop does. The values are new ones, not the module's own,
so that a forward that reads the module's tensors instead of the state's (an
activation checkpoint recomputed after its binding is gone, a compiled module)
gives another answer. Only parameters that require grad are differentiated,
on both sides; random ops draw from the same seed on both sides.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import optree
import torch
from _property_support import (
    Unchanged,
    dense,
    load_values,
    refill,
    split_inputs,
    tolerances,
    trainable,
    weighted_loss,
)
from hypothesis import note
from hypothesis import strategies as st

import freplicate as fr
from freplicate.testing import assert_trees_close, devices

How = Literal["grad_and_value", "grad", "backward"]
HOWS: tuple[How, ...] = ("grad_and_value", "grad", "backward")


class Result(NamedTuple):
    """One side's answer: the loss, gradients by parameter name, input gradients, buffers."""

    loss: torch.Tensor
    grads: dict[str, torch.Tensor]
    input_grads: list[torch.Tensor]
    buffers: dict[str, torch.Tensor]


class Problem(NamedTuple):
    """One example: the module, its new values, the arguments, and what to differentiate."""

    module: torch.nn.Module
    params: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    trainable: list[str]
    wrt_inputs: bool
    rng_seed: int


def problem(
    module: torch.nn.Module, x: Any, *, values_seed: int, rng_seed: int = 0, wrt_inputs: bool
) -> Problem:
    """An example for ``module`` on drawn inputs ``x``, its parameters refilled from ``values_seed``."""
    args, kwargs = split_inputs(x)
    s = fr.state(module)
    params = refill(s.params, values_seed, integral=False)
    names = list(trainable(module, params))
    if len(names) < len(params):
        note(f"frozen: {sorted(set(params) - set(names))}")
    return Problem(module, params, s.buffers, args, kwargs, names, wrt_inputs, rng_seed)


def _float_positions(tree: Any) -> list[int]:
    return [
        i
        for i, t in enumerate(optree.tree_leaves(tree))
        if isinstance(t, torch.Tensor) and t.is_floating_point()
    ]


def _with_inputs(p: Problem, inputs: list[torch.Tensor]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(args, kwargs)`` with their floating-point tensors replaced by ``inputs``, in order."""
    leaves, spec = optree.tree_flatten((p.args, p.kwargs))
    for i, t in zip(_float_positions((p.args, p.kwargs)), inputs):
        leaves[i] = t
    args, kwargs = optree.tree_unflatten(spec, leaves)
    return args, kwargs


def _inputs(p: Problem) -> list[torch.Tensor]:
    if not p.wrt_inputs:
        return []
    leaves = optree.tree_leaves((p.args, p.kwargs))
    return [leaves[i].detach().clone() for i in _float_positions((p.args, p.kwargs))]


def _uncompiled(module: torch.nn.Module) -> tuple[torch.nn.Module, str]:
    """The module ``torch.compile`` wrapped (the stateful reference), and its names' prefix."""
    inner = getattr(module, "_orig_mod", None)
    return (inner, "_orig_mod.") if isinstance(inner, torch.nn.Module) else (module, "")


def _seeded(seed: int, fn: Callable[[], Any]) -> Any:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return fn()


def _zeros_for_none(grads: Any, like: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.zeros_like(t) if g is None else g for g, t in zip(grads, like)]


def stateful(p: Problem, how: How) -> Result:
    """The stateful module's answer: a deep copy, values loaded, forward, then backward.

    ``how="grad"`` asks ``torch.autograd.grad``; the others call
    ``.backward()`` and read ``.grad``.
    """
    inner, prefix = _uncompiled(p.module)
    ref = copy.deepcopy(inner)
    load_values(ref, {k.removeprefix(prefix): v for k, v in {**p.params, **p.buffers}.items()})
    inputs = [t.requires_grad_() for t in _inputs(p)]
    args, kwargs = _with_inputs(p, inputs) if inputs else (p.args, p.kwargs)
    out = _seeded(p.rng_seed, lambda: ref(*args, **kwargs))
    loss = weighted_loss(out)
    wrt = [ref.get_parameter(k.removeprefix(prefix)) for k in p.trainable] + inputs
    if how == "grad":
        got = torch.autograd.grad(loss, wrt, allow_unused=True) if loss.requires_grad else []
    else:
        if loss.requires_grad:
            loss.backward()
        got = [t.grad for t in wrt]
    grads = _zeros_for_none(got or [None] * len(wrt), wrt)
    n = len(p.trainable)
    buffers = {prefix + k: b.detach() for k, b in ref.named_buffers()}
    return Result(loss.detach(), dict(zip(p.trainable, grads[:n])), grads[n:], buffers)


def functional(p: Problem, how: How) -> Result:
    """``fr.apply`` in a loss, differentiated by ``fr.grad_and_value`` or autograd (``how``)."""
    frozen = {k: v for k, v in p.params.items() if k not in p.trainable}
    unchanged = Unchanged(p.params, p.buffers, p.args, p.kwargs)

    def loss_fn(train: dict[str, torch.Tensor], inputs: list[torch.Tensor]) -> Any:
        args, kwargs = _with_inputs(p, inputs) if inputs else (p.args, p.kwargs)
        state = fr.State({**frozen, **train}, p.buffers)
        out, new = _seeded(p.rng_seed, lambda: fr.apply(p.module, state, *args, **kwargs))
        return weighted_loss(out), new.buffers

    train = {k: p.params[k] for k in p.trainable}
    if how == "grad_and_value":
        (grads, input_grads), (loss, buffers) = fr.grad_and_value(
            loss_fn, argnums=(0, 1), has_aux=True
        )(train, _inputs(p))
    else:
        train = {k: v.detach().requires_grad_() for k, v in train.items()}
        inputs = [t.requires_grad_() for t in _inputs(p)]
        loss, buffers = loss_fn(train, inputs)
        wrt = [*train.values(), *inputs]
        if not loss.requires_grad:
            got: Any = [None] * len(wrt)
        elif how == "grad":
            got = torch.autograd.grad(loss, wrt, allow_unused=True)
        else:
            loss.backward()
            got = [t.grad for t in wrt]
        all_grads = _zeros_for_none(got, wrt)
        grads = dict(zip(train, all_grads[: len(train)]))
        input_grads = all_grads[len(train) :]
    unchanged.check(f"fr.apply under {how}")
    return Result(loss.detach(), grads, list(input_grads), dict(buffers))


def _dtype(p: Problem) -> torch.dtype:
    dtypes = [t.dtype for t in p.params.values() if t.is_floating_point()]
    return max(dtypes, key=lambda d: torch.finfo(d).eps) if dtypes else torch.float32


def check_gradients(p: Problem, how: How) -> None:
    """Assert that the functional and the stateful side agree on loss, gradients and buffers.

    Where the stateful side raises (``torch.autograd.grad`` through a
    reentrant checkpoint, which PyTorch refuses), the functional side must
    raise the same type.
    """
    try:
        want = stateful(p, how)
    except RuntimeError as err:
        try:
            functional(p, how)
        except RuntimeError:
            return
        raise AssertionError(f"the stateful module raised, fr.apply did not: {err}") from None
    got = functional(p, how)
    tol = tolerances(_dtype(p))
    torch.testing.assert_close(got.loss, want.loss, **tol)
    assert_trees_close(dense(got.grads), dense(want.grads), **tol)
    assert_trees_close(dense(got.input_grads), dense(want.input_grads), **tol)
    assert_trees_close(got.buffers, want.buffers, **tol)


def mean_loss(out: Any) -> torch.Tensor:
    """A mean over the batch (dimension 0) of a fixed weighting of each example's outputs.

    The weights depend on an example's position in no way, so the mean of
    equal shards' losses is the full batch's, and so are its gradients.
    """
    total = torch.zeros((), dtype=torch.float64)
    for i, leaf in enumerate(optree.tree_leaves(out)):
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point() and leaf.dim():
            g = torch.Generator().manual_seed(i)
            weight = torch.randn(leaf.shape[1:], generator=g, dtype=torch.float64)
            total = total + (leaf.double() * weight).sum() / leaf.shape[0]
    return total


EQUAL_SHARDS = st.tuples(devices(), st.integers(1, 3), st.integers(0, 2**16))
"""``(devices, per_device, seed)`` for ``check_data_parallel_grad``."""


def check_data_parallel_grad(
    module: torch.nn.Module, x: Any, devices: list[str], per_device: int, seed: int
) -> None:
    """``fr.data_parallel_grad`` over equal shards equals the stateful full-batch gradient.

    For modules whose forward treats examples independently (no BatchNorm in
    training mode) and draws no random numbers. Only the trainable
    parameters are differentiated; the frozen ones are closed over.
    """
    args, kwargs = split_inputs(x)
    assert not kwargs, "fr.data_parallel_grad takes the batch positionally"
    size = per_device * len(devices)  # equal shards, whatever the drawn batch
    batch = tuple(torch.cat([t] * size)[:size] for t in args)
    p = problem(module, batch, values_seed=seed, wrt_inputs=False)
    frozen = {k: v for k, v in p.params.items() if k not in p.trainable}

    def loss_fn(train: dict[str, torch.Tensor], *shard: torch.Tensor) -> torch.Tensor:
        out, _ = fr.apply(module, fr.State({**frozen, **train}, p.buffers), *shard)
        return mean_loss(out)

    train = {k: p.params[k] for k in p.trainable}
    unchanged = Unchanged(p.params, p.buffers, batch)
    grads, loss = fr.data_parallel_grad(loss_fn, devices)(train, *batch)
    unchanged.check("fr.data_parallel_grad")

    inner, prefix = _uncompiled(module)
    ref = copy.deepcopy(inner)
    load_values(ref, {k.removeprefix(prefix): v for k, v in {**p.params, **p.buffers}.items()})
    want_loss = mean_loss(ref(*batch))
    if want_loss.requires_grad:
        want_loss.backward()
    want = {}
    for k in p.trainable:
        q = ref.get_parameter(k.removeprefix(prefix))
        want[k] = torch.zeros_like(q) if q.grad is None else q.grad
    tol = tolerances(_dtype(p))
    assert_trees_close(dense(grads), dense(want), **tol)
    torch.testing.assert_close(loss, want_loss.detach().to(loss.dtype), **tol)
