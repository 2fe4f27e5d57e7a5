"""The sides of the ``shard`` benchmark, and the accounting that says where their memory goes.

A *side* is one way to train on 2 gloo ranks with AdamW: DDP + ``torch.optim.AdamW``,
DDP + ``ZeroRedundancyOptimizer``, FSDP2's ``fully_shard`` + AdamW, and freplicate's
ZeRO-1, ZeRO-2 and ZeRO-3 (eager and compiled). Each exposes ``step()`` (one
training step, what is timed), ``full()`` (the full parameters, to check it
against DDP + AdamW), ``state_bytes()`` (its optimizer state on this rank) and
``roles()`` (its tensors by what they are, for the accounting), and calls
``mark(phase, **trees)`` at the boundaries of its step (after the backward pass,
after the optimizer update, after the all-gather), a no-op unless counted.

The accounting (``Census``): the live heap (glibc's ``mallinfo2``: bytes in
use, mmapped blocks included: every tensor on the CPU is one) polled after
every operator of a step (a ``TorchDispatchMode``), and, at each mark and at
the operator where the heap peaked, every tensor storage Python reaches
(``gc``, unique storages by ``data_ptr``), each put under the first role that
views it: parameters, shards, gradients, optimizer state, freplicate's pooled
communication buffers no result views (``_plans._PLANS``), tensors autograd
saved for the backward pass (``saved_tensors_hooks``), other tensors; what the
heap holds beyond them is not reached from Python (autograd's gradients in
flight, DDP's buckets, gloo's scratch).
"""

from __future__ import annotations

import copy
import ctypes
import gc
import re
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import freplicate as fr

LR, WD, BETAS, EPS = 1e-3, 1e-2, (0.9, 0.999), 1e-8
MiB = 2**20

DDP_ADAMW = "DDP + AdamW"
DDP_ZERO = "DDP + ZeroRedundancyOptimizer"
FSDP2 = "FSDP2 + AdamW"
ZERO = {1: "fr ZeRO-1", 2: "fr ZeRO-2", 3: "fr ZeRO-3"}
# docs/sharding.md's ZeRO-3 loop: torch.optim.AdamW over the shards, loss.backward(); and the
# same with fr.clear_caches() after every step (what freplicate's buffer pools keep, measured)
ZERO3_TORCH = "fr ZeRO-3 + torch.optim"
ZERO3_CLEARED = "fr ZeRO-3 + torch.optim, pools cleared"
# mixed precision (issue 30): FSDP2's MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)
# on fully_shard (each unit and the root) and as apply_sharded's mp_policy=, the loss in float32
BF16 = ", bf16"
FSDP2_BF16 = FSDP2 + BF16
ZERO3_BF16 = ZERO3_TORCH + BF16
# the units apply_sharded takes by default (``units=None``: on the Llama the embedding, each
# decoder layer, the final norm and the head, each a unit), FSDP2's fully_shard on the same
# modules and the root; the other sides' units are the model's ``units`` (the layers alone)
DEFAULT_UNITS = ", fr's default units"
FSDP2_UNITS = FSDP2 + DEFAULT_UNITS
ZERO3_UNITS = ZERO3_TORCH + DEFAULT_UNITS
COMPILED = " compiled"
SIDES = (
    DDP_ADAMW,
    DDP_ZERO,
    FSDP2,
    *ZERO.values(),
    ZERO3_TORCH,
    ZERO3_CLEARED,
    FSDP2_BF16,
    ZERO3_BF16,
    FSDP2_UNITS,
    ZERO3_UNITS,
    *(z + COMPILED for z in ZERO.values()),
)
# hybrid sharding (HSDP, issue 30) on 4 ranks: a 2 x 2 DeviceMesh ("replicate", "shard"),
# fully_shard(mesh=mesh) and apply_sharded(group=mesh), beside DDP + AdamW on the 4 ranks
MESH = ", 2x2 mesh"
FSDP2_HSDP = FSDP2 + MESH
ZERO3_HSDP = ZERO3_TORCH + MESH
HSDP_SIDES = (DDP_ADAMW, FSDP2_HSDP, ZERO3_HSDP)
HSDP_WORLD, HSDP_SHAPE = 4, (2, 2)
# the side each one is held to after 3 steps (``agree``): DDP + AdamW's, but bf16 compute's and
# the mesh's ZeRO-3, held to FSDP2 with the same policy or mesh (bit for bit, docs/sharding.md)
REFERENCE = {ZERO3_BF16: FSDP2_BF16, ZERO3_HSDP: FSDP2_HSDP, ZERO3_UNITS: FSDP2_UNITS}
#: a Hugging Face ``LlamaForCausalLM`` from a config, random weights (``build``: 24M parameters)
LLAMA = "llama"
LLAMA_CONFIG: dict[str, Any] = {
    "vocab_size": 8192,
    "hidden_size": 384,
    "intermediate_size": 1024,
    "num_hidden_layers": 10,
    "num_attention_heads": 6,
    "num_key_value_heads": 6,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}
