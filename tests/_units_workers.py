"""Rank-side code of tests/test_units.py: ZeRO-3's default units and a meta start, on gloo ranks.

A small random Hugging Face ``LlamaForCausalLM`` (no download) trained with
``fr.distributed.apply_sharded`` on its default units (one per decoder
layer, the embedding, the final norm and the head units of their own)
beside FSDP2 (``fully_shard`` on each decoder layer, then the root, as
torchtitan wraps it) + ``torch.optim.AdamW``, from the same weights and
batches; a module shared by two blocks beside ``DistributedDataParallel``;
and the Llama made from the meta device by ``fr.distributed.materialize``
with its own initialiser, beside the model built on the CPU.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _dist_workers import _kind, _main, scenario, snapshot, spawn, unchanged
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import freplicate as fr
from freplicate._distributed._units import units_of

STEPS, LR, WD = 3, 1e-2, 1e-2
LLAMA: dict[str, Any] = {
    "vocab_size": 96,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
}
LAYERS = [f"model.layers.{i}" for i in range(LLAMA["num_hidden_layers"])]


def main(*args: Any) -> None:
    _main(*args)


def run(names: list[str], *, world: int = 2, **kwargs: Any) -> dict[str, list[Any]]:
    return spawn(names, target=main, world=world, **kwargs)


def outcome(f: Any) -> tuple[Any, ...]:
    try:
        return ("ok", f())
    except Exception as err:
        return ("raised", _kind(err), str(err))


def llama(**config: Any) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(**{**LLAMA, **config}))


def post_order(module: nn.Module, name: str = "") -> Any:
    """Every module after its submodules, in ``named_modules()`` order (materialize's order)."""
    for key, child in module.named_children():
        yield from post_order(child, f"{name}.{key}" if name else key)
    yield name, module


def initialised(model: nn.Module, seed: int) -> nn.Module:
    """``model`` (built on the CPU) set afresh: after ``torch.manual_seed(seed)``, each module's
    reset, then the model's own ``_init_weights``, module after module."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for _, m in post_order(model):
            if hasattr(m, "reset_parameters"):
                m.reset_parameters()
            model._init_weights(m)  # type: ignore[operator]
    return model


def ids_of(rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randint(0, LLAMA["vocab_size"], (2, 12), generator=g)


def lm_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


@scenario
def llama_against_fsdp2(rank: int) -> dict[str, Any]:
    """The default units' ZeRO-3 loop (rows as leaves, ``torch.optim.AdamW``, ``backward``)
    beside FSDP2 per decoder layer + root: losses, and the full parameters after each step."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = llama()
    full = fr.state(model)
    snap = snapshot(full)
    with torch.device("meta"):
        twin = llama()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = units_of(twin, None)

    shards = {k: t.clone().requires_grad_() for k, t in fr.distributed.shard(full.params).items()}
    opt = torch.optim.AdamW(shards.values(), lr=LR, weight_decay=WD)
    ours: list[Any] = []
    for step in range(STEPS):
        ids = ids_of(rank, step)
        opt.zero_grad()
        out, _ = fr.distributed.apply_sharded(twin, fr.State(shards, full.buffers), input_ids=ids)
        loss = lm_loss(out.logits, ids)
        loss.backward()
        opt.step()
        rows = {k: t.detach() for k, t in shards.items()}
        ours.append((loss.detach(), fr.distributed.all_gather(rows, full.params)))

    own = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for name in LAYERS:
        fully_shard(own.get_submodule(name), mesh=mesh)
    fully_shard(own, mesh=mesh)
    theirs: list[Any] = []
    topt = torch.optim.AdamW(own.parameters(), lr=LR, weight_decay=WD)
    for step in range(STEPS):
        ids = ids_of(rank, step)
        topt.zero_grad()
        loss = lm_loss(own(input_ids=ids).logits, ids)
        loss.backward()
        topt.step()
        params = {k: p.full_tensor().detach().clone() for k, p in own.named_parameters()}  # type: ignore[operator]
        theirs.append((loss.detach(), params))
    return {
        "units": plan.names,
        "outside": plan.outside,
        "warnings": [str(w.message) for w in caught],
        "ours": ours,
        "theirs": theirs,
        "unchanged": unchanged(full, snap),
    }


class Block(nn.Module):
    """A block of its own linear layer and one ``shared`` with the other blocks."""

    def __init__(self, shared: nn.Linear) -> None:
        super().__init__()
        self.own = nn.Linear(6, 6)
        self.shared = shared

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.shared(self.own(x)))


