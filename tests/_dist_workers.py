"""Rank-side code of the distributed tests: a spawner and the scenarios each rank runs.

``spawn(scenarios, ...)`` starts 2 gloo ranks talking over loopback only
(a file store for the rendezvous, so nothing listens on a port; gloo's own
sockets pinned to ``lo``), each with a bounded process-group timeout; the parent
waits with its own deadline and kills any child still alive, so a test never
hangs. Every scenario runs on every rank and returns a picklable value, or
the exception it raised as ``("raised", type name, message)``; the parent
gets ``{scenario: [value on rank 0, value on rank 1]}``. The oracles are
PyTorch's own stateful designs: ``DistributedDataParallel`` and the
composable ``replicate``, on the same init and the same per-rank data.
"""

from __future__ import annotations

import contextlib
import copy
import faulthandler
import functools
import io
import os
import queue
import shutil
import signal
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import optree
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

import freplicate as fr
from freplicate._distributed import _agree as agree
from freplicate._distributed import _plans as planning
from freplicate.testing import init_loopback_group


def map_tensors(f: Callable[[torch.Tensor], Any], tree: Any) -> Any:
    """``f`` of every tensor leaf of ``tree``; other leaves as they are."""
    return optree.tree_map(lambda x: f(x) if isinstance(x, torch.Tensor) else x, tree)


WORLD = 2
SCENARIOS: dict[str, Callable[[int], Any]] = {}


def scenario(f: Callable[[int], Any]) -> Callable[[int], Any]:
    SCENARIOS[f.__name__] = f
    return f


@contextlib.contextmanager
def debug_mode() -> Any:
    """The checks' debug mode on, on this rank, in the block (``FREPLICATE_DISTRIBUTED_DEBUG``)."""
    before = os.environ.get(agree.DEBUG_VARIABLE)
    os.environ[agree.DEBUG_VARIABLE] = "DETAIL"
    try:
        yield
    finally:
        if before is None:
            del os.environ[agree.DEBUG_VARIABLE]
        else:
            os.environ[agree.DEBUG_VARIABLE] = before


def in_debug_mode(f: Callable[[int], Any]) -> Callable[[int], Any]:
    """``f`` with the checks' debug mode on, on every rank (``FREPLICATE_DISTRIBUTED_DEBUG``).

    For scenarios in which ranks part ways after a layout's first use onto
    buckets of other sizes: outside the debug mode gloo aborts the process
    there (the contract says so); in it every call is checked before data moves.
    """

    @functools.wraps(f)
    def run(rank: int) -> Any:
        with debug_mode():
            return f(rank)

    return run


def _kind(err: BaseException) -> str:
    """The builtin exception type ``err`` is (fr's own errors subclass ValueError, RuntimeError)."""
    return next(c.__name__ for c in type(err).__mro__ if c.__module__ == "builtins")


def _main(
    rank: int,
    store: str,
    names: list[str],
    out: Any,
    pg_timeout: float,
    die: int | None,
    stall: bool,
    world: int = WORLD,
) -> None:
    torch.set_num_threads(1)
    if hasattr(signal, "SIGUSR1"):  # a late rank's stack, asked for by ``spawn``
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    init_loopback_group(store, rank, world, timeout=pg_timeout)
    if die is not None:
        # every rank past gloo's connection set-up before one dies: a rank that exits while a
        # peer still connects fails the peer's init_process_group, not the collective under test
        dist.barrier()
    if rank == die:
        if stall:  # alive but never joining the collective (a stuck data loader, a deadlock)
            time.sleep(3 * pg_timeout)
        os._exit(0)  # a rank that dies without a word, mid-job
    results: dict[str, Any] = {}
    for name in names:
        if os.environ.get("FR_TEST_TRACE"):  # which scenario a rank that aborts was running
            print(f"rank {rank}: {name}", file=sys.stderr, flush=True)
        try:
            results[name] = SCENARIOS[name](rank)
        except Exception as err:
            results[name] = ("raised", _kind(err), str(err), traceback.format_exc())
    buf = io.BytesIO()
    torch.save(results, buf)
    out.put((rank, buf.getvalue()))
    if die is None:
        dist.destroy_process_group()
    # The results are all the parent waits for: once they are in the pipe, leave without the
    # interpreter's teardown (atexit handlers, every module's objects freed), which took 0.5 to
    # 4 s a job after a compile, while the parent waited to join the ranks.
    out.close()
    out.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(
    names: list[str],
    *,
    pg_timeout: float = 30.0,
    deadline: float = 90.0,
    die: int | None = None,
    stall: bool = False,
    target: Callable[..., None] | None = None,
    world: int = WORLD,
) -> dict[str, list[Any]]:
    """Run ``names`` on ``world`` ranks (2); ``{name: [rank 0's result, ...]}``, killing stragglers.

    ``target``: the ranks' entry point, ``_main`` unless a module of more
    scenarios passes its own (one that imports it, registering them); it
    takes ``world`` as its last argument.
    """
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    tmp = tempfile.mkdtemp(prefix="freplicate-test-")
    store = os.path.join(tmp, "store")
    entry = _main if target is None else target
    procs = [
        ctx.Process(
            target=entry, args=(r, store, names, out, pg_timeout, die, stall, world), daemon=True
        )
        for r in range(world)
    ]
    for p in procs:
        p.start()
    got: dict[int, dict[str, Any]] = {}
    end = time.monotonic() + deadline
    expected = world if die is None else world - 1
    try:
        while len(got) < expected and time.monotonic() < end:
            try:
                rank, blob = out.get(timeout=0.5)
            except queue.Empty:
                if all(not p.is_alive() for p in procs) and out.empty():
                    break
                continue
            got[rank] = torch.load(io.BytesIO(blob), weights_only=False)
    finally:
        if len(got) < expected and hasattr(signal, "SIGUSR1"):
            for r, p in enumerate(procs):
                if r not in got and p.pid and p.is_alive():  # its stack on stderr: pytest shows it
                    os.kill(p.pid, signal.SIGUSR1)
                    time.sleep(0.5)
        for r, p in enumerate(procs):
            # the rank told to die or stall has nothing to report once the others have: a
            # stalled one sleeps 3 x pg_timeout, and waiting 5 s more for it only ended in a kill
            told = r == die and len(got) >= expected
            p.join(timeout=0.0 if told else max(0.0, min(5.0, end - time.monotonic())))
            if p.is_alive():
                p.kill()
                p.join()
        shutil.rmtree(tmp, ignore_errors=True)
    if len(got) < expected:
        raise AssertionError(f"only ranks {sorted(got)} reported back within {deadline} s")
    return {n: [got[r][n] if r in got else None for r in range(world)] for n in names}


