"""A call's options: what every rank must pass alike, checked once, carried as one value.

``Options`` is part of every layout (``_layout``): two ranks that pass
different options (or call different kinds of collective) run different
layouts, and the layout check names the difference. ``check`` is not among
them: it decides whether the check runs.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, NamedTuple

import torch

from .._checks import check_choice, check_op, check_positive
from .._typing import Compress, Op
from ._wire import KINDS, Kind

__all__ = [
    "COMPRESS",
    "Options",
    "check_weighted",
    "reduction",
    "weight_value",
]

COMPRESS: dict[Compress, torch.dtype | None] = {
    None: None,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}


class Options(NamedTuple):
    """The options of one call, as every rank must pass them."""

    kind: str  # the collective's name: ``collective`` is the object (``_wire``)
    op: Op  # an all-gather's is its transpose's
    bucket_cap_mb: float
    compress: Compress
    src: int | None = None  # broadcast's source rank (global); None for every other call
    weighted: bool = False  # a weighted mean: every rank sends a weight
    # the buckets start during a backward pass (a gradient step's): DDP's small first bucket.
    # A ready tree's call is cut at the cap alone (as few collectives as it allows)
    overlap: bool = False

    @property
    def collective(self) -> Kind:
        """The kind of collective (``_wire``): its format, transport and rules."""
        return KINDS[self.kind]

    def describe(self) -> str:
        """The options named as the public functions' keywords.

        >>> Options("all_reduce", "mean", 25.0, None).describe()
        "(op='mean', bucket_cap_mb=25.0, compress=None, src=None, weighted=False)"
        """
        names = ("op", "bucket_cap_mb", "compress", "src", "weighted")
        return "(" + ", ".join(f"{n}={getattr(self, n)!r}" for n in names) + ")"

    @property
    def cap_bytes(self) -> int:
        return max(1, int(self.bucket_cap_mb * 1024 * 1024))

    @property
    def comm(self) -> torch.dtype | None:
        """The dtype floating-point buckets travel in (``None``: their own)."""
        return COMPRESS[self.compress]


def reduction(
    caller: str, kind: Kind, op: Any, bucket_cap_mb: Any, compress: Any, *, weighted: bool = False
) -> Options:
    """The checked options of a reduction (before anything else, with or without a group)."""
    valid = (  # the usual options, tested in place (every call runs this): no check to call
        type(op) is str
        and (op == "mean" or (op == "sum" and not weighted))
        and type(bucket_cap_mb) in (int, float)
        and 0 < bucket_cap_mb < math.inf
        and (compress is None or (type(compress) is str and compress in COMPRESS))
    )
    if not valid:  # the checks, which raise naming what is wrong
        check_op(caller, op)
        check_positive(caller, "bucket_cap_mb", bucket_cap_mb)
        check_choice(caller, "compress", compress, tuple(COMPRESS))
        if weighted:
            check_weighted(caller, op)
    return Options(kind.name, op, float(bucket_cap_mb), compress, None, weighted)


def check_weighted(caller: str, op: Any) -> None:
    """``ValueError`` unless ``op`` is ``"mean"``: a weight makes a mean a weighted one."""
    if op != "mean":
        raise ValueError(
            f"{caller}: weight= makes op='mean' a weighted mean; it has no meaning with "
            f"op={op!r} (drop weight=, or scale the tree yourself)"
        )


def weight_value(caller: str, weight: Any, what: str = "weight") -> float:
    """``weight`` as a float if it is a finite number >= 0 (or a one-element real tensor).

    A tensor is read back to the host (on CUDA, a synchronisation).

    >>> weight_value("fr.f", torch.tensor(3))
    3.0
    >>> weight_value("fr.f", -1)
    Traceback (most recent call last):
    ...
    ValueError: fr.f: weight must be a finite number >= 0, got -1
    """
    value = weight
    if (
        isinstance(value, torch.Tensor)
        and value.numel() == 1
        and not (value.is_complex() or value.dtype == torch.bool)
    ):
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"{caller}: {what} must be a number (or a one-element real tensor), got "
            f"{weight!r} of type {type(weight).__name__}"
        )
    number = float(value)
    if not (math.isfinite(number) and number >= 0):
        raise ValueError(f"{caller}: {what} must be a finite number >= 0, got {weight!r}")
    return number
