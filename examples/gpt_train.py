"""Train the small character-level GPT of ``gpt_model.py`` on several processes, with freplicate.

Two CPU processes on this machine, gloo on loopback (the run prints its loss
every 10 steps, train and validation losses at each evaluation, a sample of
generated text at the end):

    .venv/bin/torchrun --nproc-per-node 2 --master-addr 127.0.0.1 --master-port 29533 \\
        examples/gpt_train.py

The same loop on ``DistributedDataParallel`` + ``torch.optim.AdamW`` +
``clip_grad_norm_`` (``no_sync`` for accumulation): add ``--ddp``. With
``--optimizer exact`` the functional run uses an AdamW written here with
``torch.optim.AdamW``'s arithmetic, and trains bit for bit like ``--ddp``;
the default is torchopt's AdamW (the ``freplicate[optim]`` extra).
``--help`` lists every option.

``--zero 1|2|3`` shards the functional run like ZeRO's stages (docs/sharding.md):
``1`` all-reduces the gradients as DDP does and each rank updates its rows of
the parameters (the optimizer state 1/W of DDP's), then all-gathers them;
``2`` reduce-scatters the gradients (``grad_and_value(shard=True)``) and
clips them by the full gradient's norm (``fr.distributed.clip_grad_norm``);
``3`` keeps only this rank's rows of the parameters, all-gathering each
transformer block just before it runs (``fr.distributed.apply_sharded``, a
block per unit) on a model that lives on the ``meta`` device, and updates the
rows with no all-gather after. A ZeRO checkpoint is a directory: every rank
writes its own rows (``fr.distributed.save_sharded``), and ``--resume`` reads
them back (``load_sharded``).

What a step does on the functional side: ``fr.distributed.grad_and_value``
differentiates the loss (autocast inside it: the backward runs inside the
call), ``Step.accumulate`` takes the step's micro-batches from a generator in
the order a ``no_sync`` loop draws them (each batch, and its dropout masks,
drawn from this rank's random stream when it is needed), the one all-reduce
runs during the last micro-batch's backward pass, then the gradients are
clipped to a global norm and AdamW updates the parameter tree. Parameters
start equal on every rank because rank 0's are broadcast
(``fr.distributed.broadcast``), as DDP does at construction. A checkpoint
holds the parameters, the optimizer state and every rank's random stream;
``--resume`` goes on from one, bit-identically.

``--grain N`` trains with ``fr.distributed.grad_and_value(loss, grain=N,
seed=--seed)`` (docs/reproducible.md): ``--batch-size`` is then the global
batch of a step, drawn alike on every rank from a stream that names no rank,
and rank ``r`` of ``W`` takes its rows ``[r*B/W, (r+1)*B/W)``; each grain of
``N`` sequences has its gradient, and its dropout masks, alone, and the
grains' gradients are summed in one fixed tree. On 1, 2, 4, ... processes
with the same threads each (``OMP_NUM_THREADS=1``: torchrun sets it only
for more than one process), the run ends with the same bits: compare the
sha256 the run prints last. It takes ``--accumulate 1``, ``--zero 1``, ``2``
or ``3`` (the rows clipped by rows, ``clip_grad_norm(reproducible=True)``;
ZeRO-3's loss through ``apply_sharded``, whose gathers' transposes sum the
ranks' rows grain by grain: bits of its own, the same on every world size),
and neither ``--ddp`` nor ``--compile``; a checkpoint resumes on any power of
two of ranks:

    OMP_NUM_THREADS=1 .venv/bin/torchrun --nproc-per-node 4 --master-addr 127.0.0.1 \\
        --master-port 29533 examples/gpt_train.py --grain 4 --batch-size 32 --accumulate 1

``train(config)`` is the loop, callable on the ranks of a process group that
is already initialised (the tests start their own); ``main(argv)`` is the
torchrun entry point (``env://``).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import math
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import optree
import torch
import torch.distributed as dist
import torch.nn.functional as F
from gpt_model import GPT, GPTConfig, Vocabulary, corpus, decayed
from torch.nn.parallel import DistributedDataParallel

import freplicate as fr

Params = dict[str, torch.Tensor]
Schedule = Callable[[int], float]


def _option(default: Any, help: str, **kwargs: Any) -> Any:
    return field(default=default, metadata={"help": help, **kwargs})


@dataclass
class Config:
    # the model
    n_layer: int = _option(2, "transformer blocks")
    n_head: int = _option(4, "attention heads")
    n_embd: int = _option(64, "width of the residual stream")
    block_size: int = _option(64, "context length, in characters")
    dropout: float = _option(0.1, "dropout probability (attention, residual, embedding)")
    # the data
    sentences: int = _option(4000, "sentences in the generated corpus")
    batch_size: int = _option(
        16, "sequences in a micro-batch, on each rank (with --grain: the global batch a step)"
    )
    accumulate: int = _option(2, "micro-batches a step (gradient accumulation)")
    # the optimisation
    steps: int = _option(300, "optimizer steps")
    lr: float = _option(5e-3, "peak learning rate")
    min_lr: float = _option(5e-4, "learning rate at the end of the cosine decay")
    warmup: int = _option(30, "steps of linear warm-up")
    weight_decay: float = _option(0.1, "AdamW's decoupled weight decay (>= 2-D tensors only)")
    beta1: float = _option(0.9, "AdamW's beta1")
    beta2: float = _option(0.95, "AdamW's beta2")
    eps: float = _option(1e-8, "AdamW's eps")
    clip: float = _option(1.0, "global gradient norm to clip to (> 0)")
    optimizer: str = _option(
        "torchopt",
        "the functional side's AdamW: torchopt.adamw, or exact (torch.optim.AdamW's arithmetic)",
        choices=["torchopt", "exact"],
    )
    amp: str = _option("none", "autocast dtype for the forward", choices=["none", "bf16"])
    ddp: bool = _option(False, "run the loop on DistributedDataParallel + torch.optim.AdamW")
    zero: int = _option(
        0,
        "shard the functional run like ZeRO: 1 the optimizer state, 2 the gradients too, "
        "3 the parameters too (0: replicated)",
        choices=[0, 1, 2, 3],
    )
    compile: bool = _option(
        False, "torch.compile the loss (freplicate) or the DDP module (--ddp); minutes, once"
    )
    grain: int | None = _option(
        None,
        "sequences a grain: the same bits on 1, 2, 4, ... ranks (grad_and_value(grain=), "
        "docs/reproducible.md); one global batch of --batch-size a step, cut over the ranks",
        type=int,
    )
    # evaluation, sampling, checkpoints
    eval_every: int = _option(100, "steps between evaluations (and checkpoints)")
    eval_batches: int = _option(8, "batches an evaluation averages, on each rank")
    sample_chars: int = _option(200, "characters to generate at the end")
    seed: int = _option(1337, "seed of the initialisation, the data and the dropout")
    checkpoint: str | None = _option(None, "write a checkpoint here at each evaluation", type=str)
    resume: str | None = _option(
        None, "go on from this checkpoint (its options, not these)", type=str
    )
    stop_after: int | None = _option(None, "stop (and checkpoint) after this many steps", type=int)

    def __post_init__(self) -> None:
        if self.clip <= 0:
            raise ValueError(f"--clip must be > 0, got {self.clip}")
        if self.n_embd % self.n_head:
            raise ValueError(f"--n-embd ({self.n_embd}) must be a multiple of --n-head")
        if self.zero and self.ddp:
            raise ValueError("--zero shards the functional run: leave out --ddp")
        if self.zero == 3 and self.compile:
            raise ValueError(
                "--zero 3 runs eagerly here: this example does not compile apply_sharded's loss "
                "(docs/sharding.md says what compiling it does)"
            )
        if self.grain is not None:
            self._check_grain()

    def _check_grain(self) -> None:
        """What ``--grain`` runs: one global batch a step, on the functional side, eagerly."""
        assert self.grain is not None
        if self.grain < 1:
            raise ValueError(f"--grain must be a number of sequences >= 1, got {self.grain}")
        refused = {
            "--ddp": self.ddp,  # DDP sums in its own order: nothing to compare bits with
            "--compile": self.compile,  # grain= runs eagerly only
            # grain='s accumulate() takes a rank's block of the step's grains: this example's
            # micro-batches are each a global batch cut across the ranks, another order
            f"--accumulate {self.accumulate}": self.accumulate != 1,
        }
        for option, given in refused.items():
            if given:
                raise ValueError(
                    f"--grain (reproducible across world sizes) does not take {option}: "
                    "it runs one global batch a step, replicated, eagerly, on the functional "
                    "side (--accumulate 1, a larger --batch-size instead of micro-batches)"
                )
        grains = self.batch_size // self.grain
        if self.batch_size % self.grain or grains & (grains - 1):
            raise ValueError(
                f"--grain {self.grain} must cut the global batch (--batch-size "
                f"{self.batch_size}) into a power of two of grains (1, 2, 4, ...)"
            )


# options that say where a run goes, not what it computes: a resumed run takes these from
# its command line and everything else from the checkpoint
_WHERE = ("checkpoint", "resume", "stop_after")


def autocast(config: Config) -> Any:
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=config.amp == "bf16")


def schedule(config: Config) -> Schedule:
    """The learning rate of step ``it`` (from 0): linear warm-up, then a cosine down to ``min_lr``."""

    def lr(it: int) -> float:
        if it < config.warmup:
            return config.lr * (it + 1) / config.warmup
        progress = min(1.0, (it - config.warmup) / max(1, config.steps - config.warmup))
        return config.min_lr + 0.5 * (config.lr - config.min_lr) * (
            1 + math.cos(math.pi * progress)
        )

    return lr


class Data:
    """The corpus, split 90/10 into training and validation text; each rank its own training shard.

    With ``--grain`` every rank reads the whole training text: a step's
    global batch is drawn alike on every rank and world size, and each rank
    takes its rows of it (``rows``).
    """

    def __init__(self, config: Config, rank: int, world: int) -> None:
        text = corpus(config.sentences)
        self.vocab = Vocabulary(text)
        ids = self.vocab.encode(text)
        cut = int(0.9 * len(ids))
        shard = cut if config.grain else cut // world
        first = 0 if config.grain else rank * shard
        self.splits = {"train": ids[first : first + shard], "val": ids[cut:]}
        self.config = config
        n = config.batch_size // world  # --grain: rank r of W holds rows [r*n, (r+1)*n)
        self.rows = slice(rank * n, (rank + 1) * n) if config.grain else slice(None)

    def batch(
        self, split: str = "train", generator: torch.Generator | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Random windows of the split: inputs, and the same shifted by one (the targets).

        Without a ``generator`` the positions come from the global random
        stream, the one dropout draws from, as nanoGPT's ``get_batch`` does:
        the order of fetches and forwards then decides every number drawn.
        """
        data, t = self.splits[split], self.config.block_size
        start = torch.randint(len(data) - t, (self.config.batch_size,), generator=generator)
        x = torch.stack([data[i : i + t] for i in start.tolist()])
        y = torch.stack([data[i + 1 : i + 1 + t] for i in start.tolist()])
        return x, y


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


