"""Argument checks shared by the public functions, each written once with one wording.

Every error starts with the public function's name (``caller``), names the
argument or the tree path, shows the value, and says what to do, so that
``fr.all_reduce`` and ``fr.distributed.all_reduce`` reject the same mistake
with the same words.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from itertools import repeat
from typing import Any

import torch

from ._tree import describe

__all__ = [
    "OPS",
    "check_choice",
    "check_int",
    "check_mean",
    "check_op",
    "check_positive",
    "check_state",
    "check_trees",
]

OPS = ("sum", "mean")


def _or(choices: Sequence[Any]) -> str:
    shown = [repr(c) for c in choices]
    return shown[0] if len(shown) == 1 else ", ".join(shown[:-1]) + " or " + shown[-1]


def check_choice(caller: str, arg: str, value: Any, choices: Sequence[Any]) -> None:
    """``ValueError`` unless ``value`` is one of ``choices`` (strings or ``None``).

    >>> check_choice("fr.f", "mode", "avg", ("broadcast", "mean"))
    Traceback (most recent call last):
    ...
    ValueError: fr.f: mode must be 'broadcast' or 'mean', got 'avg'
    """
    if not (isinstance(value, str) or value is None) or value not in choices:
        raise ValueError(f"{caller}: {arg} must be {_or(choices)}, got {value!r}")


def check_op(caller: str, op: Any) -> None:
    """``ValueError`` unless ``op`` is ``"sum"`` or ``"mean"``."""
    check_choice(caller, "op", op, OPS)


def check_mean(caller: str, tensors: Sequence[torch.Tensor], paths: Sequence[str]) -> None:
    """``TypeError`` naming the first leaf whose dtype has no mean (integers, bool).

    ``paths[k]`` names ``tensors[k]`` (read only to raise).

    >>> check_mean("fr.f", [torch.ones(1), torch.ones(1, dtype=torch.int64)], ["['a']", "['n']"])
    Traceback (most recent call last):
    ...
    TypeError: fr.f: op='mean' needs floating-point or complex leaves, but the leaf at ['n'] is torch.int64; use op='sum' or convert it
    """
    for k, t in enumerate(tensors):
        if not (t.is_floating_point() or t.is_complex()):
            raise TypeError(
                f"{caller}: op='mean' needs floating-point or complex leaves, but the leaf at "
                f"{paths[k]} is {t.dtype}; use op='sum' or convert it"
            )


def check_int(caller: str, arg: str, value: Any) -> int:
    """``value`` if it is an ``int`` (not a bool), else ``TypeError`` naming ``arg``.

    >>> check_int("fr.scatter", "dim", "0")
    Traceback (most recent call last):
    ...
    TypeError: fr.scatter: dim must be an int, got '0' of type str
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"{caller}: {arg} must be an int, got {value!r} of type {type(value).__name__}"
        )
    return value


def check_positive(caller: str, arg: str, value: Any) -> float:
    """``value`` as a float if it is a finite positive number, else an error naming ``arg``.

    >>> check_positive("fr.distributed.all_reduce", "bucket_cap_mb", float("nan"))
    Traceback (most recent call last):
    ...
    ValueError: fr.distributed.all_reduce: bucket_cap_mb must be a finite positive number, got nan
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            f"{caller}: {arg} must be a number, got {value!r} of type {type(value).__name__}"
        )
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{caller}: {arg} must be a finite positive number, got {value}")
    return float(value)


def check_state(caller: str, state: Any, *, entries: bool = True) -> None:
    """``TypeError`` unless ``state`` is an ``fr.State`` of two dicts of tensors.

    With ``entries=False`` only the containers are checked (``fr.apply``'s
    every call, where a look at hundreds of values would cost more than the
    binding): the caller then checks the entries where they fail.

    >>> check_state("fr.data_parallel", {"w": torch.ones(1)})
    Traceback (most recent call last):
    ...
    TypeError: fr.data_parallel: state must be an fr.State(params, buffers), got dict; make one with fr.state(module)
    """
    if not (isinstance(state, tuple) and len(state) == 2):
        raise TypeError(
            f"{caller}: state must be an fr.State(params, buffers), got {type(state).__name__}; "
            "make one with fr.state(module)"
        )
    for field, part in zip(("params", "buffers"), state):
        if not isinstance(part, Mapping):
            raise TypeError(
                f"{caller}: state.{field} must be a dict of name -> tensor, got "
                f"{type(part).__name__}; make the state with fr.state(module)"
            )
        if not entries:
            continue
        values = list(part.values())
        if all(map(isinstance, values, repeat(torch.Tensor, len(values)))):
            continue
        for name, value in part.items():
            if not isinstance(value, torch.Tensor):
                raise TypeError(
                    f"{caller}: state.{field}[{name!r}] must be a tensor, got {describe(value)}"
                )


def check_trees(caller: str, trees: Any) -> list[Any]:
    """``trees`` as a list, if it is a sequence of trees (one per device), else ``TypeError``.

    A single tree given where a list of them is expected (a dict, a tensor, a
    ``State``) would be read as its keys or fields: refused, naming the fix.

    >>> check_trees("fr.gather", {"y": torch.ones(1)})
    Traceback (most recent call last):
    ...
    TypeError: fr.gather: trees must be a list of trees (one per device), got a dict; wrap a single tree in a list: [tree]
    """
    single = (
        isinstance(trees, (Mapping, torch.Tensor, str, bytes))
        or hasattr(trees, "_fields")  # a NamedTuple such as fr.State is one tree
        or not isinstance(trees, Iterable)
    )
    if single:
        raise TypeError(
            f"{caller}: trees must be a list of trees (one per device), got a "
            f"{type(trees).__name__}; wrap a single tree in a list: [tree]"
        )
    return list(trees)
