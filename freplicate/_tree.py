"""Tree utilities: flatten with key paths, unflatten, alias detection, path naming.

Every tree operation in freplicate is written once over a flat list of leaves
with a closed-over treespec (optree's ``tree_ravel`` shape). This module is the
only place that talks to optree, so that paths are named the same way in every
error message: ``['layer1']['weight']``, ``[0].field``.
"""

from __future__ import annotations

import dataclasses as _dataclasses
import operator
from collections.abc import Callable, Sequence
from itertools import repeat
from typing import Any

import optree
import torch
from optree import PyTreeSpec

__all__ = [
    "CONTAINERS",
    "NAMESPACE",
    "LazyPaths",
    "PyTreeSpec",
    "RebuildError",
    "alias_groups",
    "describe",
    "first_container_difference",
    "first_difference",
    "flatten",
    "flatten_containers",
    "flatten_in_order",
    "path_str",
    "paths_of",
    "picker",
    "rebuild",
    "structure_difference",
    "tensor_values",
    "unflatten",
    "unflatten_containers",
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
    if not all(map(isinstance, values, repeat(torch.Tensor))):  # at C speed: no frame a leaf
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


# --- containers optree keeps whole, seen inside as nn.parallel's scatter and gather see them

# optree treats a dict, list or tuple *subclass* it does not know (a transformers
# ``ModelOutput``) and a dataclass as leaves, where nn.parallel's scatter and gather
# look inside them. In this namespace such a container is flattened through a
# stand-in node (``_Wrapped``, ``_Fields``) whose unflattening builds the
# container's own type again; nothing is registered for the user's types.
CONTAINERS = "freplicate.containers"


class RebuildError(TypeError):
    """A container of a user's tree whose constructor refused its new values.

    ``message(caller, rename)`` is the error a public function raises,
    naming the container's path as ``rename`` shows it.
    """

    def __init__(self, cls: type, path: str, call: str, err: Exception, advice: str) -> None:
        self.cls, self.path = cls, path
        self.detail = f"{call} raised {type(err).__name__}: {err}; {advice}"
        super().__init__(self.message("freplicate"))

    def message(self, caller: str, rename: Callable[[str], str] | None = None) -> str:
        path = self.path or "<root>"
        if rename is not None:
            path = rename(path)
        return (
            f"{caller}: cannot rebuild the {self.cls.__name__} at {path} with new values: "
            f"{self.detail}"
        )


class _Through(optree.PyTreeEntry):
    """The entry of a stand-in's one child: it adds nothing to a path (``['logits']``)."""

    __slots__ = ()

    def __call__(self, obj: Any, /) -> Any:
        return obj.child

    def codify(self, /, node: str = "") -> str:
        return node


class _Wrapped:
    """A dict, list or tuple subclass as a node: its type, and its items as a plain dict or list."""

    __slots__ = ("child", "meta")

    def __init__(self, x: Any, path: str, child: Any) -> None:
        self.child = child
        if isinstance(child, dict):
            try:  # keys in any order are one structure, as a plain dict's are
                keys: Any = tuple(sorted(child))
            except TypeError:
                keys = tuple(child)
        else:
            keys = len(child)
        self.meta = (type(x), path, keys)


def _rebuild_wrapped(meta: tuple[type, str, Any], children: Sequence[Any]) -> Any:
    cls, path, _ = meta
    (child,) = children
    mapping = isinstance(child, dict)
    try:  # nn.parallel.gather's type(out)((k, v) for k in out) and type(out)(values)
        return cls(child.items()) if mapping else cls(child)
    except Exception as err:
        call, takes = (
            (f"{cls.__name__}(pairs)", "(key, value) pairs, as dict's does")
            if mapping
            else (f"{cls.__name__}(values)", "one iterable of values, as list's does")
        )
        raise RebuildError(
            cls, path, call, err, f"give it a constructor that takes {takes}"
        ) from err


class _Fields:
    """A dataclass instance as a node: its type and the values of its ``init`` fields."""

    __slots__ = ("meta", "values")

    def __init__(self, x: Any, path: str, names: tuple[str, ...], values: list[Any]) -> None:
        self.meta = (type(x), path, names)
        self.values = values


def _rebuild_fields(meta: tuple[type, str, tuple[str, ...]], values: Sequence[Any]) -> Any:
    cls, path, names = meta
    try:
        return cls(**dict(zip(names, values)))
    except Exception as err:
        advice = "its __init__ must take every init field as a keyword, as the generated one does"
        raise RebuildError(cls, path, f"{cls.__name__}(**fields)", err, advice) from err


_register: Any = optree.register_pytree_node  # typed for collections, which the stand-ins are not
_register(
    _Wrapped,
    lambda w: ((w.child,), w.meta, (0,)),
    _rebuild_wrapped,
    path_entry_type=_Through,
    namespace=CONTAINERS,
)
_register(
    _Fields,
    lambda f: (f.values, f.meta, f.meta[2]),
    _rebuild_fields,
    path_entry_type=optree.GetAttrEntry,
    namespace=CONTAINERS,
)


def _container(x: Any, dataclasses: bool) -> bool:
    cls = type(x)
    if issubclass(cls, torch.Tensor):
        return False
    if issubclass(cls, (dict, list, tuple)):
        return cls is not torch.Size  # a shape is a value: nn.parallel.gather cannot join one
    return dataclasses and _dataclasses.is_dataclass(cls)


def _with_stand_ins(tree: Any, dataclasses: bool, prefix: str) -> Any:
    accessors, leaves, spec = optree.tree_flatten_with_accessor(tree, namespace=CONTAINERS)
    for i, x in enumerate(leaves):
        if not _container(x, dataclasses):
            continue
        path = prefix + accessors[i].codify("")
        if isinstance(x, dict) or not _dataclasses.is_dataclass(x):
            child = _with_stand_ins(dict(x) if isinstance(x, dict) else list(x), dataclasses, path)
            leaves[i] = _Wrapped(x, path, child)
        else:
            names = tuple(f.name for f in _dataclasses.fields(x) if f.init)
            values = [_with_stand_ins(getattr(x, n), dataclasses, f"{path}.{n}") for n in names]
            leaves[i] = _Fields(x, path, names, values)
    return optree.tree_unflatten(spec, leaves)


def flatten_containers(tree: Any, *, dataclasses: bool = True) -> tuple[list[Any], PyTreeSpec]:
    """Flatten ``tree`` looking inside the containers optree keeps whole, as ``nn.parallel`` does.

    A dict subclass (a ``ModelOutput``), a list or tuple subclass and, with
    ``dataclasses``, a dataclass instance are nodes, not leaves; unflattening
    builds each with its own type again, as ``nn.parallel.gather`` does:
    ``cls(pairs)``, ``cls(values)``, ``cls(**init_fields)`` (a constructor
    that refuses raises ``RebuildError``). ``torch.Size`` stays a leaf. Dicts
    and dict subclasses flatten in sorted key order (any order is one
    structure); paths read ``['logits']``, ``[0]``, ``.field``.

    >>> from collections import OrderedDict
    >>> class Output(OrderedDict): pass
    >>> leaves, spec = flatten_containers([Output(b=1, a=torch.ones(1)), 3])
    >>> leaves, paths_of(spec)
    ([tensor([1.]), 1, 3], ["[0]['a']", "[0]['b']", '[1]'])
    >>> unflatten(spec, [2, 1, 3])
    [Output([('b', 1), ('a', 2)]), 3]
    """
    leaves, spec = optree.tree_flatten(tree, namespace=CONTAINERS)
    if all(map(isinstance, leaves, repeat(torch.Tensor, len(leaves)))) or not any(
        _container(x, dataclasses) for x in leaves
    ):
        return leaves, spec
    leaves, spec = optree.tree_flatten(_with_stand_ins(tree, dataclasses, ""), namespace=CONTAINERS)
    return leaves, spec


def unflatten_containers(
    spec: PyTreeSpec, leaves: Sequence[Any], caller: str, rename: Callable[[str], str] | None = None
) -> Any:
    """``unflatten`` for a spec of ``flatten_containers``: a container whose constructor
    refuses its new values raises ``TypeError`` naming ``caller`` and its path (as ``rename``
    shows it)."""
    try:
        return optree.tree_unflatten(spec, leaves)
    except RebuildError as err:
        raise TypeError(err.message(caller, rename)) from err.__cause__


def _describe_stand_in(node: Any) -> str:
    if isinstance(node, _Wrapped):
        cls, _, keys = node.meta
        shape = f"of {keys}" if isinstance(keys, int) else f"with keys {tuple(node.child)}"
        return f"{cls.__name__} {shape}"
    if isinstance(node, _Fields):
        return f"{node.meta[0].__name__} with fields {node.meta[2]}"
    return describe(node)


def first_container_difference(
    specs: Sequence[PyTreeSpec],
    trees: Sequence[Any],
    what: str = "tree",
    *,
    dataclasses: bool = True,
) -> str | None:
    """``first_difference`` for specs of ``flatten_containers(dataclasses=dataclasses)``.

    >>> from collections import OrderedDict
    >>> class Output(OrderedDict): pass
    >>> trees = [Output(a=1), Output(a=1, b=2)]
    >>> first_container_difference([flatten_containers(t)[1] for t in trees], trees)
    "trees differ at the root: Output with keys ('a',) in tree 0, Output with keys ('a', 'b') in tree 1"
    """
    for j in range(1, len(specs)):
        if specs[j] != specs[0]:
            a, b = (_with_stand_ins(trees[k], dataclasses, "") for k in (0, j))
            at, mine, theirs = structure_difference(a, b, _describe_stand_in, namespace=CONTAINERS)
            return f"{what}s differ at {at}: {mine} in {what} 0, {theirs} in {what} {j}"
    return None
