"""The rank side of the ZeRO-3 property (``test_zero3.py``), run on ``fr.testing.RankPool``'s ranks.

``check_apply_sharded(rank, payload)`` runs ``fr.distributed.apply_sharded``
on this rank's rows of a drawn module's parameters (the units drawn among
its submodules) and differentiates a loss of the output with
``loss.backward()``; then the oracle the contract defines: ``fr.apply`` on
the all-gathered parameters and ``fr.distributed.reduce_scatter`` of its
gradient. Output, new buffers and the shards' gradients must be equal bit
for bit (on 2 ranks a reduce-scatter adds the same two numbers in either
order), and no input modified; but where a unit runs twice in one forward
(a module reached under two names, ``SharedNames``), each run's gather is
reduce-scattered on its own and the two rows added, where the oracle adds
the two gradients and reduce-scatters once: the same sum in another order,
within a few units in the last place (found by this property).

The call is audited (``tests/_zero3_workers.audited``): no saved tensor may
be taken for a gathered parameter (the bug
``tests/test_zero3.py::test_no_activation_is_taken_for_a_released_units_buffer``
guards against).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from _property_ddp import _loss
from _property_support import Unchanged, split_inputs

import freplicate as fr
from freplicate.testing import assert_trees_close

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from _zero3_workers import audited  # found once its folder joins the path


def check_apply_sharded(rank: int, p: dict[str, Any]) -> None:
    module, units, op = p["module"], p["units"], p["op"]
    args, kwargs = split_inputs(p["inputs"][rank])
    full = fr.state(module)
    grads_of = {k: module.get_parameter(k).requires_grad for k in full.params}
    shards = {
        k: v.detach().clone().requires_grad_(grads_of[k])
        for k, v in fr.distributed.shard(full.params).items()
    }
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
    assert_trees_close(got, want, **(_ROUNDING if _runs_twice(module, units) else exact))
    assert all(shards[k].grad is None for k, flag in grads_of.items() if not flag)


_ROUNDING = {"rtol": 1e-6, "atol": 1e-7}


def _runs_twice(module: torch.nn.Module, units: list[str] | None) -> bool:
    """Whether a unit's module is reached under two names (and so, as drawn here, runs twice)."""
    seen: dict[int, int] = {}
    for _, m in module.named_modules(remove_duplicate=False):
        seen[id(m)] = seen.get(id(m), 0) + 1
    named = dict(module.named_modules())
    chosen = [n for n, c in module.named_children() if any(True for _ in c.parameters())]
    return any(seen[id(named[u])] > 1 for u in (chosen if units is None else units))


def _or_zeros(grad: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """A gradient, or zeros where none reached the tensor (a unit that never ran, an unused one)."""
    return torch.zeros_like(like) if grad is None else grad
