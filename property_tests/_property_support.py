"""Helpers shared by the properties: example budgets, the session's ranks, input snapshots,
value refills."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import optree
import torch
from hypothesis import settings

from freplicate.testing import RankPool


def examples(fraction: float, **overrides: Any) -> settings:
    """Settings running ``fraction`` of the profile's examples (at least 2), for costly properties.

    ``overrides`` are further settings for the one property (e.g. ``phases``).
    """
    return settings(max_examples=max(2, int(settings.default.max_examples * fraction)), **overrides)


@contextmanager
def bounded(pool: RankPool, deadline: float) -> Iterator[RankPool]:
    """The session's 2 ranks (``rank_pool``, conftest.py), every run bounded by ``deadline``
    seconds while the block lasts: a property file's own limit, on ranks that every file
    shares instead of starting its own."""
    before = pool.deadline
    pool.deadline = deadline
    try:
        yield pool
    finally:
        pool.deadline = before


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
            now, then = (t.detach().to_dense(), value.to_dense()) if t.is_sparse else (t, value)
            assert torch.equal(now.detach(), then), f"{by} changed the values of {path}"


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


def split_inputs(x: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """What ``modules()`` draws (a tensor, a tuple of arguments, or a dict of keywords) as args, kwargs."""
    if isinstance(x, dict):
        return (), x
    return (x if isinstance(x, tuple) else (x,)), {}


def trainable(module: torch.nn.Module, params: dict[str, Any]) -> dict[str, Any]:
    """The entries of ``params`` whose parameter in ``module`` requires grad (not frozen)."""
    return {k: v for k, v in params.items() if module.get_parameter(k).requires_grad}


def load_values(module: torch.nn.Module, values: dict[str, torch.Tensor]) -> None:
    """``module.load_state_dict`` of ``values``, named as ``named_parameters`` / ``named_buffers`` do.

    Names are matched through the tensors themselves, so that the state dict's
    own names (tied duplicates, ``checkpoint_wrapper``'s stripped prefix, a
    compiled module's) all get the value; a name the module lacks raises.
    """
    own = dict((*module.named_parameters(), *module.named_buffers()))
    unknown = sorted(set(values) - set(own))
    assert not unknown, f"load_values: the module has no tensors named {unknown}"
    by_id = {id(own[name]): value for name, value in values.items()}
    current = module.state_dict(keep_vars=True)
    module.load_state_dict({k: by_id.get(id(t), t) for k, t in current.items()})


def weighted_loss(out: Any) -> torch.Tensor:
    """A fixed random weighting of every floating-point output element, summed in float64.

    Every output element carries its own gradient; the sum in float64 keeps a
    half-precision output from overflowing in the loss itself.
    """
    total = torch.zeros((), dtype=torch.float64)
    for i, leaf in enumerate(optree.tree_leaves(out)):
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
            g = torch.Generator().manual_seed(i)
            weight = torch.randn(leaf.shape, generator=g, dtype=torch.float64)
            total = total + (leaf.double() * weight.to(leaf.device)).sum().to(total.device)
    return total


def dense(tree: Any) -> Any:
    """``tree`` with every sparse tensor leaf made dense (layouts aside, the values compared)."""
    return optree.tree_map(
        lambda x: x.to_dense() if isinstance(x, torch.Tensor) and x.is_sparse else x, tree
    )


def tolerances(dtype: torch.dtype) -> dict[str, float]:
    """``rtol``/``atol`` for gradients in ``dtype`` computed along two orders of the same ops."""
    if dtype in (torch.float16, torch.bfloat16):
        eps = torch.finfo(dtype).eps
        return {"rtol": 4 * eps, "atol": 4 * eps}
    return {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1e-7, "atol": 1e-9}


def large(tree: Any, seed: int) -> Any:
    """``tree`` with values of either sign between half and all of their dtype's largest."""
    g = torch.Generator().manual_seed(seed)

    def fill(t: torch.Tensor) -> torch.Tensor:
        biggest = torch.finfo(t.dtype).max
        magnitude = torch.rand(t.shape, generator=g, dtype=torch.float64) * 0.5 + 0.5
        sign = torch.randint(0, 2, t.shape, generator=g) * 2 - 1
        return (magnitude * sign * biggest).to(t.dtype)

    return optree.tree_map(fill, tree)
