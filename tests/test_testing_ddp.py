"""``fr.testing.RankPool`` and ``fr.testing.check_against_ddp``: they run, fail right, never hang.

One pool of 2 ranks serves the module, failures included: a run that
raised, killed or timed out leaves it usable for the next (a fresh group, or
new ranks). The failures that replace the ranks run on a pool of one rank
(``solo``), which starts again faster. The rank side is
``_testing_workers.py``.
"""

from __future__ import annotations

import re
import sys
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import freplicate as fr

sys.path.insert(0, str(Path(__file__).parent))  # the ranks import the rank side by name
import _testing_workers as w
from _eval_workers import ConvNet

from freplicate.testing import RankPool, check_against_ddp

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")


@pytest.fixture
def pool(rank_pool: RankPool) -> RankPool:
    return rank_pool  # the session's 2 ranks (conftest.py)


@pytest.fixture(scope="module")
def solo() -> Iterator[RankPool]:
    with RankPool(1, timeout=30.0, deadline=120.0) as rank:
        yield rank


def _usable(pool: RankPool) -> None:
    """The ranks answer, and their group reduces."""
    world = pool.world_size
    assert pool.run(dist.get_rank) == list(range(world))
    total = pool.run(fr.distributed.all_reduce, torch.ones(2), op="sum")
    assert [t.tolist() for t in total] == [[float(world)] * 2] * world


# --------------------------------------------------------------------------- RankPool


def test_run_gives_every_ranks_result_as_the_docstring_shows(pool: RankPool):
    assert pool.run(torch.distributed.get_rank) == [0, 1]
    x = torch.tensor([1.0, 2.0])
    got = pool.run(fr.distributed.all_reduce, x, op="sum")
    assert [t.tolist() for t in got] == [[2.0, 4.0], [2.0, 4.0]]
    assert got[0] is not got[1]


def test_the_ranks_work_on_copies(pool: RankPool):
    x = torch.zeros(3)
    got = pool.run(w.add_in_place, x)
    assert x._version == 0 and x.tolist() == [0.0, 0.0, 0.0]
    assert [t.tolist() for t in got] == [[1.0, 1.0, 1.0]] * 2


@pytest.mark.parametrize("error", [AssertionError, KeyError, ValueError])
def test_a_rank_that_raises_raises_its_own_type_naming_the_rank(pool: RankPool, error: type):
    with pytest.raises(
        error, match=r"fr\.testing\.RankPool\.run: rank 1 raised \w+ running raise_on: "
    ) as info:
        pool.run(w.raise_on, 1, error)
    cause = str(info.value.__cause__)
    assert cause.startswith("the traceback on rank 1:") and "in raise_on" in cause
    assert "drawn to fail" in cause
    _usable(pool)  # the same ranks, in a fresh group


def test_the_lowest_failing_rank_is_named(pool: RankPool):
    with pytest.raises(RuntimeError, match=r"rank 0 raised RuntimeError"):
        pool.run(w.raise_on, 0, RuntimeError)


def test_a_rank_that_raises_while_the_others_wait_does_not_hang_the_pool(pool: RankPool):
    pool.run(w.pid)  # started: the time below is the run's alone
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"rank 0 raised ValueError .*left before the barrier"):
        pool.run(w.raise_while_the_others_wait, 0)
    assert time.monotonic() - start < 20.0, "waited for the group's timeout (30 s)"
    _usable(pool)  # new ranks: the one in the barrier was stopped


def test_a_rank_that_dies_raises_and_new_ranks_start(solo: RankPool):
    before = solo.run(w.pid)
    with pytest.raises(RuntimeError, match=r"rank 0 \(exit code 3\) died running die_on"):
        solo.run(w.die_on, 0)
    after = solo.run(w.pid)
    assert not set(before) & set(after), "the ranks were replaced"
    _usable(solo)


def test_a_run_past_the_deadline_raises_timeout_error(solo: RankPool):
    solo.run(w.pid)  # started: the deadline below is the run's alone
    solo.deadline = 2.0
    try:
        start = time.monotonic()
        with pytest.raises(TimeoutError, match=r"rank\(s\) \[0\] did not answer within 2\.0 s"):
            solo.run(w.sleep, 60.0)
        assert time.monotonic() - start < 15.0
    finally:
        solo.deadline = 120.0
    _usable(solo)


def test_what_cannot_travel_is_refused_before_any_rank_runs(pool: RankPool):
    with pytest.raises(
        TypeError, match=r"RankPool\.run: cannot send \S*<lambda> to the ranks .*importable"
    ):
        pool.run(lambda: 1)

    class Local(nn.Module):
        pass

    with pytest.raises(TypeError, match=r"cannot send get_rank to the ranks"):
        pool.run(dist.get_rank, Local())


def test_what_the_ranks_cannot_import_names_the_reason(pool: RankPool):
    module = types.ModuleType("_fr_nowhere")  # importable here only
    exec("def f():\n    return 1\n", module.__dict__)
    sys.modules[module.__name__] = module
    try:
        with pytest.raises(
            ImportError, match=r"rank 0 raised \w+ running f: .*_fr_nowhere.*importable by"
        ):
            pool.run(module.f)
    finally:
        del sys.modules[module.__name__]
    _usable(pool)


