"""The rank side of the ZeRO-3 property (``test_zero3.py``), run on ``fr.testing.RankPool``'s ranks.

``check_apply_sharded(rank, payload)`` runs ``fr.distributed.apply_sharded``
on this rank's rows of a drawn module's parameters (the units drawn among
its submodules) and differentiates a loss of the output with
``loss.backward()``; then the oracle the contract defines: ``fr.apply`` on
the all-gathered parameters and ``fr.distributed.reduce_scatter`` of its
gradient. Output, new buffers and the shards' gradients must be equal bit
for bit (on 2 ranks a reduce-scatter adds the same two numbers in either
order), and no input modified; a unit that runs twice in one forward (a
module reached under two names, ``SharedNames``) included: its parameters
are gathered once for the call and their gradients added before the one
reduce-scatter, as the oracle adds them (before, each run's gather was
reduce-scattered on its own, a few units in the last place apart, which
this property found).

The call is audited (``tests/_zero3_workers.audited``): no saved tensor may
be taken for a gathered parameter (the bug
``tests/test_zero3.py::test_no_activation_is_taken_for_a_released_units_buffer``
guards against).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import optree
import torch
from _property_ddp import _loss
from _property_support import Unchanged, split_inputs

import freplicate as fr
from freplicate.testing import assert_trees_close

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from _zero3_workers import audited  # found once its folder joins the path


def _sharded(
    module: torch.nn.Module,
) -> tuple[fr.State, dict[str, bool], dict[str, torch.Tensor]]:
    """The module's state, which parameters train, and this rank's rows as leaves of their own."""
    full = fr.state(module)
    grads_of = {k: module.get_parameter(k).requires_grad for k in full.params}
    shards = {
        k: v.detach().clone().requires_grad_(grads_of[k])
        for k, v in fr.distributed.shard(full.params).items()
    }
    return full, grads_of, shards


def check_apply_sharded(rank: int, p: dict[str, Any]) -> None:
    module, units, op = p["module"], p["units"], p["op"]
    args, kwargs = split_inputs(p["inputs"][rank])
    full, grads_of, shards = _sharded(module)
    unchanged = Unchanged(shards, full.buffers, p["inputs"][rank])
    with audited() as mistaken:
        state = fr.State(shards, full.buffers)
        out, new = fr.distributed.apply_sharded(module, state, *args, units=units, op=op, **kwargs)
        loss = _loss(out)
        if loss.requires_grad:  # not when every parameter that reaches it is frozen
            loss.backward()
    unchanged.check("fr.distributed.apply_sharded")
    assert not mistaken, f"activations taken for gathered parameters: {mistaken}"

    like = {k: full.params[k] for k in shards}
    whole = fr.distributed.all_gather({k: v.detach() for k, v in shards.items()}, like)
    whole = {k: v.requires_grad_(grads_of[k]) for k, v in whole.items()}
    want_out, want_new = fr.apply(module, fr.State(whole, full.buffers), *args, **kwargs)
    want_loss = _loss(want_out)
    if want_loss.requires_grad:
        want_loss.backward()
    trained = [k for k, flag in grads_of.items() if flag]
    full_grads = {k: _or_zeros(whole[k].grad, whole[k]) for k in trained}
    want = fr.distributed.reduce_scatter(full_grads, op=op)
    got = {k: _or_zeros(shards[k].grad, shards[k]) for k in trained}

    exact = {"rtol": 0, "atol": 0}
    assert_trees_close(out, want_out, **exact)
    assert_trees_close(new.buffers, want_new.buffers, **exact)
    assert_trees_close(got, want, **exact)
    assert all(shards[k].grad is None for k, flag in grads_of.items() if not flag)


def _or_zeros(grad: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """A gradient, or zeros where none reached the tensor (a unit that never ran, an unused one)."""
    return torch.zeros_like(like) if grad is None else grad


def check_mixed_precision(rank: int, p: dict[str, Any]) -> None:
    """``apply_sharded(..., mp_policy=)`` against its definition on the full parameters.

    The oracle is FSDP2's ``MixedPrecisionPolicy`` written out with
    ``fr.apply``: the all-gathered parameters cast to ``param_dtype`` (FSDP2's
    unsharded parameters), the call's floating-point inputs and each unit's
    cast to it (``fully_shard`` on each unit and on the module casts them),
    the buffers left alone; each unsharded parameter's gradient cast to
    ``reduce_dtype`` (default ``param_dtype``), reduce-scattered, and cast to
    the shard's dtype. Output, buffers and
    gradients bit for bit; a forward that raises (a module that refuses the
    dtypes) raises in both.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from freplicate._distributed._units import units_of

    module, units, op = p["module"], p["units"], p["op"]
    param, reduce = (getattr(torch, n) if n else None for n in p["policy"])
    mp = MixedPrecisionPolicy(param_dtype=param, reduce_dtype=reduce)
    args, kwargs = split_inputs(p["inputs"][rank])
    full, grads_of, shards = _sharded(module)
    unchanged = Unchanged(shards, full.buffers, p["inputs"][rank])

    like = {k: full.params[k] for k in shards}
    whole = fr.distributed.all_gather({k: v.detach() for k, v in shards.items()}, like)
    # the gathered parameters in param_dtype, as FSDP2's unsharded ones: their gradients too
    cast_whole = {
        k: (v.to(param) if v.is_floating_point() else v).requires_grad_(grads_of[k])
        for k, v in whole.items()
    }
    names = units_of(module, units).names
    want = _outcome(
        lambda: _by_definition(module, names, cast_whole, full.buffers, param, args, kwargs)
    )

    got = _outcome(
        lambda: fr.distributed.apply_sharded(
            module,
            fr.State(shards, full.buffers),
            *args,
            units=units,
            op=op,
            mp_policy=mp,
            **kwargs,
        )
    )
    assert got[0] == want[0], (got, want)
    if got[0] == "raised":
        return
    (out, new), (want_out, want_new) = got[1], want[1]
    loss, want_loss = _loss(out), _loss(want_out)
    if loss.requires_grad:
        loss.backward()
    if want_loss.requires_grad:
        want_loss.backward()
    unchanged.check("fr.distributed.apply_sharded")
    trained = [k for k, flag in grads_of.items() if flag]
    wire = reduce or param
    in_wire = {k: _or_zeros(cast_whole[k].grad, cast_whole[k]).to(wire) for k in trained}
    reduced = fr.distributed.reduce_scatter(in_wire, op=op)
    want_grads = {k: v.to(shards[k].dtype) for k, v in reduced.items()}
    got_grads = {k: _or_zeros(shards[k].grad, shards[k]) for k in trained}

    exact = {"rtol": 0, "atol": 0}
    assert_trees_close(out, want_out, **exact)
    assert_trees_close(new.buffers, want_new.buffers, **exact)
    assert_trees_close(got_grads, want_grads, **exact)
    assert all(g.dtype == shards[k].dtype for k, g in got_grads.items())


