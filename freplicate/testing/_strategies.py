"""Hypothesis strategies: trees of tensors, small modules with valid inputs, device lists.

Tensor values come from a drawn integer seed through a private
``torch.Generator``, so drawing is cheap, repeatable, never touches the global
RNG, and shrinks towards seed 0; shapes, dtypes, nesting and module sizes are
drawn directly and shrink towards the smallest. Every module class here is
defined at module level, so drawn modules pickle (to spawned ranks) and
deep-copy (to the stateful oracle).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import optree
import torch
from hypothesis import strategies as st
from torch import nn

__all__ = ["ALL_DTYPES", "FLOAT_DTYPES", "Pair", "devices", "modules", "trees"]

FLOAT_DTYPES: tuple[torch.dtype, ...] = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
)
ALL_DTYPES: tuple[torch.dtype, ...] = (*FLOAT_DTYPES, torch.int64, torch.int32, torch.bool)

_SEEDS = st.integers(0, 2**31 - 1)
_KEYS = st.sampled_from(["a", "b", "c", "weight", "bias"])


class Pair(NamedTuple):
    """The NamedTuple node that ``trees()`` nests through."""

    first: Any
    second: Any


def _tensor(
    shape: Sequence[int], dtype: torch.dtype, seed: int, device: Any = "cpu"
) -> torch.Tensor:
    """A tensor of ``shape`` and ``dtype`` with values drawn from ``seed``: small and finite."""
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point or dtype.is_complex:
        t = torch.randn(tuple(shape), generator=g, dtype=torch.float32).to(dtype)
        if dtype.is_complex:
            t = t + 1j * torch.randn(tuple(shape), generator=g).to(dtype)
    elif dtype == torch.bool:
        t = torch.randint(0, 2, tuple(shape), generator=g).bool()
    else:
        t = torch.randint(-8, 9, tuple(shape), generator=g, dtype=dtype)
    return t.to(device)


_VIEWS = ("fresh", "transposed", "strided", "offset", "expanded")


def _as_view(t: torch.Tensor, how: str) -> torch.Tensor:
    """``t`` as a view of another layout (``how``), where its shape allows one.

    Equal to ``t``, except ``"expanded"``, whose rows all repeat ``t``'s first.
    """
    if how == "transposed" and t.dim() >= 2:
        return t.mT.contiguous().mT
    if how == "strided" and t.dim() >= 1:
        wide = torch.stack([t, t], dim=-1)  # every element twice: take every other one
        return wide.flatten(-2)[..., ::2]
    if how == "offset":
        flat = torch.cat([t.new_zeros(1), t.reshape(-1)])
        return flat[1:].view(t.shape)
    if how == "expanded" and t.dim() >= 1 and t.shape[0] > 1:
        return t[:1].expand(t.shape)  # every row is the first: stride 0 along dim 0
    return t


def _available_devices() -> list[str]:
    return ["cpu"] + [f"cuda:{i}" for i in range(torch.cuda.device_count())]


def devices(
    *, max_size: int = 4, cpu: bool = True, cuda: bool = True
) -> st.SearchStrategy[list[str]]:
    """Non-empty lists of this machine's devices (``"cpu"``, ``"cuda:i"``), repeats allowed.

    Shrinks towards ``["cpu"]``. ``cpu=False`` or ``cuda=False`` leave that kind
    out; asking for no device at all raises ``ValueError``.

    >>> from hypothesis import given, settings
    >>> @settings(max_examples=10)
    ... @given(devices(max_size=3))
    ... def test(devs):
    ...     assert 1 <= len(devs) <= 3
    ...     assert all(d == "cpu" or d.startswith("cuda:") for d in devs)
    >>> test()
    """
    available = [d for d in _available_devices() if (cpu if d == "cpu" else cuda)]
    if not available:
        raise ValueError(
            "fr.testing.devices: no device to draw from (cpu=False and this machine has no CUDA "
            "device, or cuda=False too)"
        )
    if max_size < 1:
        raise ValueError(f"fr.testing.devices: max_size must be at least 1, got {max_size}")
    return st.lists(st.sampled_from(available), min_size=1, max_size=max_size)


def trees(
    *,
    dtypes: Sequence[torch.dtype] = ALL_DTYPES,
    max_leaves: int = 6,
    max_dims: int = 3,
    max_side: int = 3,
    batch_size: int | None = None,
    aliased: bool = True,
    non_tensor_leaves: bool = True,
    views: bool = True,
    device: Any = "cpu",
) -> st.SearchStrategy[Any]:
    """Pytrees of tensors nested through dict, list, tuple, ``Pair`` (a NamedTuple) and None.

    Tensor leaves have a dtype from ``dtypes``, up to ``max_dims`` dimensions
    (0-dim included) of up to ``max_side`` elements each (empty included), and
    lie on ``device``. With ``batch_size``, every tensor leaf has at least one
    dimension and ``batch_size`` elements along dimension 0 (scatterable). With
    ``non_tensor_leaves``, ints, floats, strings and None appear too (None is
    a node to optree but a leaf to ``torch.utils._pytree`` and so to
    ``torch.func``: without them, every leaf is a tensor in both views); with
    ``aliased``, one tensor object may stand at several leaf positions (tied
    weights); with ``views``, a tensor leaf may be a view that is not laid
    out as a fresh tensor: transposed, strided, offset into a larger storage,
    or expanded (stride 0). At most ``max_leaves`` leaves.

    >>> from hypothesis import given, settings
    >>> @settings(max_examples=10)
    ... @given(trees(dtypes=[torch.float32], batch_size=2, non_tensor_leaves=False))
    ... def test(tree):
    ...     leaves = optree.tree_leaves(tree)
    ...     assert all(t.dtype == torch.float32 and t.shape[0] == 2 for t in leaves)
    >>> test()
    """
    if not dtypes:
        raise ValueError("fr.testing.trees: dtypes must name at least one dtype")
    if batch_size is not None and (batch_size < 0 or max_dims < 1):
        raise ValueError(
            "fr.testing.trees: batch_size needs max_dims >= 1 and a size >= 0, "
            f"got batch_size={batch_size}, max_dims={max_dims}"
        )
    if batch_size is None:
        shapes = st.lists(st.integers(0, max_side), max_size=max_dims)
    else:
        shapes = st.lists(st.integers(0, max_side), max_size=max_dims - 1).map(
            lambda tail: [batch_size, *tail]
        )
    tensors = st.builds(_tensor, shapes, st.sampled_from(list(dtypes)), _SEEDS, st.just(device))
    if views:
        tensors = st.builds(_as_view, tensors, st.sampled_from(_VIEWS))
    base = tensors
    if non_tensor_leaves:
        base = base | st.one_of(
            st.none(),
            st.integers(-3, 3),
            st.floats(-2.0, 2.0, allow_nan=False),
            st.text("xyz", max_size=2),
        )

    def extend(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
        return st.one_of(
            st.dictionaries(_KEYS, children, max_size=3),
            st.lists(children, max_size=3),
            st.lists(children, max_size=3).map(tuple),
            st.builds(Pair, children, children),
        )

    nested = st.recursive(base, extend, max_leaves=max_leaves)
    return _with_aliases(nested) if aliased else nested


@st.composite
def _with_aliases(draw: Callable[[st.SearchStrategy[Any]], Any], nested: Any) -> Any:
    tree = draw(nested)
    leaves, spec = optree.tree_flatten(tree)
    at = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    if len(at) < 2:
        return tree
    ties = draw(st.lists(st.tuples(st.sampled_from(at), st.sampled_from(at)), max_size=2))
    for src, dst in ties:
        leaves[dst] = leaves[src]
    return optree.tree_unflatten(spec, leaves)


# --- modules: each kind is a small, deterministic architecture drawn at a few sizes


class TiedMLP(nn.Module):
    """Two square Linear layers sharing one weight matrix (tied weights)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(n, n)
        self.fc2 = nn.Linear(n, n)
        self.fc2.weight = self.fc1.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


