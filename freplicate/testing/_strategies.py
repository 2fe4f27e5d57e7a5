"""Hypothesis strategies: trees of tensors, small modules with valid inputs, device lists.

Tensor values come from a drawn integer seed through a private
``torch.Generator``, so drawing is cheap, repeatable, never touches the global
RNG, and shrinks towards seed 0; shapes, dtypes, nesting and module sizes are
drawn directly and shrink towards the smallest. Every module class here is
defined at module level, so drawn modules pickle (to spawned ranks) and
deep-copy (to the stateful oracle).

Besides the classic kinds drawn by default, ``modules()`` draws, when asked,
the modules real training brings: blocks under activation checkpointing (both
of ``torch.utils.checkpoint``'s modes and ``checkpoint_wrapper``), sparse
embeddings, dropout, frozen sub-trees, compiled modules, and inputs and
outputs in every kind of container (``CONTAINER_KINDS``: a ``ModelOutput``
like ``Output``, dataclasses, subclasses), as ``trees(containers=True)``
draws them too.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, cast

import optree
import torch
from hypothesis import strategies as st
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    checkpoint_wrapper,
)
from torch.utils.checkpoint import checkpoint

__all__ = [
    "ALL_DTYPES",
    "CHECKPOINT_MODES",
    "CLASSIC_KINDS",
    "CONTAINER_KINDS",
    "FLOAT_DTYPES",
    "KINDS",
    "Items",
    "Output",
    "Pair",
    "Record",
    "contain",
    "devices",
    "modules",
    "trees",
]

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


# --- containers optree keeps whole, which nn.parallel's scatter and gather look inside


@dataclasses.dataclass
class Output(OrderedDict[str, Any]):
    """A model output as ``transformers``' ``ModelOutput`` makes one: an OrderedDict and a dataclass.

    Its keys are the fields that are not ``None``, in field order, and each
    is an attribute too. Built from its fields, or, as ``nn.parallel`` builds
    a dict subclass, from ``(key, value)`` pairs given as the only argument.

    >>> out = Output(loss=torch.tensor(1.0), logits=torch.ones(2))
    >>> list(out), out.logits is out["logits"], out.hidden
    (['loss', 'logits'], True, None)
    >>> list(Output(out.items()))
    ['loss', 'logits']
    """

    loss: Any = None
    logits: Any = None
    hidden: Any = None

    def __post_init__(self) -> None:
        names = [f.name for f in dataclasses.fields(self)]
        first = getattr(self, names[0])
        pairs = None
        if all(getattr(self, n) is None for n in names[1:]) and not isinstance(
            first, (torch.Tensor, str, type(None))
        ):
            try:
                items = list(first.items() if isinstance(first, dict) else first)
            except TypeError:  # not iterable: a value
                items = []
            if all(isinstance(p, tuple) and len(p) == 2 and p[0] in names for p in items):
                pairs, first = items, None
        setattr(self, names[0], first)
        for k, v in pairs or ():
            setattr(self, k, v)
        for n in names:
            if getattr(self, n) is not None:
                super().__setitem__(n, getattr(self, n))


@dataclasses.dataclass(frozen=True)
class Record:
    """A dataclass, frozen: a node to ``fr.gather`` (joined field by field), a leaf to ``fr.scatter``."""

    first: Any
    second: Any


class Items(list[Any]):
    """A list subclass: a node to ``fr.scatter`` and ``fr.gather``, which keep its type."""

    def __repr__(self) -> str:
        return f"Items({super().__repr__()})"


CONTAINER_KINDS: tuple[str, ...] = (
    "dict",
    "ordered_dict",
    "model_output",
    "namedtuple",
    "dataclass",
    "list",
    "tuple",
    "list_subclass",
)
"""The containers ``contain`` builds, and the ``"outputs"`` kind of ``modules()`` returns."""


def contain(kind: str, first: Any, second: Any) -> Any:
    """A container of ``kind`` (one of ``CONTAINER_KINDS``) holding ``first`` and ``second``.

    >>> contain("model_output", torch.ones(1), None)
    Output(loss=None, logits=tensor([1.]), hidden=None)
    """
    if kind == "model_output":
        return Output(logits=first, hidden=second)
    made: dict[str, Callable[[Any, Any], Any]] = {
        "dict": lambda a, b: {"first": a, "second": b},
        "ordered_dict": lambda a, b: OrderedDict(first=a, second=b),
        "namedtuple": Pair,
        "dataclass": Record,
        "list": lambda a, b: [a, b],
        "tuple": lambda a, b: (a, b),
        "list_subclass": lambda a, b: Items([a, b]),
    }
    if kind not in made:
        raise ValueError(f"contain: kind must be one of {CONTAINER_KINDS}, got {kind!r}")
    return made[kind](first, second)


def _contents(container: Any) -> tuple[Any, Any]:
    """What ``contain`` put in ``container``: ``(first, second)``."""
    if isinstance(container, Output):
        return container.logits, container.hidden
    if isinstance(container, dict):
        return container["first"], container["second"]
    if isinstance(container, Record):
        return container.first, container.second
    return container[0], container[1]


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

    Shrinks towards ``["cpu"]``.

    Args:
        max_size: the longest list.
        cpu: draw ``"cpu"``.
        cuda: draw this machine's CUDA devices.

    Returns:
        A strategy of lists of device strings.

    Raises:
        ValueError: no device to draw from, or ``max_size`` below 1.

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
    containers: bool = False,
) -> st.SearchStrategy[Any]:
    """Pytrees of tensors nested through dict, list, tuple, ``Pair`` (a NamedTuple) and None.

    Args:
        dtypes: the dtypes of the tensor leaves.
        max_leaves: at most this many leaves.
        max_dims: tensor leaves have up to this many dimensions (0-dim included).
        max_side: the most elements along a dimension (0, an empty tensor, included).
        batch_size: if given, every tensor leaf has at least one dimension
            and ``batch_size`` elements along dimension 0 (scatterable).
        aliased: one tensor object may stand at several leaf positions (tied
            weights).
        non_tensor_leaves: ints, floats, strings and None appear too (None is
            a node to optree but a leaf to ``torch.utils._pytree`` and so to
            ``torch.func``: without them, every leaf is a tensor in both views).
        views: a tensor leaf may be a view that is not laid out as a fresh
            tensor: transposed, strided, offset into a larger storage, or
            expanded (stride 0).
        device: where the tensor leaves lie.
        containers: nest through the containers that optree keeps whole (as
            leaves) but ``nn.parallel``'s scatter and gather look inside, and
            ``fr.scatter`` and ``fr.gather`` with them: ``Output`` (a
            ``ModelOutput``: a dict subclass), ``Record`` (a dataclass) and
            ``Items`` (a list subclass); and an ``OrderedDict``.

    Returns:
        A strategy of trees.

    Raises:
        ValueError: no dtype, or a ``batch_size`` that ``max_dims`` cannot hold.

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
        nodes: list[st.SearchStrategy[Any]] = [
            st.dictionaries(_KEYS, children, max_size=3),
            st.lists(children, max_size=3),
            st.lists(children, max_size=3).map(tuple),
            st.builds(Pair, children, children),
        ]
        if containers:
            nodes += [
                st.builds(Output, logits=children, hidden=children),
                st.builds(Record, children, children),
                st.lists(children, max_size=3).map(Items),
                st.dictionaries(_KEYS, children, max_size=3).map(OrderedDict),
            ]
        return st.one_of(*nodes)

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


