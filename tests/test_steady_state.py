"""A warm call never waits on itself, reads nothing on the host, and sends only its data.

The contract of ../shared/API.md ("What the guarantees cost, and when"),
counted on 2 gloo ranks (``_steady_workers``): after a layout's first use,
every call of fr.distributed launches all of its buckets before it waits
on any (a gradient step from its backward hooks), makes no host read of a
tensor (``item``, ``tolist``, ``__bool__``, ``__float__``, ``__int__``:
on a GPU each would synchronise the stream), and launches exactly the
collectives its data needs (no probe, no mirror). The same counts with the
checks' debug mode on show its cost: one probe and one host read per call.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))  # the spawned ranks import the workers by name
import _steady_workers as s

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")

# what each warm call sends: its buckets, in order (the step's sizes are the MLP's gradients)
BUCKETS = {
    "step": 1,
    "step(bucket per tensor)": 6,
    "step(shard=True)": 1,
    "step(weight=)": 1,
    "step.accumulate": 1,
    "all_reduce": None,  # several (a small cap): counted below from the first call
    "all_reduce(op='sum')": 1,
    "broadcast": 1,
    "reduce_scatter": None,
    "all_gather": 1,
}


@pytest.fixture(scope="module")
def job() -> dict[str, list[Any]]:
    return s.spawn(s.SCENARIOS, pg_timeout=30.0, deadline=240.0)


def _calls(job: dict[str, list[Any]]) -> dict[str, list[list[list[tuple[str, Any]]]]]:
    """Per call name, per rank, per measured call: its events."""
    out: dict[str, list[Any]] = {}
    for scenario in s.SCENARIOS:
        ranks = job[scenario]
        for rank, got in enumerate(ranks):
            assert isinstance(got, dict), f"{scenario} on rank {rank}: {got!r}"
        for name in ranks[0]:
            out[name] = [ranks[r][name] for r in range(len(ranks))]
    return out


def _launches(log: list[tuple[str, Any]]) -> list[Any]:
    return [what for event, what in log if event == "launch"]


@pytest.mark.parametrize("name", list(BUCKETS))
def test_a_warm_call_launches_every_bucket_before_it_waits(job, name) -> None:
    for rank, logs in enumerate(_calls(job)[name]):
        for log in logs:
            events = [event for event, _ in log]
            assert "launch" in events, f"{name}, rank {rank}: nothing launched: {log}"
            last = max(i for i, e in enumerate(events) if e == "launch")
            first_wait = events.index("wait") if "wait" in events else len(events)
            assert first_wait > last, f"{name}, rank {rank}: a wait between launches: {events}"


@pytest.mark.parametrize("name", list(BUCKETS))
def test_a_warm_call_reads_nothing_on_the_host(job, name) -> None:
    for rank, logs in enumerate(_calls(job)[name]):
        for log in logs:
            reads = [what for event, what in log if event == "read"]
            assert reads == [], f"{name}, rank {rank}: host reads {reads}"


@pytest.mark.parametrize("name", list(BUCKETS))
def test_a_warm_call_sends_its_data_alone(job, name) -> None:
    for rank, logs in enumerate(_calls(job)[name]):
        first = _launches(logs[0])
        assert all(_launches(log) == first for log in logs), f"{name}, rank {rank}: {logs}"
        assert all(kind != "all_gather_object" for kind, _ in first), first
        if BUCKETS[name] is not None:
            assert len(first) == BUCKETS[name], f"{name}, rank {rank}: {first}"
        else:
            assert len(first) > 1, f"{name}: the small cap makes several buckets: {first}"


def test_a_warm_zero3_step_sends_what_fsdp2_sends(job) -> None:
    """Three units: a gather per unit before its forward, the closing collective (a failure after
    the last gather is announced there), a regather for the backward of the units whose
    gathered parameters the backward needs (the middle one: the last is kept from its forward,
    the first saved only its input), a reduce-scatter per unit (over gloo, an all-reduce of the
    rank-major buffer); nothing else, nothing read on the host."""
    gather, reduce = "all_gather_single", "all_reduce"
    for rank, logs in enumerate(_calls(job)["zero3"]):
        for log in logs:
            kinds = [kind for kind, _ in _launches(log)]
            want = [gather] * 3 + [reduce] + [gather] + [reduce] * 3
            assert kinds == want, f"rank {rank}: {_launches(log)}"
            assert [w for e, w in log if e == "read"] == [], f"rank {rank}: {log}"


def test_the_debug_mode_probes_before_every_call(job) -> None:
    for name in ("debug step", "debug all_reduce"):
        for rank, logs in enumerate(_calls(job)[name]):
            for log in logs:
                launches = _launches(log)
                assert len(launches) == 2, f"{name}, rank {rank}: {launches}"
                probe = launches[0]
                assert probe == ("all_reduce", 4), f"{name}: the probe first: {launches}"
                reads = [w for e, w in log if e == "read"]
                assert reads == ["tolist"], f"{name}, rank {rank}: {reads}"


@pytest.mark.parametrize("world", [2, 3])
def test_a_call_diverging_after_warm_up_raises_everywhere_where_its_results_land(world) -> None:
    """Rank 1 runs another warm layout of the same bucket sizes: no probe before the data (the
    default mode), every rank raises ``ValueError`` naming the difference, the group usable."""
    got = s.spawn(["diverging_after_warm_up"], pg_timeout=30.0, deadline=120.0, world=world)
    for rank, r in enumerate(got["diverging_after_warm_up"]):
        assert isinstance(r, dict), f"rank {rank}: {r!r}"
        for name, what in (("all_reduce", r"\['a'\]|\['b'\]"), ("step", r"\['w'\]|\['v'\]")):
            outcome = r[name]
            assert outcome[0] == "raised" and outcome[1] == "ValueError", (rank, name, outcome)
            assert re.search(what, outcome[2]), outcome[2]
        data = [launch for launch in r["all_reduce launches"] if launch[0] != "all_gather_object"]
        assert len(data) == 1, f"rank {rank}: one bucket and no probe: {data}"
        assert r["after"]["x"].tolist() == [float(sum(range(world)))] * 2


def test_a_compiled_call_sends_no_probe_and_asserts_its_words_in_the_graph() -> None:
    """Compiled, a warm call is its bucket alone; cached graphs of two layouts of one size run
    against each other: every rank raises where the results land (the device-side assertion)."""
    got = s.spawn(["compiled_diverging"], pg_timeout=30.0, deadline=240.0)
    for rank, r in enumerate(got["compiled_diverging"]):
        assert isinstance(r, dict), f"rank {rank}: {r!r}"
        # one all-reduce a graph: its bucket, no probe (the debug mode's) before it
        assert [len(g) for g in r["graphs"]] == [1, 1], r["graphs"]
        outcome = r["diverged"]
        assert outcome[0] == "raised" and outcome[1] == "RuntimeError", (rank, outcome)
        assert "ranks ran different calls here" in outcome[2], outcome[2]
        assert "FREPLICATE_DISTRIBUTED_DEBUG=DETAIL" in outcome[2], outcome[2]
