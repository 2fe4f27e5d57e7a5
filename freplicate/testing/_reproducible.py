"""``check_reproducible``: a training loop on W ranks ends with one process's bits.

The assertion for users' own models that ``fr.distributed.grad_and_value(...,
grain=G)`` promises (docs/reproducible.md): the same global batch, cut into
grains of ``G`` samples, trained a few SGD steps here in one process and on
the ranks of a ``RankPool`` of each world size asked for, each rank holding
its contiguous rows of every global batch. Every rank's gradients and
parameters after every step must be this process's, to the bit
(``torch.equal``): rows of them with ``shard=True``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import optree
import torch
import torch.distributed as dist
from torch import nn

import freplicate as fr

from ._assertions import assert_trees_close
from ._oracle import arguments_of as _oracle_arguments
from ._oracle import weighted_loss as _weighted_loss
from ._pool import RankPool

__all__ = ["check_reproducible"]

_CALLER = "check_reproducible"


def check_reproducible(
    module: nn.Module,
    inputs: Any,
    *,
    grain: int,
    world_sizes: Sequence[int] = (2, 4),
    pools: Mapping[int, RankPool] | None = None,
    steps: int = 2,
    lr: float = 0.1,
    loss: Callable[[Any], torch.Tensor] | None = None,
    shard: bool = False,
    seed: int = 0,
    weight: Callable[..., Any] | None = None,
    zero3: bool = False,
    units: Sequence[str] | None = None,
) -> None:
    """Assert that ``steps`` reproducible steps on each world size give this process's bits.

    ``inputs`` is the global batch (a tensor, a tuple of positional
    arguments or a dict of keyword arguments; every tensor batch-major, the
    same batch every step). Here, in one process with one intra-op thread
    (the ranks' count), ``fr.distributed.grad_and_value(fn, grain=grain,
    seed=seed, shard=shard)`` of ``fn(params, *args) = loss(module's output)``
    runs ``steps`` times with an SGD update of learning rate ``lr`` between
    them (with ``shard``: on this rank's rows, then
    ``fr.distributed.all_gather``); then the same on every rank of a pool of
    each size in ``world_sizes``, rank ``r`` of ``W`` passing rows ``[r * B /
    W, (r + 1) * B / W)`` of each tensor. With ``zero3`` the loss runs the
    module through ``fr.distributed.apply_sharded`` (``units``) on this rank's
    shards, which the update changes, and the parameters are their
    ``all_gather``; those bits are the ZeRO-3 mode's own (its tree joins the
    ranks' grains first), checked against one process running it too. After
    every step, every rank's gradients (its rows of them with ``shard`` or
    ``zero3``) and parameters must equal this process's exactly. Dropout draws by grain (``seed``), so it may be
    on. The module's parameters are all differentiated; its buffers are
    read, never updated (BatchNorm in training mode normalises each grain
    alone).

    Args:
        module: the module, sent to each rank; never modified.
        inputs: the global batch; its samples along dimension 0 must make a
            power of two of grains for each world size, as many on every rank.
        grain: samples per grain (``grad_and_value``'s ``grain``).
        world_sizes: the world sizes to check, powers of two (1 is this
            process again, in a pool of one).
        pools: a ``RankPool`` per world size (a fixture shared by many
            calls); one missing is started for this call alone (seconds).
        steps: training steps.
        lr: the SGD learning rate.
        loss: the scalar of a grain, from the module's output; importable by
            the ranks. Default: every floating-point output element weighted
            by a fixed random number, summed.
        shard: ZeRO-2 (``grad_and_value``'s ``shard``).
        seed: ``grad_and_value``'s ``seed``.
        weight: ``grad_and_value``'s ``weight``, a function of a grain's
            arguments ``(params, *args, **kwargs)``; importable by the ranks.
        zero3: ZeRO-3: the loss through ``fr.distributed.apply_sharded``.
        units: with ``zero3``, ``apply_sharded``'s ``units`` (default: its own).

    Raises:
        AssertionError: a rank differs; the message names the world size,
            the rank, the step, what differs and its path.
        ValueError: bad world sizes or steps, a pool of the wrong size, or
            what ``grad_and_value(..., grain=)`` refuses for this batch.
        RuntimeError: called inside a process group (the one-process run
            needs none).

    >>> model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 2))
    >>> fr.testing.check_reproducible(model, torch.randn(16, 4), grain=4)  # doctest: +SKIP
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"{_CALLER}: module must be an nn.Module, got {type(module).__name__}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"{_CALLER}: steps must be an int >= 1, got {steps!r}")
    for w in world_sizes:
        if isinstance(w, bool) or not isinstance(w, int) or w < 1 or w & (w - 1):
            raise ValueError(
                f"{_CALLER}: world_sizes must hold powers of two (1, 2, 4, ...), got {w!r}"
            )
    for w, given in (pools or {}).items():
        if not isinstance(given, RankPool) or given.world_size != w:
            raise ValueError(
                f"{_CALLER}: pools[{w}] must be a fr.testing.RankPool of {w} ranks, got "
                f"{getattr(given, 'world_size', type(given).__name__)}"
            )
    if dist.is_available() and dist.is_initialized():
        raise RuntimeError(
            f"{_CALLER}: runs its one-process reference here, outside any process group; call "
            "it from a process that has not called init_process_group"
        )
    _arguments(inputs)
    if zero3 and shard:
        raise ValueError(f"{_CALLER}: shard=True (ZeRO-2) and zero3=True: give one of them")
    if units is not None and not zero3:
        raise ValueError(f"{_CALLER}: units= is apply_sharded's: give it with zero3=True")
    setup: dict[str, Any] = {"grain": grain, "seed": seed, "shard": bool(shard), "steps": steps}
    setup.update(lr=float(lr), loss=loss, weight=weight, zero3=bool(zero3))
    setup.update(units=None if units is None else list(units))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank: the same kernels' reduction orders
    try:
        here = _train(module, inputs, setup, rank=0, world=1)
    finally:
        torch.set_num_threads(threads)
    for w in world_sizes:
        pool = (pools or {}).get(w)
        if pool is None:
            with RankPool(w) as ranks:
                results = ranks.run(_on_rank, module, inputs, setup)
        else:
            results = pool.run(_on_rank, module, inputs, setup)
        for rank, got in enumerate(results):
            _compare(here, got, rank, w, setup)


