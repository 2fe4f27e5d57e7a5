"""The single-process oracle of fr.distributed under torch.func and autograd, and its rank side.

The simulation is written without fr.distributed. A *program* is a rank's
function of one tree, ``program(comm, rank, x)``, whose collectives go
through ``comm``: on the ranks ``REAL`` (fr.distributed itself), here
``Sim`` (the same collectives on every rank's values, with explicit sums).
``simulate(program, xs)`` runs every rank's program in one process and
returns every rank's output: the *global function* of all the ranks'
inputs. It runs the W programs up to their next collective, computes that
collective from the W inputs it was given (differentiable tensor ops: a
sum, ``torch.chunk``'s rows, a ``cat``), and runs them again with one more
result known, until they end: plain Python calls in one thread, so that a
``torch.func`` transform of the global function sees through all of it.

A transform a rank applies to its program has a global counterpart
(``Transform``), by JAX's convention: differentiating a function every rank
computes gives each rank the derivative of the *sum over ranks* of every
rank's output with respect to its own inputs (``grad``, ``vjp``,
``jacrev``: the cotangents of all ranks at once); a tangent goes forward on
every rank at once (``jvp``; ``jacfwd`` pushes the same basis tangent on
every rank); ``vmap`` batches every rank's input. So ``Transform.local(f,
rank)`` on each rank must equal ``Transform.glob(simulate-of-f)(xs)[rank]``.

``Step`` (``fr.distributed.grad_and_value``) is simulated as what it
promises to equal: ``torch.func.grad_and_value`` locally, then the
reduction of the gradients (``all_reduce``, weighted, or ``reduce_scatter``
with ``shard=True``); ``skip`` sends zeros (weight 0), ``accumulate`` the
sum of its micro-batches' gradients.

The rank side of the properties (``check_*``) runs on ``fr.testing.RankPool``'s
ranks: each rank runs a drawn program under a drawn transform with
fr.distributed, simulates every rank, and compares.
"""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import optree
import torch
import torch.distributed as dist
from _property_ddp import _ddp_reference as ddp_reference
from _property_ddp import _loss as ddp_loss
from _property_support import Unchanged, split_inputs, trainable

import freplicate as fr
from freplicate.testing import assert_trees_close

Tree = Any
Program = Callable[[Any, int, Tree], Any]


def tensor_map(f: Callable[..., Any], tree: Tree, *rest: Tree) -> Tree:
    """``f`` of every tensor leaf (and the matching leaves of ``rest``); other leaves as they are."""
    return optree.tree_map(
        lambda x, *r: f(x, *r) if isinstance(x, torch.Tensor) else x, tree, *rest
    )


def weights_like(t: torch.Tensor, salt: float) -> torch.Tensor:
    """Fixed, distinct values of ``t``'s shape and dtype (traceable: no generator of its own)."""
    values = torch.sin(torch.arange(t.numel(), dtype=torch.float64) * 1.3 + salt)
    return values.reshape(t.shape).to(t.dtype)


def probe(tree: Tree, salt: float) -> Tree:
    """A tangent or cotangent for ``tree``: fixed values, different for each ``salt``."""
    return tensor_map(lambda t: weights_like(t, salt), tree)


def scalar(tree: Tree, salt: float = 0.0) -> torch.Tensor:
    """A scalar that weighs every element of every floating leaf differently, through a ``sin``."""
    terms = [
        (torch.sin(leaf) * weights_like(leaf, salt + i)).sum(dtype=torch.float64)
        for i, leaf in enumerate(optree.tree_leaves(tree))
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point()
    ]
    return sum(terms[1:], terms[0]) if terms else torch.zeros((), dtype=torch.float64)