def ok(job: dict[str, list[Any]], name: str) -> list[Any]:
    """Both ranks' results of ``name``; a scenario that raised fails the test with its traceback."""
    import pytest  # the parent's only: the ranks never call this

    for rank, res in enumerate(job[name]):
        if isinstance(res, tuple) and res and res[0] == "raised":
            pytest.fail(f"{name} raised on rank {rank}:\n{res[3]}")
    return job[name]


# --- data ---------------------------------------------------------------------------


def tree_of(rank: int) -> dict[str, Any]:
    """A mixed tree, different on each rank: dtypes, a non-tensor leaf, a tied leaf."""
    g = torch.Generator().manual_seed(100 + rank)
    shared = torch.randn(3, generator=g)
    return {
        "w": torch.randn(4, 5, generator=g),
        "b": torch.randn(5, generator=g, dtype=torch.float64),
        "count": torch.tensor([rank + 1, 10 * rank], dtype=torch.int64),
        "flag": torch.tensor([rank == 0, False]),
        "step": 7,
        "tied": [shared, shared],
        "none": None,
    }


def snapshot(tree: Any) -> list[tuple[int, torch.Tensor]]:
    return [
        (t._version, t.clone()) for t in fr._tree.flatten(tree)[0] if isinstance(t, torch.Tensor)
    ]


def unchanged(tree: Any, snap: list[tuple[int, torch.Tensor]]) -> bool:
    leaves = [t for t in fr._tree.flatten(tree)[0] if isinstance(t, torch.Tensor)]
    return all(t._version == v and torch.equal(t, c) for t, (v, c) in zip(leaves, snap))


def expected_reduce(op: str) -> dict[str, Any]:
    a, b = tree_of(0), tree_of(1)
    exp = {k: a[k] + b[k] for k in ("w", "b", "count")}
    exp["flag"] = a["flag"] | b["flag"]
    exp["tied"] = a["tied"][0] + b["tied"][0]
    if op == "mean":
        exp = {k: v / 2 for k, v in exp.items() if k not in ("count", "flag")}
    return exp


# --- collectives ----------------------------------------------------------------------


@scenario
def reduce_sum(rank: int) -> dict[str, Any]:
    tree = tree_of(rank)
    snap = snapshot(tree)
    out = fr.distributed.all_reduce(tree, op="sum")
    return {
        "out": out,
        "expected": expected_reduce("sum"),
        "unchanged": unchanged(tree, snap),
        "tied_is_one": out["tied"][0] is out["tied"][1],
        "step": out["step"],
        "fresh": all(
            o.data_ptr() != i.data_ptr()
            for o, i in zip(fr._tree.flatten(out)[0], fr._tree.flatten(tree)[0])
            if isinstance(o, torch.Tensor)
        ),
    }


def floats_of(rank: int) -> dict[str, Any]:
    t = tree_of(rank)
    return {"w": t["w"], "b": t["b"], "tied": t["tied"], "step": t["step"]}


@scenario
def reduce_mean_twice(rank: int) -> dict[str, Any]:
    """Two calls with one layout: the plan's buffer is reused, the first results must survive."""
    t1 = floats_of(rank)
    t2 = map_tensors(lambda x: x * 3, t1)
    snap = snapshot(t1)
    r1 = fr.distributed.all_reduce(t1)
    r1_copy = map_tensors(torch.clone, r1)
    r2 = fr.distributed.all_reduce(t2)
    r3 = fr.distributed.all_reduce(t1)
    return {"r1": r1, "r1_copy": r1_copy, "r2": r2, "r3": r3, "unchanged": unchanged(t1, snap)}