class Shared(nn.Module):
    """Three blocks that hold one ``nn.Linear`` (the same object), and a head."""

    def __init__(self) -> None:
        super().__init__()
        shared = nn.Linear(6, 6)
        self.blocks = nn.ModuleList(Block(shared) for _ in range(3))
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class Again(nn.Module):
    """One block run twice (the same object at ``layers.0`` and ``layers.1``), and a head."""

    def __init__(self) -> None:
        super().__init__()
        block = nn.Sequential(nn.Linear(6, 6), nn.Tanh())
        self.layers = nn.ModuleList([block, block])
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def against_ddp(build: Any, rank: int) -> dict[str, Any]:
    """One step's gradient: ZeRO-3 on the default units (gathered in full) against DDP's."""
    torch.manual_seed(0)
    model = build()
    full = fr.state(model)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(5, 6, generator=g), torch.randint(0, 3, (5,), generator=g)

    def loss_fn(shards: dict[str, torch.Tensor]) -> torch.Tensor:
        out, _ = fr.distributed.apply_sharded(model, fr.State(shards, {}), x)
        return F.cross_entropy(out, y)

    got = outcome(lambda: fr.grad_and_value(loss_fn)(fr.distributed.shard(full.params)))
    ddp = DistributedDataParallel(copy.deepcopy(model))
    F.cross_entropy(ddp(x), y).backward()
    want = {k: p.grad for k, p in ddp.module.named_parameters()}
    if got[0] == "ok":
        got = ("ok", fr.distributed.all_gather(got[1][0], full.params))
    return {"got": got, "want": want, "plan": units_of(model, None)}


@scenario
def shared_modules(rank: int) -> dict[str, Any]:
    return {"shared": against_ddp(Shared, rank), "again": against_ddp(Again, rank)}


@scenario
def llama_from_meta(rank: int) -> dict[str, Any]:
    """``materialize(meta, init=meta._init_weights)`` beside the model built on the CPU and
    initialised alike, sharded; the seeded result (for the test to compare with one process);
    a meta twin run without its buffers."""
    with torch.device("meta"):
        meta = llama()
    torch.manual_seed(0)
    got = fr.distributed.materialize(meta, init=meta._init_weights)  # type: ignore[arg-type]
    after = torch.get_rng_state()
    torch.manual_seed(7)
    built = fr.state(initialised(llama(), 0))
    expected = fr.State(fr.distributed.shard(built.params), built.buffers)
    generator = torch.equal(after, torch.get_rng_state())
    torch.manual_seed(rank)  # seed= does not read the ranks' generators
    seeded = fr.distributed.materialize(meta, init=meta._init_weights, seed=3)  # type: ignore[arg-type]
    ids = ids_of(rank, 0)
    no_buffers = outcome(
        lambda: fr.distributed.apply_sharded(meta, fr.State(got.params, {}), input_ids=ids)
    )
    with_buffers = outcome(lambda: fr.distributed.apply_sharded(meta, got, input_ids=ids)[0].logits)
    want = fr.apply(llama(), built, input_ids=ids)[0].logits
    return {
        "got": got,
        "expected": expected,
        "generator": generator,
        "seeded": seeded,
        "no_buffers": no_buffers,
        "with_buffers": with_buffers,
        "want": want,
    }
