"""Scatter and gather: split a batch tree into one shard per device, and join outputs back.

``shard`` is the scatter that ``data_parallel`` and ``data_parallel_grad``
build on: it takes parsed devices, the public caller's name for its errors,
and a renaming of paths (``inputs[0]``, ``batch[1]``) so that an error names
the argument the user passed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from .. import _pack, _tree
from .._checks import check_int, check_trees
from .._devices import as_device, as_devices
from .._typing import DeviceSpec, T, Tree

__all__ = ["gather", "scatter", "shard"]


def scatter(tree: T, devices: Sequence[DeviceSpec], *, dim: int = 0) -> list[T]:
    """Split every tensor leaf of ``tree`` along ``dim``, one shard per device.

    Leaves are cut as ``torch.chunk(leaf, len(devices), dim)`` and chunk *i*
    goes to ``devices[i]`` (a chunk already on its device is a view, not a
    copy; the others move in one flat buffer per dtype). Non-tensor leaves are
    shared by every shard. As ``nn.parallel.scatter``: when a leaf yields fewer
    chunks than devices (a batch of 3 on 4 devices, or of 5, which
    ``torch.chunk`` cuts as 2 + 2 + 1), there are that many shards, and when
    leaves yield different numbers of chunks the smallest wins; a tree without
    tensor leaves gives one shard per device. Containers are looked into as
    ``nn.parallel.scatter`` looks into them, and every shard holds one of the
    same type: dicts and dict subclasses (a ``transformers`` ``ModelOutput``,
    built as ``type(d)(pairs)``), lists, tuples, their subclasses and
    NamedTuples. A dataclass is not looked into: it is shared whole by every
    shard, as ``nn.parallel.scatter`` shares it. A moved chunk has the
    strides ``chunk.to(device)`` gives it (a ``channels_last`` batch cut along
    dim 0 gives ``channels_last`` shards). Differentiable: the gradient
    of the shards flows back into ``tree``. Nothing is modified.

    Args:
        tree: the batch, any pytree; its tensor leaves are split.
        devices: where the shards go, one device spec each (repeats allowed).
        dim: the dimension every tensor leaf is split along.

    Returns:
        One tree per shard, each of ``tree``'s structure.

    Raises:
        ValueError: a bad device; a 0-dim tensor leaf (it cannot be split: pass
            a scalar as a Python number, or close over it; ``nn.parallel.scatter``
            fails on it too); ``dim`` out of range for a leaf.
        TypeError: ``dim`` is not an int; a sparse or other non-strided leaf; a
            container whose constructor refuses its shard's values (naming its path).

    Examples:
        >>> shards = scatter({"x": torch.arange(5.0), "tag": "a"}, ["cpu", "cpu"])
        >>> [s["x"].tolist() for s in shards], shards[1]["tag"]
        ([[0.0, 1.0, 2.0], [3.0, 4.0]], 'a')
        >>> len(scatter(torch.ones(3, 2), ["cpu"] * 4))
        3
    """
    caller = "fr.scatter"
    check_int(caller, "dim", dim)
    return shard(tree, as_devices(devices, caller=caller), dim, caller=caller)


def shard(
    tree: T,
    devs: Sequence[torch.device],
    dim: int,
    *,
    caller: str,
    rename: Callable[[str], str] | None = None,
) -> list[T]:
    """``scatter`` onto parsed devices; errors name ``caller`` and paths as ``rename`` shows them."""
    # dataclasses stay whole, shared by every shard: nn.parallel.scatter does not look inside them
    leaves, spec = _tree.flatten_containers(tree, dataclasses=False)
    unique, slot = _tree.alias_groups(leaves)
    if not unique:
        return [tree for _ in devs]
    paths: Sequence[str] = _tree.LazyPaths(spec, unique)
    if rename is not None:
        paths = _Renamed(paths, rename)
    tensors = [leaves[i] for i in unique]
    _pack.check_packable(tensors, range(len(tensors)), paths, caller=caller)
    chunks = [_chunk(t, len(devs), dim, paths[k], caller) for k, t in enumerate(tensors)]
    n = min(len(c) for c in chunks)
    shards: list[T] = []
    for d in range(n):
        pieces = [c[d] for c in chunks]
        moved = _pack.broadcast_coalesced(pieces, [devs[d]], paths=paths, caller=caller)[0]
        shard = [moved[s] if s >= 0 else x for x, s in zip(leaves, slot)]  # ties kept
        shards.append(_tree.unflatten_containers(spec, shard, caller, rename))
    return shards


class _Renamed(Sequence[str]):
    """Paths shown as the caller names its tree (``inputs[0]``, ``batch[1]``), read only to raise."""

    def __init__(self, paths: Sequence[str], rename: Callable[[str], str]) -> None:
        self._paths = paths
        self._rename = rename

    def __len__(self) -> int:
        return len(self._paths)

    def __getitem__(self, i: Any) -> Any:
        return self._rename(self._paths[i])


def _chunk(t: torch.Tensor, n: int, dim: int, path: str, caller: str) -> tuple[torch.Tensor, ...]:
    nd = t.dim()
    if nd == 0:
        raise ValueError(
            f"{caller}: the tensor at {path} is 0-dim and cannot be split along dim {dim}; "
            "pass a scalar as a Python number (shared by every shard) or close over it"
        )
    if not -nd <= dim < nd:
        raise ValueError(
            f"{caller}: dim={dim} is out of range for the tensor at {path} of shape "
            f"{tuple(t.shape)} (expected -{nd} <= dim < {nd})"
        )
    return torch.chunk(t, n, dim)


def gather(trees: Sequence[Tree], device: DeviceSpec, *, dim: int = 0) -> Tree:
    """Concatenate ``trees`` leaf-wise along ``dim`` onto ``device``; the inverse of scatter.

    Every tree's tensor leaves move to ``device`` in one flat buffer per dtype
    and are concatenated there (``torch.cat``). 0-dim leaves, such as a loss
    per replica, are stacked into a 1-D tensor, one entry per tree, whatever
    ``dim`` is (``nn.DataParallel`` does the same for ``dim=0``). A non-tensor
    leaf equal in every tree comes back once; unequal ones come back as a
    tuple, one value per tree. Containers are joined as ``nn.parallel.gather``
    joins them, and keep their type: dict subclasses (a ``transformers``
    ``ModelOutput``, built as ``type(out)(pairs)``), list and tuple
    subclasses, NamedTuples; dataclasses too, field by field (built as
    ``type(out)(**init_fields)``), where ``nn.parallel.gather`` raises. The
    result has the layout ``torch.cat`` gives the parts (``channels_last``
    parts: ``channels_last``). Differentiable; nothing is modified.

    Args:
        trees: one tree per replica, all of one structure (a list, not one tree).
        device: where the result lies.
        dim: the dimension tensor leaves are concatenated along.

    Returns:
        One tree of the trees' structure.

    Raises:
        TypeError: ``trees`` is a single tree (a dict, a tensor) rather than a
            list of them; ``dim`` is not an int; a container whose constructor
            refuses its gathered values (naming its path).
        ValueError: ``trees`` is empty; a bad device; trees of different
            structure, or a tensor in one tree where another has a non-tensor
            (naming the first differing path); shapes that do not concatenate.

    Examples:
        >>> out = gather([{"y": torch.ones(2), "loss": torch.tensor(1.0), "k": "a"},
        ...               {"y": torch.zeros(1), "loss": torch.tensor(3.0), "k": "b"}], "cpu")
        >>> out["y"].tolist(), out["loss"].tolist(), out["k"]
        ([1.0, 1.0, 0.0], [1.0, 3.0], ('a', 'b'))
        >>> from collections import OrderedDict
        >>> class Output(OrderedDict): pass  # a ModelOutput, say
        >>> gather([Output(y=torch.ones(2)), Output(y=torch.zeros(1))], "cpu")
        Output([('y', tensor([1., 1., 0.]))])
    """
    trees = check_trees("fr.gather", trees)
    check_int("fr.gather", "dim", dim)
    dev = as_device(device, caller="fr.gather")
    if not trees:
        raise ValueError("fr.gather: trees is empty; give at least one tree")
    flats = [_tree.flatten_containers(t) for t in trees]
    specs = [s for _, s in flats]
    diff = _tree.first_container_difference(specs, trees)
    if diff is not None:
        raise ValueError(f"fr.gather: {diff}")
    spec = specs[0]
    columns = list(zip(*(leaves for leaves, _ in flats)))
    paths = _tree.LazyPaths(spec)
    tensor_pos: list[int] = []
    out: list[Any] = []
    for i, col in enumerate(columns):
        kinds = [isinstance(x, torch.Tensor) for x in col]
        if all(kinds):
            tensor_pos.append(i)
            out.append(None)
        elif any(kinds):
            j = kinds.index(not kinds[0])
            raise ValueError(
                f"fr.gather: trees differ at {paths[i]}: {_tree.describe(col[0])} in tree 0, "
                f"{_tree.describe(col[j])} in tree {j}"
            )
        else:
            out.append(col[0] if all(_same(col[0], x) for x in col[1:]) else tuple(col))
    if tensor_pos:
        sub = _tree.LazyPaths(spec, tensor_pos)
        moved = [
            _pack.broadcast_coalesced(
                [columns[i][j] for i in tensor_pos], [dev], paths=sub, caller="fr.gather"
            )[0]
            for j in range(len(trees))
        ]
        for k, i in enumerate(tensor_pos):
            out[i] = _join([m[k] for m in moved], dim, paths, i)
    return _tree.unflatten_containers(spec, out, "fr.gather")


def _join(parts: list[torch.Tensor], dim: int, paths: Sequence[str], i: int) -> torch.Tensor:
    scalar = [p.dim() == 0 for p in parts]
    if all(scalar):
        return torch.stack(parts)
    if any(scalar):
        j = scalar.index(not scalar[0])
        raise ValueError(
            f"fr.gather: trees differ at {paths[i]}: shape {tuple(parts[0].shape)} in tree 0, "
            f"{tuple(parts[j].shape)} in tree {j}; 0-dim leaves can only be gathered with "
            "0-dim leaves"
        )
    nd = parts[0].dim()
    if not -nd <= dim < nd:
        raise ValueError(
            f"fr.gather: dim={dim} is out of range for the tensor at {paths[i]} of shape "
            f"{tuple(parts[0].shape)} (expected -{nd} <= dim < {nd})"
        )
    try:
        return torch.cat(parts, dim)
    except RuntimeError as err:
        shapes = ", ".join(str(tuple(p.shape)) for p in parts)
        raise ValueError(
            f"fr.gather: cannot concatenate the tensors at {paths[i]} along dim {dim}: "
            f"shapes {shapes}: {err}"
        ) from err


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    try:
        return bool(a == b)
    except Exception:  # e.g. arrays, whose == is not a truth value: call them different
        return False