@scenario
def reduce_reuse(rank: int) -> dict[str, Any]:
    """Six calls, every other result kept: buffers are reused, kept results stay right."""
    base = {k: v for k, v in floats_of(rank).items() if k in ("w", "b")}
    exp = {k: v for k, v in expected_reduce("mean").items() if k in ("w", "b")}
    kept, ptrs, fresh_ok = [], [], True
    for i in range(6):
        r = fr.distributed.all_reduce(map_tensors(lambda x, i=i: x * (i + 1), base))
        want = map_tensors(lambda x, i=i: x * (i + 1), exp)
        fresh_ok &= all(torch.allclose(r[k], want[k]) for k in r)
        ptrs.append(r["w"].data_ptr())
        if i % 2 == 0:
            kept.append((r, want))
    # a result that autograd saved keeps its buffer busy, even with no Python name left
    x = torch.ones(4, 5, requires_grad=True)
    r = fr.distributed.all_reduce(base)
    y = (x * r["w"]).sum()
    saved = r["w"].data_ptr()
    del r
    others = [fr.distributed.all_reduce(base)["w"].data_ptr() for _ in range(3)]
    y.backward()  # would raise if the saved tensor had been overwritten in place
    return {
        "kept": kept,
        "fresh_ok": fresh_ok,
        "distinct": len(set(ptrs)),
        "saved_reused": saved in others,
        "grad": x.grad,
        "exp_w": exp["w"],
    }


def odd_tree(rank: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(300 + rank)
    return {
        "scalar": torch.tensor(float(rank + 1)),
        "empty": torch.ones(0, 3),
        "complex": torch.randn(3, dtype=torch.complex64, generator=g),
        "transposed": torch.randn(3, 4, generator=g).t(),
        "param": torch.nn.Parameter(torch.randn(2, generator=g)),
    }


@scenario
def reduce_odd_leaves(rank: int) -> dict[str, Any]:
    """0-dim, empty, complex, non-contiguous leaves and a Parameter: reduced as they are."""
    tree = odd_tree(rank)
    snap = snapshot(tree)
    a, b = odd_tree(0), odd_tree(1)
    return {
        "out": fr.distributed.all_reduce(tree),
        "expected": {k: ((a[k] + b[k]) / 2).detach() for k in a},
        "unchanged": unchanged(tree, snap),
        "empty_tree": fr.distributed.all_reduce({"n": 3}),
    }


@scenario
def reduce_small_buckets(rank: int) -> dict[str, Any]:
    tree = floats_of(rank)
    return {
        "tiny": fr.distributed.all_reduce(tree, bucket_cap_mb=1e-5),
        "default": fr.distributed.all_reduce(tree),
    }


@scenario
def reduce_compressed(rank: int) -> dict[str, Any]:
    tree = floats_of(rank)
    snap = snapshot(tree)
    return {
        "bf16": fr.distributed.all_reduce(tree, compress="bf16"),
        "fp16": fr.distributed.all_reduce(tree, compress="fp16", op="sum"),
        "exact": fr.distributed.all_reduce(tree),
        "exact_sum": fr.distributed.all_reduce(tree, op="sum"),
        "unchanged": unchanged(tree, snap),
    }


@scenario
def mean_of_ints(rank: int) -> Any:
    fr.distributed.all_reduce(tree_of(rank), op="mean")


@scenario
def mismatch_shape(rank: int) -> Any:
    fr.distributed.all_reduce({"a": torch.ones(3), "b": torch.ones(2 + rank)})


@scenario
def mismatch_structure(rank: int) -> Any:
    tree = {"a": torch.ones(3), "c": torch.ones(2)} if rank else {"a": torch.ones(3)}
    fr.distributed.all_reduce(tree)


@scenario
def mismatch_dtype(rank: int) -> Any:
    fr.distributed.broadcast({"a": torch.ones(3, dtype=torch.float64 if rank else torch.float32)})


@scenario
def mismatch_empty(rank: int) -> Any:
    """One rank has no tensor at all: still a ValueError on both, not a hang."""
    fr.distributed.all_reduce({"a": torch.ones(2) if rank else None})


@scenario
def mismatch_options(rank: int) -> Any:
    fr.distributed.all_reduce({"a": torch.ones(3)}, op="sum" if rank else "mean")


@scenario
def mismatch_grad(rank: int) -> Any:
    params = {"w": torch.ones(2, 2 + rank)}
    fr.distributed.grad_and_value(lambda p: p["w"].sum())(params)


@scenario
@in_debug_mode
def mismatch_after_cached(rank: int) -> Any:
    """Rank 0 passes a layout both ranks reduced before, rank 1 a new one: still caught."""
    fr.distributed.all_reduce({"w": torch.ones(2)})
    fr.distributed.all_reduce({"w": torch.ones(2 + rank)})


@scenario
@in_debug_mode
def mismatch_grad_after_cached(rank: int) -> Any:
    loss = lambda p: p["w"].sum()  # noqa: E731
    fr.distributed.grad_and_value(loss)({"w": torch.ones(2)})
    fr.distributed.grad_and_value(loss)({"w": torch.ones(2 + rank)})


@scenario
def mismatch_grad_in_hook(rank: int) -> Any:
    """A bucket per tensor: the check fails inside a gradient hook, during the backward pass."""
    params = {"a": torch.ones(2), "b": torch.ones(3 + rank)}
    loss = lambda p: p["a"].sum() * p["b"].sum()  # noqa: E731
    fr.distributed.grad_and_value(loss, bucket_cap_mb=1e-6)(params)


@scenario
def after_mismatch(rank: int) -> Any:
    """The group is still usable after the mismatches above: every rank took the same path."""
    return fr.distributed.all_reduce({"x": torch.full((2,), float(rank))}, op="sum")


@scenario
def broadcasts(rank: int) -> dict[str, Any]:
    tree = tree_of(rank)
    snap = snapshot(tree)
    return {
        "from0": fr.distributed.broadcast(tree),
        "from1": fr.distributed.broadcast(tree, src=1),
        "tree0": tree_of(0),
        "tree1": tree_of(1),
        "unchanged": unchanged(tree, snap),
    }


@scenario
def buffers_mean(rank: int) -> dict[str, Any]:
    """sync_buffers(mode="mean"): floating buffers averaged, the others from rank 0."""
    bn = nn.BatchNorm1d(3)
    bn(torch.randn(8, 3, generator=torch.Generator().manual_seed(rank)))  # rank-local statistics
    buffers = fr.state(bn).buffers
    if rank == 1:
        buffers = {**buffers, "num_batches_tracked": torch.tensor(5)}
    snap = snapshot(buffers)
    everyone = [None, None]
    dist.all_gather_object(everyone, buffers)  # the oracle: every rank's buffers
    return {
        "mean": fr.distributed.sync_buffers(buffers, mode="mean"),
        "broadcast": fr.distributed.sync_buffers(buffers, src=1),
        "everyone": everyone,
        "unchanged": unchanged(buffers, snap),
    }


# --- training against DDP and composable replicate --------------------------------------


class Net(nn.Module):
    def __init__(self, batchnorm: bool) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.bn = nn.BatchNorm1d(16) if batchnorm else nn.Identity()
        self.fc2 = nn.Linear(16, 16)
        self.fc3 = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(torch.tanh(self.fc2(torch.relu(self.bn(self.fc1(x))))))


class DeepNet(nn.Module):
    """Six hidden layers of one shape: fr.distributed differentiates each bucket's runs stacked."""

    def __init__(self, batchnorm: bool) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.hidden = nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(16, 16), nn.Tanh())])
        self.fc3 = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(self.hidden(torch.relu(self.fc1(x))))


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(6, 8, generator=g), torch.randint(0, 4, (6,), generator=g)