LLAMA_BATCH, LLAMA_SEQ = 2, 128
STATEFUL = {DDP_ADAMW: "adamw", DDP_ZERO: "zero", FSDP2: "fsdp2"}


def _no_mark(phase: str, **trees: Any) -> None:
    """What a side calls at the boundaries of its step, unless a ``Census`` counts it."""


def missing(name: str) -> str | None:
    """Why side ``name`` cannot run here (``None``: it can)."""
    if name == FSDP2:
        try:
            from torch.distributed.fsdp import fully_shard  # noqa: F401
        except ImportError as err:
            return f"torch.distributed.fsdp.fully_shard: {err}"
    return None


def make(name: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor, **kw: Any) -> Any:
    """Side ``name`` on ``model`` (left as it is: each side trains its own copy)."""
    bf16, mesh, default = name.endswith(BF16), name.endswith(MESH), name.endswith(DEFAULT_UNITS)
    base = name.removesuffix(BF16).removesuffix(MESH).removesuffix(DEFAULT_UNITS)
    if base in STATEFUL:
        return Stateful(model, x, y, STATEFUL[base], bf16=bf16, mesh=mesh, default=default)
    if base in (ZERO3_TORCH, ZERO3_CLEARED):
        cleared = base == ZERO3_CLEARED
        return Zero3Torch(model, x, y, cleared=cleared, bf16=bf16, mesh=mesh, default=default)
    stage = next(s for s, z in ZERO.items() if name.startswith(z))
    return Functional(model, x, y, stage, compiled=name.endswith(COMPILED), **kw)


class Llama(nn.Module):
    """``LlamaForCausalLM`` whose forward gives the logits as rows (``F.cross_entropy``'s input)."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        self.llama = LlamaForCausalLM(LlamaConfig(**LLAMA_CONFIG))
        layers = LLAMA_CONFIG["num_hidden_layers"]
        # ZeRO-3's units, FSDP2's and apply_sharded's: each decoder layer (torchtitan's
        # wrapping; the embedding, final norm and head the root's, kept for the whole step)
        self.units = [f"llama.model.layers.{i}" for i in range(layers)]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.llama(input_ids=ids).logits.flatten(0, 1)  # type: ignore[no-any-return]


def build(name: str) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """``(model, input, target)``: ``_common.build``'s models, and ``LLAMA`` (seeded with 0)."""
    if name != LLAMA:
        from ._common import build as common

        return common(name)
    torch.manual_seed(0)
    model = Llama()
    ids = torch.randint(0, LLAMA_CONFIG["vocab_size"], (LLAMA_BATCH, LLAMA_SEQ + 1))
    return model, ids[:, :-1], ids[:, 1:].flatten()


