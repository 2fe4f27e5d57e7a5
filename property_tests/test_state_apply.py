"""``fr.state`` and ``fr.apply`` equal the module's own stateful forward, from any number of threads."""

from __future__ import annotations

import copy
import threading
from typing import Any

import torch
from _property_support import Unchanged, refill
from hypothesis import given
from hypothesis import strategies as st

import freplicate as fr
from freplicate.testing import assert_trees_close, modules
from freplicate.testing._strategies import CLASSIC_KINDS

# the default kinds and a forward that reassigns its buffers
KINDS = [*CLASSIC_KINDS, "reassigned"]


def _split(x: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if isinstance(x, dict):
        return (), x
    return (x if isinstance(x, tuple) else (x,)), {}


@given(modules(dtypes=(torch.float32, torch.float64)))
def test_state_is_the_modules_tensors_without_copies(pair: tuple[torch.nn.Module, Any]):
    module, _ = pair
    s = fr.state(module)
    params, buffers = dict(module.named_parameters()), dict(module.named_buffers())
    assert list(s.params) == list(params) and list(s.buffers) == list(buffers)
    for name, t in (*s.params.items(), *s.buffers.items()):
        own = params.get(name, buffers.get(name))
        assert t.data_ptr() == own.data_ptr() and not t.requires_grad
        assert torch.equal(t, own)


@given(modules(kinds=KINDS, dtypes=(torch.float32, torch.float64)), st.data())
def test_apply_equals_the_stateful_forward(pair: tuple[torch.nn.Module, Any], data: st.DataObject):
    module, inputs = pair
    args, kwargs = _split(data.draw(inputs, label="inputs"))
    s = fr.state(module)
    unchanged = Unchanged(dict((*module.named_parameters(), *module.named_buffers())), args, kwargs)
    out, new = fr.apply(module, s, *args, **kwargs)
    unchanged.check("fr.apply")
    reference = copy.deepcopy(module)
    with torch.no_grad():
        expected = reference(*args, **kwargs)
    assert_trees_close(out, expected)
    assert new.params is s.params
    assert_trees_close(new.buffers, dict(reference.named_buffers()))


@given(
    modules(kinds=["mlp", "conv", "buffers", "tied", "nested", "shared", "reassigned"]),
    st.integers(2, 4),
    st.data(),
)
def test_concurrent_applies_each_see_their_own_state(
    pair: tuple[torch.nn.Module, Any], threads: int, data: st.DataObject
):
    module, inputs = pair
    x = data.draw(inputs, label="inputs")
    s = fr.state(module)
    # new parameters for each thread; buffers as they are (a random running_var could be < 0)
    states = [
        fr.State(refill(s.params, seed, integral=False), s.buffers) for seed in range(threads)
    ]
    expected = [fr.apply(module, s, x) for s in states]
    got: list[Any] = [None] * threads
    barrier = threading.Barrier(threads)

    def run(i: int) -> None:
        barrier.wait()
        for _ in range(3):  # overlap the calls as much as two cores allow
            got[i] = fr.apply(module, states[i], x)

    workers = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=60)
    for g, e in zip(got, expected):
        assert_trees_close(g, e)


@given(modules(kinds=KINDS, dtypes=(torch.float32, torch.float64)), st.data())
def test_none_in_the_state_is_bound_as_functional_call_binds_it(
    pair: tuple[torch.nn.Module, Any], data: st.DataObject
):
    module, inputs = pair
    args, kwargs = _split(data.draw(inputs, label="inputs"))
    s = fr.state(module)
    biases = [k for k in s.params if k.endswith("bias")]  # what a forward computes without
    dropped = (
        data.draw(st.lists(st.sampled_from(biases), unique=True), label="None") if biases else []
    )
    params = {k: None if k in dropped else v for k, v in s.params.items()}
    out, new = fr.apply(module, fr.State(params, s.buffers), *args, **kwargs)  # type: ignore[arg-type]
    given = {**params, **{k: v.clone() for k, v in s.buffers.items()}}
    # on a copy: functional_call may leave a shared submodule holding what it was given
    expected = torch.func.functional_call(copy.deepcopy(module), given, args, kwargs)
    assert_trees_close(out, expected)
    assert_trees_close(new.buffers, {k: given[k] for k in s.buffers})
