"""``fr.testing``: its assertions fail where they should, its oracle can fail, its strategies keep their word."""

from __future__ import annotations

import copy
import importlib
import pickle
import re
import subprocess
import sys
from collections import OrderedDict
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
    init_loopback_group,
    modules,
    trees,
)
from freplicate.testing._strategies import (
    ALL_DTYPES,
    CHECKPOINT_MODES,
    CLASSIC_KINDS,
    CONTAINER_KINDS,
    KINDS,
    Checkpointed,
    Items,
    Output,
    Outputs,
    Pair,
    Reassigned,
    Record,
    SparseEmbedding,
    TiedMLP,
    _contents,
    contain,
)

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


@pytest.mark.parametrize(
    ("tolerances", "message"),
    [
        ({"rtol": 0.1}, "got rtol=0.1 and no atol"),
        ({"atol": 0.0}, "got atol=0.0 and no rtol"),
        ({"rtol": 0.1, "atol": None}, "got rtol=0.1 and no atol"),
    ],
)
def test_one_tolerance_without_the_other_is_refused(tolerances: dict[str, Any], message: str):
    expected = re.escape(f"give rtol and atol together, or neither; {message}")
    with pytest.raises(ValueError, match="assert_trees_close: " + expected):
        assert_trees_close({"w": torch.ones(1)}, {"w": torch.ones(1)}, **tolerances)
    with pytest.raises(ValueError, match="assert_trees_close: " + expected):
        assert_trees_close({"n": 1}, {"n": 1}, **tolerances)  # no tensor to compare: refused too
    with pytest.raises(ValueError, match="check_against_stateful: " + expected):
        check_against_stateful(nn.Linear(2, 2), (torch.ones(2, 2),), ["cpu"], **tolerances)


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


def _touching_grad(module, state, *args, devices, **kwargs):
    out, new = _real_data_parallel(module, state, *args, devices=devices, **kwargs)
    module[0].weight.grad = torch.ones_like(module[0].weight)  # as a backward into it would
    return out, new


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
        (_touching_grad, r"fr\.data_parallel changed the \.grad of the module's '0\.weight'"),
    ],
)
def test_the_oracle_fails_on_a_wrong_functional_result(monkeypatch, wrong, message: str):
    monkeypatch.setattr(fr, "data_parallel", wrong)
    with pytest.raises(AssertionError, match="check_against_stateful: " + message):
        check_against_stateful(_model(), (torch.randn(6, 3),), ["cpu", "cpu"])


def _model_output(module, state, *args, devices, **kwargs):
    out, new = _real_data_parallel(module, state, *args, devices=devices, **kwargs)
    return dict(out), new  # a ModelOutput come back as a plain dict: its type lost


@pytest.mark.parametrize("kind", CONTAINER_KINDS)
def test_the_oracle_passes_on_every_container_and_fails_on_a_lost_type(monkeypatch, kind: str):
    torch.manual_seed(0)
    module, x = Outputs(3, 2, kind), torch.randn(6, 3)
    check_against_stateful(module, (contain(kind, x, 0.5),), ["cpu", "cpu"])
    if kind == "model_output":
        monkeypatch.setattr(fr, "data_parallel", _model_output)
        with pytest.raises(
            AssertionError,
            match=r"outputs of fr\.data_parallel differ .*structures differ at the root: dict "
            r"with keys \['hidden', 'logits'\] in actual, Container of 2 in expected",
        ):
            check_against_stateful(module, (contain(kind, x, 0.5),), ["cpu", "cpu"])


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
        "fr.testing needs the optional 'hypothesis' dependency: pip install hypothesis "
        "(or, from a clone of the repository, pip install -e '.[testing]')"
    )
    with pytest.raises(ImportError, match=expected):
        importlib.import_module("freplicate.testing")
    with pytest.raises(ImportError, match=expected):
        fr.testing  # noqa: B018


_WITHOUT_HYPOTHESIS = """
import sys
sys.modules["hypothesis"] = None  # what an absent package looks like to import
from freplicate import *
assert "testing" not in dir(), "the star import must not reach fr.testing"
import freplicate as fr
try:
    fr.testing
except ImportError as err:
    print(err)
"""