def mp_policy() -> Any:
    """FSDP2's ``MixedPrecisionPolicy``: gathered and computed in bf16, reduced in float32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def hsdp_mesh() -> Any:
    """The 2-D mesh of hybrid sharding: ``HSDP_SHAPE`` = (replicate, shard), on ``"cpu"`` (gloo);
    every rank calls it (it makes the mesh's groups)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", HSDP_SHAPE, mesh_dim_names=("replicate", "shard"))


def unit_names(model: nn.Module) -> list[str]:
    """ZeRO-3's units (FSDP2's, apply_sharded's): the model's ``units`` where it names them
    (``Llama``), else the direct children that hold parameters."""
    named = getattr(model, "units", None)
    if isinstance(named, list):
        return named
    return [n for n, m in model.named_children() if next(m.parameters(), None) is not None]


def default_unit_names(model: nn.Module) -> list[str]:
    """The units ``apply_sharded`` takes for ``units=None`` (freplicate's own planning)."""
    from freplicate._distributed._units import unit_names as planned

    return list(planned(model, None, "bench_shard", run=False))


def units(model: nn.Module, default: bool = False) -> list[nn.Module]:
    """The modules ``unit_names`` names (``default``: ``default_unit_names``)."""
    names = default_unit_names(model) if default else unit_names(model)
    return [model.get_submodule(n) for n in names]


# --- the stateful sides -------------------------------------------------------------------


class Stateful:
    """DDP + AdamW (``kind="adamw"``), DDP + ZeroRedundancyOptimizer(AdamW) (``"zero"``), or
    FSDP2's ``fully_shard`` on every unit and on the root + AdamW (``"fsdp2"``; ``bf16``: with
    ``mp_policy()``; ``mesh``: on ``hsdp_mesh()``, hybrid sharding).

    ``torch.optim.AdamW`` as it comes: on CPU its default, the single-tensor loop.
    """

    def __init__(
        self,
        model: nn.Module,
        x: torch.Tensor,
        y: torch.Tensor,
        kind: str,
        bf16: bool = False,
        mesh: bool = False,
        default: bool = False,
    ) -> None:
        own = copy.deepcopy(model)
        options: dict[str, Any] = {"lr": LR, "betas": BETAS, "eps": EPS, "weight_decay": WD}
        self.kind, self.module, self.mark = kind, own, _no_mark
        if kind == "fsdp2":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            # on the CPU over gloo: a 1-D mesh of device type "cpu" over the default group
            on = hsdp_mesh() if mesh else init_device_mesh("cpu", (dist.get_world_size(),))
            policy = mp_policy() if bf16 else MixedPrecisionPolicy()
            for unit in units(own, default):
                fully_shard(unit, mesh=on, mp_policy=policy)
            fully_shard(own, mesh=on, mp_policy=policy)
            run: nn.Module = own
            self.opt: Any = torch.optim.AdamW(own.parameters(), **options)
        else:
            from torch.distributed.optim import ZeroRedundancyOptimizer
            from torch.nn.parallel import DistributedDataParallel

            run = DistributedDataParallel(own)
            if kind == "adamw":
                self.opt = torch.optim.AdamW(own.parameters(), **options)
            else:
                self.opt = ZeroRedundancyOptimizer(
                    own.parameters(), optimizer_class=torch.optim.AdamW, **options
                )
        self.run, self.x, self.y = run, x, y

    def step(self) -> None:
        self.opt.zero_grad()
        # .float(): bf16 logits (mixed precision) into a float32 loss; float32's is itself
        F.cross_entropy(self.run(self.x).float(), self.y).backward()
        self.mark("backward")
        self.opt.step()
        self.mark("update")

    def full(self) -> dict[str, torch.Tensor]:
        """Every parameter whole (FSDP2's gathered: a collective, every rank calls it)."""
        return {
            k: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach()
            for k, p in self.module.named_parameters()
        }

    def _state(self) -> list[torch.Tensor]:
        opt = getattr(self.opt, "optim", self.opt)  # ZeroRedundancyOptimizer's local optimizer
        return [_local(t) for s in opt.state.values() for t in s.values() if _is_tensor(t)]

    def state_bytes(self) -> int:
        return sum(t.nbytes for t in self._state())

    def roles(self) -> list[tuple[str, list[torch.Tensor]]]:
        params: list[torch.Tensor] = list(self.module.parameters())
        grads = [p.grad for p in params if p.grad is not None]
        if self.kind != "fsdp2":
            return [("params", params), ("grads", grads), ("opt state", self._state())]
        return [
            ("params", _fsdp2_unsharded(self.module)),
            ("shards", [_local(p) for p in params]),
            ("grads", [_local(g) for g in grads]),
            ("opt state", self._state()),
        ]


def _is_tensor(t: Any) -> bool:
    return isinstance(t, torch.Tensor)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard; any other tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t  # type: ignore[no-any-return]


def _fsdp2_unsharded(module: nn.Module) -> list[torch.Tensor]:
    """FSDP2's full parameters and all-gather outputs where they exist now (its internals:
    nothing where they are not found)."""
    out: list[torch.Tensor] = []
    for m in module.modules():
        try:
            group = m._get_fsdp_state()._fsdp_param_group  # type: ignore[operator]
        except (AttributeError, TypeError):
            continue
        for fp in getattr(group, "fsdp_params", None) or []:
            out += [t for t in getattr(fp, "all_gather_outputs", []) if _is_tensor(t)]
            if _is_tensor(getattr(fp, "_unsharded_param", None)):
                out.append(fp._unsharded_param)
    return out


# --- freplicate's sides ---------------------------------------------------------------------


def adamw(p: Any, g: Any, m: Any, v: Any, step: Any) -> tuple[Any, ...]:
    """AdamW on lists of tensors, out of place. ``step`` an int: ``torch.optim.AdamW``'s
    single-tensor arithmetic (on CPU the foreach ops run its per-tensor kernels: the same bits);
    a float64 tensor: its capturable arithmetic, which a compiled step runs without recompiling."""
    b1, b2 = BETAS
    m = torch._foreach_lerp(m, g, 1 - b1)
    v = torch._foreach_addcmul(torch._foreach_mul(v, b2), g, g, value=1 - b2)
    decayed = torch._foreach_mul(p, 1 - LR * WD)
    if isinstance(step, int):
        step_size = LR / (1 - b1**step)
        denom = torch._foreach_add(
            torch._foreach_div(torch._foreach_sqrt(v), (1 - b2**step) ** 0.5), EPS
        )
        return torch._foreach_addcdiv(decayed, m, denom, value=-step_size), m, v
    neg = (-(LR / (1 - b1**step))).float()
    root = (1 - b2**step).sqrt().float()
    denom = torch._foreach_add(torch._foreach_div(torch._foreach_sqrt(v), root * neg), EPS / neg)
    return torch._foreach_addcdiv(decayed, m, denom), m, v


def adamw_(p: Any, g: Any, m: Any, v: Any, step: Any) -> tuple[Any, ...]:
    """``adamw`` in place, tensor by tensor: ``torch.optim.AdamW``'s own single-tensor loop (the
    same bits), whose temporaries are one tensor's at a time; returns ``p, m, v`` themselves."""
    b1, b2 = BETAS
    if isinstance(step, int):
        step_size: Any = -LR / (1 - b1**step)
        root: Any = (1 - b2**step) ** 0.5
        eps: Any = EPS
    else:
        neg = (-(LR / (1 - b1**step))).float()
        root, eps, step_size = (1 - b2**step).sqrt().float() * neg, EPS / neg, None
    for pi, gi, mi, vi in zip(p, g, m, v):
        pi.mul_(1 - LR * WD)
        mi.lerp_(gi, 1 - b1)
        vi.mul_(b2).addcmul_(gi, gi, value=1 - b2)
        denom = (vi.sqrt() / root).add_(eps)
        if step_size is None:
            pi.addcdiv_(mi, denom)
        else:
            pi.addcdiv_(mi, denom, value=step_size)
    return p, m, v


class Functional:
    """freplicate's ZeRO step of docs/sharding.md at ``stage`` 1, 2 or 3, AdamW on this rank's
    rows (``adamw``: ``torch.optim.AdamW``'s bits), eager or compiled (Inductor, ``fullgraph``).

    - 1: ``fr.distributed.grad_and_value`` (gradients all-reduced whole), then this rank's rows
      (``shard``), AdamW, ``all_gather`` of the new parameters;
    - 2: ``grad_and_value(..., shard=True)`` (reduce-scattered from the backward pass), AdamW,
      ``all_gather``;
    - 3: ``fr.grad_and_value`` of a loss calling ``fr.distributed.apply_sharded(module,
      State(shards, buffers), x)`` (compiled: ``torch.autograd.grad`` inside the graph, where
      ``fr.grad_and_value`` is refused), AdamW; no full parameters kept.

    ``in_place``: AdamW updates this rank's shards and moments in place (``adamw_``, as
    ``torch.optim.AdamW`` does), instead of docs/sharding.md's out-of-place update; eagerly, at
    stages 1 and 2, the shards are then views of the parameters (``fr.distributed.shard``'s
    rows, as ``torch.optim``'s tensors are a module's), taken again from each step's new ones.

    The module the step runs is a copy on the meta device (the step binds every parameter):
    the only full parameters a rank holds are the step's own.
    """

    def __init__(
        self,
        model: nn.Module,
        x: torch.Tensor,
        y: torch.Tensor,
        stage: int,
        compiled: bool,
        in_place: bool = False,
    ) -> None:
        s = fr.state(model)
        names = list(s.params)
        full = {k: v.detach().clone() for k, v in s.params.items()}
        buffers = {k: v.clone() for k, v in s.buffers.items()}
        module = copy.deepcopy(model).to("meta")
        self.module, self.names, self.stage, self.mark = module, names, stage, _no_mark
        self.layout = {k: (v.shape, v.dtype) for k, v in full.items()}  # all_gather's like
        if stage == 3:
            sharded = fr.distributed.apply_sharded

            names_of_units = unit_names(model)

            def zero3_loss(p: dict[str, torch.Tensor]) -> torch.Tensor:
                out, _ = sharded(module, fr.State(p, buffers), x, units=names_of_units)
                return F.cross_entropy(out, y)

            if compiled:  # the loss compiled (one graph), differentiated by autograd outside it
                # (fr.grad_and_value is refused under compile, and Dynamo breaks at autograd.grad)
                compiled_loss = torch.compile(zero3_loss, fullgraph=True, dynamic=False)

                def grad_fn(p: dict[str, torch.Tensor]) -> tuple[Any, torch.Tensor]:
                    p = {k: t.detach().requires_grad_() for k, t in p.items()}
                    loss = compiled_loss(p)
                    grads = torch.autograd.grad(loss, list(p.values()))
                    return dict(zip(p, grads)), loss.detach()

            else:
                grad_fn = fr.grad_and_value(zero3_loss)
        else:

            def loss_fn(p: dict[str, torch.Tensor]) -> torch.Tensor:
                out, _ = fr.apply(module, fr.State(p, buffers), x)
                return F.cross_entropy(out, y)

            grad_fn = fr.distributed.grad_and_value(loss_fn, shard=stage == 2)

        update = adamw_ if in_place else adamw
        # in place and eager, ZeRO-1/2's rows are views of the parameters (as torch.optim's are
        # of a module's), updated in place before the all-gather makes the new ones
        views = in_place and not compiled and stage != 3

        def step(params: Any, mine: list[Any], m: list[Any], v: list[Any], t: Any) -> Any:
            if stage == 3:
                grads, _ = grad_fn(dict(zip(names, mine)))
            else:
                grads, _ = grad_fn(params)
                if stage == 1:
                    grads = fr.distributed.shard(grads)
            if not compiled:
                self.mark("backward", grads=grads)
            t = t + 1
            mine, m, v = update(mine, [grads[k] for k in names], m, v, t)
            if not compiled:
                self.mark("update", shards=mine, **{"opt state": m + v})
            if stage != 3:
                params = fr.distributed.all_gather(dict(zip(names, mine)), params)
                if views:  # the next step's rows: the new parameters'
                    rows = fr.distributed.shard(params)
                    mine = [rows[k] for k in names]
                if not compiled:
                    self.mark("all-gather", params=params)
            return params, mine, m, v, t

        # dynamic=False: the same step's code on another model would retrace with symbolic
        # sizes, which fr.distributed's traced layout check cannot take (reported)
        if compiled and stage == 3:  # its loss compiled above, and the update on its own
            update = torch.compile(update, fullgraph=True, dynamic=False)
            self._step = step
        else:
            self._step = torch.compile(step, fullgraph=True, dynamic=False) if compiled else step
        self.params = None if stage == 3 else full
        # fresh tensors, not views of the parameters (but in place, eagerly): a compiled step
        # would guard on the alias
        rows = fr.distributed.shard(full)
        self.mine = [rows[k] if views else rows[k].clone() for k in names]
        self.m = [torch.zeros_like(t) for t in self.mine]
        self.v = [torch.zeros_like(t) for t in self.mine]
        self.t: Any = torch.zeros((), dtype=torch.float64) if compiled else 0
        del full

    def step(self) -> None:
        self.params, self.mine, self.m, self.v, self.t = self._step(
            self.params, self.mine, self.m, self.v, self.t
        )

    def full(self) -> dict[str, torch.Tensor]:
        if self.params is not None:
            return self.params
        like = {k: torch.empty(shape, dtype=dtype) for k, (shape, dtype) in self.layout.items()}
        return fr.distributed.all_gather(dict(zip(self.names, self.mine)), like)  # type: ignore[no-any-return]

    def state_bytes(self) -> int:
        return sum(t.nbytes for t in self.m + self.v)

    def roles(self) -> list[tuple[str, list[torch.Tensor]]]:
        params = [] if self.params is None else list(self.params.values())
        return [("params", params), ("shards", self.mine), ("opt state", self.m + self.v)]


class Zero3Torch:
    """docs/sharding.md's ZeRO-3 loop: this rank's rows as tensors of its own (``requires_grad``),
    ``torch.optim.AdamW`` over them, and ``zero_grad``, ``loss.backward()`` through
    ``fr.distributed.apply_sharded`` (this rank's rows of the mean gradient into ``.grad``),
    ``step`` (the rows updated in place). The module it runs is a copy on the meta device.
    ``cleared``: ``fr.clear_caches()`` after every step, which lets go of the communication
    buffers ``fr.distributed`` pools for the next step (a measurement of what they hold, not a
    recipe: the next step plans its calls again). ``bf16``: ``apply_sharded(...,
    mp_policy=mp_policy())``, the loss of the bf16 logits in float32 (FSDP2's with the same
    policy). ``mesh``: hybrid sharding, ``group=hsdp_mesh()`` (the shards the mesh's rows).
    ``default``: ``units=None``, apply_sharded's own units, instead of the model's ``units``."""

    def __init__(
        self,
        model: nn.Module,
        x: torch.Tensor,
        y: torch.Tensor,
        cleared: bool = False,
        bf16: bool = False,
        mesh: bool = False,
        default: bool = False,
    ) -> None:
        s = fr.state(model)
        self.cleared = cleared
        buffers = {k: v.clone() for k, v in s.buffers.items()}
        self.module, self.mark = copy.deepcopy(model).to("meta"), _no_mark
        self.layout = {k: (v.shape, v.dtype) for k, v in s.params.items()}
        self.group = group = hsdp_mesh() if mesh else None
        self.shards = {
            k: t.detach().clone().requires_grad_()
            for k, t in fr.distributed.shard(s.params, group=group).items()
        }
        self.opt = torch.optim.AdamW(
            self.shards.values(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD
        )
        names, module = unit_names(model), self.module
        options: dict[str, Any] = {"units": None if default else names}
        if group is not None:
            options["group"] = group
        if bf16:
            options["mp_policy"] = mp_policy()

        def loss_fn(shards: dict[str, torch.Tensor]) -> torch.Tensor:
            out, _ = fr.distributed.apply_sharded(module, fr.State(shards, buffers), x, **options)
            return F.cross_entropy(out.float(), y)

        self.loss_fn = loss_fn

    def step(self) -> None:
        self.opt.zero_grad()
        self.loss_fn(self.shards).backward()
        self.mark("backward", grads=[t.grad for t in self.shards.values()])
        self.opt.step()
        self.mark("update")
        if self.cleared:
            fr.clear_caches()

    def full(self) -> dict[str, torch.Tensor]:
        like = {k: torch.empty(shape, dtype=dtype) for k, (shape, dtype) in self.layout.items()}
        mine = {k: t.detach() for k, t in self.shards.items()}
        return fr.distributed.all_gather(mine, like, group=self.group)  # type: ignore[no-any-return]

    def _state(self) -> list[torch.Tensor]:
        return [t for s in self.opt.state.values() for t in s.values() if _is_tensor(t)]

    def state_bytes(self) -> int:
        return sum(t.nbytes for t in self._state())

    def roles(self) -> list[tuple[str, list[torch.Tensor]]]:
        shards = list(self.shards.values())
        grads = [t.grad for t in shards if t.grad is not None]
        return [("shards", shards), ("grads", grads), ("opt state", self._state())]


def agree(sides: dict[str, Any], steps: int = 3) -> dict[str, float]:
    """Each side's largest parameter difference to its reference's after ``steps`` steps from
    the same init, as a fraction of the reference's largest parameter update over those steps
    (a wrong step is off by about the update; rounding, by far less). The reference is
    ``REFERENCE``'s where it names one of ``sides``, else the first side. Every rank calls it
    (FSDP2 gathers)."""
    finals = {}
    first = next(iter(sides))
    init = {k: p.clone() for k, p in sides[first].full().items()}
    for name, side in sides.items():
        for _ in range(steps):
            side.step()
        finals[name] = side.full()
    out = {}
    for name, params in finals.items():
        ref = finals[reference(name, sides)]
        update = max(float((p - init[k]).abs().max()) for k, p in ref.items())
        out[name] = max(float((p - ref[k]).abs().max()) for k, p in params.items()) / update
    return out


def reference(name: str, sides: Any) -> str:
    """The side ``name`` is held to among ``sides`` (``agree``)."""
    ref = REFERENCE.get(name)
    return ref if ref is not None and ref in sides else next(iter(sides))


def check_zero3(model_name: str) -> dict[str, float]:
    """The ZeRO-3 sides (``apply_sharded``, eager and compiled) beside DDP + AdamW after 3 steps,
    on this rank (``on_two_ranks`` runs it): their largest difference, as ``agree`` measures
    it, and the optimizer state's share of DDP's."""
    from ._common import build

    model, x, y = build(model_name)
    sides = {name: make(name, model, x, y) for name in (DDP_ADAMW, ZERO[3], ZERO[3] + COMPILED)}
    worst = agree(sides)
    state = sides[ZERO[3]].state_bytes() / sides[DDP_ADAMW].state_bytes()
    return {"eager": worst[ZERO[3]], "compiled": worst[ZERO[3] + COMPILED], "state": state}


# --- the accounting -------------------------------------------------------------------------


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd",
            "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost",
        )
    ]  # fmt: skip


