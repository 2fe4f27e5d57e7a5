"""fr.distributed on 2 gloo ranks (127.0.0.1), against DistributedDataParallel and replicate.

Spawning ranks costs seconds (each imports torch), so one module-scoped job
runs every collective scenario once and the tests below read its results;
the rank that dies needs a job of its own. The rank-side code is in
``_dist_workers.py``.
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

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")

close = fr.testing.assert_trees_close


@pytest.fixture(scope="module")
def job() -> dict[str, list[Any]]:
    names = [n for n in w.SCENARIOS if n != "survivor"]
    return w.spawn(names, pg_timeout=30.0, deadline=150.0)


ok = w.ok


def raised(job: dict[str, list[Any]], name: str, kind: str, pattern: str) -> None:
    for rank, res in enumerate(job[name]):
        assert isinstance(res, tuple) and res[0] == "raised", f"rank {rank} returned {res!r}"
        assert res[1] == kind, res[3]
        assert re.search(pattern, res[2]), res[2]


# --- all_reduce -------------------------------------------------------------------------


def test_all_reduce_sum_mixed_tree(job):
    for r in ok(job, "reduce_sum"):
        out, exp = r["out"], r["expected"]
        for k in ("w", "b", "count", "flag"):
            assert out[k].dtype == exp[k].dtype
            torch.testing.assert_close(out[k], exp[k], rtol=0, atol=1e-12)
        torch.testing.assert_close(out["tied"][0], exp["tied"])
        assert r["tied_is_one"], "a tied leaf must stay one tensor object"
        assert r["step"] == 7 and out["none"] is None
        assert r["unchanged"] and r["fresh"]


def test_all_reduce_mean_results_survive_the_next_call(job):
    exp = w.expected_reduce("mean")
    for r in ok(job, "reduce_mean_twice"):
        close(r["r1"], r["r1_copy"], rtol=0, atol=0)
        close(r["r3"], r["r1_copy"], rtol=0, atol=0)
        torch.testing.assert_close(r["r1"]["w"], exp["w"])
        torch.testing.assert_close(r["r2"]["w"], exp["w"] * 3)
        torch.testing.assert_close(r["r1"]["tied"][1], exp["tied"])
        assert r["unchanged"]


def test_all_reduce_reuses_buffers_without_aliasing(job):
    for r in ok(job, "reduce_reuse"):
        assert r["fresh_ok"]
        for got, want in r["kept"]:
            close(got, want)
        assert r["distinct"] < 6, "the pool should reuse buffers whose results were dropped"
        assert not r["saved_reused"], "a buffer saved by autograd must not be reused"
        torch.testing.assert_close(r["grad"], r["exp_w"])


def test_all_reduce_odd_leaves(job):
    for r in ok(job, "reduce_odd_leaves"):
        close(r["out"], r["expected"])
        assert r["out"]["transposed"].shape == (4, 3) and r["out"]["empty"].shape == (0, 3)
        assert r["out"]["transposed"].stride() == (1, 4)  # the input's memory format, kept
        assert r["out"]["param"].requires_grad  # a graph-carrying input: its result carries it
        assert r["unchanged"] and r["empty_tree"] == {"n": 3}


def test_all_reduce_tiny_buckets_equal(job):
    for r in ok(job, "reduce_small_buckets"):
        close(r["tiny"], r["default"], rtol=0, atol=0)


def test_all_reduce_compressed_within_tolerance(job):
    for r in ok(job, "reduce_compressed"):
        assert r["bf16"]["w"].dtype == torch.float32 and r["bf16"]["b"].dtype == torch.float64
        close(r["bf16"], r["exact"], rtol=1.6e-2, atol=1e-2)
        close(r["fp16"], r["exact_sum"], rtol=2e-3, atol=2e-3)
        assert r["unchanged"]


def test_mean_of_integer_leaf_names_path(job):
    raised(job, "mean_of_ints", "TypeError", r"fr\.distributed\.all_reduce: op='mean'.*\['count'\]")


def test_mismatched_shapes_raise_on_every_rank(job):
    raised(
        job,
        "mismatch_shape",
        "ValueError",
        r"fr\.distributed\.all_reduce: the tensor at \['b'\] differs across ranks: "
        r"shape \(2,\).*rank 0; shape \(3,\).*rank 1",
    )


def test_mismatched_structure_raises_on_every_rank(job):
    raised(
        job,
        "mismatch_structure",
        "ValueError",
        r"structure differs across ranks: a leaf at \['c'\] on rank 1, none there on rank 0 "
        r"\(its tree ends after 1 leaves\)",
    )


def test_a_rank_without_tensors_raises_too(job):
    raised(
        job,
        "mismatch_empty",
        "ValueError",
        r"structure differs across ranks: a leaf at \['a'\] on rank 1, none there on rank 0",
    )


def test_mismatched_dtype_raises_in_broadcast(job):
    raised(
        job, "mismatch_dtype", "ValueError", r"fr\.distributed\.broadcast: .*\['a'\].*torch.float64"
    )


def test_mismatched_options_raise(job):
    raised(job, "mismatch_options", "ValueError", r"options differ across ranks.*'mean'.*'sum'")


def test_mismatched_params_raise_in_grad(job):
    raised(
        job, "mismatch_grad", "ValueError", r"fr\.distributed\.grad_and_value: .*\['w'\] differs"
    )


def test_mismatch_caught_when_one_rank_has_the_layout_cached(job):
    pattern = r"the tensor at \['w'\] differs across ranks: shape \(2,\).*rank 0; shape \(3,\)"
    raised(job, "mismatch_after_cached", "ValueError", r"fr\.distributed\.all_reduce: " + pattern)
    raised(
        job,
        "mismatch_grad_after_cached",
        "ValueError",
        r"fr\.distributed\.grad_and_value: " + pattern,
    )


def test_group_usable_after_mismatches(job):
    for r in ok(job, "after_mismatch"):
        torch.testing.assert_close(r["x"], torch.ones(2))


# --- the layout check's fast path ------------------------------------------------------


def test_steady_state_sends_no_probe(job):
    for r in ok(job, "steady_state"):
        for counts in (r["counts"], r["grad_counts"]):
            assert counts["probe"] == 1, counts  # the first call's full check only
            # ten single-bucket reductions, the probe, and at most one mirror of the last layout
            assert 11 <= counts["all_reduce"] <= 12, counts
        for out in r["reduced"]:
            torch.testing.assert_close(out["s"], torch.full((11, 3), 0.5))
            torch.testing.assert_close(out["t"], torch.ones(4))
        for grads in r["grads"]:
            torch.testing.assert_close(grads["w"], torch.full((13, 2), 3.0))


@pytest.mark.parametrize(
    ("case", "pattern"),
    [
        (0, r"the tensor at \['b'\] differs across ranks: shape \(2, 2\).*rank 0; shape \(2, 3\)"),
        (1, r"the tensor at \['b'\] differs across ranks: .*dtype torch\.float64 on rank 1"),
        (2, r"the tree's structure differs across ranks: a leaf at \['c'\] on rank 1, none there"),
        (3, r"the tree's structure differs across ranks: a leaf at \['b'\] on rank 0, none there"),
        (4, r"the tensor at \['m'\] differs across ranks: shape \(4,\), dtype torch\.bool"),
        (5, r"the tensor at \['b'\] differs across ranks: shape \(2, 2\).*rank 0; shape \(2, 3\)"),
    ],
    ids=["shape", "dtype", "structure", "fewer_tensors", "bool_bucket", "bf16_bucket"],
)
def test_mismatch_against_the_agreed_layout_raises_on_every_rank(job, case, pattern):
    for r in ok(job, "mismatch_on_agreed"):
        assert r[case][0] == "raised", r[case]
        assert re.search(r"^fr\.distributed\.all_reduce: " + pattern, r[case][1]), r[case][1]
        torch.testing.assert_close(r[-1]["x"], torch.ones(2))  # the group is still usable


def test_switching_layouts_together_stays_right(job):
    for r in ok(job, "switching_layouts"):
        for got, want in r["pairs"]:
            close(got, want, rtol=0, atol=0)
        # 7 data buckets and a probe for A and for B on their first use: nothing at a switch
        assert r["counts"]["probe"] == 2, r["counts"]
        assert r["counts"]["all_reduce"] == 9, r["counts"]


def test_mismatch_against_the_second_layout_raises_on_every_rank(job):
    for r in ok(job, "mismatch_second_layout"):
        assert re.search(r"the tensor at \['a'\] differs across ranks: shape \(6,\)", r[0][1])
        assert re.search(
            r"structure differs across ranks: leaf 0 is at \['b'\] on rank 0, at \['a'\]", r[1][1]
        )
        torch.testing.assert_close(r[2]["a"], torch.full((6,), 2.0))


def test_multi_bucket_mismatch_raises_on_every_rank(job):
    for first, got, again in ok(job, "mismatch_multi_bucket"):
        assert got[0] == "raised", got
        assert re.search(r"the tensor at \['a'\] differs across ranks: shape \(4,\)", got[1])
        for out in (first, again):
            close(
                out,
                {
                    "a": torch.full((4,), 2.0),
                    "b": torch.full((3,), 2.0),
                    "c": torch.full((2,), 2.0),
                },
            )


def test_grad_switching_layouts_and_mismatch(job):
    for r in ok(job, "grad_switching_and_mismatch"):
        assert len(r["switch"]) == 10
        for got, want in r["switch"]:
            close(got, want, rtol=0, atol=0)
        for cap in (25.0, 1e-6):
            assert r[cap][0] == "raised", r[cap]
            assert re.search(
                r"fr\.distributed\.grad_and_value: the tensor at \['B0'\] differs across ranks",
                r[cap][1],
            ), r[cap][1]


# --- broadcast --------------------------------------------------------------------------


def test_broadcast_from_each_source(job):
    for r in ok(job, "broadcasts"):
        close(r["from0"], r["tree0"], rtol=0, atol=0)
        close(r["from1"], r["tree1"], rtol=0, atol=0)
        assert r["from1"]["tied"][0] is r["from1"]["tied"][1]
        assert r["unchanged"]


def test_sync_buffers_mean_and_broadcast(job):
    for r in ok(job, "buffers_mean"):
        b0, b1 = r["everyone"]
        for k in ("running_mean", "running_var"):
            torch.testing.assert_close(r["mean"][k], (b0[k] + b1[k]) / 2)
        assert int(r["mean"]["num_batches_tracked"]) == 1  # rank 0's, not averaged
        close(r["broadcast"], b1, rtol=0, atol=0)
        assert r["unchanged"]


# --- grad_and_value against DDP and composable replicate --------------------------------


@pytest.mark.parametrize(
    "name", ["train_mlp", "train_batchnorm", "train_tiny_buckets", "train_stacked"]
)
def test_sgd_steps_equal_ddp_and_replicate(job, name):
    results = ok(job, name)
    if name == "train_stacked":  # stacked leaves filled runs of several buckets
        for r in results:
            ((buckets, stacked_runs),) = r["stacked"]
            assert buckets >= 3 and stacked_runs >= 4, r["stacked"]
    for r in results:
        close(r["fr"], r["ddp"], rtol=0, atol=1e-6)
        close(r["fr"], r["rep"], rtol=0, atol=1e-6)
        assert r["model_unchanged"]
        if r["fr_buffers"]:
            close(r["fr_buffers"], r["ddp_buffers"], rtol=0, atol=1e-6)
    # the ranks trained on different data, yet hold the same parameters
    close(results[0]["fr"], results[1]["fr"], rtol=0, atol=0)
    assert results[0]["losses"] != results[1]["losses"]


def test_grad_equals_all_reduce_of_local_grad(job):
    for r in ok(job, "grad_matches_all_reduce"):
        for cap in (25.0, 1e-6):
            grads, reduced, value, local_value = r[cap]
            close(grads, reduced, rtol=0, atol=1e-7)
            assert torch.equal(grads["unused"], torch.zeros(3))
            assert torch.equal(value, local_value)
        close(*r["sum"], rtol=0, atol=1e-7)
        assert r["unchanged"]


def test_grad_under_vmap_gives_each_sample_the_mean_over_ranks(job):
    for rank, (grads, values) in enumerate(ok(job, "under_vmap")):
        xs = [torch.arange(6.0).view(3, 2) + r for r in range(2)]
        torch.testing.assert_close(grads["w"], (xs[0] + xs[1]) / 2, rtol=0, atol=0)
        torch.testing.assert_close(values, xs[rank].sum(1), rtol=0, atol=0)


# --- failures that must not hang --------------------------------------------------------


@pytest.mark.parametrize("stall", [False, True], ids=["exits", "stalls"])
def test_dead_rank_makes_the_other_raise(stall):
    res = w.spawn(["survivor"], pg_timeout=5.0, deadline=60.0, die=1, stall=stall)["survivor"][0]
    assert res[0] == "raised", f"the survivor's all_reduce returned: {res!r}"
    assert res[1] == "RuntimeError" and res[3] is not None, res  # the original is the cause
    assert res[2].startswith("fr.distributed.all_reduce: a collective failed: a peer rank "), res
    assert res[-1] < 20.0  # within the group's timeout (5 s) and some slack, not a hang


# --- ranks that part ways (issue 10, item 6) -------------------------------------------


def test_ranks_calling_different_functions_all_raise(job):
    fns = {
        "broadcast": "fr.distributed.broadcast",
        "sync_buffers": "fr.distributed.sync_buffers",
        "grad": "fr.distributed.grad_and_value",
    }
    for rank, r in enumerate(ok(job, "different_functions")):
        for name, fn in fns.items():
            got = r[name]
            assert got[0] == "raised" and got[1] == "ValueError", got
            mine = fn if rank else "fr.distributed.all_reduce"
            assert got[2].startswith(f"{mine}: ranks called different functions: "), got
            assert f"fr.distributed.all_reduce on rank 0, {fn} on rank 1" in got[2], got
        torch.testing.assert_close(r["after"]["x"], torch.ones(2))


def test_a_rank_that_skips_a_step_makes_every_rank_raise(job):
    r0, r1 = ok(job, "skipped_step")
    (step0, kind0, text0), (step1, kind1, text1) = r0["errors"][0], r1["errors"][0]
    assert (step0, step1) == (3, 4), (r0["errors"], r1["errors"])
    assert kind0 == kind1 == "ValueError"
    assert text0.startswith("fr.distributed.grad_and_value: ranks called different functions")
    assert text1.startswith("fr.distributed.sync_buffers: ranks called different functions")
    for r in (r0, r1):
        torch.testing.assert_close(r["after"]["x"], torch.full((2,), 2.0))


@pytest.mark.parametrize("case", ["fast", "new_layout", "backward", "graph"])
def test_fn_raising_on_one_rank_raises_on_every_rank(job, case):
    r0, r1 = ok(job, "fn_raises")
    own = {"backward": ("ArithmeticError", "backward of rank 1 failed")}.get(
        case, ("KeyError", "no such batch on rank 1")
    )
    assert r1[case][:2] == ("raised", own[0]), r1[case]
    assert own[1] in r1[case][2]
    assert r0[case][:2] == ("raised", "RuntimeError"), r0[case]
    assert re.match(
        r"fr\.distributed\.grad_and_value: rank 1 \(fr\.distributed\.grad_and_value\) raised "
        + own[0],
        r0[case][2],
    ), r0[case][2]
    for r in (r0, r1):  # the group goes on
        close(
            r["after"], {"a": torch.ones(3), "b": torch.full((2,), 2.0), "c": torch.full((4,), 3.0)}
        )


# --- wasted collectives (issue 10, item 7) ---------------------------------------------


def test_sync_buffers_without_buffers_sends_nothing(job):
    for r in ok(job, "no_buffers"):
        assert r["same"]
        assert r["counts"] == {"probe": 0, "all_reduce": 0}, r["counts"]


def test_accumulation_costs_one_collective_a_reduction(job):
    for r in ok(job, "accumulation"):
        # five steps of three reductions (gradients, loss, buffers): the data, nothing more
        assert r["counts"] == {"probe": 0, "all_reduce": 15}, r["counts"]
    close(*[r["grads"] for r in job["accumulation"]], rtol=0, atol=0)


# --- bad arguments across processes (issue 10, item 5) ----------------------------------


def test_bad_arguments_on_every_rank(job):
    for rank, r in enumerate(ok(job, "bad_arguments")):
        expect = {
            "src_str": ("TypeError", r"^fr\.distributed\.broadcast: src must be an int, got '0'"),
            "src_float": (
                "TypeError",
                r"^fr\.distributed\.broadcast: src must be an int, got 1\.0",
            ),
            "src_range": (
                "ValueError",
                r"^fr\.distributed\.broadcast: src=2 is not a rank of the default group "
                r"\(its global ranks are \[0, 1\]\)",
            ),
            "group_str": (
                "TypeError",
                r"^fr\.distributed\.all_reduce: group must be a torch\.distributed process "
                r"group .* got 'abc' of type str$",
            ),
            "cap_nan": ("ValueError", r"^fr\.distributed\.all_reduce: bucket_cap_mb must be a "),
            "cap_str": (
                "TypeError",
                r"^fr\.distributed\.all_reduce: bucket_cap_mb must be a number",
            ),
            "cap_neg": ("ValueError", r"^fr\.distributed\.all_reduce: bucket_cap_mb must be a "),
            "meta": (
                "TypeError",
                r"^fr\.distributed\.all_reduce: the tensor at \['w'\] is on the meta device",
            ),
            "meta_again": (
                "TypeError",
                r"^fr\.distributed\.all_reduce: the tensor at \['w'\] is on the meta device",
            ),
            "key_order": (
                "ValueError",
                r"structure differs across ranks: leaf 0 is at \['a'\] on rank 0, at \['b'\] "
                r"on rank 1",
            ),
            "tied": (
                "ValueError",
                r"tied \(aliased\) leaves differ across ranks: .* on rank 0 and on rank 1$",
            ),
        }
        for name, (kind, pattern) in expect.items():
            got = r[name]
            assert got[0] == "raised" and got[1] == kind, (name, got)
            assert re.search(pattern, got[2]), (name, got[2])
        assert r["outside"] == ("returned", True)
        if rank == 0:
            assert r["src_not_in_sub"][:2] == ("raised", "ValueError")
            assert re.search(
                r"src=1 is not a rank of the given group \(its global ranks are \[0\]\)",
                r["src_not_in_sub"][2],
            )
            assert r["warnings"] == []
        else:
            (text,) = r["warnings"]
            assert text.startswith(
                "fr.distributed.all_reduce: this rank is not in the given process group"
            )
        torch.testing.assert_close(r["after"]["x"], torch.full((2,), 2.0))


# --- memory held by the pools (issue 10, item 4) ----------------------------------------


def test_pools_keep_one_spare_and_clear_caches_frees_them(job):
    for r in ok(job, "pools_release"):
        assert r["live"] == [2], r  # the live result's buffer and one spare
        assert r["spare"] == [1], r  # every result dropped: one spare only
        assert r["freed"] >= 48 * 2**20, r  # the 64 MiB spare buffer, given back
        assert r["plans"] == 0


# --- sparse gradients (issue 11, item 4) ------------------------------------------------


def test_sparse_gradients_equal_ddp(job):
    for r in ok(job, "sparse_against_ddp"):
        assert len(r["steps"]) == 6
        for got, want, layouts in r["steps"]:
            close(got, want, rtol=1e-6, atol=1e-7)
            assert layouts["emb.weight"] == layouts["bag.weight"] == torch.sparse_coo
            assert layouts["fc.weight"] == torch.strided
        a, b = r["everyone"]
        close(r["reduced"]["sum"], {k: a[k] + b[k] for k in a}, rtol=0, atol=0)
        close(r["reduced"]["mean"], {k: (a[k] + b[k]) / 2 for k in a}, rtol=0, atol=0)
        close(r["broadcast"], b, rtol=0, atol=0)
        assert r["unchanged"]
    close(*[r["steps"][-1][0] for r in job["sparse_against_ddp"]], rtol=0, atol=0)


# --- no process group -------------------------------------------------------------------


def test_without_group_trees_come_back_unchanged():
    tree = {"w": torch.ones(2), "n": 3}
    assert fr.distributed.all_reduce(tree) is tree
    assert fr.distributed.broadcast(tree) is tree
    assert fr.distributed.sync_buffers(tree, mode="mean") is tree
    grads, value = fr.distributed.grad_and_value(lambda t: (t["w"] * 2).sum())({"w": torch.ones(2)})
    torch.testing.assert_close(grads["w"], torch.full((2,), 2.0))
    torch.testing.assert_close(value, torch.tensor(4.0))


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match=r"fr\.distributed\.all_reduce: op must be"):
        fr.distributed.all_reduce({}, op="max")
    with pytest.raises(ValueError, match=r"compress must be None, 'bf16' or 'fp16'"):
        fr.distributed.all_reduce({}, compress="int8")
    with pytest.raises(ValueError, match=r"fr\.distributed\.sync_buffers: mode must be"):
        fr.distributed.sync_buffers({}, mode="first")
    with pytest.raises(ValueError, match=r"fr\.distributed\.grad_and_value: op must be"):
        fr.distributed.grad_and_value(lambda p: p, op="avg")


@pytest.mark.parametrize(
    "kwargs, error, pattern",
    [
        ({"bucket_cap_mb": float("nan")}, ValueError, r"bucket_cap_mb must be a finite positive"),
        ({"bucket_cap_mb": "25"}, TypeError, r"bucket_cap_mb must be a number, got '25'"),
        ({"bucket_cap_mb": -1}, ValueError, r"bucket_cap_mb must be a finite positive number"),
        ({"group": "abc"}, TypeError, r"group must be a torch\.distributed process group"),
    ],
)
def test_bad_arguments_raise_without_a_group_too(kwargs, error, pattern):
    # checked on every call, not only when a process group makes the call do something
    tree = {"w": torch.ones(2)}
    with pytest.raises(error, match=r"^fr\.distributed\.all_reduce: " + pattern):
        fr.distributed.all_reduce(tree, **kwargs)
    with pytest.raises(error, match=r"^fr\.distributed\.grad_and_value: " + pattern):
        fr.distributed.grad_and_value(lambda p: p["w"].sum(), **kwargs)(tree)


@pytest.mark.parametrize("src", ["0", 1.0, None])
def test_broadcast_src_must_be_an_int(src):
    with pytest.raises(TypeError, match=r"^fr\.distributed\.broadcast: src must be an int, got "):
        fr.distributed.broadcast({"w": torch.ones(2)}, src=src)
    with pytest.raises(TypeError, match=r"^fr\.distributed\.sync_buffers: src must be an int"):
        fr.distributed.sync_buffers({"w": torch.ones(2)}, src=src)


def test_grad_and_value_needs_a_callable():
    with pytest.raises(TypeError, match=r"^fr\.distributed\.grad_and_value: fn must be callable"):
        fr.distributed.grad_and_value(None)  # type: ignore[arg-type]


def test_buckets_follow_the_reverse_of_the_insertion_order() -> None:
    # Gradients become ready in the reverse of named_parameters() order; sorted
    # keys ('10.weight' < '2.weight') would scatter a bucket over the backward pass.
    from freplicate._distributed import _plans as planning
    from freplicate._distributed._options import Options
    from freplicate._distributed._wire import ALL_REDUCE

    tree = {f"{i}.weight": torch.zeros(300_000) for i in range(12)}  # 1.2 MB: a bucket each
    options = Options(ALL_REDUCE.name, "mean", 1.0, None)
    plan, leaves = planning.plan_of(tree, options, None, 2, "fr.distributed.all_reduce")
    layout = plan.layout
    names = list(tree)
    name_of = {id(t): n for n, t in tree.items()}
    order = [name_of[id(leaves[layout.unique[k]])] for b in layout.buckets for k in b.members]
    assert order == names[::-1]
    # and the user's dict comes back with its own key order
    assert list(plan.rebuild(list(tree.values()), [tree[n] for n in names])) == names


@pytest.mark.parametrize(
    "call",
    [
        lambda: fr.distributed.all_reduce({"w": torch.ones(2)}),
        lambda: fr.distributed.broadcast({"w": torch.ones(2)}),
        lambda: fr.distributed.sync_buffers({"w": torch.ones(2)}),
        lambda: fr.distributed.grad_and_value(lambda p: p["w"].sum())({"w": torch.ones(2)}),
    ],
    ids=["all_reduce", "broadcast", "sync_buffers", "grad_and_value"],
)
def test_launched_without_a_process_group_raises(monkeypatch, call):
    # under torchrun (WORLD_SIZE > 1) with no process group, each rank would train alone
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(
        RuntimeError,
        match=r"^fr\.distributed\.\w+: WORLD_SIZE=2 in the environment .* call "
        r"torch\.distributed\.init_process_group\(\) first",
    ):
        call()
    monkeypatch.setenv("WORLD_SIZE", "1")
    call()  # one process: nothing to do


@pytest.mark.parametrize("name", ["sparse", "reentrant"])
def test_grad_with_a_stacked_sparse_gradient_or_a_reentrant_checkpoint(job, name):
    for r in ok(job, "stacked_sparse_and_reentrant"):
        for got, want in r[name]:
            close(got, want, rtol=1e-6, atol=1e-7)
            assert any(v.abs().sum() > 0 for v in got.values())