def rows(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """``rank``'s rows of ``t`` as ``torch.chunk`` splits them (a 0-dim tensor whole)."""
    if t.dim() == 0:
        return t
    c = -(-t.shape[0] // world)
    return t[min(rank * c, t.shape[0]) : min((rank + 1) * c, t.shape[0])]


# --- the collectives of every rank, in one process -------------------------------------------


class _Stop(Exception):
    """A rank's program reached a collective whose result is not known yet."""

    def __init__(self, request: tuple[Any, ...]) -> None:
        super().__init__(request[0])
        self.request = request


def _reduced(trees: Sequence[Tree], op: str, weights: Sequence[float] | None) -> Tree:
    """Leaf-wise sum or mean over the ranks' trees (a weighted mean with ``weights``)."""
    world = len(trees)

    def leaf(*xs: torch.Tensor) -> torch.Tensor:
        if weights is not None:
            total = sum(weights)
            if total == 0:
                return torch.zeros_like(xs[0])
            # weights as tensors: a Python float times a 0-dim float32 tensor has a float64
            # tangent under torch.func.jvp (torch 2.13)
            ws = [torch.tensor(w / total, dtype=x.dtype) for w, x in zip(weights, xs)]
            return sum((w * x for w, x in zip(ws[1:], xs[1:])), ws[0] * xs[0])
        if xs[0].dtype == torch.bool:
            return torch.stack(xs).any(0)
        s = xs[0]
        for x in xs[1:]:
            s = s + x
        return s / world if op == "mean" else s

    return tensor_map(leaf, trees[0], *trees[1:])


def _gathered(shards: Sequence[Tree], like: Tree, rank: int) -> Tree:
    """Every rank's rows put together; a 0-dim leaf is this rank's own."""
    return tensor_map(lambda lk, *s: s[rank] if lk.dim() == 0 else torch.cat(s), like, *shards)


def _answer(requests: list[tuple[Any, ...]]) -> list[Tree]:
    """Each rank's result of one collective, from every rank's request."""
    kind, opts = requests[0][0], requests[0][1]
    for r, (k, o, *_) in enumerate(requests):
        if (k, o) != (kind, opts):
            raise AssertionError(
                f"the programs part ways: rank 0 calls {kind} {opts}, rank {r} {k} {o}"
            )
    world = len(requests)
    trees = [req[2] for req in requests]
    if kind == "reduce":  # all_reduce, or reduce_scatter with shard
        op, shard = opts
        ws = [req[3] for req in requests]
        full = _reduced(trees, op, None if ws[0] is None else ws)
        if not shard:
            return [full] * world
        return [tensor_map(lambda t, r=r: rows(t, r, world), full) for r in range(world)]
    if kind == "broadcast":
        return [trees[opts[0]]] * world
    if kind == "all_gather":
        likes = [req[3] for req in requests]
        return [_gathered(trees, likes[r], r) for r in range(world)]
    raise AssertionError(kind)


class Sim:
    """``fr.distributed``'s collectives for one rank of ``world``, in the one-process simulation."""

    def __init__(self, rank: int, world: int, known: list[Tree]) -> None:
        self.rank, self.world, self.known, self.count = rank, world, known, 0

    def _collective(self, *request: Any) -> Tree:
        k = self.count
        self.count += 1
        if k < len(self.known):
            return self.known[k]
        raise _Stop(request)

    def all_reduce(
        self, tree: Tree, *, op: str = "mean", weight: float | None = None, **_: Any
    ) -> Tree:
        return self._collective("reduce", (op, False), tree, weight)

    def reduce_scatter(self, tree: Tree, *, op: str = "mean", **_: Any) -> Tree:
        return self._collective("reduce", (op, True), tree, None)

    def broadcast(self, tree: Tree, *, src: int = 0) -> Tree:
        return self._collective("broadcast", (src,), tree)

    def all_gather(self, shards: Tree, like: Tree) -> Tree:
        return self._collective("all_gather", (), shards, like)

    def shard(self, tree: Tree) -> Tree:
        return tensor_map(lambda t: rows(t, self.rank, self.world), tree)

    def grad_and_value(self, fn: Callable[..., Any], **options: Any) -> SimStep:
        return SimStep(self, fn, **options)


class SimStep:
    """``fr.distributed.grad_and_value``'s step as it promises to be: local, then reduced."""

    def __init__(
        self,
        comm: Sim,
        fn: Callable[..., Any],
        *,
        op: str = "mean",
        has_aux: bool = False,
        argnums: int = 0,
        weight: Callable[..., Any] | None = None,
        shard: bool = False,
        check: bool = True,
        bucket_cap_mb: float = 25.0,
    ) -> None:
        self.comm, self.op, self.weight, self.shard = comm, op, weight, shard
        self.argnums = argnums
        self.local = torch.func.grad_and_value(fn, argnums=argnums, has_aux=has_aux)

    def _reduce(self, grads: Tree, weight: float | None) -> Tree:
        if self.shard and weight is None:
            return self.comm.reduce_scatter(grads, op=self.op)
        if self.shard:  # a weighted mean's rows
            full = self.comm.all_reduce(grads, op=self.op, weight=weight)
            return self.comm.shard(full)
        return self.comm.all_reduce(grads, op=self.op, weight=weight)

    def __call__(self, *args: Any) -> tuple[Tree, Any]:
        grads, value = self.local(*args)
        w = None if self.weight is None else float(self.weight(*args))
        return self._reduce(grads, w), value

    def skip(self, *args: Any) -> tuple[Tree, None]:
        zeros = tensor_map(torch.zeros_like, args[self.argnums])
        return self._reduce(zeros, None if self.weight is None else 0.0), None

    def accumulate(
        self, tree: Tree, micro_batches: Sequence[tuple[Any, ...]]
    ) -> tuple[Tree, list[Any]]:
        total, weight, values = None, 0.0, []
        for batch in micro_batches:
            args = (*batch[: self.argnums], tree, *batch[self.argnums :])
            grads, value = self.local(*args)
            w = 1.0 if self.weight is None else float(self.weight(*args))
            scaled = grads if self.weight is None else tensor_map(lambda g, w=w: g * w, grads)
            total = scaled if total is None else tensor_map(torch.add, total, scaled)
            weight += w
            values.append(value)
        if total is None:
            total = tensor_map(torch.zeros_like, tree)
        if self.weight is None:
            return self._reduce(total, None), values
        # sum_r sum_i w_i g_i / sum_r sum_i w_i: the weighted sums' sum over the weights'
        summed = self.comm.all_reduce(total, op="sum")
        weights = self.comm.all_reduce(torch.tensor(weight, dtype=torch.float64), op="sum")
        out = tensor_map(
            lambda s: torch.where(weights == 0, torch.zeros_like(s), s / weights.to(s.dtype)),
            summed,
        )
        return (self.comm.shard(out) if self.shard else out), values


class Real:
    """The same methods as ``Sim``, on the ranks: fr.distributed itself."""

    all_reduce = staticmethod(fr.distributed.all_reduce)
    reduce_scatter = staticmethod(fr.distributed.reduce_scatter)
    broadcast = staticmethod(fr.distributed.broadcast)
    all_gather = staticmethod(fr.distributed.all_gather)
    shard = staticmethod(fr.distributed.shard)
    grad_and_value = staticmethod(fr.distributed.grad_and_value)


REAL = Real()


def simulate(program: Program, xs: Sequence[Tree]) -> list[Any]:
    """Every rank's output of ``program`` on its input ``xs[rank]``, computed in this process."""
    world = len(xs)
    known: list[list[Tree]] = [[] for _ in range(world)]
    while True:
        outs: list[Any] = [None] * world
        requests: list[Any] = [None] * world
        for r in range(world):
            try:
                outs[r] = ("done", program(Sim(r, world, known[r]), r, xs[r]))
            except _Stop as stop:
                requests[r] = stop.request
        done = [r for r in range(world) if requests[r] is None]
        if len(done) == world:
            return [out[1] for out in outs]
        if done:
            raise AssertionError(f"the programs part ways: ranks {done} end, the others call more")
        for r, result in enumerate(_answer(requests)):
            known[r].append(result)


def global_function(program: Program) -> Callable[[list[Tree]], list[Any]]:
    return lambda xs: simulate(program, xs)


# --- transforms: what a rank applies, and what that is of the global function ---------------


def _total(outs: Sequence[Any]) -> Any:
    """The sum over ranks of their outputs, leaf-wise."""
    return optree.tree_map(lambda *xs: sum(xs[1:], xs[0]), outs[0], *outs[1:])


def _detached_leaves(x: Tree) -> tuple[Tree, list[torch.Tensor]]:
    fresh = tensor_map(lambda t: t.detach().requires_grad_(), x)
    return fresh, [t for t in optree.tree_leaves(fresh) if isinstance(t, torch.Tensor)]


def _autograd(x: Tree, f: Callable[[Tree], torch.Tensor], twice: bool) -> Any:
    """``f``'s gradient by ``torch.autograd.grad``; ``twice``: also that of its squared norm."""
    fresh, leaves = _detached_leaves(x)
    value = f(fresh)
    grads = torch.autograd.grad(value, leaves, create_graph=twice, materialize_grads=True)
    if not twice:
        return list(grads)
    second = torch.autograd.grad(_sq_norm(grads), leaves, materialize_grads=True)
    return [g.detach() for g in grads], list(second)


def _sq_norm(grads: Sequence[torch.Tensor]) -> Any:
    return sum((g * g).sum() for g in grads)


class Transform(NamedTuple):
    """A transform as a rank applies it (``local(f, rank)``) and as the global function sees it.

    ``local`` takes the rank's function of its tree and returns its
    transformed function of the same tree; ``glob`` takes the global function
    (every rank's tree -> every rank's output) and returns the transformed one.
    ``batched``: the inputs carry a batch dim in front (``vmap``).
    """

    name: str
    local: Callable[[Callable[[Tree], Any], int], Callable[[Tree], Any]]
    glob: Callable[[Callable[[list[Tree]], list[Any]]], Callable[[list[Tree]], list[Any]]]
    batched: bool = False
    scalar: bool = True  # whether the function it takes must return a scalar
    forward: bool = False  # forward mode: torch.func refuses expanded (stride 0) primals


def _g_grad(F: Callable[[list[Tree]], list[Any]]) -> Callable[[list[Tree]], list[Any]]:
    return lambda xs: list(torch.func.grad(lambda xs: _total(F(xs)))(xs))


def _g_jacrev(F: Callable[[list[Tree]], list[Any]]) -> Callable[[list[Tree]], list[Any]]:
    # rank r's: the Jacobian of the sum over ranks with respect to its own input (the output's
    # structure of its input's, as torch.func.jacrev gives it)
    def at(xs: list[Tree]) -> list[Any]:
        def of(r: int) -> Any:
            total = lambda x: _total(F([*xs[:r], x, *xs[r + 1 :]]))  # noqa: E731
            return torch.func.jacrev(total)(xs[r])

        return [of(r) for r in range(len(xs))]

    return at


def _g_jacfwd(F: Callable[[list[Tree]], list[Any]]) -> Callable[[list[Tree]], list[Any]]:
    # the same basis tangent on every rank at once
    def at(xs: list[Tree]) -> list[Any]:
        zero = tensor_map(torch.zeros_like, xs[0])
        moved = lambda u: F([tensor_map(torch.add, x, u) for x in xs])  # noqa: E731
        return list(torch.func.jacfwd(moved)(zero))

    return at


def _g_value_and_grad(F: Callable[[list[Tree]], list[Any]]) -> Callable[[list[Tree]], list[Any]]:
    def at(xs: list[Tree]) -> list[Any]:
        grads, (_, outs) = torch.func.grad_and_value(
            lambda xs: (_total(F(xs)), F(xs)), has_aux=True
        )(xs)
        return list(zip(grads, outs))

    return at


def _l_vjp(f: Callable[[Tree], Any], rank: int) -> Callable[[Tree], Any]:
    def at(x: Tree) -> Any:
        out, pull = torch.func.vjp(f, x)
        return out, pull(probe(out, 10.0 + rank))[0]

    return at


def _g_vjp(F: Callable[[list[Tree]], list[Any]]) -> Callable[[list[Tree]], list[Any]]:
    def at(xs: list[Tree]) -> list[Any]:
        outs, pull = torch.func.vjp(F, xs)
        (cts,) = pull([probe(o, 10.0 + r) for r, o in enumerate(outs)])
        return list(zip(outs, cts))

    return at


def _l_jvp(f: Callable[[Tree], Any], rank: int) -> Callable[[Tree], Any]:
    return lambda x: torch.func.jvp(f, (x,), (probe(x, 20.0 + rank),))


def _g_jvp(F: Callable[[list[Tree]], list[Any]]) -> Callable[[list[Tree]], list[Any]]:
    def at(xs: list[Tree]) -> list[Any]:
        tangents = [probe(x, 20.0 + r) for r, x in enumerate(xs)]
        outs, dots = torch.func.jvp(F, (xs,), (tangents,))
        return list(zip(outs, dots))

    return at


def _g_autograd2(F: Callable[[list[Tree]], list[Any]]) -> Callable[[list[Tree]], list[Any]]:
    grads = _g_grad(F)
    flat = lambda xs: [optree.tree_leaves(g) for g in grads(xs)]  # noqa: E731
    seconds = _g_grad(lambda xs: [_sq_norm(g) for g in flat(xs)])
    return lambda xs: [(g, optree.tree_leaves(s)) for g, s in zip(flat(xs), seconds(xs))]


TRANSFORMS: dict[str, Transform] = {
    t.name: t
    for t in (
        Transform("none", lambda f, r: f, lambda F: F, scalar=False),
        Transform("grad", lambda f, r: torch.func.grad(f), _g_grad),
        Transform("grad_and_value", lambda f, r: torch.func.grad_and_value(f), _g_value_and_grad),
        Transform("vjp", _l_vjp, _g_vjp, scalar=False),
        Transform("jvp", _l_jvp, _g_jvp, scalar=False, forward=True),
        Transform("jacrev", lambda f, r: torch.func.jacrev(f), _g_jacrev, scalar=False),
        Transform(
            "jacfwd", lambda f, r: torch.func.jacfwd(f), _g_jacfwd, scalar=False, forward=True
        ),
        Transform(
            "hessian",
            lambda f, r: torch.func.hessian(f),
            lambda F: _g_jacfwd(_g_jacrev(F)),
            forward=True,
        ),
        Transform(
            "vmap", lambda f, r: torch.func.vmap(f), torch.func.vmap, batched=True, scalar=False
        ),
        Transform(
            "autograd",
            lambda f, r: lambda x: _autograd(x, f, twice=False),
            lambda F: lambda xs: [optree.tree_leaves(g) for g in _g_grad(F)(xs)],
        ),
        Transform("autograd2", lambda f, r: lambda x: _autograd(x, f, twice=True), _g_autograd2),
        # nested: vmap of grad, grad of vmap (a sum over the batch), jvp of grad
        Transform(
            "vmap_grad",
            lambda f, r: torch.func.vmap(torch.func.grad(f)),
            lambda F: torch.func.vmap(_g_grad(F)),
            batched=True,
        ),
        Transform(
            "grad_vmap",
            lambda f, r: torch.func.grad(lambda x: torch.func.vmap(f)(x).sum()),
            lambda F: _g_grad(lambda xs: [o.sum() for o in torch.func.vmap(F)(xs)]),
            batched=True,
        ),
        Transform(
            "jvp_grad",
            lambda f, r: _l_jvp(torch.func.grad(f), r),
            lambda F: _g_jvp(_g_grad(F)),
            forward=True,
        ),
    )
}


def transformed(program: Program, transform: str, rank: int, x: Tree, comm: Any = REAL) -> Any:
    """``program`` under ``transform`` on this rank, through fr.distributed (``comm``)."""
    t = TRANSFORMS[transform]
    body = (
        (lambda x: scalar(program(comm, rank, x)))
        if t.scalar
        else (lambda x: program(comm, rank, x))
    )
    return t.local(body, rank)(x)


def oracle(program: Program, transform: str, xs: Sequence[Tree]) -> list[Any]:
    """Every rank's result of ``program`` under ``transform``, from the global function."""
    t = TRANSFORMS[transform]
    F = global_function(program)
    body = (lambda xs: [scalar(o) for o in F(xs)]) if t.scalar else F
    return t.glob(body)(list(xs))


# --- drawn programs ------------------------------------------------------------------------


class Stage(NamedTuple):
    """One step of a drawn program: ``kind`` and its options (see ``run_stages``)."""

    kind: str
    op: str = "mean"
    src: int = 0
    method: str = "call"  # a step's: call, skip (on the last rank), accumulate
    weighted: bool = False
    shard: bool = False
    cap: float = 25.0  # bucket_cap_mb: 1e-6 puts every tensor in a bucket of its own
    compress: str | None = None  # an all_reduce's or reduce_scatter's


def _regather(comm: Any, shards: Tree, like: Tree) -> Tree:
    """The full tree from shards; a 0-dim leaf stays as it is (an all-gather keeps it).

    0-dim leaves stay out of the all-gather: it keeps each rank's own value but
    transposes to the sum over ranks (the contract's; see ``tests/test_compose.py``),
    which no plain function of the ranks' values is.
    """
    rowed = tensor_map(lambda t: t if t.dim() else None, like)
    parts = tensor_map(lambda s, lk: s if lk.dim() else None, shards, like)
    gathered = comm.all_gather(parts, rowed)
    return optree.tree_map(
        lambda g, s, lk: s if isinstance(lk, torch.Tensor) and lk.dim() == 0 else g,
        gathered,
        shards,
        like,
        none_is_leaf=True,
    )


def _step_loss(params: Tree, data: Tree) -> torch.Tensor:
    """A step's loss: nonlinear in the parameters (second derivatives do not vanish)."""
    terms = [
        (torch.sin(p) * d).sum() + (p * p * d).sum()
        for p, d in zip(optree.tree_leaves(params), optree.tree_leaves(data))
        if isinstance(p, torch.Tensor)
    ]
    return sum(terms[1:], terms[0])


def _run_step(comm: Any, rank: int, world: int, x: Tree, stage: Stage) -> Tree:
    weight = (lambda p, d, rank=rank: rank + 1.0) if stage.weighted else None
    # the ranks' trees differ (a function of every rank's values): no check of equal parameters
    step = comm.grad_and_value(
        _step_loss,
        op=stage.op,
        weight=weight,
        shard=stage.shard,
        check=False,
        bucket_cap_mb=stage.cap,
    )
    data = probe(x, 30.0 + rank)
    if stage.method == "skip" and rank == world - 1:
        grads, _ = step.skip(x, data)
    elif stage.method == "accumulate":
        grads, _ = step.accumulate(x, [(data,), (probe(x, 40.0 + rank),)])
    else:
        grads, _ = step(x, data)
    return _regather(comm, grads, x) if stage.shard else grads


def run_stages(stages: Sequence[Stage], comm: Any, rank: int, x: Tree) -> Tree:
    """A drawn program: each stage maps the tree to a tree of the same layout.

    ``sin`` and ``scale`` (by rank + 1) are local; ``all_reduce``,
    ``broadcast``; ``reduce_scatter`` (a ``sin`` on the shards, then the
    all-gather back); ``shard`` (this rank's rows, a ``sin``, the all-gather
    back); ``step`` (the gradients of ``_step_loss`` with respect to the
    tree, reduced: ``Step``, ``skip``, ``accumulate``, ``weight=``, ``shard=True``).
    """
    world = dist.get_world_size() if isinstance(comm, Real) else comm.world
    for stage in stages:
        if stage.kind == "sin":
            x = tensor_map(torch.sin, x)
        elif stage.kind == "scale":
            # an int factor: a Python float times a 0-dim float32 tensor makes a float64 tangent
            # under torch.func.jvp (torch 2.13), on the ranks and here alike
            x = tensor_map(lambda t: t * (rank + 1), x)
        elif stage.kind == "all_reduce":
            x = comm.all_reduce(x, op=stage.op, bucket_cap_mb=stage.cap, compress=stage.compress)
        elif stage.kind == "broadcast":
            x = comm.broadcast(x, src=stage.src)
        elif stage.kind == "reduce_scatter":
            scattered = comm.reduce_scatter(
                x, op=stage.op, bucket_cap_mb=stage.cap, compress=stage.compress
            )
            x = _regather(comm, tensor_map(torch.sin, scattered), x)
        elif stage.kind == "shard":
            x = _regather(comm, tensor_map(torch.sin, comm.shard(x)), x)
        elif stage.kind == "step":
            x = _run_step(comm, rank, world, x, stage)
        else:
            raise AssertionError(stage.kind)
    return x


class Staged:
    """A program of ``stages`` (picklable: it travels to the ranks)."""

    def __init__(self, stages: Sequence[Stage]) -> None:
        self.stages = tuple(stages)

    def __call__(self, comm: Any, rank: int, x: Tree) -> Tree:
        return run_stages(self.stages, comm, rank, x)

    def __repr__(self) -> str:
        return f"Staged({list(self.stages)})"


def inputs_of(tree: Tree, world: int, batch: int | None, *, expanded: bool = True) -> list[Tree]:
    """Every rank's input: ``tree``'s layout, with values of each rank's own.

    Each tensor keeps its strides and offset (a transposed, strided or
    expanded view stays one, over a storage of new values) and its ties (one
    tensor at several places stays one); with ``expanded=False`` a tensor
    whose elements overlap (stride 0) comes contiguous instead (forward mode
    takes none: ``Transform.forward``); ``batch``: a batch dim in front
    instead, contiguous (``vmap``'s input).
    """
    out = []
    for r in range(world):
        made: dict[int, torch.Tensor] = {}

        def fill(t: torch.Tensor, r: int = r, made: dict[int, torch.Tensor] = made) -> torch.Tensor:
            if id(t) not in made:
                overlaps = any(s == 0 and n > 1 for s, n in zip(t.stride(), t.shape))
                if batch is not None:
                    made[id(t)] = _values((batch, *t.shape), t.dtype, r + 1)
                elif overlaps and not expanded:
                    made[id(t)] = _values(t.shape, t.dtype, r + 1)
                else:
                    size = t.untyped_storage().nbytes() // t.element_size()
                    storage = _values((size,), t.dtype, r + 1)
                    made[id(t)] = storage.as_strided(t.shape, t.stride(), t.storage_offset())
            return made[id(t)]

        out.append(tensor_map(fill, tree))
    return out


def _values(shape: Sequence[int], dtype: torch.dtype, salt: float) -> torch.Tensor:
    values = torch.sin(torch.arange(math.prod(shape), dtype=torch.float64) * 0.7 + salt)
    return values.reshape(*shape).to(dtype)


def tolerance(tree: Tree, program: Any = None) -> dict[str, float]:
    """Rounding of a differentiated chain through a few collectives (some of them in bf16)."""
    if any(getattr(s, "compress", None) for s in getattr(program, "stages", ())):
        return {"rtol": 5e-2, "atol": 5e-2}
    kinds = {t.dtype for t in optree.tree_leaves(tree) if isinstance(t, torch.Tensor)}
    return {"rtol": 1e-4, "atol": 1e-5} if torch.float32 in kinds else {"rtol": 1e-9, "atol": 1e-10}


def check_program(rank: int, p: dict[str, Any]) -> None:
    """Rank side: ``p["program"]`` under ``p["transform"]`` equals the global function's."""
    program, transform, xs = p["program"], p["transform"], p["inputs"]
    unchanged = Unchanged(xs[rank])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a differentiated tree that carries a graph: meant here
        got = transformed(program, transform, rank, xs[rank])
    unchanged.check(f"{transform} of {program!r}")
    want = oracle(program, transform, xs)[rank]
    assert_trees_close(got, want, **tolerance(xs[rank], program))


def check_adjoint(rank: int, p: dict[str, Any]) -> None:
    """Rank side: the transposes are the tangents' adjoints, summed over the ranks.

    ``sum_r <ct_r, J t>`` (forward mode) equals ``sum_r <J^T ct, t_r>`` (reverse
    mode): no oracle but the two rule sets against each other.
    """
    program, x = p["program"], p["inputs"][rank]
    f = lambda x: program(REAL, rank, x)  # noqa: E731
    tangent = probe(x, 50.0 + rank)
    out, dot = torch.func.jvp(f, (x,), (tangent,))
    _, pull = torch.func.vjp(f, x)
    ct = probe(out, 60.0 + rank)
    (back,) = pull(ct)
    forward = sum((a * b).sum() for a, b in zip(optree.tree_leaves(ct), optree.tree_leaves(dot)))
    reverse = sum(
        (a * b).sum() for a, b in zip(optree.tree_leaves(back), optree.tree_leaves(tangent))
    )
    both = torch.tensor([float(forward), float(reverse)], dtype=torch.float64)
    dist.all_reduce(both)
    torch.testing.assert_close(both[0], both[1], **tolerance(x, program))


# --- drawn modules: ensembles under vmap against DDP, second order against one process ---------


def _module_loss(module: torch.nn.Module, buffers: Tree) -> Callable[..., torch.Tensor]:
    """``loss(params, inputs)``: ``_property_ddp``'s loss of the module's output on ``inputs``."""

    def loss(params: Tree, inputs: Any) -> torch.Tensor:
        args, kwargs = split_inputs(inputs)
        out, _ = fr.apply(module, fr.State(params, buffers), *args, **kwargs)
        return ddp_loss(out)

    return loss


def check_ensemble(rank: int, p: dict[str, Any]) -> None:
    """Rank side: ``vmap(step)`` over stacked members gives each member DDP's gradient.

    Two members: the drawn module's trainable parameters, and the same moved
    by fixed values; parameters and buffers stacked (as ``stack_module_state``
    does), frozen parameters shared.
    """
    module, inputs = p["module"], p["inputs"][rank]
    s = fr.state(module)
    train = trainable(module, s.params)  # DDP reduces these; the frozen ones stay constants
    frozen = {k: v for k, v in s.params.items() if k not in train}
    members = [train, {k: v + weights_like(v, 2.0) / 4 for k, v in train.items()}]
    stacked = {k: torch.stack([m[k] for m in members]) for k in train}
    buffers = {k: torch.stack([b, b]) for k, b in s.buffers.items()}

    def loss(params: Tree, buffers: Tree, inputs: Any) -> torch.Tensor:
        return _module_loss(module, buffers)({**frozen, **params}, inputs)

    unchanged = Unchanged(stacked, buffers, inputs)
    step = fr.distributed.grad_and_value(loss)
    grads, _ = torch.func.vmap(step, in_dims=(0, 0, None))(stacked, buffers, inputs)
    unchanged.check("vmap(fr.distributed.grad_and_value)")
    for k, member in enumerate(members):
        reference = copy.deepcopy(module)
        with torch.no_grad():
            for name, q in reference.named_parameters():
                q.copy_(member.get(name, q))
        _, _, want = ddp_reference(reference, inputs)
        # vmap runs the batched kernels (a conv through BatchNorm on a tiny batch): rounding
        assert_trees_close({name: g[k] for name, g in grads.items()}, want, rtol=1e-4, atol=1e-5)


ALPHA = 0.25


def _dot(a: Tree, b: Tree) -> torch.Tensor:
    terms = [(x * y).sum() for x, y in zip(optree.tree_leaves(a), optree.tree_leaves(b))]
    return sum(terms[1:], terms[0])


def _sgd(params: Tree, grads: Tree) -> Tree:
    return {k: v - ALPHA * grads[k] for k, v in params.items()}


def second_order(
    how: str, module: torch.nn.Module, inputs: Sequence[Any], rank: int
) -> tuple[Any, Any]:
    """A second-order quantity across the ranks, and the same in one process on every rank's inputs.

    ``hvp_forward`` (jvp of the step), ``hvp_reverse`` (torch.func.grad of
    <step's gradient, v>, the shares averaged), ``maml_func`` and
    ``maml_autograd`` (the meta-gradient of one inner step whose gradient is
    the step's, by torch.func.grad and by autograd, the shares averaged). One
    process: the loss is the mean over ranks of each rank's loss (DDP's mean).
    """
    s = fr.state(module)
    params = {k: v.detach() for k, v in s.params.items()}
    loss = _module_loss(module, s.buffers)
    mine = inputs[rank]
    step = fr.distributed.grad_and_value(loss)
    v = probe(params, 3.0)

    def every(q: Tree) -> torch.Tensor:
        return sum(loss(q, x) for x in inputs) / len(inputs)  # type: ignore[return-value]

    def meta(q: Tree) -> torch.Tensor:
        return loss(_sgd(q, step(q, mine)[0]), mine)

    def every_meta(q: Tree) -> torch.Tensor:
        return every(_sgd(q, torch.func.grad(every)(q)))

    if how == "hvp_forward":
        got = torch.func.jvp(lambda q: step(q, mine)[0], (params,), (v,))[1]
    elif how == "hvp_reverse":
        got = fr.distributed.all_reduce(
            torch.func.grad(lambda q: _dot(step(q, mine)[0], v))(params)
        )
    elif how == "maml_func":
        got = fr.distributed.all_reduce(torch.func.grad(meta)(params))
    else:
        leaves = {k: t.clone().requires_grad_() for k, t in params.items()}
        shares = torch.autograd.grad(meta(leaves), list(leaves.values()), materialize_grads=True)
        got = fr.distributed.all_reduce(dict(zip(leaves, shares)))
    if how.startswith("hvp"):
        want = torch.func.jvp(torch.func.grad(every), (params,), (v,))[1]
    else:
        want = torch.func.grad(every_meta)(params)
    return got, want


def check_second_order(rank: int, p: dict[str, Any]) -> None:
    """Rank side: ``second_order`` across the ranks equals the one-process computation."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a differentiated tree that carries a graph: meant here
        got, want = second_order(p["how"], p["module"], p["inputs"], rank)
    assert_trees_close(got, want, rtol=1e-9, atol=1e-10)


def check_compiled(rank: int, p: dict[str, Any]) -> None:
    """Rank side: a program compiled (``backend="eager"``) and differentiated by autograd."""
    program, xs = p["program"], p["inputs"]
    torch._dynamo.reset()
    f = torch.compile(lambda x: scalar(program(REAL, rank, x)), backend="eager")
    x = tensor_map(lambda t: t.detach().clone().requires_grad_(), xs[rank])
    leaves = [t for t in optree.tree_leaves(x) if isinstance(t, torch.Tensor)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        grads = torch.autograd.grad(f(x), leaves, materialize_grads=True)
    want = optree.tree_leaves(oracle(program, "grad", xs)[rank])
    assert_trees_close(list(grads), want, **tolerance(xs[rank], program))
