"""The composites: data_parallel and data_parallel_grad, built from the primitives.

Both run their replicas through ``apply_each`` with a ``Draws`` record kept
across calls (per module, per step function), so that replicas drawing
random numbers from a generator they share do it in order, as the stateful
design's copies called one after another do. While ``torch.compile``
traces, the replicas run one after another in the traced code: one graph,
no threads.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import torch
from torch import nn

from .. import _caches, _pack, _tree
from .._apply import apply, check_bindable
from .._checks import check_choice, check_int, check_op
from .._devices import as_device, as_devices
from .._grad import grad_and_value
from .._replicate import replicate, replicate_shared
from .._state import State
from .._torch import is_compiling
from .._typing import DeviceSpec, Op, TensorTree
from .apply import Draws, apply_each
from .reduce import reduce_lists
from .scatter import gather, shard

__all__ = ["data_parallel", "data_parallel_grad"]

# What data_parallel learned of each module's replicas (do they draw random numbers?).
_DRAWS: weakref.WeakKeyDictionary[nn.Module, Draws] = weakref.WeakKeyDictionary()
_caches.register(_DRAWS.clear)


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
    one replica runs (as ``nn.DataParallel``). Inputs and outputs in
    containers (a ``transformers`` ``ModelOutput``, a dataclass output) are
    split and joined as ``scatter`` and ``gather`` do, keeping their type.

    Every replica binds tensor objects of its own (``fr.replicate``), so a
    forward that writes ``.grad`` or calls ``zero_grad()`` touches its own
    replica only, never ``state`` nor the module. Random numbers (dropout):
    a replica draws from its device's generator. Replicas that share one
    (``["cpu", "cpu"]``, a CUDA device named twice) and draw from it run one
    after another, in order, replica ``i`` drawing the numbers that follow
    replica ``i - 1``'s: what copies of the module called in order draw, so
    a seed fixes the result and the caller's generator advances by what
    the replicas drew. Replicas that draw nothing run in parallel. A call
    learns which case holds by comparing the shared generators' states
    after a threaded run: the first call that draws runs the forward twice
    (in threads, then, generators restored, in order) and later calls with
    this module run in order at once, until one draws nothing. Under
    ``torch.compile`` the replicas run one after another in one graph.

    ``new_state.params`` is ``state.params``; ``new_state.buffers`` holds
    replica 0's buffers after the call (``buffers="first"``, what
    ``nn.DataParallel`` leaves in its module) or, with ``buffers="mean"``,
    the mean over replicas of every floating-point buffer (integer buffers,
    such as ``num_batches_tracked``, are equal in every replica and come from
    replica 0), each on the device of the corresponding buffer of ``state``.
    ``state`` and ``module`` are left unchanged. Names missing from ``state``
    fall back to the module's own tensors, as in ``fr.apply``: give a complete
    state when ``devices`` are not the module's device. A ``None`` in
    ``state`` is bound on every replica, as in ``fr.apply``.

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
    caller = "fr.data_parallel"
    check_bindable(caller, state)
    check_choice(caller, "buffers", buffers, ("first", "mean"))
    check_int(caller, "dim", dim)
    devs = as_devices(devices, caller=caller)
    out_dev = (
        devs[0]
        if output_device is None
        else as_device(output_device, caller=caller, arg="output_device")
    )
    if not inputs and not kwargs:
        shards: list[tuple[tuple[Any, ...], dict[str, Any]]] = [((), {})]
    elif not kwargs:
        # inputs alone (Dynamo cannot flatten the empty kwargs dict without a graph break)
        cut = shard(inputs, devs, dim, caller=caller, rename=lambda p: f"inputs{p}")
        shards = [(s, {}) for s in cut]
    else:
        shards = shard((inputs, kwargs), devs, dim, caller=caller, rename=_as_call_args)
    used = devs[: len(shards)]
    replicas = replicate(state, used)
    if is_compiling():
        results = [apply(module, st, *a, **kw) for st, (a, kw) in zip(replicas, shards)]
    else:
        draws = _DRAWS.get(module)
        if draws is None:
            draws = _DRAWS[module] = Draws()
        results = apply_each(
            lambda st, *a, **kw: apply(module, st, *a, **kw),
            replicas,
            [s[0] for s in shards],
            [s[1] for s in shards],
            used,
            caller=caller,
            draws=draws,
        )
    if len(devs) == 1:
        # nn.DataParallel calls the module directly on one device: no gather
        output = results[0][0]
        if out_dev != devs[0]:
            leaves, spec = _tree.flatten_containers(output)
            output = _tree.unflatten_containers(spec, replicate(leaves, [out_dev])[0], caller)
    else:
        output = gather([r[0] for r in results], out_dev, dim=dim)
    new_buffers = _combine_buffers([r[1].buffers for r in results], state.buffers, buffers, caller)
    return output, State(state.params, new_buffers)


def _combine_buffers(
    per_replica: list[dict[str, torch.Tensor]],
    given: Mapping[str, torch.Tensor],
    how: str,
    caller: str,
) -> dict[str, torch.Tensor]:
    first = per_replica[0]
    keys = [k for k, v in first.items() if v is not None]  # None, bound as given, stays None
    values = [first[k] for k in keys]
    # where each buffer goes back to: the given state's device (names the state
    # lacks came from the module's own tensors, already on its device)
    targets = [given[k].device if k in given else v.device for k, v in zip(keys, values)]
    paths = [f"buffers[{k!r}]" for k in keys]
    per = [[bufs[k] for k in keys] for bufs in per_replica] if how == "mean" else [values]
    combined = dict(zip(keys, _first_or_mean(per, how, targets, paths, caller)))
    return {k: combined.get(k) for k in first}  # type: ignore[misc]


def data_parallel_grad(
    loss_fn: Callable[..., Any],
    devices: Sequence[DeviceSpec],
    *,
    op: Op = "mean",
    has_aux: bool = False,
    replicated: int = 0,
    aux: Literal["gather", "first", "mean"] = "gather",
) -> Callable[..., tuple[Any, Any]]:
    """``step(params, *batch) -> (grads, loss)``: DDP's gradient step, in one process.

    ``step`` replicates ``params`` onto ``devices``, scatters ``batch`` along
    dim 0 (as ``scatter``: a batch smaller than ``devices`` uses fewer
    devices), computes ``fr.grad_and_value(loss_fn)(params_i, *batch_i)`` on
    every device in parallel (``parallel_apply``), and all-reduces the
    gradients (``op``, default the mean, as DDP) onto the devices of
    ``params``. ``loss`` is the mean of the replicas' losses, on
    ``devices[0]``. With equal shards and a loss that is a mean over the
    batch, ``grads`` and ``loss`` equal the full-batch ones; with unequal
    shards, each replica's mean counts as much as the others' (as in DDP).
    The mean sums float16 and bfloat16 gradients in float64 and rounds once,
    so a mean whose sum would overflow the dtype stays finite (and is the
    correctly rounded mean).

    **Frozen parameters, buffers, constants.** ``replicated=k`` says that the
    ``k`` arguments after ``params`` are replicated onto every device as
    ``params`` are, but not differentiated: ``step(trainable, frozen, *batch)``
    with ``replicated=1`` (``fr.partition``) leaves ``frozen`` without
    gradients, backward work or reduction, and no replica computes with
    another device's tensors. Buffers go the same way, and come back as
    ``aux``: with ``has_aux``, ``loss_fn`` returns ``(loss, aux)``, and
    ``aux`` says how the replicas' aux combine, on ``devices[0]``:
    ``"gather"`` (``gather``: 0-dim values stacked, one per replica),
    ``"first"`` (replica 0's: the buffers ``nn.DataParallel`` keeps) or
    ``"mean"`` (the mean over replicas of floating-point leaves, the others
    replica 0's: ``fr.data_parallel``'s ``buffers="mean"``).

    Random numbers are drawn as in ``fr.data_parallel``: replicas sharing a
    generator that draw from it run in order, so a seed fixes the result.
    Under ``torch.compile`` the replicas run one after another in the traced
    code (one graph, no threads).

    Args:
        loss_fn: ``loss_fn(params, *replicated_args, *batch) -> loss`` (a
            scalar tensor), or ``(loss, aux)`` with ``has_aux``.
        devices: the devices the replicas run on.
        op: how the replicas' gradients combine: ``"mean"`` (DDP's) or ``"sum"``.
        has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
        replicated: how many arguments after ``params`` are replicated (not
            scattered) and not differentiated.
        aux: how the replicas' aux combine: ``"gather"``, ``"first"`` or ``"mean"``.

    Returns:
        ``step(params, *replicated_args, *batch) -> (grads, loss)``, or
        ``(grads, (loss, aux))`` with ``has_aux``.

    Raises:
        TypeError: ``replicated`` is not an int; ``step`` gets fewer than
            ``replicated`` arguments after ``params``.
        ValueError: a bad ``op``, ``aux`` or device, a negative ``replicated``,
            ``aux`` other than ``"gather"`` without ``has_aux`` (at once); a
            batch that cannot be scattered (when ``step`` runs, naming it as
            ``batch[0]``); with ``aux="mean"``, replicas whose aux differ in
            structure.

    Examples:
        >>> w = {"w": torch.tensor([1.0, -1.0])}
        >>> def loss_fn(p, x, y):
        ...     return ((x @ p["w"] - y) ** 2).mean()
        >>> x, y = torch.tensor([[1.0, 0.0], [0.0, 1.0]]), torch.tensor([0.0, 0.0])
        >>> data_parallel_grad(loss_fn, ["cpu", "cpu"])(w, x, y)
        ({'w': tensor([ 1., -1.])}, tensor(1.))

        Fine-tuning a BatchNorm model with a frozen first layer: the frozen
        parameters and the buffers are replicated, the new buffers come back
        as replica 0's, as ``nn.DataParallel`` keeps them.

        >>> import freplicate as fr
        >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
        <...>
        >>> model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
        >>> _ = model[0].requires_grad_(False)
        >>> params, buffers = fr.state(model)
        >>> trainable, frozen = fr.partition(params, model)
        >>> def loss_fn(trainable, frozen, buffers, x, y):
        ...     state = fr.State(fr.combine(trainable, frozen), buffers)
        ...     out, new = fr.apply(model, state, x)
        ...     return nn.functional.cross_entropy(out, y), new.buffers
        >>> step = fr.data_parallel_grad(
        ...     loss_fn, ["cpu", "cpu"], replicated=2, has_aux=True, aux="first"
        ... )
        >>> x, y = torch.randn(8, 3), torch.randint(0, 2, (8,))
        >>> grads, (loss, buffers) = step(trainable, frozen, buffers, x, y)
        >>> sorted(grads), buffers["1.running_mean"].shape, int(buffers["1.num_batches_tracked"])
        (['1.bias', '1.weight', '2.bias', '2.weight'], torch.Size([4]), 1)
    """
    caller = "fr.data_parallel_grad"
    check_op(caller, op)
    check_int(caller, "replicated", replicated)
    if replicated < 0:
        raise ValueError(f"{caller}: replicated must be >= 0, got {replicated}")
    check_choice(caller, "aux", aux, ("gather", "first", "mean"))
    if aux != "gather" and not has_aux:
        raise ValueError(
            f"{caller}: aux={aux!r} says how the replicas' aux combine, but loss_fn returns "
            "no aux; pass has_aux=True (and return (loss, aux) from loss_fn)"
        )
    devs = as_devices(devices, caller=caller)
    per_device = grad_and_value(loss_fn, has_aux=has_aux)
    draws = Draws()

    def step(params: TensorTree, *args: Any) -> tuple[TensorTree, Any]:
        if len(args) < replicated:
            raise TypeError(
                f"{caller}: step takes params, then replicated={replicated} argument(s), then the "
                f"batch; got {len(args)} argument(s) after params"
            )
        shards = shard(args[replicated:], devs, 0, caller=caller, rename=lambda p: f"batch{p}")
        used = devs[: len(shards)]
        # grad_and_value binds fresh leaves of its own to every replica of params: no
        # replica sees the shared objects; the rest reaches loss_fn as it is, own objects
        replicas = replicate_shared(params, used)
        if replicated:
            rest = replicate(args[:replicated], used)
            shards = [(*r, *b) for r, b in zip(rest, shards)]
        if is_compiling():
            results = [per_device(p, *b) for p, b in zip(replicas, shards)]
        else:
            results = apply_each(
                per_device, replicas, shards, [{}] * len(shards), used, caller=caller, draws=draws
            )
        leaves, spec = _tree.flatten(params)
        targets = [p.device for p in leaves]
        grads_leaves = [_tree.flatten(g)[0] for g, _ in results]
        if len(results) == 1:
            grads = results[0][0]
            if any(g.device != d for g, d in zip(grads_leaves[0], targets)):
                moved = _pack.move_each(
                    grads_leaves[0], targets, paths=_tree.LazyPaths(spec), caller=caller
                )
                grads = _tree.unflatten(spec, moved)
        else:
            reduced = reduce_lists(
                grads_leaves, targets, op, paths=_tree.LazyPaths(spec), caller=caller
            )
            grads = _tree.unflatten(spec, reduced)
        values = [v for _, v in results]
        losses = [v[0] for v in values] if has_aux else values
        loss = (
            losses[0] if len(losses) == 1 else torch.stack([v.to(devs[0]) for v in losses]).mean()
        )
        if has_aux:
            auxes = [v[1] for v in values]
            if aux == "gather":
                return grads, (loss, gather(auxes, devs[0]))
            return grads, (loss, _combine_aux(auxes, aux, devs[0], caller))
        return grads, loss

    return step


def _combine_aux(auxes: list[Any], how: str, device: torch.device, caller: str) -> Any:
    """Replica 0's aux (``"first"``), or the mean of its floating-point leaves (``"mean"``), on ``device``."""
    flats = [_tree.flatten_containers(a) for a in auxes]
    leaves, spec = flats[0]
    if how == "mean":
        diff = _tree.first_container_difference([s for _, s in flats], auxes, "replica")
        if diff is not None:
            raise ValueError(
                f"{caller}: aux='mean' needs the replicas' aux of one structure; {diff}"
            )
    pos = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    paths = _tree.LazyPaths(spec, pos)
    combined = _first_or_mean(
        [[lst[i] for i in pos] for lst, _ in flats], how, [device] * len(pos), paths, caller
    )
    new = list(leaves)
    for i, v in zip(pos, combined):
        new[i] = v
    return _tree.unflatten_containers(spec, new, caller)


def _first_or_mean(
    per_replica: list[list[torch.Tensor]],
    how: str,
    targets: Sequence[torch.device],
    paths: Sequence[str],
    caller: str,
) -> list[torch.Tensor]:
    """Replica 0's tensors, or (``how="mean"``) the mean over replicas where floating-point.

    Integer tensors (``num_batches_tracked``) are equal in every replica
    and come from replica 0. Tensor ``k`` lands on ``targets[k]``.
    """
    values = list(per_replica[0])
    if how == "mean" and len(per_replica) > 1:
        mean_pos = [i for i, v in enumerate(values) if v.is_floating_point() or v.is_complex()]
        if mean_pos:
            means = reduce_lists(
                [[lst[i] for i in mean_pos] for lst in per_replica],
                [targets[i] for i in mean_pos],
                "mean",
                paths=[paths[i] for i in mean_pos],
                caller=caller,
            )
            for i, m in zip(mean_pos, means):
                values[i] = m
    return _pack.move_each(values, targets, paths=paths, caller=caller)
