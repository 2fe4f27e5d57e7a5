"""ZeRO-3's units that follow the model, and a Hugging Face Llama started from the meta device.

In one process: the default units of a ``LlamaForCausalLM`` (its decoder
layers, the embedding, the final norm and the head), of a torchtitan-like
model (layers in an ``nn.ModuleDict``), of models without repeated blocks
(each direct child, as before); a module shared by two units planned
outside every unit; the warning when one default unit holds most of the
parameters, once per model structure; ``materialize``'s ``init=`` and the
buffer it names when nothing makes it.

On 2 gloo ranks (one job, ``_units_workers.py``): three AdamW steps of the
Llama through ``apply_sharded`` on its default units equal FSDP2
``fully_shard`` per decoder layer + root (losses and full parameters, bit
for bit); a ``Linear`` shared by three blocks, and one block run twice,
give DDP's gradient bit for bit; the Llama made from the meta device with
``init=model._init_weights`` equals the model built on the CPU and
initialised alike, sharded, bit for bit (buffers too), runs as it does,
and a meta twin run without its buffers raises naming the rotary
``inv_freq`` on every rank.
"""

from __future__ import annotations

import re
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import freplicate as fr
from freplicate._distributed import _units
from freplicate._distributed._units import units_of

sys.path.insert(0, str(Path(__file__).parent))  # the spawned ranks import the workers by name
import _dist_workers as w
import _shard_workers as s
import _units_workers as u

pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")

ok = w.ok
SCENARIOS = ["llama_against_fsdp2", "shared_modules", "llama_from_meta"]


def bitwise(actual: Any, expected: Any) -> None:
    fr.testing.assert_trees_close(actual, expected, rtol=0, atol=0)


@pytest.fixture(scope="module")
def job() -> dict[str, list[Any]]:
    return u.run(SCENARIOS, world=2, pg_timeout=30.0, deadline=240.0)


# --- the default units, planned ---------------------------------------------------------------


def test_a_llamas_default_units_are_its_decoder_layers_and_the_modules_beside_them() -> None:
    plan = units_of(u.llama(num_hidden_layers=3), None)
    assert plan.names == (
        "model.embed_tokens",
        "model.layers.0",
        "model.layers.1",
        "model.layers.2",
        "model.norm",
        "lm_head",
    )
    assert plan.outside == ()
    assert all(n.startswith("model.layers.1.") for n in plan.gathers["model.layers.1"])
    assert len(plan.gathers["model.layers.1"]) == 9  # 7 linear weights, 2 norms
    tied = units_of(u.llama(tie_word_embeddings=True), None)
    assert tied.outside == ("model.embed_tokens.weight",)  # the embedding is the head too
    assert tied.gathers["lm_head"] == ()


class Layer(nn.Module):
    """A torchtitan-like block: attention and a feed-forward of experts (repeated, inside)."""

    def __init__(self) -> None:
        super().__init__()
        self.attention = nn.Linear(4, 4)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(4, 4), nn.ReLU()) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.attention(x)
        return sum((e(x) for e in self.experts), x)


class Titan(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(10, 4)
        self.layers = nn.ModuleDict({str(i): Layer() for i in range(3)})
        self.norm = nn.LayerNorm(4)
        self.output = nn.Linear(4, 10)
        self.scale = nn.Parameter(torch.ones(10))


def test_repeated_blocks_anywhere_are_units_the_outermost_only() -> None:
    plan = units_of(Titan(), None)
    assert plan.names == ("tok_embeddings", "layers.0", "layers.1", "layers.2", "norm", "output")
    assert plan.outside == ("scale",)  # held by the root itself


@pytest.mark.parametrize(
    ("build", "names"),
    [
        (lambda: nn.Sequential(nn.Linear(8, 4), nn.Tanh(), nn.Linear(4, 4)), ("0", "2")),
        (lambda: nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), ("0", "1")),  # layers, not blocks
        (lambda: nn.Linear(4, 4), ()),
    ],
    ids=["mlp", "two linears", "one layer"],
)
def test_without_repeated_blocks_each_direct_child_is_a_unit(build: Any, names: Any) -> None:
    assert units_of(build(), None).names == names


def test_a_module_reached_from_two_units_is_outside_every_unit() -> None:
    plan = units_of(u.Shared(), None)
    assert plan.names == ("blocks.0", "blocks.1", "blocks.2", "head")
    assert set(plan.outside) == {"blocks.0.shared.weight", "blocks.0.shared.bias"}
    assert plan.gathers["blocks.1"] == ("blocks.1.own.weight", "blocks.1.own.bias")
    # one block under two names (run twice): outside too, gathered once, reduced once
    again = units_of(u.Again(), None)
    assert again.names == ("layers.0", "head")
    assert again.gathers["layers.0"] == ()
    assert again.outside == ("layers.0.0.weight", "layers.0.0.bias")
    # a weight tied within one unit stays in it
    inner = nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), nn.Linear(4, 2))
    inner[0][1].weight = inner[0][0].weight
    assert units_of(inner, None).gathers["0"] == ("0.0.weight", "0.0.bias", "0.1.bias")


