"""ZeRO-3 (``fr.distributed.apply_sharded``) on 2 gloo ranks, on drawn modules and units.

For a module ``fr.testing.modules()`` draws (linear and convolutional
layers, BatchNorm, tied weights, buffers updated in the forward, nested
containers, unused and frozen parameters, positional and keyword inputs, a
block reached under several names) and units drawn among its submodules
(or the default), ``apply_sharded`` on each rank's rows of the parameters
gives the output, buffers and reduce-scattered gradient of ``fr.apply`` on
the all-gathered parameters, bit for bit (``_property_zero3.py``). The
ranks are the session's ``fr.testing.RankPool`` (conftest.py); few
examples, as each costs a few collectives.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from _property_ddp import WORLD, on_rank
from _property_support import bounded, examples
from _property_zero3 import check_apply_sharded, check_mixed_precision
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from freplicate.testing import RankPool, modules

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available(), reason="torch.distributed is not available"
)

CONTAINERS = (nn.ModuleList, nn.ModuleDict)  # never run a forward of their own: not units


@pytest.fixture(scope="module")
def ranks(rank_pool: RankPool) -> Iterator[RankPool]:
    with bounded(rank_pool, 60.0) as pool:
        yield pool


def units_of(module: nn.Module) -> st.SearchStrategy[list[str] | None]:
    """Some of the submodules that hold parameters and run a forward; or the default units
    (a container among the children stands for its members)."""
    names = [
        name
        for name, m in module.named_modules()
        if name and not isinstance(m, CONTAINERS) and any(True for _ in m.parameters())
    ]
    chosen = st.lists(st.sampled_from(names), unique=True) if names else st.just([])
    return st.one_of(st.none(), chosen)


@examples(0.2)
@given(modules(frozen=None), st.sampled_from(["mean", "sum"]), st.data())
def test_apply_sharded_is_the_oracle(
    ranks: RankPool, pair: tuple[nn.Module, Any], op: str, data: st.DataObject
):
    module, inputs = pair
    per_rank = [data.draw(inputs, label=f"inputs of rank {r}") for r in range(WORLD)]
    units = data.draw(units_of(module), label="units")
    payload = {"module": module, "inputs": per_rank, "units": units, "op": op}
    ranks.run(on_rank, check_apply_sharded, payload)


POLICIES = st.sampled_from(
    [("bfloat16", None), ("bfloat16", "float32"), ("bfloat16", "bfloat16"), ("float64", None)]
)


@examples(0.2)
@given(modules(frozen=None), st.sampled_from(["mean", "sum"]), POLICIES, st.data())
def test_mixed_precision_is_its_definition(
    ranks: RankPool,
    pair: tuple[nn.Module, Any],
    op: str,
    policy: tuple[str, str | None],
    data: st.DataObject,
):
    """``mp_policy=`` (FSDP2's ``MixedPrecisionPolicy``) on drawn modules and units: the casts
    where FSDP2 makes them, the gradient reduced in ``reduce_dtype``, bit for bit."""
    module, inputs = pair
    per_rank = [data.draw(inputs, label=f"inputs of rank {r}") for r in range(WORLD)]
    units = data.draw(units_of(module), label="units")
    payload = {"module": module, "inputs": per_rank, "units": units, "op": op, "policy": policy}
    ranks.run(on_rank, check_mixed_precision, payload)