class Scaled(nn.Module):
    """``tanh(Linear(x)) * scale``, ``scale`` a registered buffer: the block ``SharedNames`` shares."""

    scale: torch.Tensor

    def __init__(self, n: int) -> None:
        super().__init__()
        self.lin = nn.Linear(n, n)
        self.register_buffer("scale", torch.rand(n) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x)) * self.scale


class SharedNames(nn.Module):
    """Tensors under several names: one block reached three ways, a weight tied across modules.

    ``block``, ``again`` and ``stack.0`` are one ``Scaled`` module (its weight,
    bias and buffer have three names each), and ``stack.1.weight`` is that
    block's weight too (four names): what a state may name by any of them.
    """

    def __init__(self, n: int) -> None:
        super().__init__()
        self.block = Scaled(n)
        self.again = self.block
        self.stack = nn.ModuleList([self.block, nn.Linear(n, n)])
        self.stack[1].weight = self.block.lin.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.stack[1](self.again(self.block(x)))


class Reassigned(nn.Module):
    """A forward that reassigns its buffers (``self.avg = ...``) instead of updating them in place.

    In training mode, an exponential average of the inputs and a step count,
    each a new tensor every call (as EMA-style code writes them); the output
    depends on the average.
    """

    avg: torch.Tensor
    steps: torch.Tensor

    def __init__(self, n: int) -> None:
        super().__init__()
        self.lin = nn.Linear(n, n)
        self.register_buffer("avg", torch.zeros(n))
        self.register_buffer("steps", torch.tensor(0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.avg = 0.9 * self.avg + 0.1 * x.detach().mean(0)
            self.steps = self.steps + 1
        return self.lin(x - self.avg)


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


CHECKPOINT_MODES: tuple[str, ...] = (
    "non_reentrant",
    "reentrant",
    "wrapper",
    "wrapper_reentrant",
)


class Checkpointed(nn.Module):
    """``Linear``, a block whose activations are recomputed in backward, ``Linear``.

    ``how`` is one of ``CHECKPOINT_MODES``: ``torch.utils.checkpoint.checkpoint``
    called in forward with ``use_reentrant=False`` or ``True``, or the block
    wrapped by ``checkpoint_wrapper`` (its default non-reentrant
    implementation, or the reentrant one). The block is a two-layer MLP, or a
    ``TiedMLP`` (``tied``), so tied weights are recomputed too. The first
    ``Linear`` makes the block's input require grad, as in real networks (a
    reentrant checkpoint passes no gradient to its parameters otherwise).
    """

    def __init__(self, n: int, h: int, m: int, how: str, tied: bool) -> None:
        super().__init__()
        if how not in CHECKPOINT_MODES:
            raise ValueError(f"Checkpointed: how must be one of {CHECKPOINT_MODES}, got {how!r}")
        self.how = how
        self.pre = nn.Linear(n, h)
        block: nn.Module = (
            TiedMLP(h) if tied else nn.Sequential(nn.Linear(h, h), nn.Tanh(), nn.Linear(h, h))
        )
        if how.startswith("wrapper"):
            impl = (
                CheckpointImpl.REENTRANT
                if how == "wrapper_reentrant"
                else CheckpointImpl.NO_REENTRANT
            )
            block = checkpoint_wrapper(block, checkpoint_impl=impl)
        self.block = block
        self.post = nn.Linear(h, m)

    def extra_repr(self) -> str:
        return f"how={self.how!r}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = torch.tanh(self.pre(x))
        if self.how in ("non_reentrant", "reentrant"):
            z = checkpoint(self.block, z, use_reentrant=self.how == "reentrant")
        else:
            z = self.block(z)
        return self.post(z)


class SparseEmbedding(nn.Module):
    """An embedding with sparse gradients (``sparse=True``) under a dense ``Linear`` head.

    ``bag=None`` is an ``nn.Embedding`` (``(B, L)`` indices to ``(B, L, m)``);
    ``"sum"`` or ``"mean"`` an ``nn.EmbeddingBag`` of that mode, one bag a row
    (``(B, L)`` to ``(B, m)``). The embedding's gradient is a sparse COO
    tensor, the head's a dense one.
    """

    def __init__(self, num: int, dim: int, m: int, bag: str | None) -> None:
        super().__init__()
        self.embed: nn.Module = (
            nn.Embedding(num, dim, sparse=True)
            if bag is None
            else nn.EmbeddingBag(num, dim, mode=bag, sparse=True)
        )
        self.head = nn.Linear(dim, m)

    def forward(self, indices: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(indices))


class Outputs(nn.Module):
    """Input and output in a container of one of ``CONTAINER_KINDS``: how scatter and gather treat each.

    ``forward(contain(kind, x, scale))`` returns ``contain(kind, y, loss)``,
    ``y = Linear(x) * scale`` (batched) and ``loss`` its mean square (0-dim,
    stacked by a gather). ``nn.parallel.scatter`` shares a dataclass input
    whole (every replica sees the whole batch), and cannot gather a
    dataclass output (``fr.gather`` joins it field by field).
    """

    def __init__(self, n: int, m: int, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.lin = nn.Linear(n, m)

    def extra_repr(self) -> str:
        return f"kind={self.kind!r}"

    def forward(self, batch: Any) -> Any:
        x, scale = _contents(batch)
        y = self.lin(x) * scale
        return contain(self.kind, y, y.square().mean())


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


def _shared(
    draw: _Draw, size: st.SearchStrategy[int], dtype: torch.dtype, max_batch: int
) -> _Built:
    n = draw(size)
    return SharedNames(n), _batch([(n,)], dtype, max_batch).map(lambda t: t[0])


def _reassigned(
    draw: _Draw, size: st.SearchStrategy[int], dtype: torch.dtype, max_batch: int
) -> _Built:
    n = draw(size)
    return Reassigned(n), _batch([(n,)], dtype, max_batch).map(lambda t: t[0])


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


def _checkpointed(
    draw: _Draw, size: st.SearchStrategy[int], dtype: torch.dtype, max_batch: int
) -> _Built:
    n, h, m = draw(size), draw(size), draw(size)
    how = draw(st.sampled_from(CHECKPOINT_MODES))
    module = Checkpointed(n, h, m, how, tied=draw(st.booleans()))
    return module, _batch([(n,)], dtype, max_batch).map(lambda t: t[0])


def _indices(num: int, max_length: int, max_batch: int) -> st.SearchStrategy[torch.Tensor]:
    """``(B, L)`` int64 indices below ``num``; few distinct ones, so that repeats are common."""

    def make(b: int, length: int, seed: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        return torch.randint(0, num, (b, length), generator=g)

    return st.builds(make, st.integers(1, max_batch), st.integers(1, max_length), _SEEDS)


def _sparse(
    draw: _Draw, size: st.SearchStrategy[int], dtype: torch.dtype, max_batch: int
) -> _Built:
    num, dim, m = draw(size), draw(size), draw(size)
    bag = draw(st.sampled_from([None, "sum", "mean"]))
    return SparseEmbedding(num, dim, m, bag), _indices(num, 3, max_batch)


def _dropout(
    draw: _Draw, size: st.SearchStrategy[int], dtype: torch.dtype, max_batch: int
) -> _Built:
    n, h, m = draw(size), draw(size), draw(size)
    p = draw(st.sampled_from([0.5, 0.2]))
    module = nn.Sequential(nn.Linear(n, h), nn.Dropout(p), nn.Tanh(), nn.Linear(h, m))
    return module, _batch([(n,)], dtype, max_batch).map(lambda t: t[0])


def _outputs(
    draw: _Draw, size: st.SearchStrategy[int], dtype: torch.dtype, max_batch: int
) -> _Built:
    n, m = draw(size), draw(size)
    kind = draw(st.sampled_from(CONTAINER_KINDS))
    scale = draw(st.sampled_from([1.0, -0.5]))
    batch = _batch([(n,)], dtype, max_batch).map(lambda t: (contain(kind, t[0], scale),))
    return Outputs(n, m, kind), batch


_Builder = Callable[[_Draw, st.SearchStrategy[int], torch.dtype, int], _Built]

_KINDS: dict[str, _Builder] = {
    "mlp": _mlp,
    "conv": _conv,
    "batchnorm": _batchnorm,
    "tied": _tied,
    "buffers": _buffered,
    "nested": _nested,
    "unused": _unused,
    "positional": _positional,
    "keywords": _keywords,
    "shared": _shared,
    "reassigned": _reassigned,
    "checkpoint": _checkpointed,
    "sparse": _sparse,
    "dropout": _dropout,
    "outputs": _outputs,
}

KINDS: tuple[str, ...] = tuple(_KINDS)
"""Every kind ``modules()`` knows."""

CLASSIC_KINDS: tuple[str, ...] = KINDS[: KINDS.index("shared") + 1]
"""The kinds ``modules()`` draws by default: deterministic, dense, differentiable by ``torch.func``."""


def modules(
    *,
    kinds: Sequence[str] | None = None,
    dtypes: Sequence[torch.dtype] = (torch.float32,),
    max_features: int = 4,
    max_batch: int = 5,
    training: bool | None = None,
    frozen: bool | None = False,
    compiled: bool | None = False,
    compile_backends: Sequence[str] = ("eager", "aot_eager"),
) -> st.SearchStrategy[tuple[nn.Module, st.SearchStrategy[Any]]]:
    """Pairs ``(module, inputs)``: a small ``nn.Module`` and a strategy of valid inputs for it.

    ``inputs`` draws what the forward takes, every tensor with a batch of 1 to
    ``max_batch`` along dimension 0: a tensor, a tuple of positional
    arguments, or a dict of keyword arguments. The module's floating-point
    parameters have a dtype from ``dtypes`` (``torch.float16`` and
    ``torch.bfloat16`` included) and sides of at most ``max_features``.

    The kinds drawn by default (``CLASSIC_KINDS``, shrinking towards
    ``"mlp"``): ``"mlp"``, ``"conv"`` (Conv1d/2d + BatchNorm),
    ``"batchnorm"``, ``"tied"`` (tied weights), ``"buffers"`` (registered
    buffers updated in forward), ``"nested"`` (ModuleDict / ModuleList and a
    tree of outputs), ``"unused"`` (parameters that never reach the output,
    and a frozen one), ``"positional"`` (``forward(x, y)``) and
    ``"keywords"`` (``forward(x, *, scale, shift)``) and ``"shared"``
    (tensors under several names: one block reached as three attributes, a
    weight tied across two modules).

    Drawn only when named in ``kinds``, as each asks something of the test
    that uses it:

    - ``"reassigned"``: a forward that reassigns its buffers in training mode
      (``self.avg = 0.9 * self.avg + ...``, ``self.steps = self.steps + 1``)
      rather than updating them in place. A stateful module keeps the new
      tensors; ``nn.DataParallel`` loses them (they land on its replica), so
      a comparison with it differs here by design.

    - ``"checkpoint"``: a block under activation checkpointing, in one of
      ``CHECKPOINT_MODES``: ``torch.utils.checkpoint.checkpoint`` with
      ``use_reentrant=False`` or ``True``, or ``checkpoint_wrapper`` (from
      ``torch.distributed.algorithms._checkpoint.checkpoint_wrapper``) of
      either implementation; the block may hold tied weights. Its forward
      runs again during backward, and a reentrant checkpoint refuses
      ``torch.autograd.grad`` and ``torch.func``: what an implementation
      must still get right.
    - ``"sparse"``: ``nn.Embedding(sparse=True)`` or
      ``nn.EmbeddingBag(sparse=True)`` (mode sum or mean) under a ``Linear``
      head; the inputs are int64 indices of shape ``(B, L)``; the
      embedding's gradient is a sparse COO tensor.
    - ``"dropout"``: ``Linear``, ``Dropout``, ``Tanh``, ``Linear``: in
      training mode its output depends on the random number generator, so
      seed it (``torch.manual_seed``) before each call you compare.
    - ``"outputs"``: ``Outputs``, whose input (the one positional argument)
      and output are containers of a kind drawn from ``CONTAINER_KINDS``
      (dict, ``OrderedDict``, a ``ModelOutput`` like ``Output``, NamedTuple,
      dataclass, list, tuple, list subclass); a dataclass or a dict subclass
      is a leaf to optree, so compare such outputs with a comparison that
      looks inside them (``check_against_stateful`` does).

    Other options:

    Args:
        kinds: the kinds to draw from (default: ``CLASSIC_KINDS``).
        dtypes: dtypes of the floating-point parameters.
        max_features: the largest side of a layer.
        max_batch: the largest batch of the inputs.
        training: the module's mode: ``True``, ``False``, or ``None`` (drawn).
        frozen: freeze a sub-tree: ``requires_grad_(False)`` on a drawn
            submodule, or on some of the parameters where they all sit in
            one, leaving at least one trainable where there are two or more.
            ``True``: always (where the module has parameters); ``False``:
            never (only the ``"unused"`` kind's own frozen parameter);
            ``None``: drawn.
        compiled: return ``torch.compile(module, backend=b)`` (an
            ``OptimizedModule``; ``b`` drawn from ``compile_backends``);
            ``True``, ``False`` or ``None`` (drawn). A first call compiles
            (about a second for ``"aot_eager"``): keep such examples few.
        compile_backends: the ``torch.compile`` backends to draw from.

    Returns:
        A strategy of ``(module, inputs)`` pairs.

    Raises:
        ValueError: an unknown kind, no backend where ``compiled`` may be
            true, or ``max_features`` or ``max_batch`` below 1.

    >>> from hypothesis import given, settings
    >>> @settings(max_examples=5)
    ... @given(modules(kinds=["mlp", "tied"]), st.data())
    ... def test(pair, data):
    ...     module, inputs = pair
    ...     x = data.draw(inputs)
    ...     assert module(x).shape[0] == x.shape[0]
    >>> test()
    >>> @settings(max_examples=5, deadline=None)
    ... @given(modules(kinds=["checkpoint", "sparse"], frozen=True), st.data())
    ... def test_frozen(pair, data):
    ...     module, inputs = pair
    ...     assert not all(p.requires_grad for p in module.parameters())
    ...     module(data.draw(inputs)).sum().backward()
    >>> test_frozen()
    """
    names = list(CLASSIC_KINDS) if kinds is None else list(kinds)
    unknown = [k for k in names if k not in _KINDS]
    if unknown or not names:
        raise ValueError(
            f"fr.testing.modules: unknown kinds {unknown!r}; choose among {list(KINDS)!r}"
        )
    if max_features < 1 or max_batch < 1:
        raise ValueError(
            "fr.testing.modules: max_features and max_batch must be at least 1, "
            f"got {max_features} and {max_batch}"
        )
    if compiled is not False and not compile_backends:
        raise ValueError(
            "fr.testing.modules: compile_backends must name at least one torch.compile backend "
            f"when compiled={compiled!r}"
        )
    options = _Options(frozen, compiled, tuple(compile_backends))
    return _modules(names, list(dtypes), max_features, max_batch, training, options)


class _Options(NamedTuple):
    frozen: bool | None
    compiled: bool | None
    compile_backends: tuple[str, ...]


@st.composite
def _modules(
    draw: _Draw,
    names: list[str],
    dtypes: list[torch.dtype],
    max_features: int,
    max_batch: int,
    training: bool | None,
    options: _Options,
) -> _Built:
    build = _KINDS[draw(st.sampled_from(names))]
    dtype = draw(st.sampled_from(dtypes))
    mode = draw(st.booleans()) if training is None else training
    seed = draw(_SEEDS)
    # parameters keep PyTorch's own initialisation, from a seed of the draw's own
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        module, inputs = build(draw, st.integers(1, max_features), dtype, max_batch)
    module = module.to(dtype).train(mode)
    if draw(st.booleans()) if options.frozen is None else options.frozen:
        _freeze(draw, module)
    if draw(st.booleans()) if options.compiled is None else options.compiled:
        backend = draw(st.sampled_from(options.compile_backends))
        module = cast(nn.Module, torch.compile(module, backend=backend))
    return module, inputs


def _freeze(draw: _Draw, module: nn.Module) -> None:
    """``requires_grad_(False)`` on a drawn sub-tree, leaving one parameter trainable if it can."""
    params = list(module.parameters())
    if not params:
        return
    smaller = [
        sub
        for name, sub in module.named_modules()
        if name and 0 < len(list(sub.parameters())) < len(params)
    ]
    if smaller:
        draw(st.sampled_from(smaller)).requires_grad_(False)
        return
    # every parameter sits in one module (or the root): freeze some of them one by one
    count = draw(st.integers(1, max(1, len(params) - 1)))
    for p in draw(st.permutations(params))[:count]:
        p.requires_grad_(False)