def test_a_star_import_works_without_hypothesis():
    done = subprocess.run(
        [sys.executable, "-c", _WITHOUT_HYPOTHESIS],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "fr.testing needs the optional 'hypothesis' dependency" in done.stdout


# --------------------------------------------------------------------------- init_loopback_group


@pytest.mark.parametrize(
    ("arguments", "error", "message"),
    [
        (
            {"rank": 2, "world_size": 2},
            ValueError,
            r"rank must be in \[0, world_size\) = \[0, 2\), got rank=2",
        ),
        ({"rank": -1, "world_size": 2}, ValueError, r"rank must be in .* got rank=-1"),
        (
            {"rank": 0, "world_size": 0},
            ValueError,
            r"world_size must be at least 1, got world_size=0",
        ),
        ({"rank": 0, "world_size": "2"}, TypeError, r"world_size must be an int, got '2'"),
        ({"rank": 1.0, "world_size": 2}, TypeError, r"rank must be an int, got 1\.0"),
        ({"rank": 0, "world_size": 1, "timeout": 0}, ValueError, r"timeout must be a positive"),
        ({"rank": 0, "world_size": 1, "timeout": float("nan")}, ValueError, r"timeout must be"),
        ({"rank": 0, "world_size": 1, "timeout": "30"}, TypeError, r"timeout must be a number"),
    ],
)
def test_init_loopback_group_names_a_bad_argument(
    tmp_path: Path, arguments: dict[str, Any], error: type[Exception], message: str
):
    with pytest.raises(error, match=r"fr\.testing\.init_loopback_group: " + message):
        init_loopback_group(str(tmp_path / "store"), **arguments)
    assert not (tmp_path / "store").exists(), "refused before any rendezvous"


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


def test_trees_with_containers_nest_through_those_optree_keeps_whole():
    def containers(tree: Any) -> set[type]:
        return {
            type(x)
            for x in optree.tree_leaves(tree)
            if isinstance(x, (Output, Record, Items, dict, list, tuple))
        }

    drawn = _collect(trees(containers=True), 200)
    assert {Output, Record, Items} <= set().union(*map(containers, drawn))
    assert any("OrderedDict" in str(optree.tree_structure(t)) for t in drawn)
    assert not any(containers(t) for t in _collect(trees(), 200)), "only when asked"


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
    assert kinds >= {"TwoInputs", "Keywords", "SharedNames"}
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


def test_shared_modules_name_one_tensor_several_ways():
    shared, _ = _first(modules(kinds=["shared"]))
    names = [k for k, _ in shared.named_parameters(remove_duplicate=False)]
    weight = shared.block.lin.weight
    tied = [k for k, p in shared.named_parameters(remove_duplicate=False) if p is weight]
    assert tied == ["block.lin.weight", "again.lin.weight", "stack.0.lin.weight", "stack.1.weight"]
    assert len(list(shared.parameters())) == 3 < len(names)
    assert [k for k, _ in shared.named_buffers(remove_duplicate=False)] == [
        "block.scale",
        "again.scale",
        "stack.0.scale",
    ]


def test_reassigned_modules_rebind_their_buffers_in_training_only():
    module, inputs = _first(modules(kinds=["reassigned"], training=True))
    x = _first(inputs)
    before = dict(module.named_buffers())
    module(x)
    after = dict(module.named_buffers())
    assert all(after[k] is not before[k] for k in before), "new tensors, not updated in place"
    assert all(b._version == 0 for b in before.values())
    assert int(after["steps"]) == 1 and not torch.equal(after["avg"], before["avg"])
    module.eval()
    module(x)
    assert all(b is after[k] for k, b in module.named_buffers())


def test_modules_reject_unknown_kinds():
    with pytest.raises(ValueError, match=r"fr\.testing\.modules: unknown kinds \['lstm'\]"):
        modules(kinds=["lstm"])
    with pytest.raises(ValueError, match=r"fr\.testing\.modules: compile_backends must name"):
        modules(compiled=None, compile_backends=[])


def test_modules_draw_only_the_classic_kinds_unless_asked():
    assert set(CLASSIC_KINDS) < set(KINDS)
    assert {"reassigned", "checkpoint", "sparse", "dropout", "outputs"} == set(KINDS) - set(
        CLASSIC_KINDS
    )
    drawn = _collect(modules(), 100)
    assert not any(
        isinstance(m, (Checkpointed, SparseEmbedding, Reassigned, Outputs)) for m, _ in drawn
    )
    assert not any(isinstance(x, nn.Dropout) for m, _ in drawn for x in m.modules())


def _grads(module: nn.Module, x: Any) -> dict[str, torch.Tensor | None]:
    args, kwargs = _split(x)
    module.zero_grad(set_to_none=True)
    out = module(*args, **kwargs)
    if out.requires_grad:
        out.pow(2).sum().backward()
    return {k: p.grad for k, p in module.named_parameters()}


def test_checkpoint_modules_recompute_their_block_in_every_mode():
    drawn = _collect(st.tuples(modules(kinds=["checkpoint"]), st.data()), 60)
    assert {m.how for (m, _), _ in drawn} == set(CHECKPOINT_MODES)
    blocks = {type(getattr(m.block, "_checkpoint_wrapped_module", m.block)) for (m, _), _ in drawn}
    assert blocks == {nn.Sequential, TiedMLP}, "plain and tied blocks"
    for how in CHECKPOINT_MODES:
        module, inputs = next(pair for pair, _ in drawn if pair[0].how == how)
        calls: list[int] = []
        inner = getattr(module.block, "_checkpoint_wrapped_module", module.block)
        hook = inner.register_forward_pre_hook(lambda *_, calls=calls: calls.append(1))
        grads = _grads(module, _first(inputs))
        hook.remove()
        assert len(calls) == 2, f"{how}: the block runs again in backward"
        assert all(g is not None for g in grads.values())
        assert f"how={how!r}" in repr(module)


def test_sparse_modules_take_indices_and_give_sparse_gradients():
    for module, inputs in _collect(modules(kinds=["sparse"]), 20):
        x = _first(inputs)
        assert x.dtype == torch.int64 and x.dim() == 2
        assert int(x.max()) < module.embed.num_embeddings
        grads = _grads(module, x)
        assert grads["embed.weight"].is_sparse and not grads["head.weight"].is_sparse


def test_dropout_modules_draw_random_numbers_in_training_only():
    module, inputs = _first(modules(kinds=["dropout"], training=True, max_features=4))
    x = _first(inputs)
    torch.manual_seed(0)
    a = module(x)
    torch.manual_seed(0)
    assert torch.equal(a, module(x)), "one seed, one answer"
    assert any(isinstance(m, nn.Dropout) for m in module.modules())
    module.eval()
    assert torch.equal(module(x), module(x))


def test_frozen_modules_freeze_a_sub_tree_and_keep_one_trainable():
    seen_partial = False
    for module, _ in _collect(modules(kinds=list(KINDS), frozen=True), 150):
        flags = [p.requires_grad for p in module.parameters()]
        if flags:
            assert not all(flags), "something is frozen"
        if len(flags) >= 2:
            assert any(flags), "at least one parameter stays trainable"
            seen_partial = True
    assert seen_partial
    either = _collect(modules(frozen=None), 100)
    assert {all(p.requires_grad for p in m.parameters() if m) for m, _ in either} == {True, False}
    never = _collect(modules(kinds=["mlp", "tied", "checkpoint"]), 50)
    assert all(p.requires_grad for m, _ in never for p in m.parameters())


def test_compiled_modules_are_optimized_modules_of_a_drawn_backend():
    drawn = _collect(modules(kinds=["mlp"], compiled=True, compile_backends=["eager"]), 10)
    assert all(type(m).__name__ == "OptimizedModule" for m, _ in drawn)
    assert all(isinstance(m._orig_mod, nn.Sequential) for m, _ in drawn)
    never = _collect(modules(kinds=["mlp"]), 10)
    assert not any(type(m).__name__ == "OptimizedModule" for m, _ in never)


def test_half_precision_modules_have_half_parameters():
    for dtype in (torch.float16, torch.bfloat16):
        module, inputs = _first(modules(kinds=["mlp", "tied"], dtypes=[dtype]))
        assert all(p.dtype == dtype for p in module.parameters())
        assert _first(inputs).dtype == dtype


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


def test_outputs_modules_take_and_return_a_container_of_their_kind():
    @settings(max_examples=30, derandomize=True, database=None, deadline=None)
    @given(modules(kinds=["outputs"], max_batch=3), st.data())
    def check(pair: Any, data: st.DataObject) -> None:
        module, inputs = pair
        (batch,) = data.draw(inputs)
        assert module.kind in CONTAINER_KINDS
        assert type(module(batch)) is type(batch) is type(contain(module.kind, 0, 0))

    check()


@pytest.mark.parametrize("kind", CONTAINER_KINDS)
def test_contain_builds_each_kind_of_container(kind: str):
    made = contain(kind, torch.ones(4, 2), 3)
    expected = {
        "dict": dict,
        "ordered_dict": OrderedDict,
        "model_output": Output,
        "namedtuple": Pair,
        "dataclass": Record,
        "list": list,
        "tuple": tuple,
        "list_subclass": Items,
    }[kind]
    assert type(made) is expected
    y, loss = _contents(Outputs(2, 3, kind)(made))
    assert y.shape == (4, 3) and loss.shape == ()
    with pytest.raises(ValueError, match=r"contain: kind must be one of"):
        contain("set", 1, 2)


def test_output_is_built_as_a_model_output():
    logits = torch.ones(2)
    out = Output(loss=None, logits=logits, hidden=(logits,))
    assert list(out) == ["logits", "hidden"] and out.logits is out["logits"] is logits
    # from (key, value) pairs, as nn.parallel.scatter (a tuple) and gather (a generator) build it
    for pairs in (tuple(out.items()), (kv for kv in out.items()), out.items()):
        again = Output(pairs)
        assert list(again) == ["logits", "hidden"] and again.logits is logits and again.loss is None
    assert list(Output(loss=[1, 2])) == ["loss"], "values that are not pairs stay values"
    copied = copy.deepcopy(out)
    assert type(copied) is Output and torch.equal(copied.logits, logits)
    assert list(pickle.loads(pickle.dumps(out))) == ["logits", "hidden"]
