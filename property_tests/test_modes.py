"""``fr.apply``, ``fr.grad_and_value`` and ``fr.data_parallel``, eager and compiled, against the module.

Every property runs in both modes: ``eager``, and ``compiled`` (the same
call inside a function compiled with ``torch.compile(..., fullgraph=True)``
by Dynamo's ``CompileCounter``, which runs the captured graph as the
``"eager"`` backend does and counts the graphs: a call that fell back to
eager code fails).
The references are the stateful module (a deep copy holding the example's
values, run and differentiated as a stateful loop does) and
``torch.func.functional_call`` / ``torch.func.grad`` on the same inputs.
The modules are ``fr.testing.modules()``'s default kinds plus
``"reassigned"`` (a forward that reassigns its buffers); states may leave
names out (they fall back to the module's own tensors). Compiling costs
tenths of a second an example, so the compiled properties run two fifths
of the examples, reported unshrunk.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import optree
import torch
import torch.func
from _property_support import (
    Unchanged,
    examples,
    load_values,
    module_tensors,
    refill,
    split_inputs,
    tolerances,
)
from hypothesis import Phase, given
from hypothesis import strategies as st
from torch._dynamo.testing import CompileCounter

import freplicate as fr
from freplicate.testing import assert_trees_close, devices, modules
from freplicate.testing._strategies import CLASSIC_KINDS

KINDS = [*CLASSIC_KINDS, "reassigned"]
drawn = modules(kinds=KINDS, dtypes=(torch.float32, torch.float64))
# no shrinking when compiled: every attempt would compile again
COMPILED = examples(0.4, phases=[Phase.explicit, Phase.reuse, Phase.generate])


def in_mode(mode: str, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, or the same compiled (one graph, no break: checked)."""
    if mode == "eager":
        return fn(*args)
    torch._dynamo.reset()
    graphs = CompileCounter()  # counts the graphs it compiles, runs them as captured
    result = torch.compile(fn, backend=graphs, fullgraph=True)(*args)
    assert graphs.frame_count == 1, f"{graphs.frame_count} graphs"
    return result


def loss_of(out: Any) -> torch.Tensor:
    """A scalar of every floating-point output element, each with a gradient of its own.

    ``sin`` of each leaf scaled by its position, summed in float64; no random
    weights, so that it traces (a ``torch.Generator`` breaks the graph).
    """
    total = torch.zeros((), dtype=torch.float64)
    for i, leaf in enumerate(optree.tree_leaves(out)):
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
            total = total + torch.sin(leaf.double() * (i + 1.5)).sum()
    return total