def _arguments(inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    try:
        return _oracle_arguments(inputs)
    except TypeError:
        raise TypeError(
            f"{_CALLER}: inputs must be a tensor, a tuple of positional arguments or a dict of "
            f"keyword arguments, got {type(inputs).__name__}"
        ) from None


def _on_rank(module: nn.Module, inputs: Any, setup: dict[str, Any]) -> dict[str, Any]:
    return _train(module, inputs, setup, dist.get_rank(), dist.get_world_size())


def _train(
    module: nn.Module, inputs: Any, setup: dict[str, Any], rank: int, world: int
) -> dict[str, Any]:
    """The loop on this rank's rows: per step, its gradients and the parameters after it."""
    args, kwargs = _arguments(inputs)
    s = fr.state(module)
    params = {k: p.detach().clone() for k, p in s.params.items()}
    buffers = s.buffers
    n = len(args)

    def fn(p: dict[str, torch.Tensor], *a: Any, **kw: Any) -> torch.Tensor:
        if setup["zero3"]:
            out, _ = fr.distributed.apply_sharded(
                module, fr.State(p, buffers), *a, units=setup["units"], **kw
            )
        else:
            out, _ = fr.apply(module, fr.State(p, buffers), *a, **kw)
        value = setup["loss"](out) if setup["loss"] is not None else _weighted_loss(out)
        if not isinstance(value, torch.Tensor):
            raise ValueError(
                f"{_CALLER}: the module's output holds no floating-point tensor; pass loss="
            )
        return value

    step = fr.distributed.grad_and_value(
        fn, grain=setup["grain"], seed=setup["seed"], shard=setup["shard"], weight=setup["weight"]
    )
    mine = _rows(args, kwargs, rank, world)
    history = []
    shards = fr.distributed.shard(params) if setup["zero3"] else {}
    for _ in range(setup["steps"]):
        if setup["zero3"]:
            grads, _ = step(shards, *mine[:n], **mine[n])
            shards = {k: r - setup["lr"] * grads[k] for k, r in shards.items()}
            params = fr.distributed.all_gather(shards, params)
            history.append({"gradients": grads, "parameters": params})
            continue
        grads, _ = step(params, *mine[:n], **mine[n])
        if setup["shard"]:
            rows = fr.distributed.shard(params)
            new = {k: rows[k] - setup["lr"] * grads[k] for k in rows}
            params = fr.distributed.all_gather(new, params)
        else:
            params = {k: p - setup["lr"] * grads[k] for k, p in params.items()}
        history.append({"gradients": grads, "parameters": params})
    return {"steps": history}


def _rows(args: tuple[Any, ...], kwargs: dict[str, Any], rank: int, world: int) -> list[Any]:
    """Rank ``rank``'s contiguous rows of every tensor: the positional ones, then the keywords."""

    def cut(t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or not t.dim():
            return t
        if t.shape[0] % world:
            raise ValueError(
                f"{_CALLER}: the global batch's {t.shape[0]} samples do not split into {world} "
                "equal parts"
            )
        rows = t.shape[0] // world
        return t[rank * rows : (rank + 1) * rows]

    cut_args: list[Any] = [optree.tree_map(cut, a) for a in args]
    return [*cut_args, optree.tree_map(cut, kwargs)]  # type: ignore[arg-type]


def _compare(
    here: dict[str, Any], got: dict[str, Any], rank: int, world: int, setup: dict[str, Any]
) -> None:
    for t, (ours, theirs) in enumerate(zip(here["steps"], got["steps"])):
        for what in ("gradients", "parameters"):
            want = ours[what]
            if what == "gradients" and (setup["shard"] or setup["zero3"]):
                want = {k: _rows_of(g, rank, world) for k, g in want.items()}
            try:
                assert_trees_close(theirs[what], want, rtol=0, atol=0)
            except AssertionError as err:
                raise AssertionError(
                    f"{_CALLER}: {what} after step {t} on rank {rank} of {world} differ from "
                    f"one process's (grain={setup['grain']}): {err}"
                ) from None


def _rows_of(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """``fr.distributed.shard``'s rows of ``t`` for ``rank`` of ``world``."""
    if not t.dim():
        return t
    c = -(-t.shape[0] // world)
    return t[rank * c : (rank + 1) * c]
