"""Train a small Hugging Face Llama with ZeRO-3 and bf16 mixed precision, beside FSDP2.

Two CPU processes on this machine, gloo on loopback (needs ``transformers``,
the ``freplicate[llama]`` extra; random weights, nothing downloaded):

    .venv/bin/torchrun --nproc-per-node 2 --master-addr 127.0.0.1 --master-port 29535 \\
        examples/llama_train.py

A ``LlamaForCausalLM`` made from a ``LlamaConfig`` (about 3M parameters by
default) learns to continue arithmetic progressions of token ids, each rank
on batches of its own. It is trained twice, step by step, from the same
weights and on the same batches:

- with freplicate's ZeRO-3: the model is built on the ``meta`` device (it
  gives the shapes, its tensors are never read), each rank makes its own
  rows of every parameter with ``fr.distributed.materialize(meta,
  init=meta._init_weights)`` (the model's own initialisation, one unit at a
  time, never the whole model), ``torch.optim.AdamW`` updates those rows,
  and ``loss.backward()`` runs through ``fr.distributed.apply_sharded(...,
  mp_policy=mp)`` on its default units (one per decoder layer, the
  embedding, the final norm and the head units of their own);
- with FSDP2: ``fully_shard`` on each decoder layer and on the root, the
  same ``MixedPrecisionPolicy``, ``torch.optim.AdamW``, starting from the
  ZeRO-3 side's parameters all-gathered.

The policy is FSDP2's own object, ``MixedPrecisionPolicy(param_dtype=
torch.bfloat16, reduce_dtype=torch.float32)``: parameters cast to bf16
before they are gathered, the forward and backward in bf16, gradients
reduced in float32 into float32 rows (``--mp none``: float32 throughout).
Each step prints both losses and whether they are the same bits; the end,
the largest difference between the two sides' parameters. On 2 ranks they
are equal to the bit, losses and parameters, with the policy and without
(``tests/test_example_llama.py``). ``--clip`` clips both sides by the full
gradient's norm (``fr.distributed.clip_grad_norm``, FSDP2's
``clip_grad_norm_``), which the two add up in other orders: the same bits or
an ulp apart, and once a clip scales by norms an ulp apart the runs part,
bf16 compute amplifying it (docs/sharding.md, "The Llama example", has the
figures). ``--help`` lists every option.

``train(config)`` is the loop, callable on the ranks of a process group that
is already initialised (the tests start their own); ``main(argv)`` is the
torchrun entry point (``env://``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import freplicate as fr

Params = dict[str, torch.Tensor]


def _option(default: Any, help: str, **kwargs: Any) -> Any:
    return field(default=default, metadata={"help": help, **kwargs})


@dataclass
class Config:
    # the model: LlamaConfig's fields
    vocab_size: int = _option(128, "tokens in the vocabulary")
    hidden_size: int = _option(256, "width of the residual stream")
    intermediate_size: int = _option(688, "width of the MLP")
    num_hidden_layers: int = _option(4, "decoder layers")
    num_attention_heads: int = _option(8, "attention heads")
    num_key_value_heads: int = _option(4, "key and value heads (grouped-query attention)")
    # the data
    seq_len: int = _option(32, "tokens in a sequence")
    batch_size: int = _option(8, "sequences in a batch, on each rank")
    # the optimisation
    steps: int = _option(60, "optimizer steps")
    lr: float = _option(3e-3, "AdamW's learning rate")
    weight_decay: float = _option(0.01, "AdamW's decoupled weight decay")
    clip: float = _option(
        0.0, "clip the gradients to this global norm (0: no clipping), on both sides"
    )
    mp: str = _option(
        "bf16",
        "bf16: MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32); none: float32",
        choices=["bf16", "none"],
    )
    seed: int = _option(0, "seed of the initialisation and the data")

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("--hidden-size must be a multiple of --num-attention-heads")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("--num-attention-heads must be a multiple of --num-key-value-heads")
        if self.clip < 0:
            raise ValueError(f"--clip must be >= 0, got {self.clip}")


def llama(config: Config) -> nn.Module:
    """A ``LlamaForCausalLM`` of ``config``'s shape (on the current default device)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_hidden_layers=config.num_hidden_layers,
            num_attention_heads=config.num_attention_heads,
            num_key_value_heads=config.num_key_value_heads,
            max_position_embeddings=config.seq_len,
            tie_word_embeddings=False,
        )
    )