class Example:
    """A drawn module, new values for some of its names, and inputs."""

    def __init__(self, pair: tuple[torch.nn.Module, Any], data: st.DataObject) -> None:
        self.module, inputs = pair
        self.args, self.kwargs = split_inputs(data.draw(inputs, label="inputs"))
        s = fr.state(self.module)
        values = refill(s.params, data.draw(st.integers(0, 2**16), label="seed"), integral=False)
        names = list(values)
        keep = data.draw(st.lists(st.booleans(), min_size=len(names), max_size=len(names)))
        given = [k for k, kept in zip(names, keep) if kept or all(keep)]  # at times all of them
        self.params = {k: values[k] for k in given}
        # buffers as they are (a random running_var could be < 0), and at times none given
        self.buffers = (
            {k: v.clone() for k, v in s.buffers.items()} if data.draw(st.booleans()) else {}
        )
        self.state = fr.State(self.params, self.buffers)

    def stateful(self) -> torch.nn.Module:
        """A deep copy of the module holding the given values (the rest its own)."""
        ref = copy.deepcopy(self.module)
        load_values(ref, {**self.params, **self.buffers})
        return ref

    def trainable(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """The given parameters split into those that require grad and the frozen rest."""
        train = {k: v for k, v in self.params.items() if self.module.get_parameter(k).requires_grad}
        return train, {k: v for k, v in self.params.items() if k not in train}

    def dtype(self) -> torch.dtype:
        return next((p.dtype for p in self.module.parameters()), torch.float32)


def check_apply(mode: str, ex: Example) -> None:
    unchanged = Unchanged(ex.state, module_tensors(ex.module), ex.args, ex.kwargs)
    out, new = in_mode(
        mode, lambda s, a, k: fr.apply(ex.module, s, *a, **k), ex.state, ex.args, ex.kwargs
    )
    unchanged.check(f"fr.apply ({mode})")
    assert new.params is ex.params
    ref = ex.stateful()
    tol = tolerances(ex.dtype())
    assert_trees_close(out, ref(*ex.args, **ex.kwargs), **tol)
    assert_trees_close(new.buffers, dict(ref.named_buffers()), **tol)
    assert list(new.buffers)[: len(ex.buffers)] == list(ex.buffers)  # the given ones first
    # functional_call binds the same (on a copy: a shared submodule is left holding its tensors)
    bound = {**ex.params, **{k: b.clone() for k, b in ex.module.named_buffers()}}
    bound.update({k: v.clone() for k, v in ex.buffers.items()})
    fc_out = torch.func.functional_call(copy.deepcopy(ex.module), bound, ex.args, ex.kwargs)
    assert_trees_close(out, fc_out, **tol)
    assert_trees_close(new.buffers, {k: bound[k] for k in new.buffers}, **tol)


@given(drawn, st.data())
def test_apply_equals_the_module_and_functional_call_eager(pair: Any, data: st.DataObject):
    check_apply("eager", Example(pair, data))


@COMPILED
@given(drawn, st.data())
def test_apply_equals_the_module_and_functional_call_compiled(pair: Any, data: st.DataObject):
    check_apply("compiled", Example(pair, data))


def check_grad(mode: str, ex: Example) -> None:
    train, rest = ex.trainable()

    def loss(p: dict[str, torch.Tensor], args: Any, kwargs: Any) -> Any:
        out, new = fr.apply(ex.module, fr.State({**rest, **p}, ex.buffers), *args, **kwargs)
        return loss_of(out), new.buffers

    unchanged = Unchanged(ex.state, module_tensors(ex.module), ex.args, ex.kwargs)
    step = fr.grad_and_value(loss, has_aux=True)
    grads, (value, buffers) = in_mode(mode, step, train, ex.args, ex.kwargs)
    unchanged.check(f"fr.grad_and_value ({mode})")
    ref = ex.stateful()
    ref_loss = loss_of(ref(*ex.args, **ex.kwargs))
    wrt = [ref.get_parameter(k) for k in train]
    got = (
        torch.autograd.grad(ref_loss, wrt, allow_unused=True)
        if wrt and ref_loss.requires_grad
        else [None] * len(wrt)
    )
    want = {k: torch.zeros_like(t) if g is None else g for (k, t), g in zip(zip(train, wrt), got)}
    tol = tolerances(ex.dtype())
    torch.testing.assert_close(value, ref_loss.detach(), **tol)
    assert_trees_close(grads, want, **tol)
    assert_trees_close(buffers, dict(ref.named_buffers()), **tol)
    # and torch.func.grad through functional_call, on a copy of the module, its buffers cloned
    # inside the transformed function (an in-place update of a captured tensor is refused)
    other = copy.deepcopy(ex.module)
    buffers_in = {**dict(other.named_buffers()), **ex.buffers}

    def fc_loss(p: dict[str, torch.Tensor]) -> torch.Tensor:
        bound = {**rest, **p, **{k: v.clone() for k, v in buffers_in.items()}}
        return loss_of(torch.func.functional_call(other, bound, ex.args, ex.kwargs))

    assert_trees_close(grads, torch.func.grad(fc_loss)(train), **tol)


@given(drawn, st.data())
def test_grad_and_value_equals_the_modules_gradients_eager(pair: Any, data: st.DataObject):
    check_grad("eager", Example(pair, data))


@COMPILED
@given(drawn, st.data())
def test_grad_and_value_equals_the_modules_gradients_compiled(pair: Any, data: st.DataObject):
    check_grad("compiled", Example(pair, data))


def _shards(ex: Example, n: int) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
    """``nn.parallel.scatter_kwargs`` on CPU: every tensor chunked along dim 0, the rest shared."""
    leaves, spec = optree.tree_flatten((ex.args, ex.kwargs))
    chunks = [t.chunk(n) if isinstance(t, torch.Tensor) else None for t in leaves]
    count = min(len(c) for c in chunks if c is not None)
    return [
        optree.tree_unflatten(
            spec, [leaf if c is None else c[i] for leaf, c in zip(leaves, chunks)]
        )
        for i in range(count)
    ]


def _gathered(outs: list[Any]) -> Any:
    """``nn.parallel.gather`` on CPU: tensors concatenated along dim 0, 0-dim ones stacked."""
    return optree.tree_map(
        lambda *xs: torch.cat([x.unsqueeze(0) if x.dim() == 0 else x for x in xs]), *outs
    )


def check_data_parallel(mode: str, ex: Example, devs: list[str]) -> None:
    """Outputs, gradients and replica 0's buffers against one deep copy per shard (DataParallel's way)."""
    train, rest = ex.trainable()

    def loss(p: dict[str, torch.Tensor], args: Any, kwargs: Any) -> Any:
        state = fr.State({**rest, **p}, ex.buffers)
        out, new = fr.data_parallel(ex.module, state, *args, devices=devs, **kwargs)
        return loss_of(out), (out, new.buffers)

    unchanged = Unchanged(ex.state, module_tensors(ex.module), ex.args, ex.kwargs)
    step = fr.grad_and_value(loss, has_aux=True)
    grads, (value, (out, buffers)) = in_mode(mode, step, train, ex.args, ex.kwargs)
    unchanged.check(f"fr.data_parallel ({mode})")

    shards = _shards(ex, len(devs))
    replicas = [ex.stateful() for _ in shards]
    outs = [r(*a, **k) for r, (a, k) in zip(replicas, shards)]
    ref_out = outs[0] if len(devs) == 1 else _gathered(outs)
    ref_loss = loss_of(ref_out)
    if ref_loss.requires_grad:
        ref_loss.backward()
    want = {}
    for k, t in train.items():
        total = torch.zeros_like(t)
        for r in replicas:
            g = r.get_parameter(k).grad
            total = total if g is None else total + g
        want[k] = total
    tol = tolerances(ex.dtype())
    assert_trees_close(out, ref_out, **tol)
    torch.testing.assert_close(value, ref_loss.detach(), **tol)
    assert_trees_close(grads, want, **tol)
    assert_trees_close(buffers, dict(replicas[0].named_buffers()), **tol)


@given(drawn, devices(cuda=False), st.data())
def test_data_parallel_equals_a_deep_copy_per_shard_eager(
    pair: Any, devs: list[str], data: st.DataObject
):
    check_data_parallel("eager", Example(pair, data), devs)


@COMPILED
@given(drawn, devices(cuda=False), st.data())
def test_data_parallel_equals_a_deep_copy_per_shard_compiled(
    pair: Any, devs: list[str], data: st.DataObject
):
    check_data_parallel("compiled", Example(pair, data), devs)
