"""``fr.testing``: its assertions fail where they should, its oracle can fail, its strategies keep their word."""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path
from typing import Any, NamedTuple

import optree
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import freplicate as fr
from freplicate.testing import (
    assert_trees_close,
    check_against_stateful,
    devices,
    modules,
    trees,
)
from freplicate.testing._strategies import ALL_DTYPES, Pair

ROOT = Path(__file__).resolve().parent.parent


class Point(NamedTuple):
    x: Any
    y: Any


# --------------------------------------------------------------------------- assert_trees_close


def test_equal_trees_pass():
    t = torch.arange(3.0)
    tree = {"a": [t, Point(1, torch.ones(()))], "b": None, "s": "text", "f": float("nan")}
    same = {"a": [t.clone(), Point(1, torch.ones(()))], "b": None, "s": "text", "f": float("nan")}
    assert_trees_close(tree, same)


@pytest.mark.parametrize(
    ("actual", "expected", "message"),
    [
        (
            {"a": [torch.ones(2), Point(1, torch.ones(3))]},
            {"a": [torch.ones(2), Point(1, torch.zeros(3))]},
            r"leaves differ at \['a'\]\[1\]\.y: Tensor-likes are not close",
        ),
        (
            {"w": torch.ones(2)},
            {"w": torch.ones(2, dtype=torch.float64)},
            r"leaves differ at \['w'\]: .*dtype",
        ),
        ({"w": torch.ones(2)}, {"w": torch.ones(3)}, r"leaves differ at \['w'\]: .*shape"),
        ({"n": 1}, {"n": 2}, r"leaves differ at \['n'\]: 1 in actual, 2 in expected"),
        (
            {"n": torch.ones(1)},
            {"n": 1},
            r"leaves differ at \['n'\]: a tensor of shape \(1,\) .* in actual, a leaf 1",
        ),
        (
            {"a": {"b": [1, 2]}},
            {"a": {"b": (1, 2)}},
            r"structures differ at \['a'\]\['b'\]: list of 2 in actual, tuple of 2 in expected",
        ),
        (
            {"a": [1, 2]},
            {"a": [1, 2, 3]},
            r"structures differ at \['a'\]: list of 2 in actual, list of 3",
        ),
        (
            {"a": 1},
            {"b": 1},
            r"structures differ at the root: dict with keys \['a'\] in actual, dict with keys \['b'\]",
        ),
        (
            Point(None, 1),
            Point(torch.ones(1), 1),
            r"structures differ at \.x: None in actual, a tensor of shape \(1,\)",
        ),
    ],
)
def test_a_difference_is_named_by_its_path(actual: Any, expected: Any, message: str):
    with pytest.raises(AssertionError, match="assert_trees_close: " + message):
        assert_trees_close(actual, expected)


def test_the_first_differing_leaf_is_named():
    actual = [torch.zeros(1), torch.zeros(1), torch.zeros(1)]
    expected = [torch.zeros(1), torch.ones(1), torch.ones(1)]
    with pytest.raises(AssertionError, match=r"at \[1\]:"):
        assert_trees_close(actual, expected)


def test_tolerances_are_passed_to_assert_close():
    a, b = {"w": torch.tensor([1.0])}, {"w": torch.tensor([1.01])}
    with pytest.raises(AssertionError, match=r"\['w'\]"):
        assert_trees_close(a, b)
    assert_trees_close(a, b, rtol=0.0, atol=0.02)


# --------------------------------------------------------------------------- check_against_stateful


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Tanh(), nn.Linear(4, 2))


@pytest.mark.parametrize("devs", [["cpu"], ["cpu", "cpu"], ["cpu", "cpu", "cpu", "cpu"]])
def test_the_oracle_passes_on_the_real_data_parallel(devs: list[str]):
    x = torch.randn(6, 3)
    check_against_stateful(_model(), (x,), devs)
    check_against_stateful(_model(), x, devs)  # a lone tensor as is
    check_against_stateful(_model().eval(), (x,), devs, buffers="mean")


def test_the_oracle_takes_keyword_inputs():
    module, inputs = _first(modules(kinds=["keywords"]))
    check_against_stateful(module, _first(inputs), ["cpu", "cpu"])


def _first(strategy: st.SearchStrategy[Any]) -> Any:
    found: list[Any] = []

    @settings(max_examples=1, derandomize=True, database=None)
    @given(strategy)
    def grab(x: Any) -> None:
        found.append(x)

    grab()
    return found[0]


_real_data_parallel = fr.data_parallel


def _wrong_output(module, state, *args, devices, **kwargs):
    out, new = _real_data_parallel(module, state, *args, devices=devices, **kwargs)
    return out * 1.001, new