class Buffered(nn.Module):
    """Registered buffers, read in forward and updated in place (as BatchNorm does)."""

    scale: torch.Tensor
    running: torch.Tensor
    calls: torch.Tensor
    offset: torch.Tensor

    def __init__(self, n: int) -> None:
        super().__init__()
        self.lin = nn.Linear(n, n)
        self.register_buffer("scale", torch.rand(n) + 0.5)
        self.register_buffer("running", torch.zeros(n))
        self.register_buffer("calls", torch.tensor(0))
        self.register_buffer("offset", torch.randn(n), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls += 1
            self.running.mul_(0.9).add_(x.detach().mean(0), alpha=0.1)
        return self.lin(x) * self.scale + self.offset + self.running


class Nested(nn.Module):
    """Nested containers (ModuleDict, ModuleList, Sequential) and a tree of outputs."""

    def __init__(self, n: int, hidden: int, m: int) -> None:
        super().__init__()
        self.parts = nn.ModuleDict(
            {
                "trunk": nn.Sequential(nn.Linear(n, hidden), nn.ReLU()),
                "heads": nn.ModuleList([nn.Linear(hidden, m), nn.Linear(hidden, 1)]),
            }
        )

    def forward(self, x: torch.Tensor) -> dict[str, Any]:
        heads: Any = self.parts["heads"]
        z = self.parts["trunk"](x)
        a, b = (head(z) for head in heads)
        # a 0-dim output: DataParallel stacks one per replica
        return {"a": a, "rest": (b.squeeze(-1), z.pow(2).mean()), "nothing": None}


class WithUnused(nn.Module):
    """Parameters that never reach the output, and a frozen one (``requires_grad=False``).

    The unused ones get zero gradients here, ``None`` in PyTorch; the frozen one
    is used but left out of PyTorch's gradients (and out of DDP's reducer).
    """

    def __init__(self, n: int, m: int) -> None:
        super().__init__()
        self.used = nn.Linear(n, m)
        self.unused = nn.Linear(n, m)
        self.frozen = nn.Parameter(torch.randn(m), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x) * self.frozen


class TwoInputs(nn.Module):
    """Positional arguments: ``forward(x, y)``."""

    def __init__(self, n: int, k: int, m: int) -> None:
        super().__init__()
        self.a = nn.Linear(n, m)
        self.b = nn.Linear(k, m, bias=False)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.a(x) * torch.sigmoid(self.b(y))


class Keywords(nn.Module):
    """Keyword arguments, one of them a non-tensor shared by every shard."""

    def __init__(self, n: int, m: int) -> None:
        super().__init__()
        self.lin = nn.Linear(n, m)

    def forward(
        self, x: torch.Tensor, *, scale: float = 1.0, shift: torch.Tensor | None = None
    ) -> torch.Tensor:
        out = self.lin(x) * scale
        return out if shift is None else out + shift


def _batch(
    tails: Sequence[Sequence[int]], dtype: torch.dtype, max_batch: int
) -> st.SearchStrategy[tuple[torch.Tensor, ...]]:
    """Tuples of tensors of shapes ``(B, *tail)`` sharing one drawn batch size ``B``."""

    def make(b: int, seed: int) -> tuple[torch.Tensor, ...]:
        return tuple(_tensor((b, *tail), dtype, seed + i) for i, tail in enumerate(tails))

    return st.builds(make, st.integers(1, max_batch), _SEEDS)


_Built = tuple[nn.Module, st.SearchStrategy[Any]]
_Draw = Callable[[st.SearchStrategy[Any]], Any]


def _mlp(draw: _Draw, size: st.SearchStrategy[int], dtype: torch.dtype, max_batch: int) -> _Built:
    n, h, m = draw(size), draw(size), draw(size)
    act = draw(st.sampled_from([nn.ReLU, nn.Tanh, nn.Identity]))
    module = nn.Sequential(nn.Linear(n, h), act(), nn.Linear(h, m))
    return module, _batch([(n,)], dtype, max_batch).map(lambda t: t[0])


def _conv(draw: _Draw, size: st.SearchStrategy[int], dtype: torch.dtype, max_batch: int) -> _Built:
    c, c2, k = draw(size), draw(size), draw(st.integers(1, 3))
    # each shard's BatchNorm sees at least two values per channel, even at batch 1
    if draw(st.booleans()):
        module = nn.Sequential(nn.Conv1d(c, c2, k), nn.BatchNorm1d(c2), nn.ReLU())
        tail: tuple[int, ...] = (c, k + 1 + draw(st.integers(0, 2)))
    else:
        module = nn.Sequential(nn.Conv2d(c, c2, k), nn.BatchNorm2d(c2), nn.ReLU())
        tail = (c, k + 1, k + draw(st.integers(0, 2)))
    return module, _batch([tail], dtype, max_batch).map(lambda t: t[0])


def _batchnorm(
    draw: _Draw, size: st.SearchStrategy[int], dtype: torch.dtype, max_batch: int
) -> _Built:
    n = draw(size)
    momentum = draw(st.sampled_from([0.1, None]))  # None: cumulative average, num_batches_tracked
    module = nn.BatchNorm1d(n, momentum=momentum, affine=draw(st.booleans()))
    return module, _batch([(n, 2)], dtype, max_batch).map(lambda t: t[0])


def _tied(draw: _Draw, size: st.SearchStrategy[int], dtype: torch.dtype, max_batch: int) -> _Built:
    n = draw(size)
    return TiedMLP(n), _batch([(n,)], dtype, max_batch).map(lambda t: t[0])


def _buffered(
    draw: _Draw, size: st.SearchStrategy[int], dtype: torch.dtype, max_batch: int
) -> _Built:
    n = draw(size)
    return Buffered(n), _batch([(n,)], dtype, max_batch).map(lambda t: t[0])


def _nested(
    draw: _Draw, size: st.SearchStrategy[int], dtype: torch.dtype, max_batch: int
) -> _Built:
    n, h, m = draw(size), draw(size), draw(size)
    return Nested(n, h, m), _batch([(n,)], dtype, max_batch).map(lambda t: t[0])


def _unused(
    draw: _Draw, size: st.SearchStrategy[int], dtype: torch.dtype, max_batch: int
) -> _Built:
    n, m = draw(size), draw(size)
    return WithUnused(n, m), _batch([(n,)], dtype, max_batch).map(lambda t: t[0])


def _positional(
    draw: _Draw, size: st.SearchStrategy[int], dtype: torch.dtype, max_batch: int
) -> _Built:
    n, k, m = draw(size), draw(size), draw(size)
    return TwoInputs(n, k, m), _batch([(n,), (k,)], dtype, max_batch)


def _keywords(
    draw: _Draw, size: st.SearchStrategy[int], dtype: torch.dtype, max_batch: int
) -> _Built:
    n, m = draw(size), draw(size)
    with_shift = draw(st.booleans())

    def make(xs: tuple[torch.Tensor, ...], scale: float) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"x": xs[0], "scale": scale}
        if with_shift:
            kwargs["shift"] = xs[1]
        return kwargs

    return Keywords(n, m), st.builds(
        make, _batch([(n,), (m,)], dtype, max_batch), st.sampled_from([1.0, 0.5, -2.0])
    )