def _by_definition(
    module: torch.nn.Module,
    units: tuple[str, ...],
    whole: dict[str, torch.Tensor],
    buffers: dict[str, torch.Tensor],
    param: torch.dtype,
    args: Any,
    kwargs: Any,
) -> Any:
    """``fr.apply`` on ``whole`` (in ``param``), the inputs of the call and of every unit cast
    to ``param`` (forward pre-hooks on the units, removed after)."""

    def cast(tree: Any) -> Any:
        return optree.tree_map(
            lambda t: t.to(param) if isinstance(t, torch.Tensor) and t.is_floating_point() else t,
            tree,
            none_is_leaf=True,
        )

    def hook(_: torch.nn.Module, a: Any, k: Any) -> Any:
        return cast(a), cast(k)

    handles = [
        module.get_submodule(u).register_forward_pre_hook(hook, with_kwargs=True)
        for u in units
        if u
    ]
    try:
        return fr.apply(module, fr.State(whole, buffers), *cast(args), **cast(kwargs))
    finally:
        for h in handles:
            h.remove()


def _outcome(fn: Any) -> tuple[str, Any]:
    """``("ok", result)``, or ``("raised", the exception's type name)``."""
    try:
        return "ok", fn()
    except Exception as err:  # compared across the two paths: both must raise
        return "raised", type(err).__name__
