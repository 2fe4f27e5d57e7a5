"""One-process data parallelism: the seed ``nn.DataParallel`` path as functions on trees.

``scatter`` splits a batch tree along a dimension, one shard per device;
``parallel_apply`` runs one call per replica in its own thread; ``gather``
concatenates the replicas' outputs on one device; ``data_parallel`` chains
them with ``fr.replicate`` and ``fr.apply`` (the functional
``nn.parallel.data_parallel``); ``all_reduce`` sums or averages one tree per
device; ``data_parallel_grad`` is the DDP-style step in one process (per-device
gradients, all-reduced). Every transfer and reduction goes through the
coalescing engine (``_pack``), so a tree of many small tensors costs a handful
of copies; chunk, cat, stack and ``.to`` are differentiable, so all of it
composes with autograd and ``torch.func``.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal, TypeVar

import torch
from torch import nn
from torch._C._functorch import maybe_current_level

from . import _pack, _tree
from ._devices import DeviceSpec, as_device, as_devices
from ._grad import grad_and_value
from ._replicate import replicate
from ._state import State, apply

__all__ = [
    "all_reduce",
    "data_parallel",
    "data_parallel_grad",
    "gather",
    "parallel_apply",
    "scatter",
]

T = TypeVar("T")
Op = Literal["sum", "mean"]


# --------------------------------------------------------------------------- scatter


def scatter(tree: T, devices: Sequence[DeviceSpec], *, dim: int = 0) -> list[T]:
    """Split every tensor leaf of ``tree`` along ``dim``, one shard per device.

    Leaves are cut as ``torch.chunk(leaf, len(devices), dim)`` and chunk *i*
    goes to ``devices[i]`` (a chunk already on its device is a view, not a
    copy; the others move in one flat buffer per dtype). Non-tensor leaves are
    shared by every shard. As ``nn.parallel.scatter``: when a leaf yields fewer
    chunks than devices (a batch of 3 on 4 devices, or of 5, which
    ``torch.chunk`` cuts as 2 + 2 + 1), there are that many shards, and when
    leaves yield different numbers of chunks the smallest wins; a tree without
    tensor leaves gives one shard per device. A 0-dim tensor cannot be split
    and raises ``ValueError`` (``nn.parallel.scatter`` fails on it too): pass a
    scalar as a Python number, or close over it. Differentiable: the gradient
    of the shards flows back into ``tree``. Nothing is modified.

    >>> shards = scatter({"x": torch.arange(5.0), "tag": "a"}, ["cpu", "cpu"])
    >>> [s["x"].tolist() for s in shards], shards[1]["tag"]
    ([[0.0, 1.0, 2.0], [3.0, 4.0]], 'a')
    >>> len(scatter(torch.ones(3, 2), ["cpu"] * 4))
    3
    """
    devs = as_devices(devices, fn="fr.scatter")
    return _scatter(tree, devs, dim, "fr.scatter")


def _scatter(
    tree: T,
    devs: list[torch.device],
    dim: int,
    fn: str,
    rename: Callable[[str], str] | None = None,
) -> list[T]:
    leaves, spec = _tree.flatten(tree)
    unique, slot = _tree.alias_groups(leaves)
    if not unique:
        return [tree for _ in devs]
    paths: Sequence[str] = _tree.LazyPaths(spec, unique)
    if rename is not None:
        paths = _Renamed(paths, rename)
    chunks = [_chunk(leaves[i], len(devs), dim, paths, k, fn) for k, i in enumerate(unique)]
    n = min(len(c) for c in chunks)
    shards: list[T] = []
    for d in range(n):
        pieces = [c[d] for c in chunks]
        moved = _pack.broadcast_coalesced(pieces, [devs[d]], paths=paths, fn=fn)[0]
        shards.append(
            _tree.unflatten(spec, [moved[s] if s >= 0 else x for x, s in zip(leaves, slot)])
        )
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


def _as_call_args(path: str) -> str:
    # data_parallel scatters the tree (inputs, kwargs): show its paths as such
    return ("inputs" if path.startswith("[0]") else "kwargs") + path[3:]


def _chunk(
    t: torch.Tensor, n: int, dim: int, paths: Sequence[str], k: int, fn: str
) -> tuple[torch.Tensor, ...]:
    nd = t.dim()
    if nd == 0:
        raise ValueError(
            f"{fn}: the tensor at {paths[k]} is 0-dim and cannot be split along dim {dim}; "
            "pass a scalar as a Python number (shared by every shard) or close over it"
        )
    if not -nd <= dim < nd:
        raise ValueError(
            f"{fn}: dim={dim} is out of range for the tensor at {paths[k]} of shape "
            f"{tuple(t.shape)} (expected -{nd} <= dim < {nd})"
        )
    return torch.chunk(t, n, dim)


# --------------------------------------------------------------------------- gather


def gather(trees: Sequence[Any], device: DeviceSpec, *, dim: int = 0) -> Any:
    """Concatenate ``trees`` leaf-wise along ``dim`` onto ``device``; the inverse of scatter.

    Every tree's tensor leaves move to ``device`` in one flat buffer per dtype
    and are concatenated there (``torch.cat``). 0-dim leaves, such as a loss
    per replica, are stacked into a 1-D tensor, one entry per tree, whatever
    ``dim`` is (``nn.DataParallel`` does the same for ``dim=0``). A non-tensor
    leaf equal in every tree comes back once; unequal ones come back as a
    tuple, one value per tree. Differentiable; nothing is modified.

    >>> out = gather([{"y": torch.ones(2), "loss": torch.tensor(1.0), "k": "a"},
    ...               {"y": torch.zeros(1), "loss": torch.tensor(3.0), "k": "b"}], "cpu")
    >>> out["y"].tolist(), out["loss"].tolist(), out["k"]
    ([1.0, 1.0, 0.0], [1.0, 3.0], ('a', 'b'))
    """
    dev = as_device(device, fn="fr.gather")
    trees = list(trees)
    if not trees:
        raise ValueError("fr.gather: trees is empty; give at least one tree")
    flats = [_tree.flatten(t) for t in trees]
    specs = [s for _, s in flats]
    diff = _tree.first_difference(specs, trees)
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
                f"fr.gather: trees differ at {paths[i]}: {_kind(col[0])} in tree 0, "
                f"{_kind(col[j])} in tree {j}"
            )
        else:
            out.append(col[0] if all(_same(col[0], x) for x in col[1:]) else tuple(col))
    if tensor_pos:
        sub = _tree.LazyPaths(spec, tensor_pos)
        moved = [
            _pack.broadcast_coalesced(
                [columns[i][j] for i in tensor_pos], [dev], paths=sub, fn="fr.gather"
            )[0]
            for j in range(len(trees))
        ]
        for k, i in enumerate(tensor_pos):
            out[i] = _join([m[k] for m in moved], dim, paths, i)
    return _tree.unflatten(spec, out)


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


def _kind(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"a tensor of shape {tuple(x.shape)}"
    return f"a {type(x).__name__} ({x!r})"


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    try:
        return bool(a == b)
    except Exception:  # e.g. arrays, whose == is not a truth value: call them different
        return False


# --------------------------------------------------------------------------- parallel_apply


def parallel_apply(
    fn: Callable[..., Any],
    replicas: Sequence[Any],
    inputs: Sequence[Any],
    *,
    devices: Sequence[DeviceSpec] | None = None,
    kwargs: Sequence[Mapping[str, Any]] | None = None,
) -> list[Any]:
    """Call ``fn(replicas[i], *inputs[i], **kwargs[i])`` for every ``i`` at once; results in order.

    Each call runs in a thread of its own (the first in the caller's thread,
    the others in threads that have ended when this returns), so calls whose
    work releases the GIL (tensor ops) run in parallel. Every call sees the
    caller's grad mode, inference mode and autocast state (thread-local in
    PyTorch), and, on a CUDA device, runs with that device current and on a
    stream of its own, ordered after the caller's stream (the caller's stream
    waits for it before this returns). ``inputs[i]`` is a tuple (or list) of
    positional arguments; any other object is passed as the only argument, as
    ``nn.parallel.parallel_apply`` does. ``devices`` defaults to the device of
    the first tensor found in ``inputs[i]`` or ``replicas[i]``.

    An exception in any call is re-raised here as the same exception type,
    its message naming the replica index and device, the original chained
    (the lowest failing index wins). Under a ``torch.func`` transform the
    calls run one after another in the caller's thread: the transform's
    state is thread-local, and another thread would silently compute
    without it.

    >>> parallel_apply(lambda w, x: w * x, [torch.tensor(2.0), torch.tensor(3.0)],
    ...                [(torch.tensor(1.0),), (torch.tensor(5.0),)])
    [tensor(2.), tensor(15.)]
    >>> parallel_apply(lambda w, x: w[x], [{}, {}], [("a",), ("b",)], devices=["cpu", "cpu"])
    Traceback (most recent call last):
    ...
    KeyError: "fr.parallel_apply: replica 0 on cpu raised KeyError: 'a'"
    """
    n = len(replicas)
    if n == 0:
        raise ValueError("fr.parallel_apply: replicas is empty; give at least one replica")
    if len(inputs) != n:
        raise ValueError(
            f"fr.parallel_apply: replicas has {n} entries but inputs has {len(inputs)}; "
            "give one input tuple per replica"
        )
    if kwargs is not None and len(kwargs) != n:
        raise ValueError(
            f"fr.parallel_apply: replicas has {n} entries but kwargs has {len(kwargs)}; "
            "give one dict of keyword arguments per replica"
        )
    if devices is not None:
        devs: list[torch.device | None] = list(as_devices(devices, fn="fr.parallel_apply"))
        if len(devs) != n:
            raise ValueError(
                f"fr.parallel_apply: replicas has {n} entries but devices has {len(devs)}; "
                "give one device per replica"
            )
    else:
        devs = [_device_of(inputs[i], replicas[i]) for i in range(n)]
    args = [tuple(x) if isinstance(x, (tuple, list)) else (x,) for x in inputs]
    kws: list[Mapping[str, Any]] = list(kwargs) if kwargs is not None else [{}] * n
    return _parallel_apply(fn, list(replicas), args, kws, devs, "fr.parallel_apply")


def _device_of(*trees: Any) -> torch.device | None:
    for leaf in _tree.flatten(trees)[0]:
        if isinstance(leaf, torch.Tensor):
            return leaf.device
    return None


class _Modes:
    """The caller's thread-local modes, re-entered in each worker thread."""

    def __init__(self) -> None:
        self.grad = torch.is_grad_enabled()
        self.inference = torch.is_inference_mode_enabled()
        self.autocast = [
            (kind, torch.get_autocast_dtype(kind))
            for kind in ("cpu", "cuda")
            if torch.is_autocast_enabled(kind)
        ]

    def enter(self, stack: contextlib.ExitStack) -> None:
        if self.inference:
            stack.enter_context(torch.inference_mode())
        stack.enter_context(torch.set_grad_enabled(self.grad))
        for kind, dtype in self.autocast:
            stack.enter_context(torch.autocast(kind, dtype=dtype))


