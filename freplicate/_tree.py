"""Tree utilities: flatten with key paths, unflatten, alias detection, path naming.

Every tree operation in freplicate is written once over a flat list of leaves
with a closed-over treespec (optree's ``tree_ravel`` shape). This module is the
only place that talks to optree, so that paths are named the same way in every
error message: ``['layer1']['weight']``, ``[0].field``.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from itertools import repeat
from typing import Any

import optree
import torch
from optree import PyTreeSpec

__all__ = [
    "NAMESPACE",
    "LazyPaths",
    "PyTreeSpec",
    "alias_groups",
    "describe",
    "first_difference",
    "flatten",
    "flatten_in_order",
    "path_str",
    "paths_of",
    "picker",
    "rebuild",
    "structure_difference",
    "tensor_values",
    "unflatten",
]


# In freplicate's own optree namespace, dicts flatten in insertion order rather
# than sorted by key. A state's names come in ``named_parameters()`` order, and
# its reverse is the order gradients become ready, which fr.distributed's
# buckets follow (as DDP's do); sorted keys would put '10.weight' before
# '2.weight' and scatter a bucket's gradients over the backward pass. The mode
# is optree's own, set once for this namespace only (users' flattening keeps
# optree's default); the context is entered for the life of the process.
NAMESPACE = "freplicate"
_INSERTION_ORDERED = optree.dict_insertion_ordered(True, namespace=NAMESPACE)
_INSERTION_ORDERED.__enter__()


def flatten_in_order(tree: Any) -> tuple[list[Any], PyTreeSpec]:
    """Flatten ``tree`` with dicts in insertion order (see ``NAMESPACE``).

    >>> flatten_in_order({"b": 1, "a": 2})[0], flatten({"b": 1, "a": 2})[0]
    ([1, 2], [2, 1])
    """
    leaves, spec = optree.tree_flatten(tree, namespace=NAMESPACE)
    return leaves, spec


def tensor_values(tree: Any) -> list[torch.Tensor] | None:
    """``tree``'s values if it is a plain dict of tensors (how parameter trees come), else ``None``.

    In insertion order, as ``flatten_in_order`` gives them: for the commonest
    tree, callers skip optree's flatten, most of a small call's own cost.

    >>> tensor_values({"b": torch.ones(1), "a": torch.zeros(1)})
    [tensor([1.]), tensor([0.])]
    >>> tensor_values({"a": torch.ones(1), "n": 3}) is None, tensor_values([torch.ones(1)]) is None
    (True, True)
    """
    if type(tree) is not dict:
        return None
    values = list(tree.values())
    if not all(issubclass(k, torch.Tensor) for k in set(map(type, values))):
        return None
    return values


def flatten(tree: Any) -> tuple[list[Any], PyTreeSpec]:
    """Flatten ``tree`` into its leaves (``None`` is a node, not a leaf)."""
    leaves, spec = optree.tree_flatten(tree)
    return leaves, spec


def path_str(accessor: Any) -> str:
    """Render an optree accessor (or a tuple of keys) as ``['a'][0].field``."""
    if isinstance(accessor, optree.PyTreeAccessor):
        return accessor.codify("") or "<root>"
    return "".join(f"[{k!r}]" for k in accessor) or "<root>"


def paths_of(spec: PyTreeSpec) -> list[str]:
    """Paths of the leaves described by ``spec``, in leaf order, as source text.

    >>> paths_of(flatten({"a": [1, 2], "b": None})[1])
    ["['a'][0]", "['a'][1]"]
    """
    return [path_str(a) for a in spec.accessors()]


def picker(idx: Sequence[int]) -> Callable[[Sequence[Any]], list[Any]]:
    """``f(seq) -> [seq[i] for i in idx]``, at C speed.

    >>> picker([2, 0])("abc"), picker([1])("abc"), picker([])("abc")
    (['c', 'a'], ['b'], [])
    """
    if not idx:
        return lambda seq: []
    get = operator.itemgetter(*idx)
    if len(idx) == 1:
        return lambda seq: [get(seq)]
    return lambda seq: list(get(seq))


def unflatten(spec: PyTreeSpec, leaves: Sequence[Any]) -> Any:
    return optree.tree_unflatten(spec, leaves)


def rebuild(
    spec: PyTreeSpec, leaves: Sequence[Any], slot: Sequence[int], values: Sequence[Any]
) -> Any:
    """The tree of ``leaves`` with every tensor leaf ``i`` replaced by ``values[slot[i]]``.

    The inverse of ``alias_groups``: tied leaves get the one new value of
    their group, non-tensor leaves (``slot[i] == -1``) pass by reference.

    >>> leaves, spec = flatten({"a": 1, "b": 2, "c": "x"})
    >>> rebuild(spec, leaves, [0, 0, -1], ["new"])
    {'a': 'new', 'b': 'new', 'c': 'x'}
    """
    return optree.tree_unflatten(spec, [values[s] if s >= 0 else x for x, s in zip(leaves, slot)])


def alias_groups(leaves: Sequence[Any]) -> tuple[list[int], list[int]]:
    """Deduplicate tensor leaves by identity.

    Returns ``(unique, slot)``: ``unique`` lists the index of the first
    occurrence of every distinct tensor object, and ``slot[i]`` is the position
    in ``unique`` of leaf ``i`` (``-1`` for a non-tensor leaf). Tied weights
    therefore appear once in ``unique`` and can be re-aliased afterwards.

    >>> t = torch.ones(2)
    >>> alias_groups([t, 3, t, torch.zeros(1)])
    ([0, 3], [0, -1, 0, 1])
    """
    n = len(leaves)
    # Tensors hash by identity. Eagerly ``id()`` keys decide at C speed; while Dynamo traces,
    # ``id()`` would make it guard on every tensor's identity (a recompile each step), and the
    # tensors themselves as keys make it guard on their aliasing only.
    keys = leaves if torch.compiler.is_compiling() else list(map(id, leaves))
    if len(set(keys)) == n and all(map(isinstance, leaves, repeat(torch.Tensor, n))):
        # the common case (distinct tensors only)
        return list(range(n)), list(range(n))
    seen: dict[Any, int] = {}
    unique: list[int] = []
    slot: list[int] = []
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            pos = seen.get(keys[i])
            if pos is None:
                pos = seen[keys[i]] = len(unique)
                unique.append(i)
            slot.append(pos)
        else:
            slot.append(-1)
    return unique, slot


def first_difference(
    specs: Sequence[PyTreeSpec], trees: Sequence[Any], what: str = "tree"
) -> str | None:
    """Describe the first path at which the structures of ``trees`` differ.

    Returns ``None`` when all specs are equal. The text names the path and
    what stands there in each differing tree, e.g.
    ``at ['b']: dict with keys ('x',) in tree 0, list of 2 in tree 1``.
    """
    ref = specs[0]
    for j in range(1, len(specs)):
        if specs[j] == ref:
            continue
        at, mine, theirs = structure_difference(trees[0], trees[j])
        return f"{what}s differ at {at}: {mine} in {what} 0, {theirs} in {what} {j}"
    return None


def describe(node: Any) -> str:
    """What stands at a place in a tree, in words, for error messages.

    A tensor by its shape and dtype, another leaf by its type and value, a
    node by its type and keys or length.

    >>> describe(torch.ones(2)), describe(3), describe({"b": 1, "a": 2}), describe([1]), describe(None)
    ('a tensor of shape (2,) and dtype torch.float32', 'an int (3)', "dict with keys ('b', 'a')", 'list of 1', 'None')
    """
    if node is None:
        return "None"
    if isinstance(node, torch.Tensor):
        return f"a tensor of shape {tuple(node.shape)} and dtype {node.dtype}"
    if optree.tree_structure(node).is_leaf():
        name = type(node).__name__
        shown = repr(node)
        if len(shown) > 40:
            shown = shown[:37] + "..."
        return f"{'an' if name[0] in 'aeiouAEIOU' else 'a'} {name} ({shown})"
    if isinstance(node, dict):  # keys in their own order: an order that differs shows
        return f"{type(node).__name__} with keys {tuple(node)}"
    return f"{type(node).__name__} of {optree.tree_structure(node, is_leaf=lambda x: x is not node).num_children}"


def _one_level(node: Any, namespace: str) -> tuple[list[Any], list[Any], PyTreeSpec]:
    return optree.tree_flatten_with_accessor(
        node, is_leaf=lambda x: x is not node, namespace=namespace
    )


def structure_difference(
    a: Any, b: Any, render: Callable[[Any], str] | None = None, *, namespace: str = ""
) -> tuple[str, str, str]:
    """Where the structures of ``a`` and ``b`` first part: ``(path, what a has, what b has)``.

    ``render`` renders the node found there (default: ``describe``);
    ``path`` is ``"the root"`` when the roots already differ. With
    ``namespace=NAMESPACE``, dicts whose keys come in another order differ.

    >>> structure_difference({"a": [1, 2]}, {"a": [1]})
    ("['a']", 'list of 2', 'list of 1')
    >>> structure_difference({"a": 1, "b": 2}, {"b": 2, "a": 1}, namespace=NAMESPACE)
    ('the root', "dict with keys ('a', 'b')", "dict with keys ('b', 'a')")
    """
    return _diff(a, b, optree.PyTreeAccessor(), render or describe, namespace)


def _diff(
    a: Any, b: Any, path: Any, render: Callable[[Any], str], namespace: str
) -> tuple[str, str, str]:
    where = path_str(path) if len(path) else "the root"
    acc_a, kids_a, spec_a = _one_level(a, namespace)
    _, kids_b, spec_b = _one_level(b, namespace)
    if spec_a != spec_b or spec_a.num_children == 0:
        return where, render(a), render(b)
    for acc, ca, cb in zip(acc_a, kids_a, kids_b):
        if optree.tree_structure(ca, namespace=namespace) != optree.tree_structure(
            cb, namespace=namespace
        ):
            return _diff(ca, cb, path + acc, render, namespace)
    return where, render(a), render(b)  # pragma: no cover


class LazyPaths(Sequence[str]):
    """Paths of the leaves ``unique`` (all leaves if ``None``) of ``spec``, computed on first read.

    Hot paths hand these to the engine, which reads them only to raise.
    """

    def __init__(self, spec: PyTreeSpec, unique: Sequence[int] | None = None) -> None:
        self._spec = spec
        self._unique = unique
        self._paths: list[str] | None = None

    def __len__(self) -> int:
        return len(self._unique) if self._unique is not None else self._spec.num_leaves

    def __getitem__(self, i: Any) -> Any:
        if self._paths is None:
            every = paths_of(self._spec)
            self._paths = every if self._unique is None else [every[j] for j in self._unique]
        return self._paths[i]
