"""The composites: data_parallel and data_parallel_grad, built from the primitives."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import torch
from torch import nn

from .. import _pack, _tree
from .._apply import apply
from .._checks import check_choice, check_int, check_op, check_state
from .._devices import as_device, as_devices
from .._grad import grad_and_value
from .._replicate import replicate
from .._state import State
from .._typing import DeviceSpec, Op, TensorTree
from .apply import apply_each
from .reduce import reduce_lists
from .scatter import gather, shard

__all__ = ["data_parallel", "data_parallel_grad"]


def _as_call_args(path: str) -> str:
    # data_parallel scatters the tree (inputs, kwargs): show its paths as such
    return ("inputs" if path.startswith("[0]") else "kwargs") + path[3:]


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

    Args:
        module: the module whose forward runs; never modified.
        state: its ``fr.State`` (``fr.state(module)``, or a trained one).
        *inputs: the forward's positional arguments, scattered along ``dim``.
        devices: the devices the replicas run on.
        output_device: where the output is gathered (default ``devices[0]``).
        dim: the dimension inputs are scattered and outputs gathered along.
        buffers: which buffers come back: ``"first"`` or ``"mean"``.
        **kwargs: the forward's keyword arguments, scattered along ``dim``.

    Returns:
        ``(output, new_state)``.

    Raises:
        TypeError: ``state`` is not an ``fr.State``; ``dim`` is not an int.
        ValueError: a bad device or ``buffers``; inputs that cannot be
            scattered (naming them as ``inputs[0]``, ``kwargs['x']``).

    Examples:
        >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
        <...>
        >>> bn = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))
        >>> out, new = data_parallel(bn, fr.state(bn), torch.randn(8, 3), devices=["cpu", "cpu"])
        >>> out.shape, int(new.buffers["1.num_batches_tracked"])
        (torch.Size([8, 2]), 1)
    """
    name = "fr.data_parallel"
    check_state(name, state)
    check_choice(name, "buffers", buffers, ("first", "mean"))
    check_int(name, "dim", dim)
    devs = as_devices(devices, caller=name)
    out_dev = (
        devs[0]
        if output_device is None
        else as_device(output_device, caller=name, arg="output_device")
    )
    if not inputs and not kwargs:
        shards: list[tuple[tuple[Any, ...], dict[str, Any]]] = [((), {})]
    else:
        shards = shard((inputs, kwargs), devs, dim, caller=name, rename=_as_call_args)
    used = devs[: len(shards)]
    replicas = replicate(state, used)
    results = apply_each(
        lambda st, *a, **kw: apply(module, st, *a, **kw),
        replicas,
        [s[0] for s in shards],
        [s[1] for s in shards],
        used,
        caller=name,
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
            means = reduce_lists(
                lists,
                [targets[i] for i in mean_pos],
                "mean",
                paths=[paths[i] for i in mean_pos],
                caller=name,
            )
            for i, m in zip(mean_pos, means):
                values[i] = m
    values = _pack.move_each(values, targets, paths=paths, caller=name)
    return dict(zip(keys, values))


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

    Args:
        loss_fn: ``loss_fn(params, *batch) -> loss`` (a scalar tensor), or
            ``(loss, aux)`` with ``has_aux``.
        devices: the devices the replicas run on.
        op: how the replicas' gradients combine: ``"mean"`` (DDP's) or ``"sum"``.
        has_aux: whether ``loss_fn`` returns ``(loss, aux)``.

    Returns:
        ``step(params, *batch) -> (grads, loss)``, or ``(grads, (loss, aux))``
        with ``has_aux``.

    Raises:
        ValueError: a bad ``op`` or device (at once); a batch that cannot be
            scattered (when ``step`` runs, naming it as ``batch[0]``).

    Examples:
        >>> w = {"w": torch.tensor([1.0, -1.0])}
        >>> def loss_fn(p, x, y):
        ...     return ((x @ p["w"] - y) ** 2).mean()
        >>> x, y = torch.tensor([[1.0, 0.0], [0.0, 1.0]]), torch.tensor([0.0, 0.0])
        >>> data_parallel_grad(loss_fn, ["cpu", "cpu"])(w, x, y)
        ({'w': tensor([ 1., -1.])}, tensor(1.))
    """
    name = "fr.data_parallel_grad"
    check_op(name, op)
    devs = as_devices(devices, caller=name)
    per_device = grad_and_value(loss_fn, has_aux=has_aux)

    def step(params: TensorTree, *batch: Any) -> tuple[TensorTree, Any]:
        shards = shard(batch, devs, 0, caller=name, rename=lambda p: f"batch{p}")
        used = devs[: len(shards)]
        replicas = replicate(params, used)
        results = apply_each(per_device, replicas, shards, [{}] * len(shards), used, caller=name)
        leaves, spec = _tree.flatten(params)
        targets = [p.device for p in leaves]
        grads_leaves = [_tree.flatten(g)[0] for g, _ in results]
        if len(results) == 1:
            grads = results[0][0]
            if any(g.device != d for g, d in zip(grads_leaves[0], targets)):
                moved = _pack.move_each(
                    grads_leaves[0], targets, paths=_tree.LazyPaths(spec), caller=name
                )
                grads = _tree.unflatten(spec, moved)
        else:
            reduced = reduce_lists(
                grads_leaves, targets, op, paths=_tree.LazyPaths(spec), caller=name
            )
            grads = _tree.unflatten(spec, reduced)
        values = [v for _, v in results]
        losses = [v[0] for v in values] if has_aux else values
        loss = (
            losses[0] if len(losses) == 1 else torch.stack([v.to(devs[0]) for v in losses]).mean()
        )
        if has_aux:
            return grads, (loss, gather([v[1] for v in values], devs[0]))
        return grads, loss

    return step
