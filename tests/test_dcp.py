"""Sharded checkpoints through torch.distributed.checkpoint: saved on 2 ranks, loaded on 1, 2, 3.

A job of 2 gloo ranks saves (every dtype and padding case; ZeRO-2 and
ZeRO-1 AdamW runs at step 5; a ZeRO-3 state of parameters' shards and
whole buffers) and resumes what one process saved; a job of 3 ranks and
this process load the 2 ranks' checkpoints and train on. The oracles: the
rows ``torch.chunk`` gives of the saved full tensors, and the run that was
never interrupted. Bit for bit where the arithmetic is the same: on 1 and 2
processes the resumed runs are the uninterrupted run's bits (one process
adds the two halves' gradients as 2 ranks do); on 3 ranks the checkpoint
loads bit for bit, but each rank's gradient is a mean over 4 rows, not 6,
and gloo adds 3 ranks' values in its own order: the runs agree to rounding.
"""

from __future__ import annotations

import os
import re
import sys
import warnings
from pathlib import Path
from typing import Any

import optree
import pytest
import torch
import torch.distributed as dist

import freplicate as fr

sys.path.insert(0, str(Path(__file__).parent))  # the spawned ranks import the workers by name
import _dcp_workers as d
import _dist_workers as w

from freplicate._distributed._dcp import load_sharded, save_sharded

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")

ok = w.ok


def bitwise(actual: Any, expected: Any) -> None:
    fr.testing.assert_trees_close(actual, expected, rtol=0, atol=0)


def worst(actual: list[Any], expected: list[Any]) -> float:
    """The largest difference of a parameter, relative to its largest magnitude, over the steps."""
    out = 0.0
    for a, e in zip(actual, expected):
        for k in e:
            out = max(out, float((a[k] - e[k]).abs().max() / e[k].abs().max().clamp_min(1e-30)))
    return out