@pytest.mark.parametrize(
    ("arguments", "error", "message"),
    [
        ({"world_size": 0}, ValueError, r"world_size must be at least 1, got world_size=0"),
        ({"world_size": "2"}, TypeError, r"world_size must be an int, got '2'"),
        ({"timeout": 0}, ValueError, r"timeout must be a positive number of seconds, got 0"),
        ({"deadline": float("nan")}, ValueError, r"deadline must be a positive number of seconds"),
        ({"deadline": "9"}, TypeError, r"deadline must be a number of seconds, got '9'"),
    ],
)
def test_a_bad_argument_is_named_before_any_rank_starts(
    arguments: dict[str, Any], error: type[Exception], message: str
):
    with pytest.raises(error, match=r"fr\.testing\.RankPool: " + message):
        RankPool(**arguments)


def test_a_closed_pool_refuses_to_run_and_its_ranks_are_gone():
    with RankPool(1) as pool:
        (rank_pid,) = pool.run(w.pid)
        ranks = pool._ranks
    assert ranks is not None and not any(p.is_alive() for p in ranks.procs)
    with pytest.raises(RuntimeError, match=r"RankPool\.run: the pool is closed"):
        pool.run(w.pid)
    assert rank_pid > 0


# --------------------------------------------------------------------------- check_against_ddp


def _images(rows: int = 4, side: int = 8) -> list[tuple[torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(rows, 3, side, side, generator=g) + r,) for r in range(2)]


def test_a_conv_net_trains_and_evaluates_as_under_ddp_to_the_bit(pool: RankPool):
    torch.manual_seed(0)
    model = ConvNet(dropout=0.3)
    before = {k: t.clone() for k, t in fr.state(model).params.items()}
    for phases in (
        ("step", "step", "eval", "step"),
        ("eval", "no_grad", "step", "no_grad", "no_grad", "step", "eval", "eval", "step"),
    ):
        check_against_ddp(model, _images(), pool=pool, phases=phases, rtol=0, atol=0)
    check_against_ddp(model, _images(), pool=pool, sync_buffers=False, rtol=0, atol=0)
    check_against_ddp(model.eval(), _images(), pool=pool, loss=w.first_output, lr=0.5)
    fr.testing.assert_trees_close(fr.state(model).params, before, rtol=0, atol=0)


def test_a_difference_names_what_the_rank_the_phase_and_the_path(pool: RankPool):
    inputs = [(torch.randn(2, 3),), (torch.randn(2, 3),)]
    expected = (
        r"check_against_ddp: gradients of the fr\.distributed loop differ from DDP's on rank 0, "
        r"phases\[0\] \('step'\): assert_trees_close: leaves differ at \['lin\.weight'\]"
    )
    with pytest.raises(AssertionError, match=expected):
        check_against_ddp(w.HeldWeight(), inputs, pool=pool)


def test_a_modified_input_is_reported(pool: RankPool):
    inputs = [(torch.randn(2, 3),), (torch.randn(2, 3),)]
    with pytest.raises(
        AssertionError,
        match=re.escape("on rank 0, the fr.distributed loop modified ['inputs[0][0]']"),
    ):
        check_against_ddp(w.ScalesItsInput(), inputs, pool=pool)


def test_an_output_without_a_loss_to_take_asks_for_one(pool: RankPool):
    with pytest.raises(
        ValueError, match=r"holds no floating-point tensor to differentiate; pass loss="
    ):
        check_against_ddp(w.NoFloatOutput(), [(torch.randn(2, 3),)] * 2, pool=pool)
    _usable(pool)


@pytest.mark.parametrize(
    ("inputs", "options", "error", "message"),
    [
        ({"x": 1}, {}, TypeError, r"inputs must be a list with one entry per rank, got dict"),
        (
            [(torch.ones(2, 3),)],
            {},
            ValueError,
            r"inputs must hold one entry per rank: 2 for the pool's 2 ranks, got 1",
        ),
        ([(torch.ones(2, 3),), [torch.ones(2, 3)]], {}, TypeError, r"inputs\[1\] must be a tuple"),
        (None, {"phases": ["step", "train"]}, ValueError, r"phases\[1\] must be one of"),
        (
            None,
            {"ddp_options": {"bucket_cap_mb": 1}},
            ValueError,
            r".*'bucket_cap_mb': pass bucket_cap_mb= to",
        ),
        (
            None,
            {"ddp_options": {"broadcast_buffers": False}},
            ValueError,
            r".*'broadcast_buffers': pass sync_buffers= to",
        ),
        (None, {"rtol": 0}, ValueError, r"give rtol and atol together"),
        (None, {"lr": "0.1"}, TypeError, r"lr must be a number"),
    ],
)
def test_a_bad_argument_is_named(
    pool: RankPool, inputs: Any, options: dict[str, Any], error: type[Exception], message: str
):
    given = [(torch.ones(2, 3),)] * 2 if inputs is None else inputs
    with pytest.raises(error, match=r"check_against_ddp: " + message):
        check_against_ddp(nn.Linear(3, 2), given, pool=pool, **options)


def test_without_a_pool_it_starts_ranks_of_its_own():
    check_against_ddp(ConvNet(), _images()[:1], rtol=0, atol=0)  # one rank: the cheapest


# --------------------------------------------------------------------------- the docs page


def test_the_docs_ddp_example_is_the_tested_file():
    example = (ROOT / "property_tests" / "test_docs_ddp_example.py").read_text()
    shown = f"```python\n{example}```\n" in (ROOT / "docs" / "property_testing.md").read_text()
    assert shown, "docs/property_testing.md must show property_tests/test_docs_ddp_example.py"