def _parallel_apply(
    fn: Callable[..., Any],
    replicas: list[Any],
    args: list[tuple[Any, ...]],
    kwargs: list[Mapping[str, Any]],
    devs: Sequence[torch.device | None],
    name: str,
) -> list[Any]:
    n = len(replicas)
    modes = _Modes()
    # Under a torch.func transform, whose state is thread-local, the calls run
    # one after another here, on the caller's streams (another thread would
    # silently compute without the transform).
    threaded = n > 1 and maybe_current_level() is None
    # The caller's stream on each CUDA device: side streams wait for it first
    # (the inputs were made there) and it waits for them at the end.
    callers = {d: torch.cuda.current_stream(d) for d in devs if d is not None and d.type == "cuda"}
    results: list[Any] = [None] * n
    errors: list[BaseException | None] = [None] * n
    streams: list[Any] = [None] * n

    def run(i: int) -> None:
        try:
            with contextlib.ExitStack() as stack:
                modes.enter(stack)
                dev = devs[i]
                caller = None
                if dev is not None and dev.type == "cuda":
                    stack.enter_context(torch.cuda.device(dev))
                    if threaded:
                        caller = callers[dev]
                        stream = streams[i] = torch.cuda.Stream(dev)
                        stream.wait_stream(caller)
                        # The caller's tensors are read on this stream (now, and in
                        # backward, which reuses the forward's streams): the caching
                        # allocator must not hand their memory out before it is done.
                        _record_stream((replicas[i], args[i], kwargs[i]), dev, stream)
                        stack.enter_context(torch.cuda.stream(stream))
                out = fn(replicas[i], *args[i], **kwargs[i])
                if caller is not None and dev is not None:
                    # and the outputs made here are used on the caller's stream
                    _record_stream(out, dev, caller)
                results[i] = out
        except BaseException as err:
            errors[i] = err

    if not threaded:
        for i in range(n):
            run(i)
    else:
        threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(1, n)]
        for t in threads:
            t.start()
        run(0)
        for t in threads:
            t.join()
    for i, stream in enumerate(streams):
        if stream is not None:
            callers[devs[i]].wait_stream(stream)  # type: ignore[index]
    for i, err in enumerate(errors):
        if err is not None:
            _reraise(err, i, devs[i], name)
    return results


