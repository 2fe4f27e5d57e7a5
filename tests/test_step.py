"""A gradient step's contract on 2 gloo ranks (``_step_workers.py``), against DDP.

Failures announced by control flow, checkpointing decided per call,
accumulation in a ``no_sync`` loop's order, the parameters checked on a
layout's first call, and the compiled step around ``accumulate``.
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
import _step_workers as s

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")

close = fr.testing.assert_trees_close


@pytest.fixture(scope="module")
def job() -> dict[str, list[Any]]:
    return s.spawn(s.SCENARIOS, pg_timeout=30.0, deadline=300.0)


ok = w.ok


# --- failures by control flow -----------------------------------------------------------


@pytest.mark.parametrize(
    ("case", "failing", "kind", "message"),
    [
        ("interrupt", 1, "KeyboardInterrupt", ""),
        ("text", 0, "RuntimeError", "sparse batch rejected"),
        ("backward", 1, "RuntimeError", "use_reentrant=True sparse backward refused on rank 1"),
        ("weight", 1, "SystemExit", "rank 1's weight"),
        ("micro", 1, "KeyboardInterrupt", ""),
    ],
)
def test_any_exception_in_a_step_is_announced_to_every_rank(job, case, failing, kind, message):
    # an error whose text once steered the protocol ("sparse", "use_reentrant=True") is a
    # failure like any other; a BaseException (KeyboardInterrupt, SystemExit) is announced too
    results = ok(job, "failures")
    own, other = results[failing][case], results[1 - failing][case]
    assert own == ("raised", kind, message), own
    assert other[:2] == ("raised", "RuntimeError"), other
    assert re.match(
        rf"fr\.distributed\.grad_and_value: rank {failing} \(fr\.distributed\.grad_and_value\) "
        rf"raised {kind}",
        other[2],
    ), other[2]
    for r in results:  # the group is usable at the next step
        close(r["after"], {"a": torch.ones(3), "b": torch.full((2,), 2.0), "c": torch.full((4,), 3.0)})


# --- checkpointing, decided per call ----------------------------------------------------


CASES = [
    f"{case}-{mode}-{grad}"
    for case in ("once", "twice", "shared", "first")
    for mode in ("reentrant", "plain")
    for grad in (False, True)
] + ["switching-False", "switching-True"]


@pytest.mark.parametrize("case", CASES)
def test_checkpointed_steps_equal_ddp(job, case):
    # once, twice, shared with a plain layer, on the input (with and without requires_grad),
    # a parameter unused, both use_reentrant settings, and a forward that changes what it
    # checkpoints from step to step: all in one process, one after another
    for r in ok(job, "checkpoint_matrix"):
        got, want = r[case]
        close(got, want, rtol=1e-6, atol=1e-7)


# --- accumulation in the user's order ---------------------------------------------------


def test_accumulate_draws_micro_batches_as_a_no_sync_loop_does(job):
    # batches and dropout masks come from the global RNG as the loop draws them: bit for bit
    for r in ok(job, "accumulate_in_order"):
        for got, want in r["pairs"]:
            close(got, want, rtol=0, atol=0)
        close(*r["listed"], rtol=0, atol=0)  # a list: the last known from len()
        assert r["unsized"][0] == "returned"  # no count: all local, reduced after the last
        assert r["short"][:2] == ("raised", "ValueError"), r["short"]
        assert "yielded 2 micro-batch(es), count=3" in r["short"][2]


# --- the parameters, checked on a layout's first call -----------------------------------


def test_parameters_that_differ_across_ranks_are_named(job):
    for r in ok(job, "parameters_checked"):
        kind, message = r["forgot"][1:]
        assert kind == "ValueError", r["forgot"]
        assert re.match(
            r"fr\.distributed\.grad_and_value: the parameters differ across ranks at "
            r"\['0\.weight'\].*fr\.distributed\.broadcast\(params\)",
            message,
        ), message
        assert r["unchecked"][0] == "returned"
        assert r["broadcast"][0] == "returned"
    a, b = (r["broadcast"][1] for r in job["parameters_checked"])
    close(a, b, rtol=0, atol=0)


# --- compiled accumulation --------------------------------------------------------------


def test_a_compiled_accumulating_step_is_one_graph_and_equals_ddp(job):
    for r in ok(job, "compiled_accumulate"):
        assert r["frames"] == 1, r["frames"]  # one graph; no recompile on new tensors in 10 steps
        for got, eager, ddp in zip(r["compiled"], r["eager"], r["ddp"]):
            close(eager, ddp, rtol=0, atol=0)
            close(got, ddp, rtol=1e-6, atol=1e-7)


def test_accumulating_sends_no_more_collectives_than_ddp(job):
    for r in ok(job, "compiled_accumulate"):
        buckets = r["ddp_counts"][-1]
        assert buckets == 3, r["ddp_counts"]  # DDP's buckets, once it has rebuilt them
        assert r["counts"][1:] == r["ddp_counts"][1:], r  # every later step: its buckets alone
        # the first: a new layout's probe on top, and a mirror of the layout the group ran
        # last (DDP's construction sends as many: its shape check and its broadcast)
        assert r["counts"][0] <= buckets + 2, r["counts"]


def test_weight_and_join_under_compile_equal_eager(job):
    for r in ok(job, "compiled_weight_and_join"):
        close(r["compiled"], r["eager"], rtol=0, atol=0)


def test_leaves_a_loss_kept_take_gradients_of_their_own_after_the_step(job) -> None:
    for res in ok(job, "kept_leaves"):
        assert res["hooked"] >= 1  # the step's buckets were launched from hooks on these leaves
        x = torch.full((64,), 1.5)  # the ranks' inputs, 1 and 2, averaged
        want = {"a": x.expand(64, 64), "b": 2 * x.expand(64, 64), "c": torch.ones(64)}
        close(res["grads"], want, rtol=0, atol=0)
        for k, g in res["again"].items():
            assert torch.equal(g, torch.full_like(g, 3.0)), k  # not the hooks' zero stand-ins
