"""``assert_trees_close``: tree equality whose failure says where.

Structure is compared first (node types, dict keys, lengths), walking both
trees together so that the message names the first path at which they part;
then leaves in flatten order: tensors with ``torch.testing.assert_close``
(dtype, device, shape and values), any other leaf with ``==``. Paths read as
source text, ``['layer1']['weight']`` or ``[0].field``.
"""

from __future__ import annotations

from typing import Any

import optree
import torch

__all__ = ["assert_trees_close", "check_tolerances"]


def assert_trees_close(
    actual: Any, expected: Any, *, rtol: float | None = None, atol: float | None = None
) -> None:
    """Assert that two trees have the same structure and close leaves.

    Tensor leaves are compared with ``torch.testing.assert_close(actual,
    expected, rtol=rtol, atol=atol)``, other leaves with ``==``.

    Args:
        actual: a tree.
        expected: the tree ``actual`` must equal.
        rtol: relative tolerance, given together with ``atol``; both
            ``None`` (the default) take ``torch.testing.assert_close``'s
            defaults for each leaf's dtype. One without the other is refused,
            as ``torch.testing.assert_close`` refuses it: a lone tolerance
            would silently be paired with a default that may not fit.
        atol: absolute tolerance, given together with ``rtol``.

    Raises:
        AssertionError: the structures differ, or two leaves do; the message
            names the path of the first difference.
        ValueError: ``rtol`` without ``atol``, or the reverse.

    >>> assert_trees_close({"w": torch.ones(2), "n": 3}, {"w": torch.ones(2), "n": 3})
    >>> assert_trees_close({"w": [torch.ones(2)]}, {"w": [torch.zeros(2)]})
    Traceback (most recent call last):
    ...
    AssertionError: assert_trees_close: leaves differ at ['w'][0]: Tensor-likes are not close! ...
    >>> assert_trees_close({"w": [1, 2]}, {"w": (1, 2)})
    Traceback (most recent call last):
    ...
    AssertionError: assert_trees_close: structures differ at ['w']: list of 2 in actual, tuple of 2 in expected
    >>> assert_trees_close({"w": torch.ones(2)}, {"w": torch.ones(2)}, rtol=1e-3)
    Traceback (most recent call last):
    ...
    ValueError: assert_trees_close: give rtol and atol together, or neither; got rtol=0.001 and no atol
    """
    check_tolerances(rtol, atol, "assert_trees_close")
    if optree.tree_structure(actual) != optree.tree_structure(expected):
        path, got, want = _structure_difference(actual, expected, "")
        raise AssertionError(
            f"assert_trees_close: structures differ at {path or 'the root'}: "
            f"{got} in actual, {want} in expected"
        )
    accessors, leaves_a, _ = optree.tree_flatten_with_accessor(actual)
    leaves_e = optree.tree_leaves(expected)
    for accessor, a, e in zip(accessors, leaves_a, leaves_e):
        problem = _leaf_difference(a, e, rtol, atol)
        if problem is not None:
            path = accessor.codify("") or "the root"
            raise AssertionError(f"assert_trees_close: leaves differ at {path}: {problem}")


def check_tolerances(rtol: float | None, atol: float | None, fn: str) -> None:
    """``ValueError`` naming ``fn`` unless ``rtol`` and ``atol`` are both given or both ``None``."""
    if (rtol is None) != (atol is None):
        given, missing = ("rtol", "atol") if atol is None else ("atol", "rtol")
        value = rtol if atol is None else atol
        raise ValueError(
            f"{fn}: give rtol and atol together, or neither; got {given}={value!r} and no {missing}"
        )


def _leaf_difference(a: Any, e: Any, rtol: float | None, atol: float | None) -> str | None:
    a_is, e_is = isinstance(a, torch.Tensor), isinstance(e, torch.Tensor)
    if a_is and e_is:
        try:
            torch.testing.assert_close(a, e, rtol=rtol, atol=atol)
        except AssertionError as err:
            return str(err)
        return None
    if a_is or e_is:
        return f"{_describe(a)} in actual, {_describe(e)} in expected"
    if a is e or _equal(a, e):
        return None
    return f"{a!r} in actual, {e!r} in expected"


def _equal(a: Any, e: Any) -> bool:
    try:
        if bool(a == e):
            return True
    except Exception:  # an object whose == does not give a truth value
        return False
    # nan equals nan here: a leaf passed through unchanged must compare equal
    return isinstance(a, float) and isinstance(e, float) and a != a and e != e


def _describe(node: Any) -> str:
    if node is None:
        return "None"
    if isinstance(node, torch.Tensor):
        return f"a tensor of shape {tuple(node.shape)} and dtype {node.dtype}"
    if optree.tree_structure(node).is_leaf():
        return f"a leaf {node!r} of type {type(node).__name__}"
    if isinstance(node, dict):
        return f"{type(node).__name__} with keys {sorted(node, key=repr)!r}"
    return f"{type(node).__name__} of {len(_children(node)[1])}"


def _children(node: Any) -> tuple[list[Any], list[Any], Any]:
    """One level of ``node``: accessors and children, and the one-level spec."""
    return optree.tree_flatten_with_accessor(node, is_leaf=lambda x: x is not node)


def _structure_difference(a: Any, e: Any, path: str) -> tuple[str, str, str]:
    """``(path, what actual has there, what expected has there)`` where the trees part."""
    acc_a, kids_a, spec_a = _children(a)
    _, kids_e, spec_e = _children(e)
    if spec_a != spec_e or spec_a.is_leaf():
        return path, _describe(a), _describe(e)
    for acc, ka, ke in zip(acc_a, kids_a, kids_e):
        if optree.tree_structure(ka) != optree.tree_structure(ke):
            return _structure_difference(ka, ke, path + acc.codify(""))
    raise AssertionError("unreachable: equal children under equal nodes")  # pragma: no cover
