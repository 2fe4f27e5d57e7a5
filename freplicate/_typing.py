"""The type aliases of freplicate's signatures, in one place (torchopt's ``typing.py``).

A *tree* is anything optree flattens; its leaves are tensors and values that
pass through unchanged. These aliases say in a signature what a tree is for;
they cannot say what it holds (Python's type system has no recursive
container of "tensor or anything").
"""

from __future__ import annotations

from typing import Any, Literal, TypeAlias, TypeVar

import torch

__all__ = [
    "Compress",
    "DeviceSpec",
    "Op",
    "T",
    "TensorTree",
    "Tree",
]

T = TypeVar("T")

#: any pytree: dict, list, tuple, NamedTuple, None, registered nodes, and leaves
Tree: TypeAlias = Any
#: a pytree whose leaves that matter are tensors (parameters, gradients, buffers)
TensorTree: TypeAlias = Any
#: a device: an int CUDA index, a str such as ``"cpu"`` or ``"cuda:1"``, or a ``torch.device``
DeviceSpec: TypeAlias = int | str | torch.device
#: how a reduction combines its operands
Op: TypeAlias = Literal["sum", "mean"]
#: the dtype a floating-point bucket travels in across processes (``None``: its own)
Compress: TypeAlias = Literal["bf16", "fp16"] | None
