"""Tree utilities: paths as source text, alias groups, structure-difference text, lazy paths."""

from __future__ import annotations

from collections import OrderedDict, namedtuple

import optree
import pytest
import torch
from torch import nn

import freplicate as fr
from freplicate import _tree

Point = namedtuple("Point", "x y")


def spec(tree: object) -> optree.PyTreeSpec:
    return _tree.flatten(tree)[1]


def diff(*trees: object, what: str = "tree") -> str | None:
    return _tree.first_difference([spec(t) for t in trees], trees, what)


@pytest.mark.parametrize(
    "tree, paths",
    [
        ({"a": [1, 2], "b": None}, ["['a'][0]", "['a'][1]"]),
        ({"layer1": {"weight": 0, "bias": 1}}, ["['layer1']['bias']", "['layer1']['weight']"]),
        ((1, (2,)), ["[0]", "[1][0]"]),
        (Point(1, [2]), [".x", ".y[0]"]),
        (fr.State({"w": 1}, {"b": 2}), [".params['w']", ".buffers['b']"]),
        (OrderedDict([("z", 1), ("a", 2)]), ["['z']", "['a']"]),
        ({0: 1, "k": 2}, ["[0]", "['k']"]),
        (5, ["<root>"]),
    ],
)
def test_paths_of(tree: object, paths: list[str]) -> None:
    leaves, s = _tree.flatten(tree)
    assert _tree.paths_of(s) == paths
    assert _tree.unflatten(s, leaves) == tree


def test_none_is_a_node_not_a_leaf() -> None:
    leaves, s = _tree.flatten([None, 1, {"a": None}])
    assert leaves == [1]
    assert _tree.unflatten(s, [7]) == [None, 7, {"a": None}]


def test_path_str_of_key_tuples() -> None:
    assert _tree.path_str(("a", 0)) == "['a'][0]"
    assert _tree.path_str(()) == "<root>"


def test_alias_groups() -> None:
    t, u = torch.ones(2), torch.zeros(1)
    view = t.view(2)  # shares storage with t but is another object: not an alias
    unique, slot = _tree.alias_groups([3, t, "s", u, t, view, None, u])
    assert unique == [1, 3, 5]
    assert slot == [-1, 0, -1, 1, 0, 2, -1, 1]
    assert _tree.alias_groups([]) == ([], [])
    # distinct tensors only (the fast path) and tensors only with an alias (the slow one)
    a, b = torch.ones(1), nn.Parameter(torch.ones(1))
    assert _tree.alias_groups([a, b, u]) == ([0, 1, 2], [0, 1, 2])
    assert _tree.alias_groups([a, b, a]) == ([0, 1], [0, 1, 0])
    assert _tree.alias_groups([1, 2]) == ([], [-1, -1])


@pytest.mark.parametrize(
    "trees, text",
    [
        (
            [{"a": {"b": [1, 2]}}, {"a": {"b": [1]}}],
            "trees differ at ['a']['b']: list of 2 in tree 0, list of 1 in tree 1",
        ),
        (
            [{"a": 1, "b": {"x": 1}}, {"a": 1, "b": [1, 2]}],
            "trees differ at ['b']: dict with keys ('x',) in tree 0, list of 2 in tree 1",
        ),
        ([[1, None], [1, 2]], "trees differ at [1]: None in tree 0, an int (2) in tree 1"),
        ([1, (1,)], "trees differ at the root: an int (1) in tree 0, tuple of 1 in tree 1"),
        (
            [Point(1, [1]), Point(1, 2)],
            "trees differ at .y: list of 1 in tree 0, an int (2) in tree 1",
        ),
        (
            [fr.State({"w": 1}, {}), fr.State({"w": 1}, {"b": 2})],
            "trees differ at .buffers: dict with keys () in tree 0, dict with keys ('b',) in tree 1",
        ),
        (
            [{"a": 1}, {"a": 1}, {"b": 1}],
            "trees differ at the root: dict with keys ('a',) in tree 0, dict with keys ('b',) in tree 2",
        ),
    ],
)
def test_first_difference_text(trees: list[object], text: str) -> None:
    assert diff(*trees) == text


def test_first_difference_equal_and_custom_word() -> None:
    t = {"a": torch.ones(1), "b": [1, "x"]}
    assert diff(t, {"a": 2.0, "b": [torch.ones(3), "y"]}) is None  # leaves may differ
    assert diff([1], [1, 2], what="replica") == (
        "replicas differ at the root: list of 1 in replica 0, list of 2 in replica 1"
    )


def test_lazy_paths_reads_only_when_asked() -> None:
    s = spec({"a": 1, "b": [2, 3]})
    lazy = _tree.LazyPaths(s, [0, 2])
    assert lazy._paths is None  # nothing computed on construction
    assert len(lazy) == 2
    assert lazy[1] == "['b'][1]"
    assert list(lazy) == ["['a']", "['b'][1]"]
    every = _tree.LazyPaths(s)
    assert len(every) == 3 and every[:] == ["['a']", "['b'][0]", "['b'][1]"]


def test_rebuild_realiases_and_passes_other_leaves() -> None:
    t, obj = torch.ones(2), object()
    leaves, s = _tree.flatten({"a": t, "b": [obj, t], "c": None})
    _, slot = _tree.alias_groups(leaves)
    new = torch.zeros(2)
    out = _tree.rebuild(s, leaves, slot, [new])
    assert out["a"] is new and out["b"][1] is new and out["b"][0] is obj and out["c"] is None


@pytest.mark.parametrize(
    "node, text",
    [
        (torch.ones(2, 3, dtype=torch.int64), "a tensor of shape (2, 3) and dtype torch.int64"),
        ("x" * 50, "a str ('" + "x" * 36 + "...)"),
        (1.5, "a float (1.5)"),
        (object, "a type (<class 'object'>)"),
        ({"b": 1, "a": 2}, "dict with keys ('b', 'a')"),
        ((1, 2), "tuple of 2"),
        (None, "None"),
    ],
)
def test_describe(node: object, text: str) -> None:
    assert _tree.describe(node) == text