def _mallinfo() -> tuple[Callable[[], int], Callable[[], int]] | tuple[None, None]:
    try:
        libc = ctypes.CDLL("libc.so.6")
        fn = libc.mallinfo2
    except (OSError, AttributeError):
        return None, None  # not glibc >= 2.33: no heap figures, the resident set only
    fn.restype = _Mallinfo2

    def live() -> int:
        info = fn()
        return int(info.uordblks + info.hblkhd)

    def free() -> int:
        return int(fn().fordblks)

    return live, free


#: the live heap, bytes (malloc's in use, mmapped blocks too); the free bytes malloc keeps in its
#: arenas (freed, not given back to the system: part of the resident set where touched)
heap, heap_free = _mallinfo()


def kib(field: str) -> int:
    """A field of /proc/self/status (``VmRSS``, ``VmHWM``), in KiB."""
    with open("/proc/self/status") as f:
        text = f.read()
    return int(re.search(rf"^{field}:\s+(\d+) kB", text, re.M)[1])  # type: ignore[index]


def reset_peak() -> None:
    """The peak resident set (``VmHWM``) starts again from the current one."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _leaves(tree: Any) -> Iterator[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for v in tree.values():
            yield from _leaves(v)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            yield from _leaves(v)


_PLAIN = (torch.Tensor, nn.Parameter)


def _storage(t: torch.Tensor) -> tuple[int, int] | None:
    """``(data_ptr, nbytes)`` of a CPU tensor's storage; ``None`` for one without (a DTensor,
    a freed FSDP2 buffer, the meta device, a subclass: ``apply_sharded``'s stand-ins raise when
    touched outside their unit)."""
    if type(t) not in _PLAIN:
        return None
    try:
        if t.device.type != "cpu" or t.layout != torch.strided:
            return None
        s = t.untyped_storage()
        ptr, nbytes = s.data_ptr(), s.nbytes()
    except (RuntimeError, NotImplementedError, TypeError):
        return None
    return (ptr, nbytes) if ptr and nbytes else None


def _storages(tensors: Iterable[Any]) -> dict[int, int]:
    out = {}
    for t in tensors:
        got = _storage(t)
        if got is not None:
            out[got[0]] = got[1]
    return out


def pools() -> dict[int, tuple[str, int]]:
    """freplicate's pooled communication buffers: data_ptr -> (``kind send|recv|res``, bytes);
    ZeRO-3's units pool none (their buffers are fresh each call)."""
    out: dict[int, tuple[str, int]] = {}
    try:
        from freplicate._distributed import _plans

        plans = list(_plans._PLANS.values())
    except (ImportError, AttributeError):
        return out
    for plan in plans:
        kind = getattr(getattr(getattr(plan, "layout", None), "kind", None), "name", "?")
        for bucket in getattr(plan, "pools", None) or []:
            for which in ("send", "recv", "res"):
                pool = getattr(bucket, which, None)
                for entry in getattr(pool, "entries", None) or []:
                    got = _storage(entry[0])
                    if got is not None:
                        out[got[0]] = (f"{kind} {which}", got[1])
    return out