def _wrong_gradient(module, state, *args, devices, **kwargs):
    # the output is right, but no gradient reaches state.params
    detached = fr.State({k: v.detach() for k, v in state.params.items()}, state.buffers)
    return _real_data_parallel(module, detached, *args, devices=devices, **kwargs)


def _wrong_buffers(module, state, *args, devices, **kwargs):
    out, _ = _real_data_parallel(module, state, *args, devices=devices, **kwargs)
    return out, state  # the buffers as they were before the call


def _mutating(module, state, *args, devices, **kwargs):
    out, new = _real_data_parallel(module, state, *args, devices=devices, **kwargs)
    with torch.no_grad():
        state.buffers["1.running_mean"].add_(0)  # an in-place op: _version moves
    return out, new


@pytest.mark.parametrize(
    ("wrong", "message"),
    [
        (_wrong_output, r"outputs of fr\.data_parallel differ .* at the root"),
        (_wrong_gradient, r"gradients of fr\.data_parallel differ .*\['0\.weight'\]"),
        (_wrong_buffers, r"buffers of fr\.data_parallel differ .*\['1\.num_batches_tracked'\]"),
        (_mutating, r"fr\.data_parallel modified the module's '1\.running_mean'"),
    ],
)
def test_the_oracle_fails_on_a_wrong_functional_result(monkeypatch, wrong, message: str):
    monkeypatch.setattr(fr, "data_parallel", wrong)
    with pytest.raises(AssertionError, match="check_against_stateful: " + message):
        check_against_stateful(_model(), (torch.randn(6, 3),), ["cpu", "cpu"])


def test_the_oracle_rejects_unknown_options():
    with pytest.raises(ValueError, match="check_against_stateful: buffers must be"):
        check_against_stateful(_model(), (torch.randn(6, 3),), ["cpu"], buffers="last")
    with pytest.raises(TypeError, match="check_against_stateful: inputs must be"):
        check_against_stateful(_model(), [torch.randn(6, 3)], ["cpu"])


# --------------------------------------------------------------------------- the import guard


