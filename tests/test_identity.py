"""Identity: calls that differ across ranks raise ``ValueError`` on every rank (issue 23, item 4).

The kind of collective, the function and every option are part of what the
ranks agree on, checked before any data moves. On 2 gloo ranks, every
ordered pair of 17 public calls on the same tree (``_identity_workers.CALLS``:
broadcast from either rank, all_reduce with each option, reduce_scatter,
all_gather, sync_buffers in both modes, a gradient step with ``shard=``,
``op=``, ``skip`` and ``accumulate``), under each situation of the
protocol (``SITUATIONS``: the group's first call, in the default mode; then,
in the checks' debug mode, where ranks that part ways after a layout's first
use must be checked before the data moves: rank 0's call warm, both calls
known, neither known); trees that differ in memory format, dtype
or ties only; the same pairs through the collectives' rules (inputs that
require grad, the backward's transposed collectives) and compiled; one rank
differentiating through a collective while the other goes on; and the
reported case, a wrong shard given to ``all_gather`` after a
``reduce_scatter``. After each case both ranks make a good call together.

Also issue 25, item 9: ``shard`` of a sparse leaf, and every call on a rank
outside its group (3 ranks).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

import freplicate as fr

sys.path.insert(0, str(Path(__file__).parent))  # the spawned ranks import the workers by name
import _dist_workers as w
import _identity_workers as iw

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")

TWO = [
    "matrix_first",
    "matrix_fast",
    "matrix_known",
    "matrix_new",
    "ruled_pairs",
    "backward_on_one_rank",
    "tree_variants",
    "wrong_shard_after_reduce_scatter",
    "new_group_first_call",
    "sparse_shard",
    "second_collective_alone",
    "compiled",
]


@pytest.fixture(scope="module")
def job() -> dict[str, list[Any]]:
    return w.spawn(TWO, target=iw.main, pg_timeout=20.0, deadline=240.0)


@pytest.fixture(scope="module")
def job3() -> dict[str, list[Any]]:
    return w.spawn(["outside_the_group"], target=iw.main, world=3, pg_timeout=20.0, deadline=120.0)


def ranks(job: dict[str, list[Any]], name: str) -> list[Any]:
    """Both ranks' results of ``name``; a scenario that raised, or whose ranks fell out of step
    (a good call that failed: ``"stopped"``), fails the test."""
    out = job[name]
    for rank, res in enumerate(out):
        if isinstance(res, tuple) and res and res[0] == "raised":
            pytest.fail(f"{name} raised on rank {rank}:\n{res[3]}")
        if isinstance(res, dict) and "stopped" in res:
            key = res["stopped"]
            pytest.fail(f"{name}: the ranks fell out of step at {key} on rank {rank}: {res[key]}")
    return out


def sides(message: str) -> dict[int, str]:
    """What a message says of each rank: the text before ``" on rank r"``, back to the other's."""
    marks = sorted((message.find(f" on rank {r}"), r) for r in (0, 1))
    if marks[0][0] < 0:  # it does not name both ranks
        return {0: "", 1: ""}
    (first, r0), (second, r1) = marks
    start = message.rfind(": ", 0, first) + 2
    return {r0: message[start:first], r1: message[first + len(f" on rank {r0}") : second]}


def names_difference(message: str, a: str, b: str) -> bool:
    """Whether ``message`` says what rank 0 ran (``a``) and what rank 1 ran (``b``) where they
    differ: the functions, the kinds of collective, or an option that differs, each beside its rank."""
    ca, cb = iw.CALLS[a], iw.CALLS[b]
    wanted = [(ca.caller, cb.caller), (ca.kind, cb.kind)]
    wanted += [(f"{k}={ca.options[k]!r}", f"{k}={cb.options[k]!r}") for k in ca.options]
    said = sides(message)
    return any(x != y and x in said[0] and y in said[1] for x, y in wanted)


def problems_of(results: list[dict[Any, Any]], keys: list[Any], check: Any) -> list[str]:
    """Every key whose two outcomes ``check`` refuses (its reason), then the good calls that failed."""
    out = []
    for key in keys:
        (got0, good0), (got1, good1) = results[0][key], results[1][key]
        why = check(key, got0, got1)
        if why:
            out.append(f"{key}: {why} (rank 0: {got0[:3]}; rank 1: {got1[:3]})")
        if good0 != ("returned", True) or good1 != ("returned", True):
            out.append(f"{key}: the good call after it: {good0}, {good1}")
    return out


def raised_value_errors(got0: tuple[Any, ...], got1: tuple[Any, ...]) -> str | None:
    if not (got0[:2] == got1[:2] == ("raised", "ValueError")):
        return "not a ValueError on every rank"
    if got0[2].split(": ", 1)[1] != got1[2].split(": ", 1)[1]:
        return "the ranks' messages differ"
    return None


