"""``check_against_stateful``: ``fr.data_parallel`` against PyTorch's stateful DataParallel.

The functional side is what a user writes: ``fr.state``, ``fr.data_parallel``
and ``.backward()`` of a loss on the gathered output into fresh leaves that
require grad, one for each trainable entry of ``state.params`` (not
``torch.autograd.grad``, which a reentrant activation checkpoint refuses, in
the stateful module too). The stateful side runs on a deep copy of the module, so the
caller's module is never touched: ``nn.DataParallel`` itself when the devices
are distinct CUDA devices; otherwise (CPU, repeated or mixed devices, where
``nn.DataParallel`` cannot run) the same steps DataParallel takes, done by
hand: scatter the inputs as ``nn.parallel.scatter_kwargs`` does, one deep copy
of the module per shard, forward each copy, gather the outputs onto the first
device, backward, sum each parameter's gradients over the copies (what
``Broadcast``'s backward does), and keep the buffers of replica 0 (whose
buffers, in DataParallel, are the module's own). The loss is a fixed random
weighting of every floating-point output, so that every output element
carries its own gradient. The containers optree keeps whole (a dict subclass
such as ``transformers``' ``ModelOutput``, a list or tuple subclass, a
dataclass) are scattered and gathered as ``nn.parallel`` does, and opened for
the loss, the comparison and the check that no input changed.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from typing import Any, Literal, NamedTuple

import optree
import torch
from torch import nn

import freplicate as fr

from ._assertions import assert_trees_close, check_tolerances

__all__ = ["check_against_stateful"]


def check_against_stateful(
    module: nn.Module,
    inputs: Any,
    devices: Sequence[Any],
    *,
    buffers: Literal["first", "mean"] = "first",
    rtol: float | None = None,
    atol: float | None = None,
) -> None:
    """Assert that ``fr.data_parallel`` gives DataParallel's outputs, gradients and buffers.

    Compares the gathered outputs, the gradients of a loss on them with
    respect to every parameter that requires grad (zero where PyTorch leaves
    ``None``; a sparse gradient by its dense values, whatever its layout on
    either side), and the buffers after the call, with
    ``assert_trees_close(rtol=, atol=)``; also asserts that neither side
    modified the module's tensors (values, ``_version``, ``.grad``) or the
    inputs. The gradients come from ``.backward()``, as in a training loop,
    so a reentrant activation checkpoint works on both sides.

    Args:
        module: the module; never modified (the stateful side runs on copies).
        inputs: a tuple of positional arguments; a single tensor may be given
            as is, and a dict is taken as keyword arguments: exactly what the
            ``inputs`` strategy of ``fr.testing.modules()`` draws.
        devices: the device list of ``fr.data_parallel``.
        buffers: ``fr.data_parallel``'s buffer policy. With ``"mean"`` (which
            DataParallel lacks), the reference buffers are the mean over the
            replicas' copies of every floating-point buffer, the others
            replica 0's.
        rtol: relative tolerance, given together with ``atol`` (or neither).
        atol: absolute tolerance, given together with ``rtol``.

    Raises:
        AssertionError: the two sides differ (the message says what and
            where), or one of them modified what it was given.
        ValueError: an unknown ``buffers``, no device, or one tolerance
            without the other.
        TypeError: ``inputs`` is not a tuple, tensor or dict.

    >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
    <...>
    >>> model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.ReLU())
    >>> check_against_stateful(model, (torch.randn(6, 3),), ["cpu", "cpu", "cpu"])
    """
    check_tolerances(rtol, atol, "check_against_stateful")
    args, kwargs = arguments_of(inputs)
    if buffers not in ("first", "mean"):
        raise ValueError(
            f"check_against_stateful: buffers must be 'first' or 'mean', got {buffers!r}"
        )
    devs = [_device(d) for d in devices]
    if not devs:
        raise ValueError("check_against_stateful: devices must name at least one device")
    before = _snapshot((module, args, kwargs))

    out_f, grads_f, buffers_f = _functional(module, args, kwargs, devices, buffers)
    _check_unchanged(before, "fr.data_parallel")
    out_s, grads_s, buffers_s = _stateful(module, args, kwargs, devs, buffers)
    _check_unchanged(before, "the stateful path")

    for what, actual, expected in (
        ("outputs", out_f, out_s),
        ("gradients", _dense(grads_f), _dense(grads_s)),
        ("buffers", buffers_f, buffers_s),
    ):
        try:
            assert_trees_close(actual, expected, rtol=rtol, atol=atol)
        except AssertionError as err:
            raise AssertionError(
                f"check_against_stateful: {what} of fr.data_parallel differ from the stateful "
                f"path's on devices {[str(d) for d in devs]}: {err}"
            ) from None


def _device(spec: Any) -> torch.device:
    device = torch.device("cuda", spec) if isinstance(spec, int) else torch.device(spec)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def arguments_of(inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if isinstance(inputs, torch.Tensor):
        return (inputs,), {}
    if isinstance(inputs, dict):
        return (), dict(inputs)
    if isinstance(inputs, tuple):
        return inputs, {}
    raise TypeError(
        "check_against_stateful: inputs must be a tuple of positional arguments, a tensor, "
        f"or a dict of keyword arguments, got {type(inputs).__name__}"
    )


class Container(NamedTuple):
    """A container optree keeps whole, opened: its type and its contents, a plain dict or list."""

    type: type
    contents: Any


def _opened(tree: Any) -> Any:
    """``tree`` with every dict, list or tuple subclass and dataclass optree keeps whole opened.

    What the loss, the comparison (``assert_trees_close`` sees ``.contents``
    and compares ``.type``) and the snapshot of the inputs look inside.
    """

    def open_one(x: Any) -> Any:
        if isinstance(x, (torch.Tensor, torch.Size)):
            return x
        if isinstance(x, dict):
            return Container(type(x), {k: _opened(v) for k, v in x.items()})
        if isinstance(x, (list, tuple)):
            return Container(type(x), [_opened(v) for v in x])
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            fields = {f.name: _opened(getattr(x, f.name)) for f in dataclasses.fields(x)}
            return Container(type(x), fields)
        return x

    return optree.tree_map(open_one, tree)


def weighted_loss(out: Any) -> torch.Tensor | None:
    """A fixed random weighting of every floating-point output element, summed."""
    total: torch.Tensor | None = None
    for i, leaf in enumerate(optree.tree_leaves(_opened(out))):
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
            g = torch.Generator().manual_seed(i)
            weight = torch.randn(leaf.shape, generator=g).to(leaf.dtype).to(leaf.device)
            term = (leaf * weight).sum()
            total = term if total is None else total + term.to(total.device)
    return total


def _functional(
    module: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    devices: Sequence[Any],
    buffers: Literal["first", "mean"],
) -> tuple[Any, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    s = fr.state(module)
    trainable = {name for name, p in module.named_parameters() if p.requires_grad}
    params = {
        name: p.detach().requires_grad_(True) if name in trainable else p
        for name, p in s.params.items()
    }
    out, new = fr.data_parallel(
        module, fr.State(params, s.buffers), *args, devices=devices, buffers=buffers, **kwargs
    )
    wrt = [params[name] for name in params if name in trainable]
    loss = weighted_loss(out)
    if loss is not None and loss.requires_grad and wrt:
        # .backward() into these fresh leaves, as a training loop does: a reentrant activation
        # checkpoint refuses torch.autograd.grad (in the stateful module too)
        loss.backward()
    grads = tuple(torch.zeros_like(p) if p.grad is None else p.grad for p in wrt)
    named = dict(zip([n for n in params if n in trainable], grads))
    return _detached(out), named, dict(new.buffers)


def _stateful(
    module: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    devs: list[torch.device],
    buffers: Literal["first", "mean"],
) -> tuple[Any, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    home = {name: t.device for name, t in module.named_parameters()}
    home.update({name: t.device for name, t in module.named_buffers()})
    base = copy.deepcopy(module)
    distinct_cuda = all(d.type == "cuda" for d in devs) and len(set(devs)) == len(devs)
    if distinct_cuda and buffers == "first":
        base.to(devs[0])
        dp = nn.DataParallel(base, device_ids=[d.index for d in devs], output_device=devs[0].index)
        out = dp(*args, **kwargs)
        replicas = [base]
    else:
        out, replicas = _data_parallel_by_hand(base, args, kwargs, devs)
    loss = weighted_loss(out)
    if loss is not None and loss.requires_grad:
        loss.backward()
    grads: dict[str, torch.Tensor] = {}
    per_replica = [dict(r.named_parameters()) for r in replicas]
    for name, p in module.named_parameters():
        if not p.requires_grad:
            continue
        total = torch.zeros_like(p)
        for named in per_replica:
            g = named[name].grad
            if g is not None:
                total = total + g.to(home[name])
        grads[name] = total
    kept = {}
    for name, b in replicas[0].named_buffers():
        if buffers == "mean" and (b.is_floating_point() or b.is_complex()):
            copies = [dict(r.named_buffers())[name].detach().to(home[name]) for r in replicas]
            kept[name] = torch.stack(copies).mean(0)
        else:
            kept[name] = b.detach().to(home[name])
    return _detached(out), grads, kept


def _data_parallel_by_hand(
    base: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], devs: list[torch.device]
) -> tuple[Any, list[nn.Module]]:
    shards_args, shards_kwargs = _scatter_kwargs(args, kwargs, devs)
    if not shards_args:
        shards_args, shards_kwargs = [()], [{}]
    replicas = [copy.deepcopy(base).to(d) for d in devs[: len(shards_args)]]
    outs = [r(*a, **k) for r, a, k in zip(replicas, shards_args, shards_kwargs)]
    if len(devs) == 1:  # DataParallel calls a lone device's module directly: no gather
        return outs[0], replicas
    return _gather(outs, devs[0]), replicas


def _scatter(obj: Any, devs: list[torch.device]) -> list[Any]:
    """``nn.parallel.scatter``: chunk tensors, recurse into containers, share the rest."""
    if isinstance(obj, torch.Tensor):
        return [c.to(d) for c, d in zip(obj.chunk(len(devs)), devs)]
    if isinstance(obj, tuple) and hasattr(obj, "_fields") and len(obj) > 0:
        return [type(obj)(*xs) for xs in zip(*(_scatter(x, devs) for x in obj))]
    if isinstance(obj, tuple) and len(obj) > 0:
        return list(zip(*(_scatter(x, devs) for x in obj)))
    if isinstance(obj, list) and len(obj) > 0:
        return [list(xs) for xs in zip(*(_scatter(x, devs) for x in obj))]
    if isinstance(obj, dict) and len(obj) > 0:
        return [type(obj)(kv) for kv in zip(*(_scatter(kv, devs) for kv in obj.items()))]
    return [obj for _ in devs]


def _scatter_kwargs(
    args: tuple[Any, ...], kwargs: dict[str, Any], devs: list[torch.device]
) -> tuple[list[Any], list[Any]]:
    """``nn.parallel.scatter_kwargs``: shards of args and kwargs, padded to one length."""
    sa: list[Any] = _scatter(args, devs) if args else []
    sk: list[Any] = _scatter(kwargs, devs) if kwargs else []
    sa += [() for _ in range(len(sk) - len(sa))]
    sk += [{} for _ in range(len(sa) - len(sk))]
    return sa, sk


def _gather(outs: list[Any], device: torch.device) -> Any:
    """``nn.parallel.gather``: concatenate tensors along dim 0 (0-dim ones stacked)."""
    first = outs[0]
    if isinstance(first, torch.Tensor):
        parts = [o.to(device) for o in outs]
        return torch.cat([p.unsqueeze(0) if p.dim() == 0 else p for p in parts])
    if first is None:
        return None
    if isinstance(first, dict):
        return type(first)((k, _gather([o[k] for o in outs], device)) for k in first)
    if isinstance(first, tuple) and hasattr(first, "_fields"):
        return type(first)(*(_gather(list(xs), device) for xs in zip(*outs)))
    if isinstance(first, (tuple, list)) and not isinstance(first, torch.Size):
        return type(first)(_gather(list(xs), device) for xs in zip(*outs))
    if dataclasses.is_dataclass(first) and not isinstance(first, type):
        # DataParallel raises here (a dataclass is not iterable); fr.gather's rule: field by field
        fields = [f.name for f in dataclasses.fields(first) if f.init]
        return type(first)(**{k: _gather([getattr(o, k) for o in outs], device) for k in fields})
    # DataParallel cannot gather other leaves (a torch.Size, a number); fr.gather's rule: equal
    # ones come back once
    return first if all(o == first for o in outs) else tuple(outs)


def _dense(tree: Any) -> Any:
    """Sparse leaves as dense: a sparse gradient (``nn.Embedding(sparse=True)``) is compared by value."""
    return optree.tree_map(
        lambda x: x.to_dense() if isinstance(x, torch.Tensor) and x.is_sparse else x, tree
    )


def _detached(tree: Any) -> Any:
    """``tree``, opened (``_opened``), with its tensors detached: what the comparison sees."""
    return optree.tree_map(
        lambda x: x.detach() if isinstance(x, torch.Tensor) else x, _opened(tree)
    )


# (what, tensor, _version, value, .grad object) of every tensor the oracle must leave alone
_Snapshot = list[tuple[str, torch.Tensor, int, torch.Tensor, torch.Tensor | None]]


def _snapshot(tree: Any) -> _Snapshot:
    module, args, kwargs = tree
    found: list[tuple[str, torch.Tensor]] = [
        (f"the module's {name!r}", t)
        for name, t in (*module.named_parameters(), *module.named_buffers())
    ]
    inputs: Any = _opened((args, kwargs))
    accessors, leaves, _ = optree.tree_flatten_with_accessor(inputs)
    for accessor, leaf in zip(accessors, leaves):
        if isinstance(leaf, torch.Tensor):
            which = "args" if accessor[0].entry == 0 else "kwargs"
            found.append((f"input {which}{optree.PyTreeAccessor(accessor[1:]).codify('')}", leaf))
    return [(what, t, t._version, t.detach().clone(), t.grad) for what, t in found]


def _check_unchanged(before: _Snapshot, by: str) -> None:
    for what, t, version, value, grad in before:
        if t._version != version or not torch.equal(_dense(t.detach()), _dense(value)):
            raise AssertionError(f"check_against_stateful: {by} modified {what}")
        if t.grad is not grad:  # a backward that reached the caller's own tensors
            raise AssertionError(f"check_against_stateful: {by} changed the .grad of {what}")