def test_without_hypothesis_the_import_error_says_what_to_install(monkeypatch):
    for name in [m for m in sys.modules if m.startswith("freplicate.testing")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.delattr(fr, "testing", raising=False)
    monkeypatch.setitem(sys.modules, "hypothesis", None)  # what an absent package looks like
    expected = re.escape(
        "fr.testing needs the optional 'hypothesis' dependency: pip install 'freplicate[testing]'"
    )
    with pytest.raises(ImportError, match=expected):
        importlib.import_module("freplicate.testing")
    with pytest.raises(ImportError, match=expected):
        fr.testing  # noqa: B018


# --------------------------------------------------------------------------- strategies


def _collect(strategy: st.SearchStrategy[Any], n: int = 300) -> list[Any]:
    found: list[Any] = []

    @settings(max_examples=n, derandomize=True, database=None, deadline=None)
    @given(strategy)
    def grab(x: Any) -> None:
        found.append(x)

    grab()
    return found


def _kinds_of_nodes(tree: Any) -> set[type]:
    seen: set[type] = set()

    def walk(node: Any) -> None:
        if isinstance(node, (dict, list, tuple)) or node is None:
            seen.add(type(node))
            for child in node.values() if isinstance(node, dict) else node or ():
                walk(child)

    walk(tree)
    return seen


def test_trees_cover_dtypes_shapes_nesting_non_tensors_and_aliases():
    drawn = _collect(trees())
    tensors = [t for tree in drawn for t in optree.tree_leaves(tree) if isinstance(t, torch.Tensor)]
    assert {t.dtype for t in tensors} == set(ALL_DTYPES)
    assert any(t.dim() == 0 for t in tensors), "0-dim tensors"
    assert any(t.numel() == 0 for t in tensors), "empty tensors"
    assert any(not t.is_contiguous() and 0 not in t.stride() for t in tensors), "strided views"
    assert any(0 in t.stride() and t.numel() > 1 for t in tensors), "expanded views"
    assert any(t.storage_offset() > 0 for t in tensors), "views offset into their storage"
    nodes = set().union(*(_kinds_of_nodes(tree) for tree in drawn))
    assert {dict, list, tuple, Pair, type(None)} <= nodes
    others = {type(x) for tree in drawn for x in optree.tree_leaves(tree)} - {torch.Tensor}
    assert {int, float, str} <= others
    assert any(
        len({id(t) for t in leaves if isinstance(t, torch.Tensor)})
        < sum(isinstance(t, torch.Tensor) for t in leaves)
        for leaves in map(optree.tree_leaves, drawn)
    ), "aliased (tied) tensor leaves"


def test_trees_respect_their_options():
    drawn = _collect(
        trees(
            dtypes=[torch.float16],
            batch_size=3,
            max_dims=2,
            max_side=2,
            max_leaves=4,
            aliased=False,
            non_tensor_leaves=False,
            views=False,
        ),
        100,
    )
    for tree in drawn:
        leaves = optree.tree_leaves(tree, none_is_leaf=True)
        assert len(leaves) <= 4
        assert all(isinstance(t, torch.Tensor) for t in leaves), "no None, no non-tensor leaf"
        assert len({id(t) for t in leaves}) == len(leaves), "no aliases"
        for t in leaves:
            assert t.dtype == torch.float16 and t.shape[0] == 3 and t.dim() <= 2
            assert t.is_contiguous() and t.storage_offset() == 0
            assert all(side <= 2 for side in t.shape[1:])


def test_trees_reject_impossible_options():
    with pytest.raises(ValueError, match=r"fr\.testing\.trees: dtypes"):
        trees(dtypes=[])
    with pytest.raises(ValueError, match=r"fr\.testing\.trees: batch_size needs max_dims >= 1"):
        trees(batch_size=2, max_dims=0)


def _split(x: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if isinstance(x, dict):
        return (), x
    return (x if isinstance(x, tuple) else (x,)), {}


def test_modules_draw_every_kind_with_inputs_that_run():
    kinds: set[str] = set()
    inputs_forms: set[type] = set()

    @settings(max_examples=150, derandomize=True, database=None, deadline=None)
    @given(modules(max_features=3, max_batch=3), st.data())
    def check(pair: Any, data: st.DataObject) -> None:
        module, inputs = pair
        x = data.draw(inputs)
        args, kwargs = _split(x)
        kinds.add(type(module).__name__)
        inputs_forms.add(type(x))
        assert sum(p.numel() for p in module.parameters()) > 0 or len(list(module.buffers()))
        batch = {t.shape[0] for t in optree.tree_leaves((args, kwargs)) if torch.is_tensor(t)}
        assert len(batch) == 1 and 1 <= min(batch) <= 3, "one batch size, within max_batch"
        out = module(*args, **kwargs)
        assert all(t.shape[0] in batch for t in optree.tree_leaves(out) if t.dim())

    check()
    assert kinds >= {"Sequential", "BatchNorm1d", "TiedMLP", "Buffered", "Nested", "WithUnused"}
    assert kinds >= {"TwoInputs", "Keywords"}
    assert inputs_forms == {torch.Tensor, tuple, dict}


def test_modules_have_what_their_kind_promises():
    tied, _ = _first(modules(kinds=["tied"]))
    assert tied.fc1.weight is tied.fc2.weight
    assert len(list(tied.parameters())) < len(list(tied.named_parameters(remove_duplicate=False)))
    buffered, _ = _first(modules(kinds=["buffers"]))
    assert {"scale", "running", "calls"} <= dict(buffered.named_buffers()).keys()
    unused, inputs = _first(modules(kinds=["unused"]))
    out = unused(_first(inputs))
    trainable = [p for p in unused.parameters() if p.requires_grad]
    grads = torch.autograd.grad(out.sum(), trainable, allow_unused=True)
    assert any(g is None for g in grads), "a parameter that does not reach the output"
    assert len(trainable) < len(list(unused.parameters())), "a frozen parameter"
    double, _ = _first(modules(kinds=["mlp"], dtypes=[torch.float64], training=False))
    assert not double.training and all(p.dtype == torch.float64 for p in double.parameters())


def test_modules_reject_unknown_kinds():
    with pytest.raises(ValueError, match=r"fr\.testing\.modules: unknown kinds \['lstm'\]"):
        modules(kinds=["lstm"])


def test_devices_are_this_machines_with_repeats():
    available = {"cpu"} | {f"cuda:{i}" for i in range(torch.cuda.device_count())}
    drawn = _collect(devices(max_size=3), 100)
    assert all(1 <= len(d) <= 3 and set(d) <= available for d in drawn)
    assert any(len(d) > len(set(d)) for d in drawn), "repeats"
    assert ["cpu"] in drawn


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA devices")
def test_devices_without_any_device_raise():
    with pytest.raises(ValueError, match=r"fr\.testing\.devices: no device to draw from"):
        devices(cpu=False)


# --------------------------------------------------------------------------- the docs page


def test_the_docs_example_is_the_tested_file():
    page = (ROOT / "docs" / "property_testing.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", page, flags=re.S)
    tested = (ROOT / "property_tests" / "test_docs_example.py").read_text()
    assert tested in blocks, (
        "docs/property_testing.md must show property_tests/test_docs_example.py"
    )
