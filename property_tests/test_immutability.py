"""No public function modifies a tensor it was given, nor the module's own tensors.

Every call below is checked by ``_version`` (no in-place op) and by value, on
modules in training mode, whose forwards update buffers in place (BatchNorm
statistics, counters): those updates must land in the returned state only.
"""

from __future__ import annotations

from typing import Any

import optree
import torch
from _property_support import Unchanged
from hypothesis import given
from hypothesis import strategies as st

import freplicate as fr
from freplicate.testing import devices, modules

STATEFUL = ["batchnorm", "conv", "buffers", "tied", "positional", "keywords"]


def _split(x: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if isinstance(x, dict):
        return (), x
    return (x if isinstance(x, tuple) else (x,)), {}


@given(modules(kinds=STATEFUL, training=True), devices(), st.data())
def test_no_public_function_modifies_its_inputs(
    pair: tuple[torch.nn.Module, Any], devs: list[str], data: st.DataObject
):
    module, inputs = pair
    args, kwargs = _split(data.draw(inputs, label="inputs"))
    s = fr.state(module)
    unchanged = Unchanged(dict((*module.named_parameters(), *module.named_buffers())), args, kwargs)

    _, new = fr.apply(module, s, *args, **kwargs)
    unchanged.check("fr.apply")
    for how in ("first", "mean"):
        fr.data_parallel(module, s, *args, devices=devs, buffers=how, **kwargs)
        unchanged.check(f"fr.data_parallel(buffers={how!r})")

    replicas = fr.replicate(s, devs)
    unchanged.check("fr.replicate")
    fr.all_reduce([r.params for r in replicas], op="sum")
    fr.all_reduce([r.buffers for r in fr.replicate(new, devs)], op="sum")
    unchanged.check("fr.all_reduce")
    shards = fr.scatter((args, kwargs), devs)
    unchanged.check("fr.scatter")
    outs = fr.parallel_apply(
        lambda st, shard: fr.apply(module, st, *shard[0], **shard[1])[0],
        replicas[: len(shards)],
        [(shard,) for shard in shards],
    )
    unchanged.check("fr.parallel_apply")
    shards_seen = Unchanged(shards, outs)
    fr.gather(outs, devs[0])
    shards_seen.check("fr.gather")

    def loss(params: dict[str, torch.Tensor], *batch: Any) -> torch.Tensor:
        result, _ = fr.apply(module, fr.State(params, s.buffers), *batch, **kwargs)
        return sum(t.double().sum() for t in optree.tree_leaves(result))

    fr.grad_and_value(loss)(s.params, *args)
    unchanged.check("fr.grad_and_value")
    if args:
        fr.data_parallel_grad(loss, devs)(s.params, *args)
        unchanged.check("fr.data_parallel_grad")