def naming_the_difference(key: Any, got0: Any, got1: Any) -> str | None:
    """A ValueError on every rank that names what differs between the calls ``key[-2:]``."""
    wrong = raised_value_errors(got0, got1)
    if wrong is None and not names_difference(got0[2], *key[-2:]):
        return "the message does not name the difference"
    return wrong


def assert_none(problems: list[str], of: int) -> None:
    assert not problems, f"{len(problems)} of {of} cases:\n" + "\n".join(problems)


# --- every pair of calls, in every situation ----------------------------------------------


def test_the_matrix_covers_every_ordered_pair():
    assert len(iw.CALLS) == 17
    assert len(iw.PAIRS) == 17 * 16
    assert len(iw.DIFFERENT) + len(iw.COMPATIBLE) + len(iw.SILENT) == len(iw.PAIRS)
    assert (len(iw.DIFFERENT), len(iw.COMPATIBLE), len(iw.SILENT)) == (246, 6, 20)


@pytest.mark.parametrize("situation", iw.SITUATIONS)
def test_different_calls_raise_naming_the_difference_on_every_rank(job, situation):
    results = ranks(job, f"matrix_{situation}")
    keys = [(situation, a, b) for a, b in iw.DIFFERENT]
    assert_none(problems_of(results, keys, naming_the_difference), len(keys))


@pytest.mark.parametrize("situation", iw.SITUATIONS)
def test_a_step_a_skip_and_an_accumulate_pair_up(job, situation):
    # one call under three names, by design (Join, no_sync): the mean of what each rank sends
    results = ranks(job, f"matrix_{situation}")
    t = iw.tree()
    local = {"w": 2 * t["w"], "b": 8 * t["b"]}  # the gradient of iw.loss at iw.tree()
    sends = {"step": 1.0, "step.skip": 0.0, "step.accumulate": 2.0}  # times the local gradient
    for a, b in iw.COMPATIBLE:
        for rank in (0, 1):
            (got, good) = results[rank][(situation, a, b)]
            assert got[0] == "returned" and good == ("returned", True), (a, b, rank, got)
            scale = (sends[a] + sends[b]) / 2
            expected = {k: v * scale for k, v in local.items()}
            fr.testing.assert_trees_close(got[1], expected)


@pytest.mark.parametrize("situation", iw.SITUATIONS)
def test_different_functions_of_one_collective_raise(job, situation):
    results = ranks(job, f"matrix_{situation}")
    keys = [(situation, a, b) for a, b in iw.SILENT if (a, b) not in iw.CASCADING]
    assert_none(problems_of(results, keys, naming_the_difference), len(keys))


def test_a_function_of_two_collectives_against_one_of_one(job):
    res = ranks(job, "second_collective_alone")
    for r in res:
        assert r["got"][:2] == ("raised", "ValueError"), r["got"]
        assert r["good"] == ("returned", [1.0, 1.0]), r["good"]
        assert r["seconds"] < 1.0


def test_the_first_call_on_a_new_group(job):
    for r in ranks(job, "new_group_first_call"):
        assert r["kinds"][:2] == ("raised", "ValueError")
        assert (
            "fr.distributed.all_reduce on rank 0, fr.distributed.reduce_scatter on rank 1"
            in r["kinds"][2]
        )
        assert r["shard"][:2] == ("raised", "ValueError")
        assert "all_reduce on rank 0, reduce_scatter on rank 1" in r["shard"][2]
        assert r["good"] == ("returned", [-2.0, -1.0, 0.0, 1.0, 2.0])


# --- trees that differ in memory format, dtype or ties only --------------------------------

VARIANT_WORDS = {
    "memory_format": ("['c']", "memory format", "(0, 2, 3, 1) on rank 1"),
    "dtype": ("['b']", "torch.float32 on rank 0", "torch.float64 on rank 1"),
    "tied": ("tied",),
}


@pytest.mark.parametrize("variant", iw.VARIANTS)
def test_trees_that_differ_only_in_memory_format_dtype_or_ties(job, variant):
    results = ranks(job, "tree_variants")
    keys = [(s, variant, name) for s in iw.SITUATIONS for name in iw.VARIANT_CALLS]
    steps = {n for n in iw.VARIANT_CALLS if iw.CALLS[n].caller == iw.D + "grad_and_value"}

    def check(key: Any, got0: Any, got1: Any) -> str | None:
        if variant == "tied" and key[2] in steps:
            # a step's gradients come one per position, untied: a tie changes nothing there
            ok = got0[0] == got1[0] == "returned"
            return None if ok and (key[2] != "step" or iw.same(got0[1], got1[1])) else "not equal"
        wrong = raised_value_errors(got0, got1)
        if wrong is None and not all(w in got0[2] for w in VARIANT_WORDS[variant]):
            return "the message does not name the difference"
        return wrong

    assert_none(problems_of(results, keys, check), len(keys))