def _record_stream(tree: Any, dev: torch.device, stream: Any) -> None:
    for leaf in _tree.flatten(tree)[0]:
        if isinstance(leaf, torch.Tensor) and leaf.device == dev:
            leaf.record_stream(stream)


def _reraise(err: BaseException, i: int, dev: torch.device | None, name: str) -> None:
    if not isinstance(err, Exception):
        raise err  # KeyboardInterrupt, SystemExit: as they are
    where = f"on {dev}" if dev is not None else "(device unknown)"
    msg = f"{name}: replica {i} {where} raised {type(err).__name__}: {err}"
    try:
        new = type(err)(msg)
    except Exception:
        # a type that cannot be built from one message: as nn.parallel does
        raise RuntimeError(msg) from err
    raise new from err


# --------------------------------------------------------------------------- data_parallel


def data_parallel(
    module: nn.Module,
    state: State,
    *inputs: Any,
    devices: Sequence[DeviceSpec],
    output_device: DeviceSpec | None = None,
    dim: int = 0,
    buffers: Literal["first", "mean"] = "first",
    **kwargs: Any,
) -> tuple[Any, State]:
    """``nn.parallel.data_parallel`` as a function: ``(output, new_state)``.

    Scatters ``inputs`` and ``kwargs`` along ``dim`` (as one tree, so both
    are cut the same way: see ``scatter``), replicates ``state`` onto the
    devices that got a shard (a batch smaller than ``devices`` uses only as
    many), runs ``fr.apply(module, state_i, *inputs_i, **kwargs_i)`` on every
    device in parallel, and gathers the outputs on ``output_device`` (default
    ``devices[0]``). As ``nn.DataParallel``, a single device in ``devices``
    gathers nothing: the output is the module's own (a 0-dim loss stays
    0-dim), moved to ``output_device`` if that is another device. Gradients
    of a loss on ``output`` flow back to ``state.params`` summed over the
    replicas, exactly as through ``nn.DataParallel``. With no inputs at all,
    one replica runs (as ``nn.DataParallel``).

    ``new_state.params`` is ``state.params``; ``new_state.buffers`` holds
    replica 0's buffers after the call (``buffers="first"``, what
    ``nn.DataParallel`` leaves in its module) or, with ``buffers="mean"``,
    the mean over replicas of every floating-point buffer (integer buffers,
    such as ``num_batches_tracked``, are equal in every replica and come from
    replica 0), each on the device of the corresponding buffer of ``state``.
    ``state`` and ``module`` are left unchanged. Names missing from ``state``
    fall back to the module's own tensors, as in ``fr.apply``: give a complete
    state when ``devices`` are not the module's device.

    >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
    <...>
    >>> bn = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))
    >>> out, new = data_parallel(bn, fr.state(bn), torch.randn(8, 3), devices=["cpu", "cpu"])
    >>> out.shape, int(new.buffers["1.num_batches_tracked"])
    (torch.Size([8, 2]), 1)
    """
    name = "fr.data_parallel"
    if not (isinstance(state, tuple) and len(state) == 2):
        raise TypeError(
            f"{name}: state must be an fr.State(params, buffers), got {type(state).__name__}; "
            "make one with fr.state(module)"
        )
    if buffers not in ("first", "mean"):
        raise ValueError(f"{name}: buffers must be 'first' or 'mean', got {buffers!r}")
    devs = as_devices(devices, fn=name)
    out_dev = (
        devs[0] if output_device is None else as_device(output_device, fn=name, arg="output_device")
    )
    if not inputs and not kwargs:
        shards: list[tuple[tuple[Any, ...], dict[str, Any]]] = [((), {})]
    else:
        shards = _scatter((inputs, kwargs), devs, dim, name, _as_call_args)
    used = devs[: len(shards)]
    replicas = replicate(state, used)
    results = _parallel_apply(
        lambda st, *a, **kw: apply(module, st, *a, **kw),
        replicas,
        [s[0] for s in shards],
        [s[1] for s in shards],
        list(used),
        name,
    )
    if len(devs) == 1:
        # nn.DataParallel calls the module directly on one device: no gather
        output = results[0][0]
        if out_dev != devs[0]:
            output = replicate(output, [out_dev])[0]
    else:
        output = gather([r[0] for r in results], out_dev, dim=dim)
    new_buffers = _combine_buffers([r[1].buffers for r in results], state.buffers, buffers, name)
    return output, State(state.params, new_buffers)