def train(
    rank: int,
    *,
    batchnorm: bool,
    cap: float,
    steps: int = 10,
    lr: float = 0.1,
    net: type[nn.Module] = Net,
) -> Any:
    from torch.distributed._composable import replicate
    from torch.nn.parallel import DistributedDataParallel

    planning._PLANS.clear()  # on every rank: plans of earlier scenarios are not this one's
    torch.manual_seed(0)
    model = net(batchnorm)
    ddp = DistributedDataParallel(copy.deepcopy(model))
    ddp_opt = torch.optim.SGD(ddp.parameters(), lr=lr)
    rep = copy.deepcopy(model)
    replicate(rep)
    rep_opt = torch.optim.SGD(rep.parameters(), lr=lr)

    s = fr.state(model)
    params, buffers = s.params, s.buffers
    snap = snapshot(s)

    def loss_fn(p: Any, b: Any, x: torch.Tensor, y: torch.Tensor) -> Any:
        out, new = fr.apply(model, fr.State(p, b), x)
        return F.cross_entropy(out, y), new.buffers

    step = fr.distributed.grad_and_value(loss_fn, has_aux=True, bucket_cap_mb=cap)
    losses = []
    for i in range(steps):
        x, y = batch(rank, i)
        for m, opt in ((ddp, ddp_opt), (rep, rep_opt)):
            opt.zero_grad()
            F.cross_entropy(m(x), y).backward()
            opt.step()
        buffers = fr.distributed.sync_buffers(buffers)  # DDP's policy: rank 0's, every forward
        grads, (loss, buffers) = step(params, buffers, x, y)
        params = {k: p - lr * grads[k] for k, p in params.items()}
        losses.append(float(loss))
    return {
        "fr": params,
        "fr_buffers": buffers,
        "ddp": {k: p.detach() for k, p in ddp.module.named_parameters()},
        "ddp_buffers": dict(ddp.module.named_buffers()),
        "rep": {k: p.detach() for k, p in rep.named_parameters()},
        "losses": losses,
        "model_unchanged": unchanged(s, snap),
        "stacked": [  # per grad plan: (buckets, runs differentiated as one stacked leaf)
            (len(plan.layout.buckets), sum(segments.count(0) for segments in stacks.segments))
            for plan in planning._PLANS.values()
            for stacks in plan.stacks.values()
        ],
    }


@scenario
def train_mlp(rank: int) -> Any:
    return train(rank, batchnorm=False, cap=25.0)


@scenario
def train_batchnorm(rank: int) -> Any:
    return train(rank, batchnorm=True, cap=25.0)


@scenario
def train_tiny_buckets(rank: int) -> Any:
    """A bucket per tensor: every bucket but the last launched from a gradient hook."""
    return train(rank, batchnorm=True, cap=1e-6)


@scenario
def train_stacked(rank: int) -> Any:
    """Buckets of ~3 KB hold runs of equal hidden layers: hooks on stacked leaves launch them."""
    return train(rank, batchnorm=False, cap=0.003, net=DeepNet)


@scenario
def grad_matches_all_reduce(rank: int) -> Any:
    torch.manual_seed(0)
    model = Net(False)
    params = fr.state(model).params
    params = {**params, "unused": torch.ones(3)}  # no gradient reaches it: zeros, as DDP's
    x, y = batch(rank, 0)

    def loss_fn(p: Any) -> torch.Tensor:
        out, _ = fr.apply(model, fr.State({k: v for k, v in p.items() if k != "unused"}, {}), x)
        return F.cross_entropy(out, y)

    snap = snapshot(params)
    out = {}
    for cap in (25.0, 1e-6):
        grads, value = fr.distributed.grad_and_value(loss_fn, bucket_cap_mb=cap)(params)
        local, local_value = fr.grad_and_value(loss_fn)(params)
        out[cap] = (grads, fr.distributed.all_reduce(local), value, local_value)
    out["unchanged"] = unchanged(params, snap)
    sums, _ = fr.distributed.grad_and_value(loss_fn, op="sum")(params)
    out["sum"] = (sums, fr.distributed.all_reduce(fr.grad_and_value(loss_fn)(params)[0], op="sum"))
    return out