# --- through the rules: inputs that require grad --------------------------------------------


def test_pairs_through_the_rules_raise_on_every_rank(job):
    results = ranks(job, "ruled_pairs")
    keys = [
        ("ruled", s, a, b)
        for s in ("first", "fast")
        for a, b in iw.PAIRS
        if a in iw.RULED and b in iw.RULED
    ]
    assert len(keys) == 2 * 10 * 9

    def check(key: Any, got0: Any, got1: Any) -> str | None:
        wrong = raised_value_errors(got0, got1)
        if wrong is None and not ("rank 0" in got0[2] and "rank 1" in got0[2]):
            return "the message does not name the ranks"
        return wrong

    assert_none(problems_of(results, keys, check), len(keys))


@pytest.mark.parametrize(
    ("name", "then"),
    [
        (name, then)
        for name in iw.BACKWARD_CALLS
        for then in iw.THEN
    ],
)
def test_a_backward_on_one_rank_raises_on_every_rank(job, name, then):
    # rank 0 differentiates through the call (its transpose runs); rank 1 goes on to `then`
    results = ranks(job, "backward_on_one_rank")
    assert_none(
        problems_of(results, [(name, then)], lambda key, a, b: raised_value_errors(a, b)), 1
    )


# --- the reported case -----------------------------------------------------------------------


def test_a_wrong_shard_after_a_reduce_scatter_of_the_same_layout(job):
    results = ranks(job, "wrong_shard_after_reduce_scatter")
    keys = [k for k in results[0] if k != "stopped"]
    assert len(keys) == 8
    shape = {0: "(3,)", 1: "(2,)"}  # each rank's rows of ['b'] (5 rows on 2 ranks)

    def check(key: Any, got0: Any, got1: Any) -> str | None:
        bad = key[1]
        mine, peer = (got0, got1) if bad == 0 else (got1, got0)
        if mine[:2] != ("raised", "ValueError") or peer[0] != "raised":
            return "not raised on every rank"
        wanted = ["fr.distributed.all_gather", "['b']", f"shape {shape[bad]}", f"rank {bad} of 2"]
        if not all(w in mine[2] for w in wanted):
            return "the wrong rank's message does not name the path, its rows and the rank"
        if not all(w in peer[2] for w in (f"rank {bad}", "['b']", "ValueError")):
            return "the other rank's message does not name the failing rank and its error"
        return None

    assert_none(problems_of(results, keys, check), len(keys))


# --- compiled ------------------------------------------------------------------------------------


def test_compiled_pairs_raise_while_tracing(job):
    results = ranks(job, "compiled")
    keys = [("traced", a, b) for a, b in iw.COMPILED_PAIRS]

    def check(key: Any, got0: Any, got1: Any) -> str | None:
        if not (got0[:2] == got1[:2] == ("raised", "ValueError")):
            return "not a ValueError on every rank"
        for got in (got0, got1):
            if "(checked when torch.compile traced this call)" not in got[2]:
                return "not raised by the traced check"
            if not names_difference(got[2], *key[1:]):
                return "the message does not name the difference"
        return None

    assert_none(problems_of(results, keys, check), len(keys))
    for r in results:  # and then a layout agreed and run compiled on both ranks
        assert r["agreed"] == (("returned", True), ("returned", True))


def test_compiled_graphs_cached_on_both_ranks_still_agree(job):
    for r in ranks(job, "compiled"):
        got, good = r["cached"]
        assert got[:2] == ("raised", "ValueError"), got
        assert good == ("returned", True)


# --- issue 25, item 9 ------------------------------------------------------------------------


@pytest.mark.parametrize("function", ["shard", "reduce_scatter"])
def test_a_sparse_leaf_is_a_type_error_naming_its_path_and_layout(job, function):
    for r in ranks(job, "sparse_shard"):
        got = r[function]
        assert got[:2] == ("raised", "TypeError"), got
        assert all(w in got[2] for w in (f"fr.distributed.{function}", "['e']", "torch.sparse_coo"))
        assert r["after"] == ("returned", [2.0, 2.0])  # the group goes on


def test_every_call_on_a_rank_outside_the_group_warns_naming_it(job3):
    outside = job3["outside_the_group"][2]
    assert not (isinstance(outside, tuple) and outside[0] == "raised"), outside
    assert set(outside) == set(iw.outside_calls(None, "").keys())
    problems = []
    for name, (got, said) in outside.items():
        function = "fr.distributed." + name.split("(")[0]
        if name in ("skip", "accumulate"):
            function = "fr.distributed.grad_and_value"
        warned = [w for w in said if w.startswith("UserWarning: ") and function in w]
        if len(warned) != 1:
            problems.append(f"{name}: {said}")
        if got[0] == "raised" and name != "materialize":  # which holds no shards: an error
            problems.append(f"{name} raised {got}")
    assert not problems, "\n".join(problems)