def _combine_buffers(
    per_replica: list[dict[str, torch.Tensor]],
    given: Mapping[str, torch.Tensor],
    how: str,
    name: str,
) -> dict[str, torch.Tensor]:
    first = per_replica[0]
    keys = list(first)
    values = [first[k] for k in keys]
    # where each buffer goes back to: the given state's device (names the state
    # lacks came from the module's own tensors, already on its device)
    targets = [given[k].device if k in given else v.device for k, v in zip(keys, values)]
    paths = [f"buffers[{k!r}]" for k in keys]
    if how == "mean" and len(per_replica) > 1:
        mean_pos = [i for i, v in enumerate(values) if v.is_floating_point() or v.is_complex()]
        if mean_pos:
            lists = [[bufs[keys[i]] for i in mean_pos] for bufs in per_replica]
            means = _reduce(
                lists, [targets[i] for i in mean_pos], "mean", [paths[i] for i in mean_pos], name
            )
            for i, m in zip(mean_pos, means):
                values[i] = m
    values = _move_each(values, targets, paths, name)
    return dict(zip(keys, values))


def _by_device(
    positions: Iterable[int], targets: Sequence[torch.device]
) -> dict[torch.device, list[int]]:
    groups: dict[torch.device, list[int]] = {}
    for i in positions:
        groups.setdefault(targets[i], []).append(i)
    return groups