#: the breakdown's columns: roles first (a storage goes under the first that views it)
COLUMNS = ("params", "shards", "grads", "opt state", "pools idle", "saved", "other", "unseen")


class Census:
    """Where a side's memory is, at the marks of its step and at its peaks (the module's text).

    ``count()`` runs two steps: the first polls the heap after every operator
    and takes a census at each mark; the second takes one right after the
    operator where the first peaked in each phase (the steps are alike once
    warm). A *phase* is the part of the step that ends at a mark
    (``forward``: a forward hook on the module; ``end``: after the last mark,
    up to the step's return).
    """

    def __init__(self, side: Any, start_heap: int) -> None:
        self.side, self.start = side, start_heap
        self.named: dict[str, list[weakref.ref[torch.Tensor]]] = {}
        self.saved: dict[int, weakref.ref[torch.Tensor]] = {}
        self.rows: list[dict[str, Any]] = []
        self.marked: list[str] = []
        self.ops, self.pass_ = 0, "warm"  # "warm", then "marks", then "peaks"
        self.overhead = 0  # what the counting itself keeps (the dispatch mode's caches)
        self.at: dict[int, str] = {}  # second step: operator -> the phase it peaked in
        self.phase_peak: tuple[int, int, str] = (-1, 0, "")  # heap, op, operator
        self.peaks: dict[str, tuple[int, int, str]] = {}  # phase -> its phase_peak

    def mark(self, phase: str, **trees: Any) -> None:
        """What the side calls at a boundary of its step, naming what it holds there."""
        for name, tree in trees.items():
            self.named[name] = [weakref.ref(t) for t in _leaves(tree)]
        if self.pass_ == "marks":
            self.rows.append(self.take(f"after {phase}"))
            self.peaks[phase] = self.phase_peak
        self.phase_peak = (-1, 0, "")
        self.marked.append(phase)

    def _forward(self, *_: Any) -> None:
        self.mark("forward")

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        got = _storage(t)
        if got is not None:
            self.saved[got[0]] = weakref.ref(t)
        return t

    def take(self, label: str) -> dict[str, Any]:
        """The census now: bytes per column, and every pooled buffer with what views it."""
        assert heap is not None
        live = heap() - self.overhead
        # type(), not isinstance: a deprecated module attribute warns when asked its __class__
        alive = _storages(o for o in gc.get_objects() if type(o) in _PLAIN)
        roles = list(self.side.roles())
        roles += [(name, [r() for r in refs]) for name, refs in self.named.items()]
        owner: dict[int, str] = {}
        for name, tensors in roles:
            for ptr in _storages(tensors):
                owner.setdefault(ptr, name)
        saved = {p for p, r in self.saved.items() if r() is not None}
        pooled = pools()
        sums = dict.fromkeys(COLUMNS, 0)
        held: dict[tuple[str, str], list[int]] = {}
        for ptr, nbytes in alive.items():
            if ptr in owner:
                col = owner[ptr]
            elif ptr in pooled:
                col = "pools idle"
            elif ptr in saved:
                col = "saved"
            else:
                col = "other"
            sums[col if col in sums else "other"] += nbytes
            if ptr in pooled:
                held.setdefault((pooled[ptr][0], owner.get(ptr, "idle")), []).append(nbytes)
        sums["unseen"] = live - self.start - sum(alive.values())
        return {
            "label": label,
            "heap": live - self.start,
            **sums,
            "pools": sorted((k, w, sum(n), len(n)) for (k, w), n in held.items()),
            "malloc free": heap_free() if heap_free else 0,
        }

    def _after_op(self, name: str) -> None:
        assert heap is not None
        self.ops += 1
        live = heap() - self.overhead
        if live > self.phase_peak[0]:
            self.phase_peak = (live, self.ops, name)
        phase = self.at.get(self.ops)
        if phase is not None:
            first = self.peaks[phase][0] - self.start
            row = self.take(f"peak in {phase} (after {name})")
            if abs(row["heap"] - first) > MiB:  # the first step's peak was not this step's
                row["label"] += f" [first step: {first / MiB:.1f}]"
            self.rows.append(row)

    def _watch(self) -> TorchDispatchMode:
        after = self._after_op

        class Watch(TorchDispatchMode):
            def __torch_dispatch__(
                self, func: Any, types: Any, args: Any = (), kwargs: Any = None
            ) -> Any:
                out = func(*args, **(kwargs or {}))
                after(str(getattr(func, "__name__", func)))
                return out

        return Watch()

    def _one(self) -> None:
        self.ops, self.named, self.marked = 0, {}, []
        self.phase_peak = (-1, 0, "")
        self.saved.clear()
        hook = self.side.module.register_forward_hook(self._forward)
        self.side.mark = self.mark
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t), self._watch():
                self.side.step()
        finally:
            hook.remove()
            self.side.mark = _no_mark
            self.saved.clear()

    def count(self) -> dict[str, Any]:
        """The census between steps, after each mark and at each phase's peak, in step order."""
        assert heap is not None
        # a first step only to build what counting keeps (the dispatch mode's caches: 24 MiB
        # on small_mlp), then taken off every figure
        gc.collect()
        held = heap()
        self._one()
        gc.collect()
        self.overhead = heap() - held
        first = self.take("between steps")
        self.rows, self.peaks, self.pass_ = [], {}, "marks"
        self._one()
        if self.phase_peak[1]:
            self.peaks["end"] = self.phase_peak
        after = {row["label"].removeprefix("after "): row for row in self.rows}
        self.at = {op: phase for phase, (_, op, _) in self.peaks.items() if op}
        top = max(self.peaks.values())
        self.rows, self.pass_ = [], "peaks"
        self._one()
        peaks = {row["label"].split()[2]: row for row in self.rows}
        rows = [first]
        for phase in [*after, "end"]:
            if phase in peaks:
                if self.peaks[phase] == top:
                    peaks[phase]["label"] = "the step's " + peaks[phase]["label"]
                rows.append(peaks[phase])
            if phase in after:
                rows.append(after[phase])
        return {
            "rows": rows,
            "ops": self.ops,
            "peak": top[0] - self.start,
            "overhead": self.overhead,
        }


def sampled_peak(fn: Callable[[], None]) -> int:
    """The live heap's largest value while ``fn`` runs, sampled every 0.2 ms from a thread (for a
    compiled step, whose operators no dispatch mode sees): a peak shorter than that may be missed."""
    assert heap is not None
    top = [heap()]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            top[0] = max(top[0], heap())  # type: ignore[misc]
            time.sleep(0.0002)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        fn()
    finally:
        done.set()
        thread.join()
    return top[0]


def malloc_trim() -> None:
    """Give the free memory malloc keeps back to the system (glibc's ``malloc_trim(0)``)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