# ---------------------------------------------------------------- the optimizers of the fr side


Init = Callable[[Params], Any]
Update = Callable[[Params, Params, Any], tuple[Params, Any]]


def exact_adamw(lr: Schedule, config: Config, decay: dict[str, bool]) -> tuple[Init, Update]:
    """AdamW whose results equal ``torch.optim.AdamW``'s on CPU to the bit, as tree maps.

    The operations of torch's single-tensor path (``torch.optim.adam.
    _single_tensor_adam`` with decoupled weight decay, what ``AdamW`` runs
    on CPU), in its order, out of place: decay the parameter, ``lerp`` the
    first moment, ``mul`` and ``addcmul`` the second, divide its square root
    by the bias correction's, add ``eps``, ``addcdiv``. The bias corrections
    and the step size are Python floats, as torch computes them.
    """
    b1, b2, eps, wd = config.beta1, config.beta2, config.eps, config.weight_decay

    def init(params: Params) -> dict[str, Any]:
        zeros = {k: torch.zeros_like(p) for k, p in params.items()}
        return {"step": 0, "m": zeros, "v": zeros}

    def update(params: Params, grads: Params, state: dict[str, Any]) -> tuple[Params, Any]:
        step, rate = state["step"] + 1, lr(state["step"])
        step_size = rate / (1 - b1**step)
        bias_correction2_sqrt = (1 - b2**step) ** 0.5
        new, m, v = {}, {}, {}
        for k, p in params.items():  # a tree map over the leaves, in the parameters' order
            g = grads[k]
            if decay[k] and wd != 0:
                p = p.mul(1 - rate * wd)
            m[k] = state["m"][k].lerp(g, 1 - b1)
            v[k] = state["v"][k].mul(b2).addcmul(g, g, value=1 - b2)
            denom = (v[k].sqrt() / bias_correction2_sqrt).add(eps)
            new[k] = p.addcdiv(m[k], denom, value=-step_size)
        return new, {"step": step, "m": m, "v": v}

    return init, update