def _move_each(
    tensors: list[torch.Tensor], targets: Sequence[torch.device], paths: Sequence[str], name: str
) -> list[torch.Tensor]:
    """``tensors[i]`` onto ``targets[i]``, coalesced per target device."""
    out = list(tensors)
    away = [i for i in range(len(tensors)) if tensors[i].device != targets[i]]
    for dev, idx in _by_device(away, targets).items():
        moved = _pack.broadcast_coalesced(
            [tensors[i] for i in idx], [dev], paths=[paths[i] for i in idx], fn=name
        )[0]
        for i, t in zip(idx, moved):
            out[i] = t
    return out


# --------------------------------------------------------------------------- all_reduce


def all_reduce(trees: Sequence[T], *, op: Op = "mean") -> list[T]:
    """Leaf-wise sum or mean of ``trees`` (one per device), a result on each tree's devices.

    Result tree *i* has the structure of ``trees[i]``, its non-tensor leaves,
    and, at every tensor leaf, the sum (``op="sum"``) or the mean
    (``op="mean"``) over all trees, on the device of ``trees[i]``'s leaf. The
    reduction is coalesced as ``replicate``: one flat buffer per (device,
    dtype) per tree. Result trees whose leaves lie on the same device share
    those result tensors; none is an input tensor, and nothing is modified.
    Differentiable.

    >>> a, b = {"w": torch.tensor([1.0, 2.0])}, {"w": torch.tensor([3.0, 6.0])}
    >>> all_reduce([a, b])[1]["w"], all_reduce([a, b], op="sum")[0]["w"]
    (tensor([2., 4.]), tensor([4., 8.]))
    >>> all_reduce([{"n": torch.tensor(1)}, {"n": torch.tensor(2)}])
    Traceback (most recent call last):
    ...
    TypeError: fr.all_reduce: op='mean' needs floating-point or complex leaves, but the leaf at ['n'] is torch.int64; use op='sum'
    """
    name = "fr.all_reduce"
    if op not in ("sum", "mean"):
        raise ValueError(f"{name}: op must be 'sum' or 'mean', got {op!r}")
    trees = list(trees)
    if not trees:
        raise ValueError(f"{name}: trees is empty; give one tree per device")
    flats = [_tree.flatten(t) for t in trees]
    diff = _tree.first_difference([s for _, s in flats], trees)
    if diff is not None:
        raise ValueError(f"{name}: {diff}")
    spec = flats[0][1]
    leaves0 = flats[0][0]
    unique, slot = _tree.alias_groups(leaves0)
    if any(_tree.alias_groups(leaves)[1] != slot for leaves, _ in flats[1:]):
        # aliasing differs between trees: reduce every tensor position on its own
        unique = [i for i, x in enumerate(leaves0) if isinstance(x, torch.Tensor)]
        slot = [
            unique.index(i) if isinstance(x, torch.Tensor) else -1 for i, x in enumerate(leaves0)
        ]
    paths = _tree.LazyPaths(spec, unique)
    lists = [[leaves[i] for i in unique] for leaves, _ in flats]
    _check_reducible(lists, paths, op, name)
    targets0 = [t.device for t in lists[0]]
    totals = _reduce(lists, targets0, op, paths, name)
    out: list[T] = []
    for j, (leaves, _) in enumerate(flats):
        here = totals if j == 0 else _move_each(totals, [t.device for t in lists[j]], paths, name)
        out.append(_tree.unflatten(spec, [here[s] if s >= 0 else x for x, s in zip(leaves, slot)]))
    return out


