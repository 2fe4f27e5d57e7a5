"""Starting from the meta device: ``materialize`` against the model built on the CPU, sharded.

On one process, 2 and 3 gloo ranks: a model of torch's modules (an
embedding, attention, a norm, an LSTM, BatchNorm, a convolution, a tied
head) built on the meta device and materialized, unit by unit, equals bit
for bit ``fr.distributed.shard(fr.state(...))`` of the same model built on
the CPU after the same ``torch.manual_seed``, and leaves the generator
where building it does; with ``seed=``, it equals one process's result
with the same seed, whatever the units and the ranks' own generators.
The limits the docs state are tested too: a module that copies a
submodule (``nn.TransformerEncoder``) is not reproduced, and what cannot
be made raises instead of coming out wrong.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import freplicate as fr

sys.path.insert(0, str(Path(__file__).parent))  # the spawned ranks import the workers by name
import _dcp_workers as d
import _dist_workers as w
import _shard_workers as s

from freplicate._distributed._materialize import materialize

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")

ok = w.ok
NAMES = ["meta_start", "meta_memory", "meta_zero2", "meta_mistakes"]


def bitwise(actual: Any, expected: Any) -> None:
    fr.testing.assert_trees_close(actual, expected, rtol=0, atol=0)


@pytest.fixture(scope="module")
def job() -> dict[str, list[Any]]:
    return d.run(NAMES, world=2, deadline=240.0)


@pytest.fixture(scope="module")
def job3() -> dict[str, list[Any]]:
    return d.run(["meta_start", "meta_memory"], world=3, deadline=240.0)


def seeded_alone() -> fr.State:
    return materialize(d.meta_zoo(), seed=5)


def check_start(results: list[dict[str, Any]]) -> None:
    world = len(results)
    alone = seeded_alone()
    for rank, r in enumerate(results):
        assert r["unchanged"], f"rank {rank}: the meta module changed"
        for units, case in zip(d.UNITS, r["by_units"]):
            bitwise(case["got"], case["expected"])
            assert case["generator"], f"rank {rank}, units={units}: the generator moved otherwise"
        for seeded in r["seeded"]:
            bitwise(seeded, fr.State(s.rows_of(alone.params, rank, world), alone.buffers))


def test_two_ranks_make_the_shards_of_the_model_built_on_the_cpu(job):
    check_start(ok(job, "meta_start"))


def test_three_ranks_make_the_shards_of_the_model_built_on_the_cpu(job3):
    check_start(ok(job3, "meta_start"))
    conv = ok(job3, "meta_start")[2]["by_units"][0]["got"].params["4.weight"]
    assert conv.shape == (0, 8, 3)  # a late rank holds no row of the conv's 4


def test_no_rank_holds_two_units_at_full_size(job, job3):
    for r in ok(job, "meta_memory") + ok(job3, "meta_memory"):
        assert r["None"] == 0  # as each unit resets, no earlier unit's full weight is alive
        assert r["['']"] == 3  # (the count sees them when they are: one unit of four)
        assert r["own_storage"]  # the rows kept are copies, not views of a full weight


def test_zero2_from_the_meta_device_is_zero2_from_the_cpu_model(job):
    for r in ok(job, "meta_zero2"):
        bitwise(r["from_meta"], r["from_cpu"])


MISTAKES = {
    "generators": r"materialize: the random generator differs between rank 0 and rank 1, so their "
    r"draws would differ; seed every rank alike",
    "units": r"materialize: the module, units, seed or init differ between rank 0 and rank 1",
    "one_rank_wrong": r"materialize: units \['x'\] are not submodules of the module",
}


@pytest.mark.parametrize("case", sorted(MISTAKES))
def test_ranks_that_differ_raise_on_every_rank(job, case):
    results = ok(job, "meta_mistakes")
    for r in results:
        kind, name, message = r[case]
        assert (kind, name) == ("raised", "ValueError"), r[case]
        assert re.search(MISTAKES[case], message), message
        assert r["after"][0] == "ok"
    assert len({r[case][2] for r in results}) == 1


# --- one process ----------------------------------------------------------------------------


@pytest.mark.parametrize("units", d.UNITS, ids=str)
def test_one_process_makes_the_model_built_on_the_cpu(units):
    meta = d.meta_zoo()
    torch.manual_seed(0)
    got = materialize(meta, units=units)
    after = torch.get_rng_state()
    torch.manual_seed(0)
    built = d.zoo()
    bitwise(got, fr.state(built))
    assert torch.equal(after, torch.get_rng_state())
    assert list(got.params) == list(fr.state(built).params)  # the tied head: once, as fr.state
    assert all(not t.requires_grad for t in got.params.values())


def test_seed_leaves_the_generator_alone_and_ignores_the_units():
    torch.manual_seed(1)
    before = torch.get_rng_state()
    a = materialize(d.meta_zoo(), seed=5)
    b = materialize(d.meta_zoo(), seed=5, units=[""])
    assert torch.equal(before, torch.get_rng_state())
    bitwise(a, b)
    c = materialize(d.meta_zoo(), seed=6)
    assert not torch.equal(a.params["0.weight"], c.params["0.weight"])


def test_a_module_with_values_is_made_afresh_and_left_alone():
    torch.manual_seed(0)
    model = d.zoo()
    snap = w.snapshot(fr.state(model))
    torch.manual_seed(0)
    got = materialize(model)
    bitwise(got, fr.state(model))  # the same draws again
    assert w.unchanged(fr.state(model), snap)


def test_a_module_that_copies_a_submodule_is_not_reproduced():
    """The limit the docs state: nn.TransformerEncoder deep-copies one layer, so its layers start
    equal; made from the meta device, each layer draws its own."""

    def build() -> nn.Module:
        layer = nn.TransformerEncoderLayer(8, 2, 16)
        return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)

    with torch.device("meta"):
        meta = build()
    torch.manual_seed(0)
    got = materialize(meta)
    torch.manual_seed(0)
    built = fr.state(build())
    bitwise(got.params["layers.0.linear1.weight"], built.params["layers.0.linear1.weight"])
    assert not torch.equal(
        got.params["layers.1.linear1.weight"], built.params["layers.1.linear1.weight"]
    )


class Unset(nn.Module):
    """A parameter set in ``__init__`` and no reset: its value is lost on the meta device."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 2)
        self.scale = nn.Parameter(torch.tensor(1.5))


