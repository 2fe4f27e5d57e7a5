"""The GPT example (examples/gpt_train.py) trains like its own ``--ddp`` switch, and resumes.

Every run is the example's loop at a tiny size (``_gpt_workers.TINY``: about
1,200 parameters, 5 steps of 3 micro-batches) on 2 gloo ranks that the
spawner starts (never torchrun). One job runs every command line once; a
second job, in fresh processes, resumes from the checkpoints the first wrote.

- ``--optimizer exact`` (an AdamW with torch.optim.AdamW's arithmetic) against
  ``--ddp`` (DDP, torch.optim.AdamW, clip_grad_norm_, no_sync): every loss,
  gradient norm, evaluation, sampled character and final parameter equal, to
  the bit, without dropout, with dropout (masks drawn while accumulating:
  the order of draws must be DDP's), and with bf16 autocast.
- The default ``torchopt.adamw`` against ``--ddp``: close, not equal (its
  arithmetic is another); the bound is what was measured, with room.
- Trained 5 steps straight, or 2 steps, checkpointed, and resumed for 3 in
  fresh processes: the same, to the bit, on each optimizer path.
- ``--zero 1|2|3`` (``--optimizer exact``, dropout, 3 micro-batches a step)
  against ``--ddp`` over 20 steps: ZeRO-1 bit for bit; ZeRO-2 bit for bit but
  its reported gradient norm, put together from the ranks' rows (within
  1e-6 relative of ``clip_grad_norm_``'s, measured 1.2e-07); ZeRO-3 within
  1e-6 relative (each micro-batch's gradient is reduce-scattered on its own,
  where DDP under ``no_sync`` sums the micro-batches first: the same sum in
  another order), and bit for bit with one micro-batch a step. Each ``--zero``
  stopped after 10 steps, checkpointed as a directory of every rank's rows
  (``fr.distributed.save_sharded``) and resumed in fresh processes: the
  straight run, to the bit.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))  # the spawned ranks import the helpers by name
import _gpt_workers as g
from _dist_workers import ok

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")

EXACT = "--optimizer exact"
CASES = {
    "no dropout": "--dropout 0",
    "dropout": "--dropout 0.1",
    "bf16 autocast": "--dropout 0.1 --amp bf16",
}
HAS_TORCHOPT = importlib.util.find_spec("torchopt") is not None
PATHS = {"exact": EXACT, "torchopt": "--optimizer torchopt", "ddp": "--ddp"}
if not HAS_TORCHOPT:
    del PATHS["torchopt"]
needs_torchopt = pytest.mark.skipif(
    not HAS_TORCHOPT, reason="torchopt is the optional extra freplicate[optim]"
)
STOP = 2  # the resumed runs stop after 2 of the 5 steps

# --zero against --ddp: 20 steps, dropout on, 3 micro-batches a step (TINY's), and 1
LONG = "--steps 20 --dropout 0.1"
ZERO = {stage: f"{EXACT} --zero {stage} {LONG}" for stage in (1, 2, 3)}
ZERO_DDP = f"--ddp {LONG}"
ZERO_3_ALONE = f"{EXACT} --zero 3 {LONG} --accumulate 1"  # one micro-batch a step
ZERO_DDP_ALONE = f"--ddp {LONG} --accumulate 1"
ZERO_STOP = 10
# the runs resumed from a ZeRO checkpoint, by name
ZERO_RESUMED = {
    "zero 1": ZERO[1],
    "zero 2": ZERO[2],
    "zero 3": ZERO[3],
    "zero 3 torchopt": f"--optimizer torchopt --zero 3 {LONG}",
}
if not HAS_TORCHOPT:
    del ZERO_RESUMED["zero 3 torchopt"]
# measured after 20 steps: the sharded norm 1.2e-07 (ZeRO-2), 1.8e-07 (ZeRO-3, one micro-batch)
# and 2.0e-07 (ZeRO-3, three) from clip_grad_norm_'s, relative; ZeRO-3 accumulating 3
# micro-batches: 3.3e-07 of a parameter's largest magnitude, 1.5e-07 relative in a loss, 7.7e-08
# in an evaluation. The bound, with room:
ZERO_RTOL = 1e-6
WIDTH = 8  # TINY's --n-embd: the key bias is qkv.bias[WIDTH : 2 * WIDTH]

# torchopt's AdamW against torch.optim.AdamW at TINY after 5 steps, dropout on or off: measured
# at most 4.3e-07 apart in a parameter and 7.4e-08 relative in a loss (bf16 autocast: 3.3e-05)
TORCHOPT_ATOL = 2e-6
TORCHOPT_RTOL = 1e-6


def checkpoint(directory: Path, path: str) -> Path:
    return directory / f"{path}.pt"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Any]]:
    directory = tmp_path_factory.mktemp("gpt")
    straight = [f"{side} {case}" for case in CASES.values() for side in (EXACT, "--ddp")]
    if HAS_TORCHOPT:
        straight += [f"--optimizer torchopt {CASES[c]}" for c in ("no dropout", "dropout")]
    stopped = [
        f"{opts} {CASES['dropout']} --stop-after {STOP} --checkpoint {checkpoint(directory, p)}"
        for p, opts in PATHS.items()
    ]
    zero = [ZERO_DDP, *ZERO.values(), ZERO_3_ALONE, ZERO_DDP_ALONE]
    zero += [opts for name, opts in ZERO_RESUMED.items() if "torchopt" in name]
    zero_stopped = {
        name: f"{opts} --stop-after {ZERO_STOP} --checkpoint {zero_checkpoint(directory, name)}"
        for name, opts in ZERO_RESUMED.items()
    }
    zero_resumed = {name: f"--resume {zero_checkpoint(directory, name)}" for name in ZERO_RESUMED}
    first = g.run(straight + stopped + zero + list(zero_stopped.values()))
    resumed = g.run(
        [f"--resume {checkpoint(directory, p)}" for p in PATHS] + list(zero_resumed.values())
    )
    return {
        **first,
        **{f"resumed {p}": resumed[f"--resume {checkpoint(directory, p)}"] for p in PATHS},
        **{f"stopped {p}": first[name] for p, name in zip(PATHS, stopped)},
        **{f"resumed {n}": resumed[name] for n, name in zero_resumed.items()},
        **{f"stopped {n}": first[name] for n, name in zero_stopped.items()},
        "directory": [directory],
    }


def zero_checkpoint(directory: Path, name: str) -> Path:
    return directory / name.replace(" ", "-")


def both(runs: dict[str, list[Any]], name: str) -> list[dict[str, Any]]:
    return ok(runs, name)


def assert_same_run(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["loss"] == b["loss"]
    assert a["norm"] == b["norm"]
    assert a["eval"] == b["eval"]
    assert a["sample"] == b["sample"]
    assert list(a["params"]) == list(b["params"])
    differing = [k for k in a["params"] if not torch.equal(a["params"][k], b["params"][k])]
    assert not differing, f"parameters differ: {differing}"


@pytest.mark.parametrize("case", CASES)
def test_the_exact_optimizer_trains_bit_for_bit_like_ddp(
    runs: dict[str, list[Any]], case: str
) -> None:
    fr_ranks = both(runs, f"{EXACT} {CASES[case]}")
    ddp_ranks = both(runs, f"--ddp {CASES[case]}")
    for fr_run, ddp_run in zip(fr_ranks, ddp_ranks):
        assert len(fr_run["loss"]) == 5
        assert_same_run(fr_run, ddp_run)


def test_the_comparison_can_fail(runs: dict[str, list[Any]]) -> None:
    # each rank has its own data, dropout changes the numbers, the parameters move,
    # and every rank ends with the same parameters
    plain = both(runs, f"{EXACT} {CASES['no dropout']}")
    dropped = both(runs, f"{EXACT} {CASES['dropout']}")
    assert plain[0]["loss"] != plain[1]["loss"]
    assert plain[0]["loss"] != dropped[0]["loss"]
    assert plain[0]["loss"][-1] < plain[0]["loss"][0]
    for name in (f"{EXACT} {CASES['dropout']}", f"--ddp {CASES['dropout']}"):
        rank0, rank1 = both(runs, name)
        assert all(torch.equal(rank0["params"][k], rank1["params"][k]) for k in rank0["params"])


@needs_torchopt
@pytest.mark.parametrize("case", ["no dropout", "dropout"])
def test_torchopt_is_close_to_ddp_not_equal(runs: dict[str, list[Any]], case: str) -> None:
    opt_ranks = both(runs, f"--optimizer torchopt {CASES[case]}")
    ddp_ranks = both(runs, f"--ddp {CASES[case]}")
    for opt_run, ddp_run in zip(opt_ranks, ddp_ranks):
        for k, p in ddp_run["params"].items():
            torch.testing.assert_close(opt_run["params"][k], p, rtol=0, atol=TORCHOPT_ATOL)
        torch.testing.assert_close(
            torch.tensor(opt_run["loss"], dtype=torch.float64),
            torch.tensor(ddp_run["loss"], dtype=torch.float64),
            rtol=TORCHOPT_RTOL,
            atol=0,
        )
    assert any(
        not torch.equal(opt_ranks[0]["params"][k], p) for k, p in ddp_ranks[0]["params"].items()
    ), "torchopt's AdamW equals torch's to the bit: the exact path is no longer needed"


@pytest.mark.parametrize("path", PATHS)
def test_a_resumed_run_is_the_straight_run(runs: dict[str, list[Any]], path: str) -> None:
    straight = both(runs, f"{PATHS[path]} {CASES['dropout']}")
    stopped = both(runs, f"stopped {path}")
    resumed = both(runs, f"resumed {path}")
    for whole, first, rest in zip(straight, stopped, resumed):
        assert_resumed(whole, first, rest, STOP, 5)


def assert_resumed(
    whole: dict[str, Any], first: dict[str, Any], rest: dict[str, Any], stop: int, steps: int
) -> None:
    """``first`` (stopped after ``stop`` steps) then ``rest`` (resumed) make ``whole``, to the bit."""
    assert (first["first"], len(first["loss"])) == (0, stop)
    assert (rest["first"], len(rest["loss"])) == (stop, steps - stop)
    assert first["loss"] + rest["loss"] == whole["loss"]
    assert first["eval"] + rest["eval"] == whole["eval"]
    assert rest["norm"] == whole["norm"][stop:]
    assert rest["sample"] == whole["sample"]
    assert all(torch.equal(rest["params"][k], p) for k, p in whole["params"].items())


def test_a_checkpoint_loads_with_weights_only_and_holds_the_tied_weight_once(
    runs: dict[str, list[Any]],
) -> None:
    for path in PATHS:
        saved = torch.load(checkpoint(runs["directory"][0], path))  # weights_only=True
        assert saved["step"] == STOP and len(saved["rng"]) == 2
        assert "tok.weight" in saved["params"] and "head.weight" not in saved["params"]


# --- --zero 1|2|3 -------------------------------------------------------------------------------


def relative(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest difference of a parameter, relative to the reference's largest magnitude."""
    return max(float((a[k] - b[k]).abs().max() / b[k].abs().max()) for k in b)