def policy(config: Config) -> MixedPrecisionPolicy | None:
    if config.mp == "none":
        return None
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def batch(config: Config, rank: int, step: int) -> torch.Tensor:
    """This rank's token ids at ``step``: arithmetic progressions modulo the vocabulary.

    Each sequence has a random start and a random stride (from 1 to 7): from
    its second token on, the next one can be told. Drawn from a generator of
    the rank and the step, so the two sides see the same batches.
    """
    g = torch.Generator().manual_seed(config.seed * 1_000_003 + 1000 * (rank + 1) + step)
    start = torch.randint(0, config.vocab_size, (config.batch_size, 1), generator=g)
    stride = torch.randint(1, 8, (config.batch_size, 1), generator=g)
    return (start + stride * torch.arange(config.seq_len)) % config.vocab_size


def lm_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy, in float32 (the logits are bf16 under the policy)."""
    logits = logits[:, :-1].float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


# ---------------------------------------------------------------- the two sides


class Zero3:
    """freplicate's ZeRO-3: this rank's rows of every parameter, the module on the meta device."""

    def __init__(self, config: Config) -> None:
        self.config, self.mp = config, policy(config)
        with torch.device("meta"):
            self.model = llama(config)
        # every rank draws the same numbers (materialize checks it) and keeps its own rows
        torch.manual_seed(config.seed)
        start = fr.distributed.materialize(self.model, init=self.model._init_weights)  # type: ignore[arg-type]
        self.buffers = start.buffers  # whole: the rotary embedding's inv_freq
        self.shards = {k: t.requires_grad_() for k, t in start.params.items()}
        self.like = fr.state(self.model).params  # the full layout, on the meta device
        self.optimizer = torch.optim.AdamW(
            self.shards.values(), lr=config.lr, weight_decay=config.weight_decay
        )

    def step(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        self.optimizer.zero_grad()
        state = fr.State(self.shards, self.buffers)
        out, _ = fr.distributed.apply_sharded(self.model, state, input_ids=ids, mp_policy=self.mp)
        loss = lm_loss(out.logits, ids)
        loss.backward()  # this rank's rows of the mean gradient, float32, in .grad
        norm = None
        if self.config.clip:  # by the full gradient's norm: clip_grad_norm_ of the rows would not
            grads = {k: t.grad for k, t in self.shards.items()}
            grads, norm = fr.distributed.clip_grad_norm(grads, self.config.clip)
            for k, t in self.shards.items():
                t.grad = grads[k]
        self.optimizer.step()
        return loss.detach(), norm

    def parameters(self) -> Params:
        """The full parameters, all-gathered (collective: every rank calls it)."""
        like = {k: torch.empty_like(p, device="cpu") for k, p in self.like.items()}
        return fr.distributed.all_gather({k: t.detach() for k, t in self.shards.items()}, like)


class FSDP2:
    """FSDP2: ``fully_shard`` on each decoder layer and on the root, the same policy."""

    def __init__(self, config: Config, params: Params, buffers: Params, mesh: DeviceMesh) -> None:
        self.config = config
        with torch.device("meta"):
            model = llama(config)
        model.to_empty(device="cpu")
        with torch.no_grad():  # the ZeRO-3 side's first parameters and buffers
            for k, p in model.named_parameters():
                p.copy_(params[k])
            for k, b in model.named_buffers():
                b.copy_(buffers[k])
        mp = policy(config) or MixedPrecisionPolicy()  # the default: no casts
        for layer in model.model.layers:  # type: ignore[union-attr]
            fully_shard(layer, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        self.model = model
        self.optimizer = torch.optim.AdamW(
            model.parameters(), lr=config.lr, weight_decay=config.weight_decay
        )

    def step(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        self.optimizer.zero_grad()
        loss = lm_loss(self.model(input_ids=ids).logits, ids)
        loss.backward()
        norm = None
        if self.config.clip:
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.clip)
            norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        self.optimizer.step()
        return loss.detach(), norm

    def parameters(self) -> Params:
        return {k: p.full_tensor().detach().clone() for k, p in self.model.named_parameters()}  # type: ignore[attr-defined]


# ---------------------------------------------------------------- the loop


def difference(ours: Params, theirs: Params) -> tuple[float, str]:
    """The largest absolute difference of a parameter, and the parameter's name."""
    gaps = {k: float((ours[k] - p).abs().max()) for k, p in theirs.items()}
    worst = max(gaps, key=lambda k: gaps[k])
    return gaps[worst], worst


