"""``grad_and_value(..., grain=)`` on 2 and 4 gloo ranks ends each step with one process's bits.

Drawn modules (``fr.testing.modules``: dropout, BatchNorm, tied and shared
weights, unused and frozen parameters, several arguments, keyword arguments,
buffers, activation checkpointing of every kind), a global batch of
four grains made from one drawn input (it, twice it, minus it, it plus one:
four grains of other values), trained two SGD steps by
``fr.testing.check_reproducible`` in this process and on pools of 2 and 4
ranks (2 and 1 grains a rank), all-reduced or, with ``shard=True``, reduce-
scattered (ZeRO-2), or through ``apply_sharded`` on shards (ZeRO-3, its
default units), each grain weighted or not (``weight=``): every rank's
gradients and parameters after every step equal this process's, bit for bit.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import optree
import pytest
import torch
from _property_support import bounded, examples
from hypothesis import given
from hypothesis import strategies as st

from freplicate.testing import RankPool, check_reproducible, modules

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available(), reason="torch.distributed is not available"
)

WORLDS = (2, 4)
# every kind whose inputs are batch-major tensors (grains cut every tensor argument)
KINDS = [
    "mlp", "conv", "batchnorm", "tied", "nested", "unused", "positional", "shared", "dropout",
    "checkpoint", "keywords", "buffers", "reassigned",
]  # fmt: skip


@pytest.fixture(scope="module")
def pools(rank_pool: RankPool) -> Iterator[dict[int, RankPool]]:
    with bounded(rank_pool, 90.0) as two, RankPool(4, timeout=30.0, deadline=90.0) as four:
        yield {2: two, 4: four}


def four_grains(inputs: Any) -> Any:
    """A global batch of four grains of ``inputs``' rows: it, twice it, minus it, it plus one."""

    def grains(t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or not t.dim():
            return t
        if not t.is_floating_point():
            return torch.cat([t] * 4)
        return torch.cat([t, 2 * t, -t, t + 1])

    return optree.tree_map(grains, inputs)


def positives(params: Any, *args: Any, **kwargs: Any) -> float:
    """A grain's weight: its samples whose first floating-point input sums above 0 (may be 0)."""
    for t in optree.tree_leaves((args, kwargs)):
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim():
            return float((t.flatten(1).sum(1) > 0).sum()) if t.dim() > 1 else float((t > 0).sum())
    return 1.0


def rows(inputs: Any) -> int:
    return next(t.shape[0] for t in optree.tree_leaves(inputs) if isinstance(t, torch.Tensor))


@examples(0.1)
@given(
    modules(kinds=KINDS, training=True),
    st.sampled_from(["all_reduce", "zero2", "zero3"]),
    st.booleans(),
    st.data(),
)
def test_every_world_size_ends_each_step_with_one_process_bits(
    pools: dict[int, RankPool], drawn: Any, mode: str, weighted: bool, data: st.DataObject
) -> None:
    module, inputs = drawn
    one = data.draw(inputs)
    check_reproducible(
        module, four_grains(one), grain=rows(one), pools=pools, shard=mode == "zero2",
        zero3=mode == "zero3", seed=3, steps=2, weight=positives if weighted else None,
    )  # fmt: skip