class Lopsided(nn.Module):
    """The trap the default used to fall in: a body of distinct layers, most of the model."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
        self.head = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def test_a_default_unit_holding_most_parameters_is_warned_about_once_per_structure() -> None:
    _units._WARNED.clear()
    with pytest.warns(UserWarning) as caught:
        units_of(Lopsided(), None)
    (message,) = [str(c.message) for c in caught]
    assert re.fullmatch(
        r"fr\.distributed\.apply_sharded: the default unit 'body' holds 97% of the parameters "
        r"\(1,072 of 1,106\), all gathered at once, so sharding saves little memory there: pass "
        r"units= the qualified names of smaller submodules .*\[f'layers\.\{i\}' for i in range\(n\)\]\)",
        message,
    ), message
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        units_of(Lopsided(), None)  # another model of the same structure: no second warning
        units_of(Lopsided(), ["body.0", "body.2", "head"])  # units named: never warned
        units_of(u.llama(), None)  # no unit holds most
        units_of(nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 1)), None)  # no smaller unit


def test_apply_sharded_warns_at_the_callers_line() -> None:
    _units._WARNED.clear()
    model = Lopsided()
    shards = fr.distributed.shard(fr.state(model).params)
    with pytest.warns(UserWarning, match="the default unit 'body'") as caught:
        out, _ = fr.distributed.apply_sharded(model, fr.State(shards, {}), torch.ones(1, 16))
    assert [c.filename for c in caught] == [__file__]
    assert out.shape == (1, 2)


# --- materialize's init= ----------------------------------------------------------------------


def test_a_llama_cannot_be_made_by_resets_alone_and_is_made_with_its_own_initialiser() -> None:
    with torch.device("meta"):
        meta = u.llama()
    with pytest.raises(
        ValueError,
        match=r"model\.layers\.0\.input_layernorm\.weight is left unset \(NaN\) by the resets \(and init\) of its unit: pass init= a function that sets it \(a Hugging Face model's own: init=model\._init_weights\)",
    ):
        fr.distributed.materialize(meta)
    torch.manual_seed(0)
    got = fr.distributed.materialize(meta, init=meta._init_weights)  # type: ignore[arg-type]
    built = fr.state(u.initialised(u.llama(), 0))
    bitwise(got, built)
    assert list(got.buffers) == ["model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq"]
    assert bool(got.params["model.norm.weight"].eq(1).all())
    # seed=: each module's reset and init under a generator of its own; not the global one
    torch.manual_seed(1)
    before = torch.get_rng_state()
    seeded = fr.distributed.materialize(meta, init=meta._init_weights, seed=3)  # type: ignore[arg-type]
    assert torch.equal(before, torch.get_rng_state())
    again = fr.distributed.materialize(meta, init=meta._init_weights, seed=3, units=[""])  # type: ignore[arg-type]
    bitwise(seeded, again)


def test_a_buffer_nothing_makes_is_named() -> None:
    with torch.device("meta"):
        meta = u.llama()

    def norms_only(m: nn.Module) -> None:
        if "RMSNorm" in type(m).__name__:
            nn.init.ones_(m.weight)

    with pytest.raises(
        ValueError, match=r"materialize: model\.rotary_emb\.inv_freq is left unset \(NaN\)"
    ):
        fr.distributed.materialize(meta, init=norms_only)
    with pytest.raises(
        TypeError, match=r"materialize: init must be a function of a module .* got an int \(3\)"
    ):
        fr.distributed.materialize(meta, init=3)  # type: ignore[arg-type]


# --- on 2 ranks ---------------------------------------------------------------------------------


def test_a_llama_on_its_default_units_trains_as_fsdp2_per_layer_and_root(job) -> None:
    for got in ok(job, "llama_against_fsdp2"):
        assert got["units"] == ("model.embed_tokens", *u.LAYERS, "model.norm", "lm_head")
        assert got["outside"] == () and got["warnings"] == []
        assert got["unchanged"]
        for step, ((loss, params), (loss_t, params_t)) in enumerate(
            zip(got["ours"], got["theirs"])
        ):
            assert torch.equal(loss, loss_t), (step, loss, loss_t)
            bitwise(params, params_t)
        assert not torch.equal(
            got["ours"][0][1]["lm_head.weight"], got["ours"][-1][1]["lm_head.weight"]
        )


@pytest.mark.parametrize("case", ["shared", "again"])
def test_a_module_shared_by_two_units_gives_ddps_gradient(job, case: str) -> None:
    for got in ok(job, "shared_modules"):
        result = got[case]
        assert result["got"][0] == "ok", result["got"]
        bitwise(result["got"][1], result["want"])


def test_a_llama_made_from_the_meta_device_is_the_model_built_on_the_cpu(job) -> None:
    with torch.device("meta"):
        meta = u.llama()
    alone = fr.distributed.materialize(meta, init=meta._init_weights, seed=3)  # type: ignore[arg-type]
    results = ok(job, "llama_from_meta")
    for rank, got in enumerate(results):
        bitwise(got["got"], got["expected"])
        assert got["generator"], rank
        bitwise(got["seeded"], fr.State(s.rows_of(alone.params, rank, 2), alone.buffers))
        assert got["with_buffers"][0] == "ok", got["with_buffers"]
        bitwise(got["with_buffers"][1], got["want"])
        kind, name, message = got["no_buffers"]
        assert (kind, name) == ("raised", "ValueError"), got["no_buffers"]
        assert re.search(
            r"apply_sharded: state\.buffers leaves out \['model\.rotary_emb\.inv_freq', "
            r"'model\.rotary_emb\.original_inv_freq'\], whose module tensors are on the meta device",
            message,
        ), message
        assert "init=model._init_weights" in message