_KINDS: dict[str, Callable[[_Draw, st.SearchStrategy[int], torch.dtype, int], _Built]] = {
    "mlp": _mlp,
    "conv": _conv,
    "batchnorm": _batchnorm,
    "tied": _tied,
    "buffers": _buffered,
    "nested": _nested,
    "unused": _unused,
    "positional": _positional,
    "keywords": _keywords,
}


def modules(
    *,
    kinds: Sequence[str] | None = None,
    dtypes: Sequence[torch.dtype] = (torch.float32,),
    max_features: int = 4,
    max_batch: int = 5,
    training: bool | None = None,
) -> st.SearchStrategy[tuple[nn.Module, st.SearchStrategy[Any]]]:
    """Pairs ``(module, inputs)``: a small ``nn.Module`` and a strategy of valid inputs for it.

    ``kinds`` picks among ``"mlp"``, ``"conv"`` (Conv1d/2d + BatchNorm),
    ``"batchnorm"``, ``"tied"`` (tied weights), ``"buffers"`` (registered
    buffers updated in forward), ``"nested"`` (ModuleDict / ModuleList and a
    tree of outputs), ``"unused"`` (parameters that never reach the output,
    and a frozen one), ``"positional"`` (``forward(x, y)``) and ``"keywords"``
    (``forward(x, *, scale, shift)``); all by default, shrinking towards
    ``"mlp"``. The module's parameters have a dtype from ``dtypes`` and sides
    of at most ``max_features``; it is in training mode, eval mode or either
    (``training=None``). ``inputs`` draws what the forward takes, every tensor
    with a batch of 1 to ``max_batch`` along dimension 0: a tensor, a tuple of
    positional arguments, or a dict of keyword arguments.

    >>> from hypothesis import given, settings
    >>> @settings(max_examples=5)
    ... @given(modules(kinds=["mlp", "tied"]), st.data())
    ... def test(pair, data):
    ...     module, inputs = pair
    ...     x = data.draw(inputs)
    ...     assert module(x).shape[0] == x.shape[0]
    >>> test()
    """
    names = list(_KINDS) if kinds is None else list(kinds)
    unknown = [k for k in names if k not in _KINDS]
    if unknown or not names:
        raise ValueError(
            f"fr.testing.modules: unknown kinds {unknown!r}; choose among {list(_KINDS)!r}"
        )
    if max_features < 1 or max_batch < 1:
        raise ValueError(
            "fr.testing.modules: max_features and max_batch must be at least 1, "
            f"got {max_features} and {max_batch}"
        )
    return _modules(names, list(dtypes), max_features, max_batch, training)


@st.composite
def _modules(
    draw: _Draw,
    names: list[str],
    dtypes: list[torch.dtype],
    max_features: int,
    max_batch: int,
    training: bool | None,
) -> _Built:
    build = _KINDS[draw(st.sampled_from(names))]
    dtype = draw(st.sampled_from(dtypes))
    mode = draw(st.booleans()) if training is None else training
    seed = draw(_SEEDS)
    # parameters keep PyTorch's own initialisation, from a seed of the draw's own
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        module, inputs = build(draw, st.integers(1, max_features), dtype, max_batch)
    return module.to(dtype).train(mode), inputs