class Counter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("idx", torch.arange(3))


def raises(kind: type[Exception], pattern: str, f: Any, *args: Any, **kwargs: Any) -> None:
    with pytest.raises(kind, match=pattern):
        f(*args, **kwargs)


@pytest.mark.filterwarnings("ignore:enable_nested_tensor is True")
def test_what_cannot_be_made_raises_and_says_what_to_do():
    with torch.device("meta"):
        unset, counter = Unset(), Counter()
        transformer = nn.Transformer(8, 2, 1, 1, 16)
        lazy = nn.LazyLinear(3)
    raises(
        ValueError,
        r"materialize: scale is left unset \(NaN\) by the resets \(and init\) of its unit: pass init= "
        r"a function that sets it \(a Hugging Face model's own: init=model._init_weights\), give Unset "
        r"a reset_parameters\(\)",
        materialize,
        unset,
    )
    raises(
        ValueError,
        r"materialize: idx \(torch.int64\) belongs to Counter, which has no reset_parameters\(\)",
        materialize,
        counter,
    )
    raises(
        ValueError,
        r"the _reset_parameters\(\) of the module \(Transformer\) uses encoder.layers.0.self_attn.in_proj_weight, which is made apart from it",
        materialize,
        transformer,
    )
    materialize(transformer, units=[""])  # made together: no error
    raises(
        ValueError,
        r"the _reset_parameters\(\) of 1.attn \(MultiheadAttention\) uses 1.attn.out_proj.bias",
        materialize,
        d.meta_zoo(),
        units=["1.attn.out_proj"],
    )
    raises(ValueError, r"weight is a lazy tensor \(no shape yet\)", materialize, lazy)
    raises(
        ValueError,
        r"units \['nope'\] are not submodules of the module",
        materialize,
        unset,
        units=["nope"],
    )
    raises(
        TypeError,
        r"units must be a list of submodules' qualified names \(as named_modules\(\) gives them\), got a str",
        materialize,
        unset,
        units="fc",
    )
    raises(TypeError, r"materialize: seed must be an int", materialize, unset, seed=1.5)
    raises(TypeError, r"materialize: module must be an nn.Module, got an int \(3\)", materialize, 3)
    raises(
        ValueError,
        r"materialize: device must hold values, got 'meta'",
        materialize,
        unset,
        device="meta",
    )