@scenario
def under_vmap(rank: int) -> Any:
    """Per-sample gradients under vmap: each sample's gradient averaged over the ranks."""
    g = fr.distributed.grad_and_value(lambda p, x: (p["w"] * x).sum())
    xs = torch.arange(6.0).view(3, 2) + rank
    return torch.func.vmap(g, in_dims=(None, 0))({"w": torch.ones(2)}, xs)


# --- the layout check's fast path (the agreed layout) -------------------------------------


def counting(f: Callable[[], Any]) -> tuple[Any, dict[str, int]]:
    """``f()`` with fr.distributed's probes and collectives counted on this rank."""
    counts = {"probe": 0, "all_reduce": 0}
    probe, all_reduce = agree._probe, dist.all_reduce

    def counted_probe(*args: Any, **kwargs: Any) -> Any:
        counts["probe"] += 1
        return probe(*args, **kwargs)

    def counted_all_reduce(*args: Any, **kwargs: Any) -> Any:
        counts["all_reduce"] += 1
        return all_reduce(*args, **kwargs)

    agree._probe = counted_probe  # type: ignore[assignment]
    dist.all_reduce = counted_all_reduce
    try:
        return f(), counts
    finally:
        agree._probe = probe  # type: ignore[assignment]
        dist.all_reduce = all_reduce


