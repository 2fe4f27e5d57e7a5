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
    first = g.run(straight + stopped)
    resumed = g.run([f"--resume {checkpoint(directory, p)}" for p in PATHS])
    return {
        **first,
        **{f"resumed {p}": resumed[f"--resume {checkpoint(directory, p)}"] for p in PATHS},
        **{f"stopped {p}": first[name] for p, name in zip(PATHS, stopped)},
        "directory": [directory],
    }


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
        assert (first["first"], len(first["loss"])) == (0, STOP)
        assert (rest["first"], len(rest["loss"])) == (STOP, 5 - STOP)
        assert first["loss"] + rest["loss"] == whole["loss"]
        assert first["eval"] + rest["eval"] == whole["eval"]
        assert rest["norm"] == whole["norm"][STOP:]
        assert rest["sample"] == whole["sample"]
        assert all(torch.equal(rest["params"][k], p) for k, p in whole["params"].items())


def test_a_checkpoint_loads_with_weights_only_and_holds_the_tied_weight_once(
    runs: dict[str, list[Any]],
) -> None:
    for path in PATHS:
        saved = torch.load(checkpoint(runs["directory"][0], path))  # weights_only=True
        assert saved["step"] == STOP and len(saved["rng"]) == 2
        assert "tok.weight" in saved["params"] and "head.weight" not in saved["params"]