def torchopt_adamw(lr: Schedule, config: Config, decay: dict[str, bool]) -> tuple[Init, Update]:
    """``torchopt.adamw(lr, ..., mask=decay)``, spelt out as its own chain of transforms.

    Spelt out because ``adamw``'s ``mask`` does not work in torchopt 0.7.3
    (every tensor is decayed; docs/optimizers.md). The learning rate is the
    schedule at torchopt's own step count (a 0-dim tensor, 0 at the first step).
    """
    import torchopt

    tx = torchopt.chain(
        torchopt.transform.scale_by_adam(b1=config.beta1, b2=config.beta2, eps=config.eps),
        torchopt.transform.add_decayed_weights(config.weight_decay, mask=decay),
        torchopt.transform.scale_by_schedule(lambda count: -lr(int(count))),
    )

    def update(params: Params, grads: Params, state: Any) -> tuple[Params, Any]:
        # inplace=False: torchopt's default writes into the state, the gradients and the parameters
        updates, state = tx.update(grads, state, params=params, inplace=False)
        return torchopt.apply_updates(params, updates, inplace=False), state

    return tx.init, update


# ---------------------------------------------------------------- the two sides of --ddp


class Functional:
    """The loop's step on freplicate: the parameters (or, sharded, this rank's rows) in a tree.

    ``zero`` (``--zero``): 0 keeps everything replicated; 1 and 2 keep the
    full parameters for the forward and this rank's rows (``mine``) for the
    optimizer; 3 keeps the rows alone, the module on the meta device.
    """

    def __init__(self, config: Config, model: GPT, data: Data) -> None:
        self.config, self.model, self.data = config, model, data
        self.zero = config.zero
        # every rank starts from rank 0's parameters, as DDP makes them at construction
        params: Params = fr.distributed.broadcast(fr.state(model).params)
        # the full layout (shapes and dtypes only): what an all-gather or a checkpoint fills in
        self.like = {k: torch.empty_like(p, device="meta") for k, p in params.items()}
        make = exact_adamw if config.optimizer == "exact" else torchopt_adamw
        self.init, self.update = make(schedule(config), config, decayed(params))
        # --compile: the loss compiled (its forward and backward); the buckets still start from
        # the backward pass, and the rest of the step stays eager, as with torch.compile(DDP)
        loss = torch.compile(self.loss) if config.compile else self.loss
        if self.zero == 3:
            self.params: Params | None = None  # never whole: each block gathered as it runs
            self.mine = {k: p.clone() for k, p in fr.distributed.shard(params).items()}
            self.units = [f"blocks.{i}" for i in range(config.n_layer)]
            # the module gives the shapes, its own tensors are not read: a twin on the meta device
            # (built there, so that the head stays tied to the embedding, as Module.to would not)
            with torch.device("meta"):
                self.model = GPT(model.config)
            self.model.train(model.training)
            self.grad: Any = fr.grad_and_value(self.sharded_loss)
            if config.grain:  # the gathers' transposes sum the ranks' rows in the fixed tree
                self.grad = fr.distributed.grad_and_value(
                    self.sharded_loss, grain=config.grain, seed=config.seed
                )
        else:
            self.params = params
            self.mine = fr.distributed.shard(params) if self.zero else params
            self.grad = fr.distributed.grad_and_value(
                loss,
                shard=self.zero == 2,
                **({"grain": config.grain, "seed": config.seed} if config.grain else {}),
            )
        self.opt_state = self.init(self.mine)

    def loss(self, params: Params, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        # autocast inside the loss: the backward runs inside grad_and_value, outside this block,
        # as it runs outside DDP's autocast block after loss.backward()
        with autocast(self.config):
            logits, _ = fr.apply(self.model, fr.State(params, {}), x)
            loss = cross_entropy(logits, y)
        return loss / self.config.accumulate

    def sharded_loss(self, mine: Params, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """ZeRO-3's loss: the same, each block's parameters gathered from the ranks' rows."""
        with autocast(self.config):
            state = fr.State(mine, {})
            logits, _ = fr.distributed.apply_sharded(self.model, state, x, units=self.units)
            loss = cross_entropy(logits, y)
        return loss / self.config.accumulate

    def step(self) -> tuple[float, float]:
        k = self.config.accumulate
        # fetched one by one as they are used: the order a no_sync loop draws them in
        micro: Iterator[tuple[torch.Tensor, torch.Tensor]] = (self.data.batch() for _ in range(k))
        if self.config.grain:  # the global batch, this rank's rows; dropout keyed by grain
            x, y = self.data.batch()
            rows = self.data.rows
            grads, loss = self.grad(self.mine if self.zero == 3 else self.params, x[rows], y[rows])
            losses = [loss]
        elif self.zero == 3:
            grads, losses = self.accumulate_sharded(micro)
        else:
            grads, losses = self.grad.accumulate(self.params, micro, count=k)
        if self.zero >= 2:  # this rank's rows: the norm of the full gradient, from every rank's
            # (with --grain by rows, in one order: the same bits on every world size)
            grads, norm = fr.distributed.clip_grad_norm(
                grads, self.config.clip, reproducible=bool(self.config.grain)
            )
        else:  # the full gradient: clip_grad_norm_'s, bit for bit
            grads, norm = fr.clip_grad_norm(grads, self.config.clip)
            if self.zero == 1:
                grads = fr.distributed.shard(grads)
        self.mine, self.opt_state = self.update(self.mine, grads, self.opt_state)
        if self.zero in (1, 2):
            assert self.params is not None
            self.params = fr.distributed.all_gather(self.mine, self.params)
        elif self.zero == 0:
            self.params = self.mine
        return float(sum(losses)), float(norm)

    def accumulate_sharded(self, micro: Iterator[Any]) -> tuple[Params, list[torch.Tensor]]:
        """ZeRO-3's gradient of the step: each micro-batch's rows of the mean gradient, summed.

        Each backward pass reduce-scatters its own gradient (the gathers'
        transpose), where DDP under ``no_sync`` sums the micro-batches' local
        gradients first and all-reduces once: the same sum, in another order.
        """
        total: Params = {}
        losses = []
        for x, y in micro:
            grads, loss = self.grad(self.mine, x, y)
            total = {k: total[k] + g for k, g in grads.items()} if total else grads
            losses.append(loss)
        return total, losses

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        # the trained parameters, never the module's own: `self.model(x)` would use the initial ones
        if self.params is None:  # ZeRO-3: each block gathered as it runs
            state = fr.State(self.mine, {})
            return fr.distributed.apply_sharded(self.model, state, x, units=self.units)[0]
        return fr.apply(self.model, fr.State(self.params, {}), x)[0]

    def mean_over_ranks(self, tree: Any) -> Any:
        return fr.distributed.all_reduce(tree)

    def parameters(self) -> Params:
        """The full parameters (ZeRO-3: all-gathered, so every rank calls it)."""
        if self.params is not None:
            return self.params
        like = {k: torch.empty_like(p, device="cpu") for k, p in self.like.items()}
        return fr.distributed.all_gather(self.mine, like)

    def optimizer_state(self) -> Any:
        # the leaves only: torchopt's states are NamedTuples that torch.load(weights_only=True)
        # does not know; a fresh init gives back their structure
        return optree.tree_leaves(self.opt_state, namespace="torchopt")

    def full_optimizer_state(self) -> Any:
        """The optimizer state's leaves, whole (``--zero``: every rank's rows all-gathered)."""
        if not self.zero:
            return self.optimizer_state()
        like = {k: torch.empty_like(p, device="cpu") for k, p in self.like.items()}
        return fr.distributed.all_gather(self.optimizer_state(), self._leaves(self.init(like)))

    def load(self, checkpoint: dict[str, Any]) -> None:
        if self.zero:
            self.load_sharded(checkpoint["path"])
        else:
            self.params = self.mine = dict(checkpoint["params"])
            like = optree.tree_structure(self.init(self.params), namespace="torchopt")
            self.opt_state = optree.tree_unflatten(like, checkpoint["optimizer"])
        if self.config.grain:  # the dropout masks of the steps the checkpoint had not run
            self.grad.grains.step = checkpoint["step"]

    # --- ZeRO's checkpoints: every rank writes and reads its own rows ---------------------------

    def save_sharded(self, path: str) -> None:
        fr.distributed.save_sharded(
            path,
            {"mine": self.mine, "optimizer": self.optimizer_state()},
            like={"mine": self.like, "optimizer": self._leaves(self.init(self.like))},
        )

    def load_sharded(self, path: str) -> None:
        layout = {"mine": self.mine, "optimizer": self.optimizer_state()}
        got = fr.distributed.load_sharded(path, layout)
        self.mine = got["mine"]
        structure = optree.tree_structure(self.opt_state, namespace="torchopt")
        self.opt_state = optree.tree_unflatten(structure, got["optimizer"])
        if self.params is not None:
            self.params = fr.distributed.all_gather(self.mine, self.params)

    @staticmethod
    def _leaves(state: Any) -> list[Any]:
        return optree.tree_leaves(state, namespace="torchopt")


class Stateful:
    """The same step on DistributedDataParallel, torch.optim.AdamW and clip_grad_norm_."""

    def __init__(self, config: Config, model: GPT, data: Data) -> None:
        self.config, self.model, self.data = config, model, data
        self.ddp = DistributedDataParallel(model)
        if config.compile:
            self.ddp = torch.compile(self.ddp)  # type: ignore[assignment]
        named = dict(model.named_parameters())
        decay = decayed(named)
        groups = [
            {
                "params": [p for k, p in named.items() if decay[k]],
                "weight_decay": config.weight_decay,
            },
            {"params": [p for k, p in named.items() if not decay[k]], "weight_decay": 0.0},
        ]
        self.lr = schedule(config)
        self.optimizer = torch.optim.AdamW(
            groups, lr=self.lr(0), betas=(config.beta1, config.beta2), eps=config.eps
        )
        self.updates = 0

    def step(self) -> tuple[float, float]:
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr(self.updates)
        k, losses = self.config.accumulate, []
        for i in range(k):
            x, y = self.data.batch()
            with self.ddp.no_sync() if i < k - 1 else nullcontext():
                with autocast(self.config):
                    loss = cross_entropy(self.ddp(x), y) / k
                loss.backward()
            losses.append(loss.detach())
        norm = torch.nn.utils.clip_grad_norm_(self.ddp.parameters(), self.config.clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.updates += 1
        return float(sum(losses)), float(norm)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def mean_over_ranks(self, tree: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        flat = torch.stack(list(tree.values()))
        dist.all_reduce(flat)
        return dict(zip(tree, flat / dist.get_world_size()))

    def parameters(self) -> Params:
        # named_parameters: the tied weight once, under its first name, as fr.state has it
        return {k: p.detach().clone() for k, p in self.model.named_parameters()}

    def optimizer_state(self) -> Any:
        return self.optimizer.state_dict()

    def load(self, checkpoint: dict[str, Any]) -> None:
        with torch.no_grad():
            for k, p in self.model.named_parameters():
                p.copy_(checkpoint["params"][k])
        self.optimizer.load_state_dict(checkpoint["optimizer"])
        self.updates = checkpoint["step"]


Side = Functional | Stateful


# ---------------------------------------------------------------- the loop


def evaluate(config: Config, side: Side, data: Data, rank: int) -> dict[str, float]:
    """The mean loss on ``eval_batches`` batches of each split, over the ranks.

    The batches come from generators of their own, the same at every
    evaluation, so that evaluating draws nothing from the training stream.
    With ``--grain`` they are global batches, the same on every world size,
    of which each rank evaluates its rows.
    """
    side.model.eval()
    means = {}
    stream = 0 if config.grain else rank
    with torch.no_grad(), autocast(config):
        for i, split in enumerate(("train", "val")):
            g = torch.Generator().manual_seed(config.seed + 1000 * (stream + 1) + i)
            batches = [data.batch(split, g) for _ in range(config.eval_batches)]
            means[split] = torch.stack(
                [cross_entropy(side.logits(x[data.rows]), y[data.rows]) for x, y in batches]
            ).mean()
    side.model.train()
    return {k: float(v) for k, v in side.mean_over_ranks(means).items()}


def sample(config: Config, side: Side, data: Data) -> str:
    """``sample_chars`` characters generated after a newline (temperature 0.8, a seeded generator)."""
    side.model.eval()
    g = torch.Generator().manual_seed(config.seed)
    ids = data.vocab.encode("\n")[None]
    with torch.no_grad(), autocast(config):
        for _ in range(config.sample_chars):
            logits = side.logits(ids[:, -config.block_size :])[:, -1].float()
            probs = F.softmax(logits / 0.8, dim=-1)
            ids = torch.cat([ids, torch.multinomial(probs, 1, generator=g)], dim=1)
    side.model.train()
    return data.vocab.decode(ids[0, 1:])


def save(path: str, config: Config, side: Side, step: int) -> None:
    """One file, written by rank 0: parameters, optimizer state, and every rank's random stream.

    With ``--zero``, a directory: ``state/``, every rank's rows of the
    parameters and of the optimizer state (``fr.distributed.save_sharded``),
    and ``meta.pt``, rank 0's file of the rest.
    """
    streams: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(streams, torch.get_rng_state())
    meta = {"config": dataclasses.asdict(config), "step": step, "rng": streams}
    if isinstance(side, Functional) and side.zero:
        save_directory(path, side, meta)
        return
    if dist.get_rank() == 0:
        checkpoint = {**meta, "params": side.parameters(), "optimizer": side.optimizer_state()}
        torch.save(checkpoint, path + ".tmp")
        os.replace(path + ".tmp", path)  # a run stopped mid-write leaves the previous file
    dist.barrier()


def save_directory(path: str, side: Functional, meta: dict[str, Any]) -> None:
    """A ZeRO checkpoint, written beside the previous one and swapped in once complete."""
    rank, tmp, old = dist.get_rank(), path + ".tmp", path + ".old"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    dist.barrier()
    side.save_sharded(os.path.join(tmp, "state"))  # collective: every rank writes its rows
    if rank == 0:
        torch.save(meta, os.path.join(tmp, "meta.pt"))
        shutil.rmtree(old, ignore_errors=True)
        if os.path.exists(path):
            os.replace(path, old)
        os.replace(tmp, path)  # a run stopped mid-write leaves the previous directory
        shutil.rmtree(old, ignore_errors=True)
    dist.barrier()


def read(path: str) -> dict[str, Any]:
    """A checkpoint's contents: the file, or a ZeRO directory's ``meta.pt`` and where its rows are."""
    if os.path.isdir(path):
        return {**torch.load(os.path.join(path, "meta.pt")), "path": os.path.join(path, "state")}
    return torch.load(path)  # weights_only=True


@dataclass
class Run:
    """A run ready to step: its configuration (a checkpoint's, when resuming), data, side, first step."""

    config: Config
    data: Data
    side: Side
    first: int


def start(config: Config, say: Callable[[str], None]) -> Run:
    """Build the model and the side, or load them from ``config.resume``; seed this rank's stream."""
    rank, world = dist.get_rank(), dist.get_world_size()
    checkpoint = read(config.resume) if config.resume else None
    if checkpoint is not None:
        where = {k: getattr(config, k) for k in _WHERE}
        config = Config(**{**checkpoint["config"], **where})
        if len(checkpoint["rng"]) != world and not config.grain:
            raise ValueError(
                f"{config.resume} was written by {len(checkpoint['rng'])} ranks; resume it on as many"
            )
    if config.grain and (config.batch_size // config.grain) % world:
        raise ValueError(
            f"--grain {config.grain} cuts the global batch (--batch-size {config.batch_size}) "
            f"into {config.batch_size // config.grain} grains, which {world} ranks cannot share "
            "alike: run on a power of two of ranks, at most as many as grains"
        )
    data = Data(config, rank, world)
    torch.manual_seed(config.seed)
    model = GPT(
        GPTConfig(
            vocab_size=len(data.vocab),
            block_size=config.block_size,
            n_layer=config.n_layer,
            n_head=config.n_head,
            n_embd=config.n_embd,
            dropout=config.dropout,
        )
    )
    side: Side = Stateful(config, model, data) if config.ddp else Functional(config, model, data)
    # this rank's stream: its batches, its dropout masks; with --grain every rank's is the same (the
    # global batches), and dropout draws from generators keyed by grain, not from it
    stream = 0 if config.grain else rank
    torch.manual_seed(config.seed + 1 + stream)
    if checkpoint is None:
        n = sum(p.numel() for p in side.parameters().values())
        say(
            f"{'DDP' if config.ddp else 'freplicate'}"
            f"{f' ZeRO-{config.zero}' if config.zero else ''}"
            f"{f' grains of {config.grain}' if config.grain else ''}, {world} ranks of "
            f"{torch.get_num_threads()} threads, {n:,} parameters, vocabulary of "
            f"{len(data.vocab)}, optimizer {'torch.optim.AdamW' if config.ddp else config.optimizer}"
        )
        return Run(config, data, side, 0)
    side.load(checkpoint)
    torch.set_rng_state(checkpoint["rng"][stream])  # --grain: any world size resumes
    say(f"resuming {config.resume} at step {checkpoint['step']}")
    return Run(config, data, side, checkpoint["step"])


def train(config: Config, log: Callable[[str], None] | None = print) -> dict[str, Any]:
    """Train on the ranks of the default process group; what every rank saw, for the tests.

    Returns:
        ``{"first": the first step run (after a resume, the checkpoint's),
        "loss": this rank's loss at each step, "norm": the gradient norm
        before clipping, "ms": each step's time on this rank,
        "eval": [(step, train loss, val loss)], "sample": generated text,
        "params": the final parameters, "optimizer": this rank's optimizer
        state (``side.optimizer_state()``)}``. Rank 0 prints the sha256 of
        the final parameters and its optimizer state (``fingerprint``).
    """
    rank = dist.get_rank()
    say = log if log is not None and rank == 0 else (lambda _: None)
    run = start(config, say)
    config, data, side = run.config, run.data, run.side
    history: dict[str, Any] = {"first": run.first, "loss": [], "norm": [], "ms": [], "eval": []}
    lr = schedule(config)
    last = config.steps if config.stop_after is None else min(config.steps, config.stop_after)
    for it in range(run.first, last):
        begin = time.perf_counter()
        loss, norm = side.step()
        history["ms"].append(1e3 * (time.perf_counter() - begin))
        history["loss"].append(loss)
        history["norm"].append(norm)
        done = it + 1
        if done % 10 == 0 or done == run.first + 1:
            ms = history["ms"][-1]
            say(f"step {done}: loss {loss:.4f}, lr {lr(it):.2e}, norm {norm:.3f}, {ms:.1f} ms")
        if done % config.eval_every == 0 or done == last:
            losses = evaluate(config, side, data, rank)
            history["eval"].append((done, losses["train"], losses["val"]))
            say(f"eval at step {done}: train {losses['train']:.4f}, val {losses['val']:.4f}")
            if config.checkpoint:
                save(config.checkpoint, config, side, done)
                say(f"checkpoint {config.checkpoint} at step {done}")
    history["sample"] = sample(config, side, data) if config.sample_chars else ""
    say(f"sample:\n{history['sample']}")
    history["params"] = {k: p.detach().clone() for k, p in side.parameters().items()}
    full = getattr(side, "full_optimizer_state", side.optimizer_state)
    history["optimizer"] = full()  # with --zero: gathered (a collective), the same on every rank
    if rank == 0:
        say(f"sha256 of the parameters and the optimizer state: {fingerprint(history)}")
    return history


def fingerprint(history: dict[str, Any]) -> str:
    """The sha256 of a run's final parameters and optimizer state: names, dtypes, shapes, bytes.

    Two runs print the same exactly when their parameters and optimizer
    states are the same bits (``--grain`` on 1, 2 and 4 ranks, for one).
    With ``--zero``, the optimizer state is gathered whole from every rank's rows.
    """
    leaves, spec = optree.tree_flatten(
        (history["params"], history["optimizer"]), namespace="torchopt"
    )
    digest = hashlib.sha256(str(spec).encode())
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            t = leaf.detach().cpu().contiguous()
            digest.update(f"{t.dtype} {tuple(t.shape)}".encode())
            digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        else:
            digest.update(repr(leaf).encode())
    return digest.hexdigest()


def parse(argv: list[str] | None) -> Config:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for f in dataclasses.fields(Config):
        flag, extra = "--" + f.name.replace("_", "-"), dict(f.metadata)
        if isinstance(f.default, bool):
            parser.add_argument(flag, action="store_true", help=extra["help"])
        else:
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
