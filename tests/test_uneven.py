"""Uneven inputs and gradient accumulation on 2 gloo ranks, against DDP's Join and no_sync.

``fr.distributed.join`` and ``step.skip`` (a rank out of data takes part,
as under ``torch.distributed.algorithms.join.Join``), ``weight=`` (the
weighted mean: the exact full-batch gradient over uneven shards), and
``step.accumulate`` (DDP's ``no_sync``, one reduction a step). One
module-scoped job runs every scenario once (``_uneven_workers.py``); the
tests without a process group check the local meaning and the errors.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import freplicate as fr

sys.path.insert(0, str(Path(__file__).parent))  # the spawned ranks import the workers by name
import _dist_workers as w
import _uneven_workers as u

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")

close = fr.testing.assert_trees_close
SCENARIOS = [
    "join_against_ddp",
    "join_weighted",
    "join_without_reductions",
    "join_forgotten_skip",
    "join_iterable_raises",
    "join_sparse",
    "accumulate_against_ddp",
    "accumulate_weighted",
    "weighted_corners",
    "accumulate_raises",
]


@pytest.fixture(scope="module")
def job() -> dict[str, list[Any]]:
    return u.run(SCENARIOS, pg_timeout=30.0, deadline=180.0)


ok = w.ok


# --- uneven inputs ----------------------------------------------------------------------


def test_join_equals_ddp_under_join_step_by_step(job):
    r0, r1 = ok(job, "join_against_ddp")
    assert len(r0["fr"]) == len(r1["fr"]) == 5  # both ranks take 5 steps, and stop together
    assert (r0["skipped"], r1["skipped"]) == (0, 2)
    for got, want in zip(r0["fr"], r0["ddp"]):  # rank 0 has data every step
        close(got, want, rtol=0, atol=1e-6)
    for got, want in zip(r1["fr"], r1["ddp"]):  # rank 1 while it has data
        close(got, want, rtol=0, atol=1e-6)
    for r in (r0, r1):  # and the model DDP's Join leaves on every rank at the end
        close(r["fr"][-1], r["ddp_final"], rtol=0, atol=1e-6)
    close(r0["fr"][-1], r1["fr"][-1], rtol=0, atol=0)


def test_join_rides_on_the_steps_reduction(job):
    for r in ok(job, "join_against_ddp"):
        # one bucket a step, skip or not, and nothing for join: its bit is in that bucket (the
        # first steps may also check a layout the group has not run in this order yet)
        assert r["per_step"][2:] == [1] * 3, r["per_step"]
        assert all(n <= 3 for n in r["per_step"][:2]), r["per_step"]
        assert 1 <= r["start"] <= 3, r["start"]  # the loop's start asks once (a new layout)


def test_weighted_mean_is_the_full_batch_gradient(job):
    results = ok(job, "join_weighted")
    for r in results:
        assert r["inputs_unchanged"]
        assert len(r["pairs"]) == 5
        for got, want in r["pairs"]:
            close(got, want, rtol=1e-5, atol=1e-6)
        assert r["same"]
        # (3 * [1, 1, 1] + 1 * [2, 2, 2]) / 4, and (3 * 0 + 1 * 10) / 4
        torch.testing.assert_close(r["weighted"]["v"], torch.full((3,), 1.25))
        torch.testing.assert_close(r["weighted"]["w"], torch.full((2, 2), 2.5))
        close(r["zero_weights"], {"v": torch.zeros(3), "w": torch.zeros(2, 2)}, rtol=0, atol=0)
        torch.testing.assert_close(r["mean"]["v"], torch.full((3,), 1.5))


def test_join_without_reductions_asks_each_step(job):
    r0, r1 = ok(job, "join_without_reductions")
    assert r0["seen"] == [0, 1, 2, 3, 4]
    assert r1["seen"] == [10, 11, 12, None, None]
    assert r0["calls"] == r1["calls"] >= 6  # the start, then one a step


def test_a_rank_that_forgets_skip_makes_every_rank_raise(job):
    r0, r1 = ok(job, "join_forgotten_skip")
    assert (r0["steps"], r1["steps"]) == (1, 1)
    for r in (r0, r1):
        kind, text = r["error"]
        assert kind == "ValueError", text
        assert re.search(
            r"ranks called different functions: fr\.distributed\.grad_and_value on rank 0, "
            r"fr\.distributed\.join on rank 1",
            text,
        ), text
        torch.testing.assert_close(r["after"]["x"], torch.full((2,), 2.0))


def test_a_data_loader_that_raises_raises_on_every_rank(job):
    r0, r1 = ok(job, "join_iterable_raises")
    assert r1["error"][0] == "KeyError" and "no batch 2 on rank 1" in r1["error"][1]
    kind, text = r0["error"]
    assert kind == "RuntimeError", text
    assert re.search(r"rank 1 \(fr\.distributed\.join\) raised KeyError", text), text
    for r in (r0, r1):
        torch.testing.assert_close(r["after"]["x"], torch.full((2,), 2.0))


def test_skip_with_sparse_gradients(job):
    r0, r1 = ok(job, "join_sparse")
    assert len(r0["steps"]) == len(r1["steps"]) == 4
    for (g0, own0, layouts), (g1, own1, _) in zip(r0["steps"], r1["steps"]):
        close(g0, g1, rtol=0, atol=0)
        assert layouts["emb.weight"] == torch.sparse_coo
        if own1 is None:  # rank 1 skipped: rank 0's gradients over the world size
            close(g0, {k: v / 2 for k, v in own0.items()}, rtol=1e-6, atol=1e-7)
        else:
            close(g0, {k: (own0[k] + own1[k]) / 2 for k in own0}, rtol=1e-6, atol=1e-7)


# --- gradient accumulation --------------------------------------------------------------


@pytest.mark.parametrize("cap", [25.0, 0.001], ids=["one_bucket", "several_buckets"])
def test_accumulate_equals_ddp_no_sync(job, cap):
    results = ok(job, "accumulate_against_ddp")
    for r in results:
        res = r[cap]
        assert len(res["pairs"]) == 4
        for got, want in res["pairs"]:
            close(got, want, rtol=0, atol=1e-6)
        assert all(len(v) == 3 for v in res["values"])
        assert res["values"][0] == pytest.approx(res["first_values"], rel=1e-6)
    close(results[0][cap]["pairs"][-1][0], results[1][cap]["pairs"][-1][0], rtol=0, atol=0)


@pytest.mark.parametrize("cap", [25.0, 0.001], ids=["one_bucket", "several_buckets"])
def test_accumulate_is_one_overlapped_round_a_step(job, cap):
    for r in ok(job, "accumulate_against_ddp"):
        res = r[cap]
        nb = res["buckets"]
        assert (nb == 1) == (cap == 25.0), nb
        # once the group has learnt the order of its layouts (by the third step): the buckets,
        # nothing more; every bucket but the last starts from a hook, during the last backward
        for inside in res["per_step"][2:]:
            assert inside == [True] * (nb - 1) + [False], inside
        for inside in res["per_step"][:2]:  # the check of a layout met out of order: 2 more
            assert nb <= len(inside) <= nb + 2, inside


def test_weighted_accumulate_is_the_full_batch_gradient(job):
    for r in ok(job, "accumulate_weighted"):
        assert len(r["pairs"]) == 4
        for got, want in r["pairs"]:
            close(got, want, rtol=1e-5, atol=1e-6)


def test_a_micro_batch_failing_on_one_rank_raises_on_every_rank(job):
    r0, r1 = ok(job, "accumulate_raises")
    kind, text = r1["error"]
    assert kind == "TypeError" and "accumulate's micro_batches must yield tuples" in text, text
    kind, text = r0["error"]
    assert kind == "RuntimeError", text
    assert re.search(r"rank 1 \(fr\.distributed\.grad_and_value\) raised TypeError", text), text
    for r in (r0, r1):
        torch.testing.assert_close(r["after"]["x"], torch.full((2,), 2.0))


def test_compressed_and_sparse_weighted_means(job):
    for r in ok(job, "weighted_corners"):
        assert r["inputs_unchanged"]
        close(*r["accumulated_bf16"], rtol=2e-2, atol=2e-3)
        close(*r["weighted_bf16"], rtol=2e-2, atol=2e-2)
        a, b = r["everyone"]
        want = {k: (3 * a[k] + 1 * b[k]) / 4 for k in a}
        close(r["sparse_alone"], {"e": want["e"]}, rtol=1e-6, atol=0)
        close(r["sparse_mixed"], want, rtol=1e-6, atol=0)


# --- without a process group ----------------------------------------------------------


def loss(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    return (p["w"] * x).sum()


def test_without_group_join_yields_the_items():
    assert list(fr.distributed.join(iter([1, 2]))) == [1, 2]
    assert list(fr.distributed.join([])) == []


def test_without_group_skip_gives_zeros_and_accumulate_sums():
    step = fr.distributed.grad_and_value(loss)
    p = {"w": torch.ones(3)}
    grads, value = step.skip(p)
    assert value is None
    torch.testing.assert_close(grads["w"], torch.zeros(3))
    xs = [(torch.full((3,), float(i)),) for i in range(1, 4)]
    grads, values = step.accumulate(p, xs)
    torch.testing.assert_close(grads["w"], torch.full((3,), 6.0))
    torch.testing.assert_close(torch.stack(values), torch.tensor([3.0, 6.0, 9.0]))
    grads, values = step.accumulate(p, [])
    assert values == [] and torch.equal(grads["w"], torch.zeros(3))


def test_without_group_weighted_accumulate_is_the_weighted_mean():
    step = fr.distributed.grad_and_value(lambda p, x: loss(p, x).mean(), weight=lambda p, x: x[0])
    p = {"w": torch.ones(2)}
    grads, _ = step.accumulate(p, [(torch.full((2,), 1.0),), (torch.full((2,), 3.0),)])
    torch.testing.assert_close(grads["w"], torch.full((2,), (1 * 1 + 3 * 3) / 4))
    grads, _ = step(p, torch.full((2,), 5.0))  # one rank: the local gradient
    torch.testing.assert_close(grads["w"], torch.full((2,), 5.0))


def test_accumulate_with_argnums_and_aux():
    step = fr.distributed.grad_and_value(
        lambda x, p: ((p["w"] * x).sum(), x.sum()), argnums=1, has_aux=True
    )
    p = {"w": torch.ones(2)}
    grads, values = step.accumulate(p, [(torch.ones(2),), (2 * torch.ones(2),)])
    torch.testing.assert_close(grads["w"], torch.full((2,), 3.0))
    assert [float(aux) for _, aux in values] == [2.0, 4.0]
    assert step.skip(torch.zeros(1), p)[0]["w"].shape == (2,)


@pytest.mark.parametrize(
    "make, error, pattern",
    [
        (
            lambda: fr.distributed.grad_and_value(loss, weight=3),
            TypeError,
            r"weight must be a function of the step's arguments",
        ),
        (
            lambda: fr.distributed.grad_and_value(loss, op="sum", weight=lambda p, x: 1),
            ValueError,
            r"weight= makes op='mean' a weighted mean; it has no meaning with op='sum'",
        ),
        (
            lambda: fr.distributed.grad_and_value(loss).accumulate({"w": torch.ones(2)}, [1]),
            TypeError,
            r"accumulate's micro_batches must yield tuples .* got int",
        ),
        (
            lambda: fr.distributed.grad_and_value(loss, argnums=1).skip({"w": torch.ones(2)}),
            TypeError,
            r"skip\(\*args\) needs the differentiated argument args\[1\]",
        ),
        (
            lambda: fr.distributed.grad_and_value(loss, weight=lambda p, x: -1.0).accumulate(
                {"w": torch.ones(2)}, [(torch.ones(2),)]
            ),
            ValueError,
            r"weight\(\*args\) must be a finite number >= 0, got -1\.0",
        ),
        (
            lambda: fr.distributed.grad_and_value(loss, weight=lambda p, x: "2").accumulate(
                {"w": torch.ones(2)}, [(torch.ones(2),)]
            ),
            TypeError,
            r"weight\(\*args\) must be a number .* got '2' of type str",
        ),
    ],
    ids=["not_callable", "with_sum", "micro_batch", "skip_args", "negative", "not_a_number"],
)
def test_bad_arguments(make, error, pattern):
    with pytest.raises(error, match=r"^fr\.distributed\.grad_and_value: " + pattern):
        make()


@pytest.mark.parametrize(
    "kwargs, error, pattern",
    [
        ({"weight": -2}, ValueError, r"weight must be a finite number >= 0, got -2"),
        ({"weight": float("nan")}, ValueError, r"weight must be a finite number >= 0"),
        ({"weight": True}, TypeError, r"weight must be a number .* got True of type bool"),
        ({"weight": 1, "op": "sum"}, ValueError, r"weight= makes op='mean' a weighted mean"),
    ],
)
def test_all_reduce_weight_is_checked_without_a_group(kwargs, error, pattern):
    with pytest.raises(error, match=r"^fr\.distributed\.all_reduce: " + pattern):
        fr.distributed.all_reduce({"w": torch.ones(2)}, **kwargs)


def test_join_refuses_what_is_not_iterable():
    with pytest.raises(TypeError, match=r"^fr\.distributed\.join: iterable must be iterable"):
        fr.distributed.join(3)  # type: ignore[arg-type]