def signal(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The parameters without the key bias: a constant added to every key leaves the softmax
    as it was, so its gradient is rounding noise, which AdamW scales to steps of about lr: where
    the gradient is summed in another order (ZeRO-3's accumulation) it moves elsewhere (5.4e-05
    of qkv.bias's largest magnitude after 20 steps, measured)."""
    out = dict(params)
    for k, p in params.items():
        if k.endswith("attn.qkv.bias"):
            out[k] = torch.cat([p[:WIDTH], p[2 * WIDTH :]])
    return out


def rtol(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_1_and_2_train_bit_for_bit_like_ddp(runs: dict[str, list[Any]], stage: int) -> None:
    for zero_run, ddp_run in zip(both(runs, ZERO[stage]), both(runs, ZERO_DDP)):
        assert len(zero_run["loss"]) == 20
        if stage == 1:  # the full gradient clipped by fr.clip_grad_norm: clip_grad_norm_'s bits
            assert_same_run(zero_run, ddp_run)
            continue
        # ZeRO-2's norm is put together from the ranks' rows: within rounding of torch's; it
        # stays under --clip here, so nothing is scaled and the rest is DDP's to the bit
        assert rtol(zero_run["norm"], ddp_run["norm"]) <= ZERO_RTOL
        assert_same_run({**zero_run, "norm": ddp_run["norm"]}, ddp_run)


def test_zero_3_with_one_micro_batch_trains_bit_for_bit_like_ddp(
    runs: dict[str, list[Any]],
) -> None:
    for zero_run, ddp_run in zip(both(runs, ZERO_3_ALONE), both(runs, ZERO_DDP_ALONE)):
        assert len(zero_run["loss"]) == 20
        assert rtol(zero_run["norm"], ddp_run["norm"]) <= ZERO_RTOL
        assert_same_run({**zero_run, "norm": ddp_run["norm"]}, ddp_run)


def assert_close_run(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert list(a["params"]) == list(b["params"])
    worst = relative(signal(a["params"]), signal(b["params"]))
    assert worst <= ZERO_RTOL, worst
    assert rtol(a["loss"], b["loss"]) <= ZERO_RTOL
    assert rtol(a["norm"], b["norm"]) <= ZERO_RTOL
    evals = [v for e in a["eval"] for v in e[1:]], [v for e in b["eval"] for v in e[1:]]
    assert rtol(*evals) <= ZERO_RTOL


def test_zero_3_trains_like_ddp_to_rounding(runs: dict[str, list[Any]]) -> None:
    for zero_run, ddp_run in zip(both(runs, ZERO[3]), both(runs, ZERO_DDP)):
        assert len(zero_run["loss"]) == 20
        assert_close_run(zero_run, ddp_run)
        assert relative(zero_run["params"], ddp_run["params"]) > 0, "bit for bit: say so"


@pytest.mark.parametrize("name", list(ZERO_RESUMED))
def test_a_resumed_zero_run_is_the_straight_run(runs: dict[str, list[Any]], name: str) -> None:
    straight_name = ZERO_RESUMED[name]
    for whole, first, rest in zip(
        both(runs, straight_name), both(runs, f"stopped {name}"), both(runs, f"resumed {name}")
    ):
        assert_resumed(whole, first, rest, ZERO_STOP, 20)


def test_a_zero_checkpoint_is_a_directory_of_every_ranks_rows(runs: dict[str, list[Any]]) -> None:
    for name in ZERO_RESUMED:
        saved = zero_checkpoint(runs["directory"][0], name)
        meta = torch.load(saved / "meta.pt")  # weights_only=True
        assert meta["step"] == ZERO_STOP and len(meta["rng"]) == 2
        assert meta["config"]["zero"] in (1, 2, 3)
        assert (saved / "state" / ".metadata").exists()
        assert sorted(p.name for p in (saved / "state").glob("*.distcp")) == [
            "__0_0.distcp",
            "__1_0.distcp",
        ]
