"""Helpers shared by the properties: example budgets, input snapshots, value refills."""

from __future__ import annotations

from typing import Any

import optree
import torch
from hypothesis import settings


def examples(fraction: float) -> settings:
    """Settings running ``fraction`` of the profile's examples (at least 2), for costly properties."""
    return settings(max_examples=max(2, int(settings.default.max_examples * fraction)))


class Unchanged:
    """Remembers every tensor in some trees (``_version`` and value) to check none was modified."""

    def __init__(self, *trees: Any) -> None:
        accessors, leaves, _ = optree.tree_flatten_with_accessor(trees)
        self.seen = [
            (a.codify("trees"), t, t._version, t.detach().clone())
            for a, t in zip(accessors, leaves)
            if isinstance(t, torch.Tensor)
        ]

    def check(self, by: str) -> None:
        for path, t, version, value in self.seen:
            assert t._version == version, f"{by} modified {path} in place (_version changed)"
            assert torch.equal(t.detach(), value), f"{by} changed the values of {path}"


def module_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return dict((*module.named_parameters(), *module.named_buffers()))


def refill(tree: Any, seed: int, device: Any = None, *, integral: bool = True) -> Any:
    """``tree`` with new tensors of the same shapes and dtypes (ties kept), optionally moved.

    With ``integral``, floating values are small integers, so that sums and
    means of a few of them are exact in every dtype (float16 and bfloat16 too).
    """
    leaves, spec = optree.tree_flatten(tree)
    made: dict[int, torch.Tensor] = {}
    g = torch.Generator().manual_seed(seed)
    out = []
    for leaf in leaves:
        if not isinstance(leaf, torch.Tensor):
            out.append(leaf)
            continue
        if id(leaf) not in made:
            if leaf.dtype == torch.bool:
                new = torch.randint(0, 2, leaf.shape, generator=g).bool()
            elif leaf.is_floating_point() and not integral:
                new = torch.randn(leaf.shape, generator=g).to(leaf.dtype)
            else:
                new = torch.randint(-4, 5, leaf.shape, generator=g).to(leaf.dtype)
            made[id(leaf)] = new.to(leaf.device if device is None else device)
        out.append(made[id(leaf)])
    return optree.tree_unflatten(spec, out)


def tensor_leaves(tree: Any) -> list[torch.Tensor]:
    return [x for x in optree.tree_leaves(tree) if isinstance(x, torch.Tensor)]


def to_device(tree: Any, device: Any) -> Any:
    return optree.tree_map(lambda x: x.to(device) if isinstance(x, torch.Tensor) else x, tree)
