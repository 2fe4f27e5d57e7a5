"""``fr.parallel_apply``: results as the calls made one by one, the caller's grad mode, errors re-raised."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import freplicate as fr
from freplicate.testing import assert_trees_close, devices


class Custom(Exception):
    pass


@given(devices(), st.integers(0, 2**16))
def test_results_come_back_in_order_as_sequential_calls(devs: list[str], seed: int):
    g = torch.Generator().manual_seed(seed)
    replicas = [{"w": torch.randn(3, generator=g).to(d)} for d in devs]
    inputs = [(torch.randn(3, generator=g).to(d), i) for i, d in enumerate(devs)]

    def fn(replica: dict[str, torch.Tensor], x: torch.Tensor, i: int) -> Any:
        return {"y": replica["w"] * x, "i": i, "grad": torch.is_grad_enabled()}

    expected = [fn(r, *x) for r, x in zip(replicas, inputs)]
    assert_trees_close(fr.parallel_apply(fn, replicas, inputs, devices=devs), expected)
    with torch.no_grad():
        assert all(not r["grad"] for r in fr.parallel_apply(fn, replicas, inputs, devices=devs))


@given(
    devices().filter(lambda d: len(d) > 1),
    st.data(),
    st.sampled_from([ValueError, KeyError, RuntimeError, Custom]),
)
def test_an_error_in_any_call_is_re_raised_as_its_type(
    devs: list[str], data: st.DataObject, kind: type[Exception]
):
    failing = data.draw(
        st.sets(st.integers(0, len(devs) - 1), min_size=1), label="failing replicas"
    )

    def fn(replica: int) -> int:
        if replica in failing:
            raise kind(f"replica says {replica}")
        return replica

    with pytest.raises(kind) as caught:
        fr.parallel_apply(fn, list(range(len(devs))), [() for _ in devs], devices=devs)
    first = min(failing)
    assert re.search(rf"replica {first}\b", str(caught.value)), str(caught.value)
    assert isinstance(caught.value.__cause__, kind)
    assert f"replica says {first}" in str(caught.value.__cause__)