@pytest.fixture(scope="module")
def directory(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The checkpoints' directory, with what one process saves before the ranks start: a run of
    5 steps (``one``), and a module's state_dict saved by torch's own ``dcp.save`` (``torch``)."""
    import torch.distributed.checkpoint as dcp

    path = tmp_path_factory.mktemp("dcp")
    before = os.environ.get("FR_TEST_DCP")
    os.environ["FR_TEST_DCP"] = str(path)
    d.save_run("zero2", "one")
    with warnings.catch_warnings():  # that it saves in one process: it does
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(d.net().state_dict(), checkpoint_id=str(path / "torch"), no_dist=True)
    yield path
    if before is None:
        del os.environ["FR_TEST_DCP"]
    else:
        os.environ["FR_TEST_DCP"] = before


@pytest.fixture(scope="module")
def job(directory: Path) -> dict[str, list[Any]]:
    names = ["save_everything", "runs", "save_zero3", "save_params", "load_torch_saved", "mistakes"]
    return d.run(names, world=2, pg_timeout=30.0, deadline=240.0)


@pytest.fixture(scope="module")
def job3(job: dict[str, list[Any]]) -> dict[str, list[Any]]:
    return d.run(["load_everything_here", "resumed", "load_zero3"], world=3, deadline=240.0)


# --- every dtype and padding case -------------------------------------------------------------


def check_load(r: dict[str, Any], where: str) -> None:
    bitwise(r["got"], r["expected"])
    for a, e in zip(optree.tree_leaves(r["got"]), optree.tree_leaves(r["expected"])):
        if isinstance(e, torch.Tensor):
            assert a.shape == e.shape and a.dtype == e.dtype, where
    assert r["untied"], f"{where}: every path loads into a tensor of its own"
    assert r["fresh"] and r["no_grad"] and r["contiguous"] and r["target_is_meta"], where


def test_two_ranks_save_and_load_every_dtype_and_padding_case(job):
    for rank, r in enumerate(ok(job, "save_everything")):
        assert r["unchanged"], f"rank {rank}: save_sharded changed its input"
        check_load(r["loaded"], f"rank {rank} of 2")


def test_a_two_rank_checkpoint_loads_on_three_ranks(job3):
    for rank, r in enumerate(ok(job3, "load_everything_here")):
        check_load(r, f"rank {rank} of 3")


def test_a_two_rank_checkpoint_loads_in_one_process(job):
    ok(job, "save_everything")
    check_load(d.load_everything(), "one process")


def test_each_rank_writes_its_own_rows_and_a_whole_leaf_once(job):
    """The files: every rank's rows of a sharded leaf in that rank's own file; whole leaves once."""
    import torch.distributed.checkpoint as dcp

    ok(job, "save_everything")
    meta = dcp.FileSystemReader(d.where("everything")).read_metadata()
    files: dict[str, set[str]] = {}
    for index, info in meta.storage_data.items():
        files.setdefault(index.fqn, set()).add(info.relative_path)
    tensors = meta.state_dict_metadata
    # a leaf with rows on both ranks: two pieces, each in its rank's file
    for key in ("floats.odd", "floats.f64", "floats.transposed", "ints.i64", "state.params.w"):
        chunks = tensors[key].chunks
        size = tensors[key].size[0]
        assert [c.offsets[0] for c in chunks] == [0, -(-size // 2)], key
        assert sorted(f[:3] for f in files[key]) == ["__0", "__1"], (key, files[key])
    # whole on every rank (buffers, 0-dim, no rows): written once, whole
    for key in ("state.buffers.stats", "state.buffers.n", "floats.scalar", "floats.empty", "step"):
        assert len(files.get(key, {"?"})) == 1 or key == "floats.empty", (key, files.get(key))
        if key != "step":
            assert [tuple(c.sizes) for c in tensors[key].chunks] == [tuple(tensors[key].size)], key


# --- ZeRO-2 and ZeRO-1: resumed on 1, 2 and 3 ranks --------------------------------------


@pytest.mark.parametrize("kind", ["zero2", "zero1"])
def test_resumed_on_two_ranks_is_the_uninterrupted_run_bit_for_bit(job, kind):
    for r in ok(job, "runs"):
        run = r[kind]
        assert len(run["whole"]) == d.STOP
        bitwise(run["first"], run["whole"][: d.RESUME_AT])
        bitwise(run["here"]["loaded"], run["state"])  # 2 -> 2: what was saved
        bitwise(run["here"]["steps"], run["whole"][d.RESUME_AT :])


@pytest.mark.parametrize("kind", ["zero2", "zero1"])
def test_one_process_resumed_on_two_ranks_is_the_two_rank_run_bit_for_bit(job, kind):
    for r in ok(job, "runs"):
        run = r[kind]
        bitwise(run["from_one"]["loaded"], run["state"])  # 1 -> 2
        bitwise(run["from_one"]["steps"], run["whole"][d.RESUME_AT :])


@pytest.mark.parametrize("kind", ["zero2", "zero1"])
def test_two_ranks_resumed_in_one_process_is_the_same_run_bit_for_bit(job, kind):
    run = ok(job, "runs")[0][kind]
    here = d.resume(kind, kind)  # 2 -> 1, no process group
    bitwise(here["loaded"], run["state"])
    bitwise(here["steps"], run["whole"][d.RESUME_AT :])


@pytest.mark.parametrize("kind", ["zero2", "zero1"])
def test_two_ranks_resumed_on_three_load_bit_for_bit_and_train_on_to_rounding(job, job3, kind):
    run = ok(job, "runs")[0][kind]
    for r in ok(job3, "resumed"):
        bitwise(r[kind]["loaded"], run["state"])  # 2 -> 3: the checkpoint itself, exactly
        # each rank's mean over 4 rows, 3 ranks' sum in gloo's order: not the 2-rank bits
        assert 0 < worst(r[kind]["steps"], run["whole"][d.RESUME_AT :]) <= 1e-6


# --- a ZeRO-3 state, torch's own format --------------------------------------------------------


def test_a_zero3_state_keeps_buffers_whole_on_every_world_size(job, job3):
    for results in (ok(job, "save_zero3"), ok(job3, "load_zero3"), [d.load_zero3()]):
        for r in results:
            bitwise(r["got"], r["expected"])
            assert r["got"]["state"].buffers["1.running_mean"].shape == (16,)


def test_torch_dcp_load_reads_a_sharded_save_and_the_other_way(job):
    import torch.distributed.checkpoint as dcp

    ok(job, "save_params")
    model = d.net()
    into = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    with warnings.catch_warnings():  # that it loads in one process: it does
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(into, checkpoint_id=d.where("params"), no_dist=True)  # torch's own, one process
    bitwise(into, fr.state(model).params)
    for r in ok(job, "load_torch_saved"):  # torch's own save of one process, loaded as shards
        bitwise(r["got"], r["expected"])


# --- mistakes: on every rank, the same error ---------------------------------------------------

MISTAKES = {
    "whole_differs": r"save_sharded: the leaf 'b' is held whole .* differs between rank 0 and rank 1",
    "number_differs": r"save_sharded: the leaf 'step' is held whole \(or is not a tensor\) but differs",
    "rows_and_whole": r"save_sharded: rank 1 gives its rows of the leaf 'w', rank 0 the leaf whole",
    "shape_on_one": r"save_sharded: the leaf at \['w'\] has shape \(3, 2\) on rank 1 of 2, which is "
    r"neither like's \(4, 2\) nor this rank's rows of it \(2, 2\)",
    "keys_differ": r"save_sharded: the trees differ across ranks: rank 0 has a tensor of shape \(2,\) "
    r"and dtype torch.float32 under the key 'k0', rank 1 a tensor .* under the key 'k1'",
    "load_shape_on_one": r"load_sharded: the leaf at \['fc3.bias'\] has shape \(5,\) on rank 1 of 2, "
    r"which is neither the checkpoint's \(3,\) nor this rank's rows of it \(1,\)",
    "load_missing_on_one": r"load_sharded: the checkpoint has nothing under the key 'x'",
}


@pytest.mark.parametrize("case", sorted(MISTAKES))
def test_mistakes_raise_the_same_value_error_on_every_rank(job, case):
    results = ok(job, "mistakes")
    messages = set()
    for r in results:
        kind, name, message = r[case]
        assert (kind, name) == ("raised", "ValueError"), r[case]
        assert re.search(MISTAKES[case], message), message
        assert message.startswith("fr.distributed.")
        messages.add(message)
    assert len(messages) == 1, messages
    for r in results:  # nothing written, and the group still works
        assert not r["written"] and r["after"][0] == "ok", r


# --- one process ----------------------------------------------------------------------------


def test_one_process_round_trip_of_every_leaf(tmp_path):
    full = d.everything()
    snap = w.snapshot(full)
    save_sharded(tmp_path, full, full)
    assert w.unchanged(full, snap)
    target = d.on_meta(full)
    got = load_sharded(tmp_path, target)
    bitwise(got, full)
    assert got["floats"]["tied"][0] is not got["floats"]["tied"][1]  # each path its own tensor
    assert got["step"] == 11 and got["lr"] == 0.25 and got["floats"]["name"] == "w"
    # into real tensors: fresh ones, the targets untouched
    zeros = optree.tree_map(
        lambda x: torch.zeros_like(x) if isinstance(x, torch.Tensor) else x, full
    )
    snap = w.snapshot(zeros)
    again = load_sharded(tmp_path, zeros)
    bitwise(again, full)
    assert w.unchanged(zeros, snap)
    assert again["state"].params["w"] is not zeros["state"].params["w"]


def test_a_tie_in_the_layout_still_loads_each_path_from_its_own_key(tmp_path):
    # AdamW's moments made from one tree of zeros share their tensors; their values do not
    zeros = {"w": torch.zeros(3)}
    layout = {"step": 0, "exp_avg": zeros, "exp_avg_sq": dict(zeros)}
    saved = {
        "step": 4,
        "exp_avg": {"w": torch.tensor([-1.0, 0.0, 1.0])},
        "exp_avg_sq": {"w": torch.ones(3)},
    }
    save_sharded(tmp_path, saved, saved)
    bitwise(load_sharded(tmp_path, layout), saved)


def test_a_part_of_the_checkpoint_loads_alone_and_where_asked(tmp_path):
    full = d.everything()
    save_sharded(tmp_path, full, full)
    got = load_sharded(tmp_path, {"state": full["state"]})
    bitwise(got["state"], full["state"])
    got = load_sharded(
        tmp_path, {"floats": {"odd": torch.empty(5, 3, device="meta")}}, device="cpu"
    )
    bitwise(got["floats"]["odd"], full["floats"]["odd"])


def raises(kind: type[Exception], pattern: str, f: Any, *args: Any, **kwargs: Any) -> None:
    with pytest.raises(kind, match=pattern):
        f(*args, **kwargs)


def test_one_process_mistakes_say_where_and_what(tmp_path):
    t = {"w": torch.ones(4, 2), "step": 1}
    save_sharded(tmp_path, t, t)
    raises(
        ValueError,
        r"save_sharded: tree must have like's structure; trees differ at the root",
        save_sharded,
        tmp_path,
        t,
        {"w": t["w"]},
    )
    raises(
        ValueError,
        r"the leaf at \['w'\] has shape \(2, 2\) on rank 0 of 1, which is neither like's \(4, 2\)",
        save_sharded,
        tmp_path,
        {"w": torch.ones(2, 2)},
        {"w": torch.ones(4, 2)},
    )
    raises(
        ValueError,
        r"the leaf at \['w'\] has dtype torch.float64, like's torch.float32",
        save_sharded,
        tmp_path,
        {"w": torch.ones(2).double()},
        {"w": torch.ones(2)},
    )
    raises(
        ValueError,
        r"the leaf at \['w'\] is on the meta device",
        save_sharded,
        tmp_path,
        {"w": torch.ones(2, device="meta")},
        {"w": torch.ones(2)},
    )
    raises(
        ValueError,
        r"the leaf at \['w'\] is a tensor, but like holds an int \(3\) there",
        save_sharded,
        tmp_path,
        {"w": torch.ones(2)},
        {"w": 3},
    )
    raises(
        ValueError,
        r"the paths \['a.b'\] and \['a'\]\['b'\] both make the checkpoint key 'a.b'",
        save_sharded,
        tmp_path,
        {"a.b": 1, "a": {"b": 2}},
        {"a.b": 1, "a": {"b": 2}},
    )
    raises(
        ValueError,
        r"the leaf at \['f'\] \(a Fraction \(Fraction\(1, 3\)\)\) would not load back with torch.load\(weights_only=True\)",
        save_sharded,
        tmp_path,
        *[{"f": __import__("fractions").Fraction(1, 3)}] * 2,
    )
    raises(TypeError, r"save_sharded: path must be a directory's path", save_sharded, 3, t, t)
    raises(
        ValueError,
        r"load_sharded: the checkpoint has nothing under the key 'v', where the tree holds a tensor of shape \(2,\)",
        load_sharded,
        tmp_path,
        {"v": torch.ones(2)},
    )
    raises(
        ValueError,
        r"the checkpoint has a non-tensor value under the key 'step', where the tree holds a tensor",
        load_sharded,
        tmp_path,
        {"step": torch.ones(1)},
    )
    raises(
        ValueError,
        r"the checkpoint has a tensor under the key 'w', where the tree holds an int \(0\)",
        load_sharded,
        tmp_path,
        {"w": 0},
    )
    raises(
        ValueError,
        r"the leaf at \['w'\] has dtype torch.float16, the checkpoint's torch.float32",
        load_sharded,
        tmp_path,
        {"w": torch.ones(4, 2).half()},
    )
    raises(
        ValueError,
        r"the leaf at \['w'\] has shape \(4, 3\) on rank 0 of 1, which is neither the checkpoint's \(4, 2\)",
        load_sharded,
        tmp_path,
        {"w": torch.ones(4, 3)},
    )
    raises(
        FileNotFoundError,
        r"load_sharded: no checkpoint at .*nothing \(its .metadata file is missing\)",
        load_sharded,
        tmp_path / "nothing",
        t,
    )
    raises(
        TypeError,
        r"load_sharded: device must be a device spec",
        load_sharded,
        tmp_path,
        t,
        device=2.5,
    )