def leafwise(tree: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The oracle of a sum: one plain ``dist.all_reduce`` per leaf, on copies."""
    out = {}
    for k, t in tree.items():
        out[k] = t.clone()
        dist.all_reduce(out[k])
    return out


def layout(rank: int, name: str, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(10 * seed + rank)
    shapes = {"A": [(7, 5), (5,)], "B": [(3, 3), (9,), (2,)]}[name]
    return {f"{name}{i}": torch.randn(*s, generator=g) for i, s in enumerate(shapes)}


@scenario
def steady_state(rank: int) -> dict[str, Any]:
    """Ten calls of one layout: one full check (the first), then no collective but the data."""
    tree = {"s": torch.full((11, 3), float(rank)), "t": torch.ones(4)}
    params = {"w": torch.ones(13, 2)}
    loss = lambda p: (p["w"] * (rank + 1)).sum()  # noqa: E731
    g = fr.distributed.grad_and_value(loss, op="sum")
    reduced, counts = counting(lambda: [fr.distributed.all_reduce(tree) for _ in range(10)])
    grads, grad_counts = counting(lambda: [g(params)[0] for _ in range(10)])
    return {"reduced": reduced, "counts": counts, "grads": grads, "grad_counts": grad_counts}


@scenario
@in_debug_mode
def mismatch_on_agreed(rank: int) -> list[Any]:
    """Rank 0 on the agreed layout, rank 1 on a changed one: ValueError on both, every time."""
    agreed = {"a": torch.ones(3), "b": torch.ones(2, 2)}
    mask = {"a": torch.ones(3), "m": torch.ones(4, dtype=torch.bool)}  # a bool first bucket: MAX
    cases: list[tuple[Any, Any, dict[str, Any]]] = [
        (agreed, {"a": torch.ones(3), "b": torch.ones(2, 3)}, {}),  # shape
        (agreed, {"a": torch.ones(3), "b": torch.ones(2, 2, dtype=torch.float64)}, {}),  # dtype
        (agreed, {"a": torch.ones(3), "b": torch.ones(2, 2), "c": torch.ones(1)}, {}),  # structure
        (agreed, {"a": torch.ones(3), "b": None}, {}),  # fewer tensors: a smaller first bucket
        (mask, {**mask, "m": torch.ones(5, dtype=torch.bool)}, {"op": "sum"}),
        (agreed, {**agreed, "b": torch.ones(2, 3)}, {"compress": "bf16"}),  # a bf16 first bucket
    ]
    out: list[Any] = []
    for same, other, kwargs in cases:
        fr.distributed.all_reduce(same, **kwargs)  # agreed on both ranks
        try:
            fr.distributed.all_reduce(other if rank else same, **kwargs)
            out.append(("returned",))
        except ValueError as err:
            out.append(("raised", str(err)))
    out.append(fr.distributed.all_reduce({"x": torch.full((2,), float(rank))}, op="sum"))
    return out


@scenario
def switching_layouts(rank: int) -> list[Any]:
    """Both ranks switch layouts together (A, A, B, A, B, B, A): every result right.

    A and B are probed once each, on their first use; later switches between
    the two send their data alone.
    """
    trees = [layout(rank, name, i) for i, name in enumerate("AABABBA")]
    got, counts = counting(lambda: [fr.distributed.all_reduce(t, op="sum") for t in trees])
    return {"pairs": list(zip(got, map(leafwise, trees))), "counts": counts}


@scenario
@in_debug_mode
def mismatch_second_layout(rank: int) -> list[Any]:
    """Agreed B, second A: rank 0 on A against rank 1 on a new C, then B against A."""
    a, b, c = {"a": torch.ones(6)}, {"b": torch.ones(2, 3)}, {"a": torch.ones(7)}
    out: list[Any] = []
    for mine, theirs in ((a, c), (b, a)):
        fr.distributed.all_reduce(a)
        fr.distributed.all_reduce(b)
        try:
            fr.distributed.all_reduce(theirs if rank else mine)
            out.append(("returned",))
        except ValueError as err:
            out.append(("raised", str(err)))
    out.append(fr.distributed.all_reduce(a, op="sum"))  # back in step
    return out


@scenario
@in_debug_mode
def mismatch_multi_bucket(rank: int) -> list[Any]:
    """A bucket per tensor, mismatched on the second call (in a later bucket): no abort."""
    tree = {"a": torch.ones(4), "b": torch.ones(3), "c": torch.ones(2)}
    first = fr.distributed.all_reduce(tree, bucket_cap_mb=1e-6, op="sum")
    second = {**tree, "a": torch.ones(4 + rank)}  # the first bucket holds 'c': unchanged
    try:
        fr.distributed.all_reduce(second, bucket_cap_mb=1e-6, op="sum")
        got: Any = ("returned",)
    except ValueError as err:
        got = ("raised", str(err))
    again = fr.distributed.all_reduce(tree, bucket_cap_mb=1e-6, op="sum")
    return [first, got, again]


@scenario
@in_debug_mode
def grad_switching_and_mismatch(rank: int) -> dict[str, Any]:
    """grad_and_value switching between two parameter trees, then mismatched on each path."""
    x = torch.full((3,), float(rank + 1))

    def loss(p: Any) -> Any:
        return sum((v.flatten()[:3] * x[: v.numel()]).sum() for v in p.values())

    out: dict[Any, Any] = {"switch": []}
    for cap in (25.0, 1e-6):
        g = fr.distributed.grad_and_value(loss, op="sum", bucket_cap_mb=cap)
        for i, name in enumerate("ABBAB"):
            params = layout(0, name, i)
            grads, _ = g(params)
            out["switch"].append((grads, leafwise(fr.grad_and_value(loss)(params)[0])))
        agreed = layout(0, "B", 0)  # with cap 1e-6, the flags are read in a gradient hook
        g(agreed)
        changed = {**agreed, "B0": torch.ones(4, 4)}
        try:
            g(changed if rank else agreed)
            out[cap] = ("returned",)
        except ValueError as err:
            out[cap] = ("raised", str(err))
    return out


# --- ranks that part ways: every rank raises, none aborts or hangs (issue 10, item 6) ---------


def outcome(f: Callable[[], Any]) -> tuple[Any, ...]:
    """``("returned", value)`` or ``("raised", type name, message, cause type name)``."""
    try:
        return ("returned", f())
    except Exception as err:
        cause = type(err.__cause__).__name__ if err.__cause__ is not None else None
        return ("raised", _kind(err), str(err), cause)


@scenario
@in_debug_mode
def different_functions(rank: int) -> dict[str, Any]:
    """After the layout is agreed, rank 0 calls all_reduce and rank 1 broadcast (and others)."""
    tree = {"a": torch.ones(3), "b": torch.ones(2, 2)}
    out: dict[str, Any] = {}
    for name, other in [
        ("broadcast", lambda: fr.distributed.broadcast(tree)),
        ("sync_buffers", lambda: fr.distributed.sync_buffers({"m": torch.ones(5)})),
        # (with op="mean", the gradient's reduction is all_reduce's own: they may meet)
        ("grad", lambda: fr.distributed.grad_and_value(lambda p: p["a"].sum(), op="sum")(tree)),
    ]:
        fr.distributed.all_reduce(tree)  # agreed on both ranks
        fr.distributed.all_reduce(tree)
        out[name] = outcome(other if rank else lambda: fr.distributed.all_reduce(tree))
    out["after"] = fr.distributed.all_reduce({"x": torch.full((2,), float(rank))}, op="sum")
    return out


class Net2(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.bn = nn.BatchNorm1d(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.fc(x))


@scenario
@in_debug_mode
def skipped_step(rank: int) -> dict[str, Any]:
    """A DDP-style loop (sync buffers, then the gradient); rank 1's loss raises at step 3 and it
    skips to the next step's sync_buffers: both ranks raise, neither aborts, the group goes on."""
    torch.manual_seed(0)
    model = Net2()
    s = fr.state(model)
    params, buffers = s.params, s.buffers

    def loss_fn(p: Any, b: Any, x: torch.Tensor) -> Any:
        out, new = fr.apply(model, fr.State(p, b), x)
        return out.square().mean(), new.buffers

    step = fr.distributed.grad_and_value(loss_fn, has_aux=True)
    errors = []
    for i in range(6):
        x = torch.randn(4, 4, generator=torch.Generator().manual_seed(10 * i + rank))
        try:
            buffers = fr.distributed.sync_buffers(buffers)
            if rank == 1 and i == 3:
                continue  # "the loss raised": this rank skips its gradient step
            grads, (_, buffers) = step(params, buffers, x)
            params = {k: p - 0.1 * grads[k] for k, p in params.items()}
        except Exception as err:
            errors.append((i, _kind(err), str(err)))
            break
    return {"errors": errors, "after": fr.distributed.all_reduce({"x": torch.ones(2)}, op="sum")}


class _BackwardRaises(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        raise ArithmeticError("backward of rank 1 failed")


@scenario
def fn_raises(rank: int) -> dict[str, Any]:
    """``fn`` raises on rank 1 inside grad_and_value: rank 1 gets its own error, rank 0 an error
    naming rank 1: on the fast path, on a new layout, after buckets left, and with a graph."""
    params = {"a": torch.ones(3), "b": torch.ones(2), "c": torch.ones(4)}

    def loss(p: Any, fail: str) -> Any:
        if rank == 1 and fail == "forward":
            raise KeyError("no such batch on rank 1")
        a = _BackwardRaises.apply(p["a"]) if rank == 1 and fail == "backward" else p["a"]
        return a.sum() + p["b"].sum() * 2 + p["c"].sum() * 3

    out: dict[str, Any] = {}
    g = fr.distributed.grad_and_value(loss)
    g(params, "none")
    g(params, "none")  # the expected layout now: the fast path
    out["fast"] = outcome(lambda: g(params, "forward"))
    out["new_layout"] = outcome(lambda: g({**params, "d": torch.ones(1)}, "forward"))
    tiny = fr.distributed.grad_and_value(loss, bucket_cap_mb=1e-6)  # a bucket per tensor
    tiny(params, "none")
    out["backward"] = outcome(lambda: tiny(params, "backward"))
    graph = {k: v.clone().requires_grad_() for k, v in params.items()}  # fr.grad_and_value first
    g(params, "none")
    out["graph"] = outcome(lambda: g(graph, "forward"))
    out["after"] = g(params, "none")[0]
    return out


# --- wasted collectives (issue 10, item 7) ------------------------------------------------


@scenario
def no_buffers(rank: int) -> dict[str, Any]:
    """A model without buffers: sync_buffers sends nothing."""
    empty: dict[str, torch.Tensor] = {}
    got, counts = counting(
        lambda: [fr.distributed.sync_buffers(empty, mode=m) for m in ("broadcast", "mean")]
    )
    return {"same": all(g is empty for g in got), "counts": counts}


@scenario
def accumulation(rank: int) -> dict[str, Any]:
    """Gradient accumulation: local gradients, then one all_reduce each of the gradients, the
    loss and the buffers (three layouts in turn): one collective a call once warm."""
    params = {"w": torch.ones(5, 3), "b": torch.ones(3)}
    bufs = {"m": torch.zeros(3), "v": torch.ones(3)}
    local = fr.grad_and_value(lambda p, x: ((x @ p["w"] + p["b"]) ** 2).mean())

    def step(i: int) -> Any:
        total, losses = None, []
        for k in range(3):
            x = torch.full((2, 5), float(rank + i + k))
            g, value = local(params, x)
            total = g if total is None else {n: total[n] + g[n] for n in g}
            losses.append(value)
        grads = fr.distributed.all_reduce(total)
        loss = fr.distributed.all_reduce({"loss": torch.stack(losses).mean()})
        return grads, loss, fr.distributed.sync_buffers(bufs)

    for i in range(3):  # warm: each layout checked once, then their order learnt
        step(i)
    got, counts = counting(lambda: [step(i) for i in range(3, 8)])
    return {"counts": counts, "grads": [g for g, _, _ in got]}


# --- bad arguments across processes (issue 10, item 5) -------------------------------------


@scenario
def bad_arguments(rank: int) -> dict[str, Any]:
    tree = {"w": torch.ones(2)}
    sub = dist.new_group([0])  # rank 1 is not in it
    out: dict[str, Any] = {}
    for name, f in [
        ("src_str", lambda: fr.distributed.broadcast(tree, src="0")),  # type: ignore[arg-type]
        ("src_float", lambda: fr.distributed.broadcast(tree, src=1.0)),  # type: ignore[arg-type]
        ("src_range", lambda: fr.distributed.broadcast(tree, src=2)),
        ("group_str", lambda: fr.distributed.all_reduce(tree, group="abc")),
        ("cap_nan", lambda: fr.distributed.all_reduce(tree, bucket_cap_mb=float("nan"))),
        ("cap_str", lambda: fr.distributed.all_reduce(tree, bucket_cap_mb="25")),  # type: ignore[arg-type]
        ("cap_neg", lambda: fr.distributed.all_reduce(tree, bucket_cap_mb=-1)),
        ("meta", lambda: fr.distributed.all_reduce({"w": torch.ones(2, device="meta")})),
        ("meta_again", lambda: fr.distributed.all_reduce({"w": torch.ones(2, device="meta")})),
    ]:
        out[name] = outcome(f)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out["outside"] = outcome(lambda: fr.distributed.all_reduce(tree, group=sub) is tree)
        if rank == 0:
            out["src_not_in_sub"] = outcome(
                lambda: fr.distributed.broadcast(tree, src=1, group=sub)
            )
    out["warnings"] = [str(w.message) for w in caught]
    k = ("a", "b") if rank == 0 else ("b", "a")
    out["key_order"] = outcome(lambda: fr.distributed.all_reduce({n: torch.ones(2) for n in k}))
    t, u = torch.ones(2), torch.ones(2)
    tied = {"a": t, "b": t} if rank == 0 else {"a": t, "b": u}
    out["tied"] = outcome(lambda: fr.distributed.all_reduce(tied))
    out["after"] = fr.distributed.all_reduce({"x": torch.ones(2)}, op="sum")
    return out


# --- memory held by the pools (issue 10, item 4) --------------------------------------------


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@scenario
def pools_release(rank: int) -> dict[str, Any]:
    """A 64 MiB tree reduced in a loop: the pool keeps one spare buffer beyond the live result,
    and fr.clear_caches() gives the memory back."""
    tree = {"w": torch.ones(16 * 2**20)}  # 64 MiB
    grads = None
    for _ in range(4):
        grads = fr.distributed.all_reduce(tree)  # the last result is live while the next is made
    plan = next(p for p in planning._PLANS.values() if p.layout.buckets[0].chunk > 2**20)
    live = [len(pools.send.entries) for pools in plan.pools]
    del grads
    fr.distributed.all_reduce(tree)  # every result dropped: one spare kept
    spare = [len(pools.send.entries) for pools in plan.pools]
    before = rss()
    fr.clear_caches()
    after = rss()
    return {"live": live, "spare": spare, "freed": before - after, "plans": len(planning._PLANS)}


# --- sparse gradients against DDP (issue 11, item 4) -------------------------------------


class SparseNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4, sparse=True)
        self.bag = nn.EmbeddingBag(10, 4, sparse=True, mode="sum")
        self.fc = nn.Linear(4, 2)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.fc(self.emb(idx).mean(1) + self.bag(idx))


def dense(tree: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.to_dense() if v.is_sparse else v for k, v in tree.items()}


@scenario
def sparse_against_ddp(rank: int) -> dict[str, Any]:
    """nn.Embedding / nn.EmbeddingBag(sparse=True) trained with fr.distributed.grad_and_value
    and with DDP: the same reduced (sparse) gradients, step by step; sparse leaves in all_reduce
    and broadcast."""
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = SparseNet()
    ddp = DistributedDataParallel(copy.deepcopy(model))
    params = fr.state(model).params

    def loss_fn(p: Any, x: torch.Tensor, y: torch.Tensor) -> Any:
        out, _ = fr.apply(model, fr.State(p, {}), x)
        return F.cross_entropy(out, y)

    steps = []
    for op in ("mean", "sum"):
        g = fr.distributed.grad_and_value(loss_fn, op=op)
        for i in range(3):
            gen = torch.Generator().manual_seed(100 * rank + i)
            x, y = (
                torch.randint(0, 10, (6, 3), generator=gen),
                torch.randint(0, 2, (6,), generator=gen),
            )
            grads, _ = g(params, x, y)
            ddp.zero_grad()
            F.cross_entropy(ddp(x), y).backward()
            want = {k: p.grad for k, p in ddp.module.named_parameters()}
            if op == "sum":  # DDP averages: its sum is the mean times the world size
                want = {k: v * WORLD for k, v in want.items()}
            steps.append((dense(grads), dense(want), {k: v.layout for k, v in grads.items()}))
            params = {k: p - 0.1 * grads[k] for k, p in params.items()}
            with torch.no_grad():
                for k, p in ddp.module.named_parameters():
                    p.add_(want[k], alpha=-0.1)
    e = torch.sparse_coo_tensor(torch.tensor([[rank, 3]]), torch.full((2, 2), rank + 1.0), (5, 2))
    tree = {"e": e, "w": torch.full((3,), rank + 1.0)}
    snap_e = e.coalesce().values().clone()
    reduced = {op: dense(fr.distributed.all_reduce(tree, op=op)) for op in ("sum", "mean")}
    sent = fr.distributed.broadcast(tree, src=1)
    return {
        "steps": steps,
        "reduced": reduced,
        "mine": dense(tree),
        "everyone": [dense(w) for w in gather_all(tree)],
        "broadcast": dense(sent),
        "unchanged": torch.equal(e.coalesce().values(), snap_e),
    }


def gather_all(tree: Any) -> list[Any]:
    everyone: list[Any] = [None] * WORLD
    dist.all_gather_object(everyone, tree)
    return everyone


# --- a rank that dies -----------------------------------------------------------------


@scenario
def survivor(rank: int) -> Any:
    start = time.monotonic()
    try:
        fr.distributed.all_reduce({"a": torch.ones(1000)})
    except Exception as err:
        cause = type(err.__cause__).__name__ if err.__cause__ is not None else None
        return ("raised", _kind(err), str(err)[:300], cause, time.monotonic() - start)
    return ("returned", time.monotonic() - start)


# --- models whose gradients need a rerun or a full backward (property tests' finds) -------------


class StackedSparse(nn.Module):
    """A sparse embedding whose weight shares its shape with a dense one: one stacked run."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4, sparse=True)
        self.fc = nn.Linear(4, 10)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.fc(self.emb(idx).mean(1))


class Reentrant(nn.Module):
    """A reentrant activation checkpoint, which autograd differentiates in a full backward only."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.b, torch.relu(self.a(x)), use_reentrant=True)


@scenario
def stacked_sparse_and_reentrant(rank: int) -> dict[str, Any]:
    """fr.distributed.grad_and_value equals all_reduce(fr.grad_and_value) on both, 3 steps each."""
    out: dict[str, Any] = {}
    for name, net, make in (
        ("sparse", StackedSparse, lambda g: torch.randint(0, 10, (6, 3), generator=g)),
        ("reentrant", Reentrant, lambda g: torch.randn(6, 8, generator=g)),
    ):
        torch.manual_seed(0)
        model = net()
        params = fr.state(model).params

        def loss_fn(p: Any, x: torch.Tensor, model: nn.Module = model) -> Any:
            return fr.apply(model, fr.State(p, {}), x)[0].square().mean()

        step = fr.distributed.grad_and_value(loss_fn)
        pairs = []
        for i in range(3):
            x = make(torch.Generator().manual_seed(10 * rank + i))
            grads, _ = step(params, x)
            want = fr.distributed.all_reduce(fr.grad_and_value(loss_fn)(params, x)[0])
            pairs.append((dense(grads), dense(want)))
            params = {k: p - 0.1 * grads[k] for k, p in params.items()}
        out[name] = pairs
    return out