def train(config: Config, log: Callable[[str], None] | None = print) -> dict[str, Any]:
    """Train both sides on the ranks of the default process group; what this rank saw.

    Returns:
        ``{"loss": [(ZeRO-3's loss, FSDP2's) at each step], "norm": the same
        for the gradient norm before clipping (``None`` without ``--clip``),
        "ms": [(ZeRO-3's step time, FSDP2's)], "params": (ZeRO-3's full
        parameters, FSDP2's) after the last step, "start": the first ones,
        "size": the parameter count}``.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    say = log if log is not None and rank == 0 else (lambda _: None)
    mesh = init_device_mesh("cpu", (world,))
    zero3 = Zero3(config)
    start = zero3.parameters()
    fsdp2 = FSDP2(config, start, zero3.buffers, mesh)
    size = sum(p.numel() for p in start.values())
    say(
        f"LlamaForCausalLM, {size:,} parameters, {world} ranks, mixed precision "
        f"{'bf16 compute, float32 reduce' if config.mp == 'bf16' else 'none (float32)'}"
    )
    history: dict[str, Any] = {"loss": [], "norm": [], "ms": [], "start": start, "size": size}
    for step in range(config.steps):
        ids = batch(config, rank, step)
        results, ms = [], []
        for side in (zero3, fsdp2):
            begin = time.perf_counter()
            results.append(side.step(ids))
            ms.append(1e3 * (time.perf_counter() - begin))
        (loss, norm), (loss_t, norm_t) = results
        history["loss"].append((float(loss), float(loss_t)))
        history["norm"].append(tuple(None if n is None else float(n) for n in (norm, norm_t)))
        history["ms"].append(tuple(ms))
        agree = "the same bits" if torch.equal(loss, loss_t) else f"differ by {loss - loss_t:.3g}"
        if config.clip:
            assert norm is not None and norm_t is not None
            gap = (
                "the same bits"
                if torch.equal(norm, norm_t)
                else f"{float(norm / norm_t - 1):.1e} apart"
            )
            agree += f"; gradient norm {norm:.4f}, {gap}"
        say(
            f"step {step + 1}: ZeRO-3 loss {loss:.4f}, FSDP2 loss {loss_t:.4f} ({agree}), "
            f"{ms[0]:.0f} ms | {ms[1]:.0f} ms"
        )
    ours, theirs = zero3.parameters(), fsdp2.parameters()
    history["params"] = (ours, theirs)
    largest, where = difference(ours, theirs)
    if largest == 0:
        say(f"after {config.steps} steps: every parameter the same bits on both sides")
    else:
        say(f"after {config.steps} steps: parameters at most {largest:.3g} apart ({where})")
    return history


def parse(argv: list[str] | None) -> Config:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for f in dataclasses.fields(Config):
        flag, extra = "--" + f.name.replace("_", "-"), dict(f.metadata)
        extra.setdefault("type", type(f.default))
        parser.add_argument(flag, default=f.default, **extra)
    return Config(**vars(parser.parse_args(argv)))


def main(argv: list[str] | None = None) -> None:
    """The torchrun entry point: a gloo group from torchrun's environment (``env://``), then train."""
    config = parse(argv)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo's sockets on loopback only
    dist.init_process_group("gloo")
    try:
        train(config)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
