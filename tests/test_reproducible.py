"""``grad_and_value(..., grain=)``: the same bits on 1, 2 and 4 gloo ranks (``_reproducible_workers``).

An MLP with dropout, trained a few AdamW steps on one global batch a step,
ends with bitwise-equal parameters and optimizer state on 1, 2 and 4 ranks
and in this process without a group; the default mode, on the same runs,
does not (its dropout draws by rank, and even without dropout its sum's
order follows the world size), which is what makes the equality a test.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import freplicate as fr
from freplicate._distributed._reproducible import grain_seed, tree_sum

sys.path.insert(0, str(Path(__file__).parent))  # the spawned ranks import the workers by name
import _dist_workers as w
import _reproducible_workers as rw

WORLDS = (1, 2, 4)


@pytest.fixture
def one_thread() -> Iterator[None]:
    """One thread, as each rank runs: the same kernels' reduction orders."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="module")
def jobs() -> dict[int, dict[str, list[Any]]]:
    names = [f"train_{m}" for m in rw.MODES]
    return {
        world: rw.spawn(
            [
                *names,
                "sent",
                "odd_sizes",
                "norms",
                "zero3_odd",
                *(["refusals", "subgroup"] if world == 4 else []),
            ],
            world=world,
            pg_timeout=30.0,
            deadline=120.0,
        )
        for world in WORLDS
    }


@pytest.fixture(scope="module")
def here() -> dict[str, Any]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return {mode: rw.train(mode) for mode in rw.MODES}
    finally:
        torch.set_num_threads(before)


def equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Parameters and optimizer state, to the bit."""
    trees = [(a["params"], b["params"]), *((a["state"][s], b["state"][s]) for s in ("m", "v"))]
    return all(torch.equal(x[k], y[k]) for x, y in trees for k in x)


# --- the equalities ----------------------------------------------------------------------------


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")
def test_training_ends_with_the_same_bits_on_1_2_and_4_ranks(jobs, here):
    for world in WORLDS:
        for rank, result in enumerate(w.ok(jobs[world], "train_grain")):
            assert equal(result, here["grain"]), f"grain=: rank {rank} of {world} differs"


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")
def test_zero2_ends_with_the_same_bits_on_1_2_and_4_ranks(jobs, here):
    # shard=True: each rank's rows of the same sum (halving alone), AdamW on the rows, gathered
    assert equal(here["zero2"], here["grain"])
    for world in WORLDS:
        for rank, result in enumerate(w.ok(jobs[world], "train_zero2")):
            assert equal(result, here["grain"]), f"grain=, shard=True: rank {rank} of {world}"


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")
def test_zero3_ends_with_the_same_bits_on_1_2_and_4_ranks(jobs, here):
    # the loss through apply_sharded: each unit's transpose sums the ranks' rows grain by grain
    # (the grains in bit-reversed order), AdamW on the shards; weighted and accumulated too.
    # Its bits are its own (its tree joins the ranks' grains first), near the replicated ones.
    for mode in ("zero3", "zero3_weighted"):
        for world in WORLDS:
            for rank, result in enumerate(w.ok(jobs[world], f"train_{mode}")):
                assert equal(result, here[mode]), f"{mode}: rank {rank} of {world} differs"
    assert not equal(here["zero3"], here["grain"])
    fr.testing.assert_trees_close(here["zero3"]["params"], here["grain"]["params"], rtol=1e-5, atol=1e-6)
    assert not equal(here["zero3_weighted"], here["zero3"])  # the weights change the run


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")
def test_zero3_rows_that_split_unevenly_a_whole_and_a_frozen_parameter(jobs, one_thread):
    # 5 rows on 4 ranks (2, 2, 1, 0), a 0-dim parameter held whole, a frozen bias never reduced
    expected = rw.odd_zero3()
    assert set(expected) == {"a.weight", "a.bias", "b.weight", "scale"}
    for world in WORLDS:
        for rank, got in enumerate(w.ok(jobs[world], "zero3_odd")):
            assert all(torch.equal(got[k], expected[k]) for k in expected), (world, rank)


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")
def test_a_checkpoint_written_on_4_ranks_resumes_on_2_and_on_1_with_the_same_bits(here, tmp_path):
    # ZeRO-2 rows and moments saved after step 2 of 4 on 4 ranks (save_sharded), loaded on 2
    # and on 1 (load_sharded reshards), the last 2 steps run there: one process's 4 steps
    path = str(tmp_path / "ckpt")
    with fr.testing.RankPool(4, timeout=30.0, deadline=90.0) as four:
        four.run(rw.resumed, path, 2)
    for world in (2, 1):
        with fr.testing.RankPool(world, timeout=30.0, deadline=90.0) as pool:
            for rank, result in enumerate(pool.run(rw.resumed, path, None)):
                assert equal(result, here["grain"]), f"resumed on {world} ranks: rank {rank}"


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")
def test_zero2_clipped_by_rows_ends_with_the_same_bits_on_1_2_and_4_ranks(jobs, here):
    # fr.distributed.clip_grad_norm(reproducible=True) on the rows: each row's contribution
    # gathered and combined in row order, so the total norm does not follow the world size.
    # (On this MLP the default way happens to agree as well: the norms test below is the one
    # that tells the two ways apart; this one holds the whole clipped loop to the bits.)
    assert not equal(here["zero2_clip"], here["zero2"])  # it clips
    for world in WORLDS:
        for rank, result in enumerate(w.ok(jobs[world], "train_zero2_clip")):
            assert equal(result, here["zero2_clip"]), f"clipped rows: rank {rank} of {world}"


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")
def test_the_clipping_norm_by_rows_is_the_same_bits_on_1_2_and_4_ranks(jobs, one_thread):
    here = rw.clip_norms()
    differ = 0
    for world in WORLDS:
        for rank, got in enumerate(w.ok(jobs[world], "norms")):
            assert all(map(torch.equal, got["reproducible"], here["reproducible"])), (world, rank)
            differ += not all(map(torch.equal, got["default"], here["default"]))
    assert differ, "the default way of summing the rows' parts should follow the world size"


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")
def test_weighted_and_accumulated_ends_with_the_same_bits_on_1_2_and_4_ranks(jobs, here):
    # weight= per grain and accumulate() over two unequal micro-batches a rank
    assert not equal(here["accumulate"], here["grain"])  # the weights change the run
    for world in WORLDS:
        for rank, result in enumerate(w.ok(jobs[world], "train_accumulate")):
            assert equal(result, here["accumulate"]), f"weight=, accumulate: rank {rank} of {world}"


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")
def test_the_default_mode_is_not_the_same_across_world_sizes(jobs, here):
    # the same runs without grain=: the test above would fail for it, with dropout (masks drawn
    # by rank) and without (only the order of the sum differs), yet it trains alike
    for mode in ("default", "eval"):
        assert equal(w.ok(jobs[1], f"train_{mode}")[0], here[mode])
        for world in (2, 4):
            assert not equal(w.ok(jobs[world], f"train_{mode}")[0], here[mode]), (mode, world)
    for world in (2, 4):
        got = w.ok(jobs[world], "train_eval")[0]["params"]
        fr.testing.assert_trees_close(got, here["eval"]["params"], rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")
def test_uneven_halves_two_dtypes_and_a_group_of_two(jobs, one_thread):
    # a 0-dim leaf, float32 and float64 buffers of 9 and 5 elements: halves of 4 and 5, 2 and 3
    # shard=True: this rank's rows of the same (fr.distributed.shard's, a late rank's empty)
    expected = rw.odd_grads()
    for world in WORLDS:
        for rank, both in enumerate(w.ok(jobs[world], "odd_sizes")):
            got = both["all"]
            assert all(torch.equal(got[k], expected[k]) for k in expected), (world, rank)
            assert all(got[k].dtype == expected[k].dtype for k in expected)
            rows = both["rows"]
            for k, t in expected.items():
                c = -(-t.shape[0] // world) if t.dim() else None
                want = t if c is None else t[rank * c : (rank + 1) * c]
                assert rows[k].shape == want.shape and torch.equal(rows[k], want), (world, rank, k)
    in_pair = w.ok(jobs[4], "subgroup")
    assert in_pair[0] is None and in_pair[2] is None
    for got in (in_pair[1], in_pair[3]):  # group= of ranks 3 and 1: the same bits again
        assert all(torch.equal(got[k], expected[k]) for k in expected)


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")
def test_each_rank_sends_what_a_ring_all_reduce_sends(jobs):
    # recursive halving then doubling: 2 n (W - 1) / W bytes of an n-byte gradient (ratio 1.00)
    # shard=True: recursive halving alone, n (W - 1) / W, a ring reduce-scatter's; ZeRO-3 too
    for world in WORLDS:
        for result in w.ok(jobs[world], "sent"):
            assert result["sent"] <= 1.05 * result["ring"], (world, result)
            assert result["sent"] == result["ring"], (world, result)
            assert result["sent_shard"] == result["ring_shard"], (world, result)
            # ZeRO-3: each grain's rows, one all-to-all a unit (one grain here)
            assert result["sent_zero3"] == result["ring_shard"], (world, result)


# --- what is refused, on every rank -------------------------------------------------------------


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")
def test_refusals_on_four_ranks(jobs):
    results = w.ok(jobs[4], "refusals")
    for rank, got in enumerate(results):
        if rank < 3:  # a group of three ranks: no fixed partners
            assert got["three_ranks"][:2] == ("raised", "ValueError")
            assert "world size that is a power of two" in got["three_ranks"][2]
            assert "got 3 ranks" in got["three_ranks"][2]
        assert got["uneven"][:2] == ("raised", "ValueError")
        assert "different numbers of grains (2 to 4)" in got["uneven"][2]
        assert got["unsynced"][:2] == ("raised", "ValueError")
        assert "parameters differ across ranks" in got["unsynced"][2]
        if rank == 1:  # its own error; the others hear of it in the same step
            assert got["failing"] == ("raised", "KeyError", '"rank 1\'s loss"')
        else:
            assert got["failing"] == (
                "raised",
                "RuntimeError",
                "fr.distributed.grad_and_value: rank 1 raised in its grains (see its error)",
            )
        # accumulate: rank 1 draws 1 micro-batch of count=2, and says so in the call (no timeout)
        _own_or_heard(got["short"], rank, "yielded 1 micro-batch(es), count=2")
        # ZeRO-3: a differentiated tensor outside the shards (its gradient this rank's alone)
        assert got["zero3_outside"][:2] == ("raised", "ValueError")
        assert "the one at ['extra'] is used outside them" in got["zero3_outside"][2]
        assert got["zero3_twice"][:2] == ("raised", "ValueError")
        assert "was gathered for two uses in one grain" in got["zero3_twice"][2]
        # rank 1's batch does not cut into grains: heard before any grain gathers (no timeout)
        _own_or_heard(got["zero3_bad_batch"], rank, "does not divide this rank's batch of 6")
        assert got["zero3_shard"][:2] == ("raised", "ValueError")
        assert "leave out shard=True" in got["zero3_shard"][2]
        assert got["after"][0] == "returned"  # the group goes on after every refusal
        fr.testing.assert_trees_close(got["after"][1], results[0]["after"][1], rtol=0, atol=0)


def _own_or_heard(got: Any, rank: int, own: str) -> None:
    """Rank 1 raised its own ``ValueError`` (saying ``own``); every other rank heard of it."""
    if rank == 1:
        assert got[:2] == ("raised", "ValueError") and own in got[2], got
    else:
        assert got[:2] == ("raised", "RuntimeError"), got
        assert "rank 1 raised in its grains" in got[2], got


# --- one process: the tree, the draws, the options ---------------------------------------------


def _mlp() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 12), nn.ReLU(), nn.Dropout(0.3), nn.Linear(12, 3))
    return net, {k: v.detach().clone() for k, v in fr.state(net).params.items()}


def test_the_gradient_is_the_tree_of_the_grains_gradients(one_thread):
    net, params = _mlp()

    def loss_fn(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(fr.apply(net, fr.State(p, {}), x)[0], y)

    x, y = torch.randn(16, 6), torch.randint(0, 3, (16,))
    x_before, p_versions = x.clone(), [t._version for t in params.values()]
    rng = torch.get_rng_state()
    step = fr.distributed.grad_and_value(loss_fn, grain=2, seed=5)
    step.grains.step = 3  # type: ignore[union-attr]
    grads, loss = step(params, x, y)
    assert torch.equal(torch.get_rng_state(), rng)  # the caller's generator as it was
    # the oracle: each grain alone, its draws keyed by (seed, step, position), the tree, / 8
    parts = []
    for p in range(8):
        torch.manual_seed(grain_seed(5, 3, p))
        g, v = torch.func.grad_and_value(loss_fn)(
            params, x[2 * p : 2 * p + 2], y[2 * p : 2 * p + 2]
        )
        parts.append([*g.values(), v])
    *expected, total = tree_sum(parts)
    assert all(torch.equal(a, e / 8) for a, e in zip(grads.values(), expected))
    assert torch.equal(loss, total / 8)
    assert torch.equal(x, x_before) and [t._version for t in params.values()] == p_versions
    assert step.grains.step == 4  # type: ignore[union-attr]
    again, _ = step(params, x, y)  # the next step draws other masks
    assert not all(torch.equal(a, b) for a, b in zip(again.values(), grads.values()))
    net.eval()  # without dropout: the full batch's gradient, summed in another order
    plain, _ = fr.grad_and_value(loss_fn)(params, x, y)
    fr.testing.assert_trees_close(step(params, x, y)[0], plain, rtol=1e-5, atol=1e-6)


def test_accumulate_is_one_call_on_the_micro_batches_rows_and_weights_scale_each_grain(one_thread):
    net, params = _mlp()

    def loss_fn(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(fr.apply(net, fr.State(p, {}), x)[0], y)

    x, y = torch.randn(16, 6), torch.randint(0, 3, (16,))
    whole, _ = fr.distributed.grad_and_value(loss_fn, grain=2, seed=1)(params, x, y)
    step = fr.distributed.grad_and_value(loss_fn, grain=2, seed=1)
    # 2 + 6 grains: neither a power of two, their block of 8 is
    acc, values = step.accumulate(params, iter([(x[:4], y[:4]), (x[4:], y[4:])]), count=2)
    assert all(torch.equal(acc[k], whole[k]) for k in whole)
    assert len(values) == 2 and all(v.dim() == 0 for v in values)

    # weight=: each grain's gradient times its weight, the tree, over the weights' sum
    def weight(p: Any, x: Any, y: torch.Tensor) -> float:
        return float((y == 0).sum())

    got, _ = fr.distributed.grad_and_value(loss_fn, grain=2, seed=1, weight=weight)(params, x, y)
    parts = []
    for p in range(8):
        torch.manual_seed(grain_seed(1, 0, p))
        rows = slice(2 * p, 2 * p + 2)
        g, _ = torch.func.grad_and_value(loss_fn)(params, x[rows], y[rows])
        wp = weight(params, None, y[rows])
        parts.append([*(t * wp for t in g.values()), torch.tensor(wp, dtype=torch.float64)])
    *expected, total = tree_sum(parts)
    assert float(total) > 0
    assert all(torch.equal(a, e / float(total)) for a, e in zip(got.values(), expected))
    none = fr.distributed.grad_and_value(loss_fn, grain=2, weight=lambda p, x, y: 0.0)
    assert all(not g.any() for g in none(params, x, y)[0].values())  # every weight 0: zeros
    with pytest.raises(ValueError, match=r"weight\(\*grain\) must be a finite number >= 0"):
        fr.distributed.grad_and_value(loss_fn, grain=2, weight=lambda p, x, y: -1.0)(params, x, y)
    with pytest.raises(ValueError, match=r"needs at least one micro-batch"):
        step.accumulate(params, [])
    # no input written: the parameters, the batch (shard=True's rows are copied out of its own
    # buffer, the weighted sums divided in theirs)
    versions = [t._version for t in (*params.values(), x, y)]
    before = {k: t.clone() for k, t in params.items()}
    for options in ({"shard": True}, {"shard": True, "weight": weight}, {"weight": weight}):
        step = fr.distributed.grad_and_value(loss_fn, grain=2, **options)
        step(params, x, y)
        step.accumulate(params, [(x[:4], y[:4]), (x[4:], y[4:])])
    assert [t._version for t in (*params.values(), x, y)] == versions
    assert all(torch.equal(params[k], before[k]) for k in params)


def test_batchnorm_normalises_each_grain_alone(one_thread):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 1))
    state = fr.state(net)

    def loss_fn(p: dict[str, torch.Tensor], x: torch.Tensor) -> tuple[torch.Tensor, Any]:
        out, new = fr.apply(net, fr.State(p, state.buffers), x)
        return out.square().mean(), new.buffers["1.running_mean"]

    x = torch.randn(8, 4)
    grads, (_, means) = fr.distributed.grad_and_value(loss_fn, grain=4, has_aux=True)(
        state.params, x
    )
    (first, _), (second, _) = (
        fr.grad_and_value(loss_fn, has_aux=True)(state.params, x[i : i + 4]) for i in (0, 4)
    )
    assert all(torch.equal(grads[k], (first[k] + second[k]) / 2) for k in grads)
    assert len(means) == 2 and not torch.equal(means[0], means[1])  # each grain's statistics


def _loss(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    return (p["w"] * x).sum()


def _policy() -> Any:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.bfloat16)


@pytest.mark.parametrize(
    ("name", "value", "shown"),
    [
        ("compress", lambda: "bf16", "compress='bf16'"),
        ("mp_policy", _policy, "mp_policy=MixedPrecisionPolicy"),
    ],
)
def test_options_the_mode_does_not_take_are_refused(name, value, shown):
    with pytest.raises(NotImplementedError, match=rf"does not take {shown} yet"):
        fr.distributed.grad_and_value(_loss, grain=2, **{name: value()})


def test_calls_the_mode_does_not_take_are_refused():
    p, x = {"w": torch.ones(3)}, torch.ones(4, 3)
    step = fr.distributed.grad_and_value(_loss, grain=2)
    with pytest.raises(NotImplementedError, match=r"has no skip\(\) yet"):
        step.skip(p)
    with pytest.raises(NotImplementedError, match="runs eagerly only"):
        torch.func.grad(lambda q: step(q, x)[1])(p)
    with pytest.raises(NotImplementedError, match="runs eagerly only"):
        step({"w": torch.ones(3, requires_grad=True)}, x)


@pytest.mark.parametrize(
    ("kwargs", "rows", "error", "message"),
    [
        ({"grain": 0}, 4, ValueError, r"grain must be a number of samples >= 1, got grain=0"),
        ({"grain": 2.0}, 4, TypeError, r"grain must be an int, got 2.0"),
        ({"grain": 2, "seed": "a"}, 4, TypeError, r"seed must be an int"),
        ({"grain": 3}, 4, ValueError, r"grain=3 does not divide this rank's batch of 4 samples"),
        (
            {"grain": 2},
            6,
            ValueError,
            r"grain=2 cuts this rank's batch into 3 grains; the grains per rank must be a power of two",
        ),
    ],
)
def test_bad_grains_are_refused_naming_the_argument(kwargs, rows, error, message):
    with pytest.raises(error, match=message):
        fr.distributed.grad_and_value(_loss, **kwargs)({"w": torch.ones(3)}, torch.ones(rows, 3))


def test_every_batch_tensor_must_have_the_same_rows():
    step = fr.distributed.grad_and_value(lambda p, x, *, y: _loss(p, x) + y.sum(), grain=2)
    with pytest.raises(ValueError, match=r"must be alike: rows args\[1\]: 4, kwargs\['y'\]: 2"):
        step({"w": torch.ones(3)}, torch.ones(4, 3), y=torch.ones(2))


def test_gradients_that_autograd_shares_or_expands_are_only_read():
    # (a + b).sum(): both gradients may be one expanded tensor of ones; the sums above the
    # grains' own level go into tensors the tree made, never into those
    p = {"a": torch.zeros(3), "b": torch.zeros(3), "c": torch.zeros(())}
    step = fr.distributed.grad_and_value(
        lambda p, x: (p["a"] + p["b"]).sum() + (p["c"] * x).sum(), grain=1, op="sum"
    )
    grads, _ = step(p, torch.arange(8.0))
    assert torch.equal(grads["a"], torch.full((3,), 8.0)) and torch.equal(grads["b"], grads["a"])
    assert torch.equal(grads["c"], torch.tensor(28.0))


def test_a_channels_last_gradient_stays_channels_last():
    # the summed gradients come back in their leaves' memory order, as fr.grad_and_value's
    torch.manual_seed(0)
    w = {"w": torch.randn(4, 3, 3, 3).to(memory_format=torch.channels_last), "b": torch.zeros(4)}
    x = torch.randn(4, 3, 5, 5).to(memory_format=torch.channels_last)

    def loss_fn(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return F.conv2d(x, p["w"], p["b"]).square().mean()

    grads, _ = fr.distributed.grad_and_value(loss_fn, grain=2)(w, x)
    plain, _ = fr.grad_and_value(loss_fn)(w, x)
    assert plain["w"].is_contiguous(memory_format=torch.channels_last)
    assert grads["w"].stride() == plain["w"].stride()
    torch.testing.assert_close(grads["w"], plain["w"])


def test_zero3_under_grain_refuses_mixed_precision():
    net = nn.Linear(4, 2)
    shards = fr.distributed.shard(fr.state(net).params)

    def loss_fn(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        out, _ = fr.distributed.apply_sharded(net, fr.State(p, {}), x, mp_policy=_policy())
        return out.float().sum()

    step = fr.distributed.grad_and_value(loss_fn, grain=2)
    with pytest.raises(NotImplementedError, match="apply_sharded takes neither mp_policy"):
        step(shards, torch.randn(4, 4))