def _check_reducible(lists: list[list[Any]], paths: Sequence[str], op: str, name: str) -> None:
    ref = lists[0]
    for j, lst in enumerate(lists[1:], start=1):
        for k, (a, b) in enumerate(zip(ref, lst)):
            if not isinstance(b, torch.Tensor):
                raise ValueError(
                    f"{name}: trees differ at {paths[k]}: a tensor in tree 0, "
                    f"{_kind(b)} in tree {j}"
                )
            if a.shape != b.shape or a.dtype != b.dtype:
                raise ValueError(
                    f"{name}: trees differ at {paths[k]}: {a.dtype} of shape {tuple(a.shape)} "
                    f"in tree 0, {b.dtype} of shape {tuple(b.shape)} in tree {j}"
                )
    if op == "mean":
        for k, a in enumerate(ref):
            if not (a.is_floating_point() or a.is_complex()):
                raise TypeError(
                    f"{name}: op='mean' needs floating-point or complex leaves, but the leaf "
                    f"at {paths[k]} is {a.dtype}; use op='sum'"
                )


def _reduce(
    lists: Sequence[Sequence[torch.Tensor]],
    targets: Sequence[torch.device],
    op: str,
    paths: Sequence[str],
    name: str,
) -> list[torch.Tensor]:
    """Leaf-wise sum / mean of ``lists``; position ``k`` lands on ``targets[k]``."""
    out: list[torch.Tensor] = [None] * len(targets)  # type: ignore[list-item]
    n = len(lists)
    for dev, idx in _by_device(range(len(targets)), targets).items():
        every = len(idx) == len(targets)
        group = [list(lst) if every else [lst[k] for k in idx] for lst in lists]
        sums = _pack.reduce_add_coalesced(
            group, dev, paths=paths if every else [paths[k] for k in idx], fn=name
        )
        if op == "mean":
            if maybe_current_level() is None and not any(s.requires_grad for s in sums):
                # the sums are fresh buffers of ours, never an input: divide in place
                torch._foreach_div_(sums, n)
            else:
                # autograd or a torch.func transform (foreach ops have no batching rules)
                sums = [s / n for s in sums]
        for k, s in zip(idx, sums):
            out[k] = s
    return out


# --------------------------------------------------------------------------- data_parallel_grad


def data_parallel_grad(
    loss_fn: Callable[..., Any],
    devices: Sequence[DeviceSpec],
    *,
    op: Op = "mean",
    has_aux: bool = False,
) -> Callable[..., tuple[Any, Any]]:
    """``step(params, *batch) -> (grads, loss)``: DDP's gradient step, in one process.

    ``step`` replicates ``params`` onto ``devices``, scatters ``batch`` along
    dim 0 (as ``scatter``: a batch smaller than ``devices`` uses fewer
    devices), computes ``fr.grad_and_value(loss_fn)(params_i, *batch_i)`` on
    every device in parallel (``parallel_apply``), and all-reduces the
    gradients (``op``, default the mean, as DDP) onto the devices of
    ``params``. ``loss`` is the mean of the replicas' losses, on
    ``devices[0]``. With ``has_aux``, ``loss_fn`` returns ``(loss, aux)`` and
    ``step`` returns ``(grads, (loss, aux))``, ``aux`` being the replicas' aux
    gathered on ``devices[0]`` (``gather``: 0-dim values stacked, one per
    replica). With equal shards and a loss that is a mean over the batch,
    ``grads`` and ``loss`` equal the full-batch ones; with unequal shards,
    each replica's mean counts as much as the others' (as in DDP).

    >>> w = {"w": torch.tensor([1.0, -1.0])}
    >>> def loss_fn(p, x, y):
    ...     return ((x @ p["w"] - y) ** 2).mean()
    >>> x, y = torch.tensor([[1.0, 0.0], [0.0, 1.0]]), torch.tensor([0.0, 0.0])
    >>> data_parallel_grad(loss_fn, ["cpu", "cpu"])(w, x, y)
    ({'w': tensor([ 1., -1.])}, tensor(1.))
    """
    name = "fr.data_parallel_grad"
    if op not in ("sum", "mean"):
        raise ValueError(f"{name}: op must be 'sum' or 'mean', got {op!r}")
    devs = as_devices(devices, fn=name)
    per_device = grad_and_value(loss_fn, has_aux=has_aux)

    def step(params: Any, *batch: Any) -> tuple[Any, Any]:
        shards = _scatter(batch, devs, 0, name, lambda p: f"batch{p}")
        used = devs[: len(shards)]
        replicas = replicate(params, used)
        results = _parallel_apply(
            per_device, replicas, list(shards), [{}] * len(shards), list(used), name
        )
        leaves, spec = _tree.flatten(params)
        grads_leaves = [_tree.flatten(g)[0] for g, _ in results]
        if len(results) == 1:
            grads = results[0][0]
            if any(g.device != p.device for g, p in zip(grads_leaves[0], leaves)):
                grads = _tree.unflatten(
                    spec,
                    _move_each(
                        grads_leaves[0], [p.device for p in leaves], _tree.LazyPaths(spec), name
                    ),
                )
        else:
            grads = _tree.unflatten(
                spec,
                _reduce(grads_leaves, [p.device for p in leaves], op, _tree.LazyPaths(spec), name),
            )
        values = [v for _, v in results]
        losses = [v[0] for v in values] if has_aux else values
        loss = (
            losses[0] if len(losses) == 1 else torch.stack([v.to(devs[0]) for v in losses]).mean()
        )
        if has_aux:
            return grads, (loss, gather([v[1] for v in values], devs[0]))
        return grads, loss

    return step
