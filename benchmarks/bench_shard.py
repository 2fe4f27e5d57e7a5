"""ZeRO on gloo ranks: freplicate's ZeRO-1/2/3 beside DDP, ZeroRedundancyOptimizer and FSDP2.

Run ``.venv/bin/python -m benchmarks.bench_shard`` (or ``python -m freplicate
bench shard``; ``--quick`` for a smoke run; ``--no-compile`` without the
compiled sides, whose Inductor compile takes a minute or more per model;
``--part speed memory collectives counts hsdp`` for some of the parts;
``--models``, ``--memory-models``, ``--hsdp-models`` for the models of each
(``llama`` among them); ``--sides`` for some sides; ``--in-place`` to have
freplicate's functional sides update their shards and AdamW moments in place,
as ``torch.optim.AdamW`` does, instead of docs/sharding.md's out-of-place
update). The sides (``_shard_sides``; AdamW, lr 1e-3, weight decay 1e-2,
``F.cross_entropy``): DDP + ``torch.optim.AdamW``, DDP +
``ZeroRedundancyOptimizer(AdamW)``, FSDP2 (``fully_shard`` on each unit and
on the root, a ``DeviceMesh`` on ``"cpu"`` over gloo) + AdamW, freplicate's
ZeRO-1, ZeRO-2 and ZeRO-3 (``fr.distributed.apply_sharded``) as functions of
trees, eager and compiled, and docs/sharding.md's ZeRO-3 loop
(``torch.optim.AdamW`` on the shards, ``loss.backward()``; also with
``fr.clear_caches()`` after each step, and on ``apply_sharded``'s default
units beside FSDP2 on the same modules). Mixed precision: that loop with
``mp_policy=MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=float32)``
beside FSDP2 with the same policy on each unit and the root. The models: the
benchmark MLPs and ``llama`` (a Hugging Face ``LlamaForCausalLM`` from a
config, 24M parameters, random weights, each decoder layer a unit; no
compiled side on it). Before any figure, every side trains 3 steps from the
same init and must reach DDP + AdamW's parameters (within 1% of their
largest update: Inductor's AdamW rounds differently), or its FSDP2 twin's
(``_shard_sides.REFERENCE``: bf16, the mesh, the default units; bit for bit
in practice); one that does not, or that fails, is left out with a note.

**Speed** (mid_mlp and the Llama): two ranks on 127.0.0.1, one thread each,
rank r pinned to core r; every round runs every side a few steps, the sides
in balanced orders (the same on both ranks), a step's time the slowest
rank's, a side's time in a round its median step, the figure the median over
rounds of the per-round ratio.

**Counts** (with the speed part, in its ranks, after the timings): the
collectives a warm step launches from Python on rank 0, by kind, and their
elements (``count_distributed``'s counting); DDP's, in its C++ reducer, are
not seen.

**Memory** (deep_mlp: 8 units, 72 MiB of parameters; and the Llama): each side
alone in a fresh pair of ranks; after 3 warm-up steps, the peak resident set
(``VmHWM``, reset through ``/proc/self/clear_refs``) over 3 steps, above the
rank's resident set at its start (before the model is built), the larger
rank's; beside it the optimizer state's bytes on each rank, the live heap's
peak (glibc's ``mallinfo2``), the storage the gradients view after a step's
backward, and the same 3 steps' peak once ``malloc_trim`` gave back the free
memory malloc keeps (glibc keeps freed blocks below its mmap threshold, which
rises to 32 MiB: the resident set of a step that allocates and frees large
buffers is its live peak plus what malloc kept). Then, for each eager side,
where that memory is: the live heap after every operator of a step and, at
each boundary of the step and at each phase's peak, every tensor by role
(``_shard_sides.Census``).

**Hybrid sharding** (``hsdp``, on the Llama): the speed, counts and memory
parts asked for, on 4 gloo ranks (``_ranks.on_ranks``; 2 a core on 2 cores)
as a 2 x 2 ``init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate",
"shard"))``: ``apply_sharded(group=mesh)`` in the ZeRO-3 loop beside
``fully_shard(mesh=mesh)`` on each unit and the root, and DDP + AdamW on the
4 ranks.

**Collectives**: gloo's ``all_reduce``, ``reduce_scatter_tensor`` and
``all_gather_into_tensor`` from 4 KiB to 64 MiB, beside the all-reduce
alternatives (all-reduce, then this rank's slice copied out, for a
reduce-scatter; this rank's rows copied into a zeroed full buffer, then
all-reduced, for an all-gather), in balanced rounds, with each way's page
faults a call.
"""

from __future__ import annotations

import argparse
import gc
import math
import resource
from typing import Any

import torch
import torch.distributed as dist

from . import _shard_sides as sides
from ._common import DEEP_MLP, MODELS, on_two_ranks, orders, two_rank_arguments
from ._ranks import on_ranks
from ._report import Row, show
from ._shard_sides import (
    BF16,
    COMPILED,
    DDP_ADAMW,
    DDP_ZERO,
    DEFAULT_UNITS,
    FSDP2,
    FSDP2_BF16,
    FSDP2_HSDP,
    FSDP2_UNITS,
    HSDP_SIDES,
    HSDP_WORLD,
    LLAMA,
    MESH,
    REFERENCE,
    SIDES,
    ZERO,
    ZERO3_BF16,
    ZERO3_CLEARED,
    ZERO3_HSDP,
    ZERO3_TORCH,
    ZERO3_UNITS,
    MiB,
)
from .bench_distributed import _rounds

NAME = "shard"
TITLE = (
    "shard: ZeRO (AdamW) on 2 gloo ranks, freplicate's ZeRO-1/2/3 beside DDP + torch.optim.AdamW, "
    "DDP + ZeroRedundancyOptimizer(AdamW) and FSDP2 fully_shard + AdamW; a step's time is the "
    "slowest rank's"
)
SPEED_MODEL, MEMORY_MODEL = "mid_mlp", DEEP_MLP
# The speed targets (issue 24, item 3), on mid_mlp: side / baseline <= target; and item 2's
# ZeRO-3 against FSDP2. None: a row without a target.
PAIRS: tuple[tuple[str, str, float | None], ...] = (
    (ZERO[2], DDP_ADAMW, 1.00),
    (ZERO[2], DDP_ZERO, 0.80),
    (ZERO[2] + COMPILED, DDP_ADAMW, 0.90),
    (ZERO[3], DDP_ADAMW, 1.30),
    (ZERO[3], FSDP2, 1.00),
    (ZERO[3] + COMPILED, DDP_ADAMW, None),
    (ZERO[1], DDP_ADAMW, None),
    (ZERO[1] + COMPILED, DDP_ADAMW, None),
    (ZERO[2], FSDP2, None),
    (DDP_ZERO, DDP_ADAMW, None),
    (FSDP2, DDP_ADAMW, None),
    # issue 30: docs/sharding.md's ZeRO-3 loop (torch.optim), mixed precision, hybrid sharding
    (ZERO3_TORCH, FSDP2, 1.00),
    (ZERO3_TORCH, DDP_ADAMW, None),
    (ZERO3_BF16, FSDP2_BF16, None),
    (ZERO3_BF16, ZERO3_TORCH, None),
    (FSDP2_BF16, FSDP2, None),
    (ZERO3_UNITS, FSDP2_UNITS, 1.00),
    (ZERO3_UNITS, FSDP2, None),
    (FSDP2_UNITS, FSDP2, None),
    (ZERO3_HSDP, FSDP2_HSDP, None),
    (ZERO3_HSDP, DDP_ADAMW, None),
    (FSDP2_HSDP, DDP_ADAMW, None),
)
# the models a pair's speed target holds on (issue 24's ZeRO-3 / FSDP2 also on the Llama, item 5
# of issue 30); the others' on SPEED_MODEL alone
HELD_ON = {
    (ZERO[3], FSDP2): (SPEED_MODEL, LLAMA),
    (ZERO3_TORCH, FSDP2): (SPEED_MODEL, LLAMA),
    (ZERO3_UNITS, FSDP2_UNITS): (SPEED_MODEL, LLAMA),
}
# the Llama's sides (no compiled one: Inductor's compile of a 24M-parameter Llama takes minutes);
# speed: the ZeRO-3 ones and their FSDP2 twins
LLAMA_MEMORY = (
    DDP_ADAMW, FSDP2, ZERO[1], ZERO[2], ZERO[3], ZERO3_TORCH, ZERO3_CLEARED, FSDP2_BF16, ZERO3_BF16,
    FSDP2_UNITS, ZERO3_UNITS,
)  # fmt: skip
LLAMA_SPEED = (
    DDP_ADAMW, FSDP2, ZERO[3], ZERO3_TORCH, FSDP2_BF16, ZERO3_BF16, FSDP2_UNITS, ZERO3_UNITS
)  # fmt: skip
HSDP_MODEL = LLAMA
# The memory targets (issue 24, item 2; issue 30, item 5 on the Llama too): the peak resident
# set above the rank's start, of DDP + AdamW's; ZeRO-3 also of FSDP2's, and its live heap's peak
MEMORY_TARGETS = {ZERO[1]: 0.85, ZERO[2]: 0.75, ZERO[3]: 0.60, ZERO3_TORCH: 0.60}
MEMORY_TARGETS[ZERO3_CLEARED] = MEMORY_TARGETS[ZERO3_UNITS] = MEMORY_TARGETS[ZERO3_TORCH]
MEMORY_FSDP2 = 1.00
TARGETED = (MEMORY_MODEL, LLAMA)  # the models the memory targets hold on
# issue 30, item 5: ZeRO-2's gradient rows alone (the storage its gradients view after the
# backward, of DDP's gradients) at W = 2, on gloo too
GRADS_TARGETS = {ZERO[2]: 0.55}
# 4 KiB to 64 MiB of float32, by fours
SIZES = tuple(4096 * 4**k for k in range(8))
COLLECTIVES = (
    "all_reduce",
    "reduce_scatter_tensor",
    "all_reduce + slice",
    "all_gather_into_tensor",
    "zeroed + all_reduce",
)
# the largest parameter difference to DDP + AdamW after 3 steps, of DDP's largest update: the
# eager sides agree bit for bit, Inductor's AdamW rounds differently (1e-3 of an update); a side
# of ``REFERENCE`` to its FSDP2 twin's. FSDP2 in bf16 is held to none (bf16 against DDP's float32
# moves AdamW's small updates by about their size): its difference is shown, not held
AGREE = 1e-2
UNHELD = (FSDP2_BF16,)


def _chosen(args: argparse.Namespace, among: tuple[str, ...] = SIDES) -> list[str]:
    """The sides of ``among`` this run can run (and the notes on those it cannot, in
    ``args.notes``)."""
    out = []
    for name in [s for s in args.only if s in among] if args.only else among:
        if name.endswith(COMPILED) and not args.compile:
            continue
        why = sides.missing(name)
        if why is None:
            out.append(name)
        else:
            args.notes[name] = f"{name}: skipped: {why}"
    return out


def _speed(args: argparse.Namespace) -> dict[str, Any]:
    """Every model's rounds and every size's collectives, on this rank (both ranks run it)."""
    out: dict[str, Any] = {}
    for name in args.models:
        model, x, y = sides.build(name)
        # the sides that are checked are those timed (a compiled one compiles once): where
        # their parameters are after the check does not change a step's time
        made, failed = {}, {}
        for s in args.sides_of.get(name, args.sides):
            try:  # a side that does not run here is a note, not the end of the benchmark
                made[s] = sides.make(s, model, x, y, **args.fr)
                made[s].step()
            except Exception as err:
                failed[s] = f"{s} on {name}: failed: {_why(err)}"
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, failed)
        for got in everyone:
            for s, why in got.items():
                made.pop(s, None)
                out.setdefault("notes", {}).setdefault(s, why)
        worst = sides.agree(made)
        for s, w in worst.items():
            if w > AGREE and s not in UNHELD:  # a fast wrong answer is no result
                del made[s]
                out.setdefault("notes", {})[s] = (
                    f"{s} on {name}: not timed: its parameters differ from "
                    f"{sides.reference(s, worst)}'s by {w:.1e} of the largest update"
                )
        rounds = args.rounds or math.ceil(16 / len(orders(len(made)))) * len(orders(len(made)))
        steps = [side.step for side in made.values()]
        out[name] = (list(made), _rounds(steps, rounds, args.steps), worst)
        del made, steps
        gc.collect()
    if "collectives" in args.parts:
        out["collectives"] = _collectives(args.sizes, args.rounds or 9, args.steps)
    if "counts" in args.parts:  # last: the counting wraps the collectives for good
        out["counts"] = _counts(args)
    return out


# what ``count_distributed`` counts in a step, shown per side (rank 0's)
COUNTED = ("collectives", "by_kind", "elements_in", "elements_wire", "bytes_full", "waits")


def _counted_sides(names: list[str]) -> list[str]:
    """The sides whose collectives are counted: those that launch them from Python (DDP's
    reducer launches its all-reduces in C++, unseen; a compiled step's are in its graph)."""
    return [s for s in names if not s.endswith(COMPILED) and not s.startswith("DDP")]


def _counts(args: argparse.Namespace) -> dict[str, Any]:
    """Each counted side's collectives in one warm step (after 2), on this rank (every rank
    runs it; ``count_distributed``'s counting): per model, per side, ``COUNTED``."""
    from . import count_distributed as counting

    counting.install()
    out: dict[str, Any] = {}
    for name in args.models:
        model, x, y = sides.build(name)
        for s in _counted_sides(args.sides_of.get(name, args.sides)):
            try:
                side = sides.make(s, model, x, y, **args.fr)
                for _ in range(2):
                    side.step()
                _, summary = counting.measured(side.step)
            except Exception as err:  # the timing's notes say why, where it fails there too
                out.setdefault(name, {})[s] = {"failed": _why(err)}
                continue
            out.setdefault(name, {})[s] = {k: summary[k] for k in COUNTED}
            del side
            gc.collect()
    return out


def _why(err: BaseException) -> str:
    """The innermost cause's first line (Dynamo wraps the error a traced call raised)."""
    while err.__cause__ is not None:
        err = err.__cause__
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0][:400] if text else ''}"


def _collectives(sizes: tuple[int, ...], rounds: int, steps: int) -> dict[int, Any]:
    """gloo's collectives, and the all-reduce ways to the same results, at every size (bytes):
    per size the repeats a figure takes, the rounds, and each way's minor page faults a call."""
    out = {}
    for nbytes in sizes:
        reps, candidates = _candidates(nbytes)
        faults = [[0, 0] for _ in candidates]  # per way: faults, calls (warm-up included)
        counted = [_counted(f, reps, n) for f, n in zip(candidates, faults)]
        t = _rounds(counted, rounds, steps)
        out[nbytes] = (reps, t, [f / max(c, 1) for f, c in faults])
    return out


def _candidates(nbytes: int) -> tuple[int, list[Any]]:
    """The five ways of ``COLLECTIVES`` on ``nbytes`` of float32, and how many calls make one
    figure (a few ms at least)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    n = nbytes // 4
    c = n // world
    full, work, part, send = torch.randn(n), torch.zeros(n), torch.empty(c), torch.randn(c)
    gathered = torch.empty(n)
    mine = slice(rank * c, (rank + 1) * c)
    reps = max(1, min(64, 2**24 // nbytes))

    def reduce_via_all_reduce() -> None:
        dist.all_reduce(work)  # zeros: repeated sums stay finite
        part.copy_(work[mine])

    def gather_via_all_reduce() -> None:
        work.zero_()
        work[mine].copy_(send)
        dist.all_reduce(work)

    ways = [
        lambda: dist.all_reduce(work),
        lambda: scatter(part, full),
        reduce_via_all_reduce,
        lambda: gather(gathered, send),
        gather_via_all_reduce,
    ]
    return reps, ways


def _counted(fn: Any, reps: int, faults: list[int]) -> Any:
    """``fn`` called ``reps`` times, its minor page faults and calls added to ``faults``."""

    def run() -> None:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(reps):
            fn()
        faults[0] += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
        faults[1] += reps

    return run


def _memory(args: tuple[str, str, bool, int, dict[str, Any]]) -> dict[str, Any]:
    """One side alone on this pair of ranks: its resident set around a few steps (as it comes,
    then after ``malloc_trim``), its optimizer state, its live heap's peak and (``census``)
    where its memory is during a step."""
    from torch.distributed.device_mesh import init_device_mesh  # noqa: F401
    from torch.distributed.optim import ZeroRedundancyOptimizer  # noqa: F401
    from torch.nn.parallel import DistributedDataParallel  # noqa: F401

    model_name, side_name, census, steps, options = (
        args  # imported first: the start is every side's
    )
    gc.collect()
    start, start_heap = sides.kib("VmRSS"), sides.heap() if sides.heap else 0
    model, x, y = sides.build(model_name)
    side = sides.make(side_name, model, x, y, **options)
    del model

    def run() -> None:
        for _ in range(steps):
            side.step()

    for _ in range(3):
        side.step()
    grads = _grad_storage(side)
    gc.collect()
    before, before_heap = sides.kib("VmRSS"), sides.heap() if sides.heap else 0
    sides.reset_peak()
    run()
    figures: dict[str, Any] = {
        "state": side.state_bytes(),
        "start": start,
        "before": before,
        "peak": sides.kib("VmHWM"),
        "kept": before_heap - start_heap,
        "grads": grads,
    }
    # the same steps once malloc gave back what it kept free (the warm-up's peaks among it)
    gc.collect()
    sides.malloc_trim()
    sides.reset_peak()
    run()
    figures["trimmed"] = sides.kib("VmHWM")
    compiled = side_name.endswith(COMPILED)
    if sides.heap is not None and compiled:
        figures["heap peak"] = sides.sampled_peak(run) - start_heap
        figures["sampled"] = True
    elif sides.heap is not None and census:
        figures["census"] = sides.Census(side, start_heap).count()
        figures["heap peak"] = figures["census"]["peak"]
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, figures)
    return {"ranks": everyone}


def _grad_storage(side: Any) -> int | None:
    """The bytes of the storages a side's gradients view after the backward of one step (a
    gradient that is a view of a larger buffer counts the buffer: ZeRO-2's shards, were they
    views of the all-reduced buffer, would count it whole); ``None`` for a compiled side
    (it marks nothing)."""
    got: list[int] = []

    def mark(phase: str, **trees: Any) -> None:
        if phase == "backward":
            if "grads" in trees:
                tensors = list(sides._leaves(trees["grads"]))
            else:
                tensors = next((t for role, t in side.roles() if role == "grads"), [])
            got.append(sum(sides._storages(tensors).values()))

    side.mark = mark
    try:
        side.step()
    finally:
        side.mark = sides._no_mark
    return got[0] if got else None


_DETAILS: list[str] = []


def details() -> list[str]:
    """The memory, breakdown and collectives tables of the last ``run`` (``freplicate bench``
    prints them after the timings)."""
    return list(_DETAILS)


def _mib(nbytes: float) -> str:
    return f"{nbytes / MiB:.1f}"


def _memory_tables(memory: dict[tuple[str, str], Any], notes: list[str]) -> list[str]:
    from freplicate._demo._table import table

    def most(got: Any, key: Any) -> float:
        return max(key(r) for r in got["ranks"])

    def above(got: Any) -> float:
        return most(got, lambda r: r["peak"] - r["start"])

    def trimmed(got: Any) -> float:
        return most(got, lambda r: r["trimmed"] - r["start"])

    def live(got: Any) -> float:
        return most(got, lambda r: r.get("heap peak", math.nan))

    def grads(got: Any) -> float:
        values = [r.get("grads") for r in got["ranks"]]
        return math.nan if None in values else max(values)

    header = ["memory (per rank)", "model", "optimizer state MiB", "of DDP's", "heap kept MiB"]
    header += ["heap peak", "of DDP's", "of FSDP2's", "RSS start", "RSS peak above start"]
    header += ["of DDP's"]
    header += ["of FSDP2's", "grads MiB", "of DDP's", "target", "status", "after malloc_trim"]
    header += ["of DDP's"]
    body = []
    for (model, side), got in memory.items():
        ddp = memory.get((model, DDP_ADAMW))
        # FSDP2 of the same kind: in bf16 beside bf16, on the mesh beside the mesh
        kind = next((k for k in (BF16, MESH, DEFAULT_UNITS) if side.endswith(k)), "")
        fsdp2 = memory.get((model, FSDP2 + kind))
        states = [r["state"] for r in got["ranks"]]
        ratio = above(got) / above(ddp) if ddp else None
        of_fsdp2 = above(got) / above(fsdp2) if fsdp2 else None
        target = MEMORY_TARGETS.get(side) if model in TARGETED else None
        heap_of_fsdp2 = live(got) / live(fsdp2) if fsdp2 else None
        grads_of_ddp = grads(got) / grads(ddp) if ddp else math.nan
        grads_target = GRADS_TARGETS.get(side) if model in TARGETED else None
        met: list[tuple[str, bool]] = []  # each target held here: what it holds, met
        if target is not None and ratio is not None:
            met.append(("RSS of DDP's", round(ratio, 3) <= target))
        if grads_target is not None and not math.isnan(grads_of_ddp):
            met.append(("grads", round(grads_of_ddp, 3) <= grads_target))
        if (
            side in (ZERO[3], ZERO3_TORCH, ZERO3_CLEARED, ZERO3_UNITS)
            and of_fsdp2 is not None
            and model in TARGETED
        ):
            met.append(("RSS of FSDP2's", round(of_fsdp2, 3) <= MEMORY_FSDP2))
            if heap_of_fsdp2 is not None and not math.isnan(heap_of_fsdp2):
                met.append(("heap of FSDP2's", round(heap_of_fsdp2, 3) <= MEMORY_FSDP2))
        missed = [what for what, ok in met if not ok]
        sampled = "~" if any(r.get("sampled") for r in got["ranks"]) else ""
        body.append(
            [
                side,
                model,
                " / ".join(_mib(s) for s in states),
                " / ".join(f"{s / ddp['ranks'][0]['state']:.3f}" for s in states) if ddp else "-",
                _mib(most(got, lambda r: r["kept"])),
                sampled + _mib(live(got)),
                f"{live(got) / live(ddp):.3f}" if ddp else "-",
                "-" if heap_of_fsdp2 is None else f"{heap_of_fsdp2:.3f}",
                f"{most(got, lambda r: r['start']) / 1024:.0f}",
                f"{above(got) / 1024:.0f}",
                "-" if ratio is None else f"{ratio:.3f}",
                "-" if of_fsdp2 is None else f"{of_fsdp2:.3f}",
                "-" if math.isnan(grads(got)) else _mib(grads(got)),
                "-" if math.isnan(grads_of_ddp) else f"{grads_of_ddp:.3f}",
                _targets(target, grads_target),
                "-" if not met else "missed: " + ", ".join(missed) if missed else "met",
                f"{trimmed(got) / 1024:.0f}",
                f"{trimmed(got) / trimmed(ddp):.3f}" if ddp else "-",
            ]
        )
    lines = [
        "",
        "memory (MiB): each side alone in a fresh pair of ranks (hybrid sharding: 4 ranks), 3 "
        "warm-up steps, then 3 steps, the largest rank's; optimizer state: rank 0 / rank 1 / ...; "
        "heap: the live heap (mallinfo2: "
        "malloc's bytes in use) above the rank's start, between steps, and its peak in a step "
        "(after every operator; ~: sampled every 0.2 ms, a compiled step); RSS: at the rank's "
        "start (before the model), and the peak resident set (VmHWM) of the 3 steps above it, "
        "the figure held to the targets (ZeRO-3 also to <= FSDP2's, the heap peak too: status "
        "names the targets missed; of "
        "FSDP2's: FSDP2 of the same kind, bf16 or on the mesh); grads: the storage the "
        "gradients view after a step's backward (ZeRO-2's held to <= 0.55 of DDP's); after "
        "malloc_trim: the same 3 steps again once malloc gave back its free memory (a compiled "
        "side's RSS includes what the compiler keeps)",
        *table(header, body, "llrrrrrrrrrrrrllrr"),
        *notes,
    ]
    for (model, side), got in memory.items():
        ranks = got["ranks"]
        rank = max(range(len(ranks)), key=lambda r: ranks[r]["peak"] - ranks[r]["start"])
        census = ranks[rank].get("census")
        if census:
            lines += _breakdown(f"{side} on {model}, rank {rank}", census)
    return lines


def _targets(target: float | None, grads: float | None) -> str:
    held = [] if target is None else [f"<= {target:.2f}"]
    held += [] if grads is None else [f"grads <= {grads:.2f}"]
    return "; ".join(held) or "-"


def _breakdown(title: str, census: dict[str, Any]) -> list[str]:
    from freplicate._demo._table import table

    header = ["where (MiB; heap above the rank's start)", "heap", *sides.COLUMNS, "malloc free"]
    body = []
    for row in census["rows"]:
        body.append(
            [
                row["label"],
                _mib(row["heap"]),
                *(_mib(row[c]) for c in sides.COLUMNS),
                _mib(row["malloc free"]),
            ]
        )
    lines = [
        "",
        f"breakdown: {title}, {census['ops']} operators a step (the counting's own "
        f"{_mib(census['overhead'])} MiB taken off): the live heap, and every tensor "
        "Python reaches by role (pools idle: freplicate's pooled buffers no result views; "
        "saved: by autograd; unseen: the heap beyond them); malloc free: freed memory malloc "
        "keeps (resident where touched)",
        *table(header, body, "l" + "r" * (len(header) - 1)),
    ]
    for row in census["rows"]:
        if row["pools"] and row["label"].startswith(("between", "the step's")):
            held = ", ".join(
                f"{kind} {_mib(n)}" + (f" in {k}" if k > 1 else "") + f" ({who})"
                for kind, who, n, k in row["pools"]
            )
            lines.append(f"  pools {row['label']}: {held}")
    return lines


def _collective_table(got: dict[int, Any]) -> list[str]:
    from freplicate._demo._table import table

    header = ["gloo, 2 ranks: size", "calls", "all_reduce ms", "reduce_scatter", "AR + slice"]
    header += ["all_gather", "zeroed + AR", "RS / (AR + slice)", "AG / (zeroed + AR)", "choose"]
    header += ["page faults a call: AR, RS, AG"]
    body = []
    for nbytes, (reps, t, faults) in got.items():
        size = f"{nbytes // MiB} MiB" if nbytes >= MiB else f"{nbytes // 1024} KiB"
        rs, ag = t.ratio(1, 2), t.ratio(3, 4)
        pick = ("reduce_scatter" if rs <= 1 else "AR + slice") + ", "
        pick += "all_gather" if ag <= 1 else "zeroed + AR"
        body.append(
            [size, str(reps), f"{t.median(0) / reps * 1e3:.3f}"]
            + [f"{t.ratio(i, 0):.2f}x" for i in range(1, 5)]
            + [f"{rs:.2f}", f"{ag:.2f}", pick]
            + [", ".join(f"{faults[i]:.0f}" for i in (0, 1, 3))]
        )
    return [
        "",
        "collectives: the median call (the slowest rank's) of all_reduce, and each other way's "
        "time / all_reduce's of the same full size (median of per-round ratios); RS via AR: "
        "all_reduce, then this rank's slice copied out; AG via AR: this rank's rows copied into "
        "a zeroed full buffer, then all_reduce; page faults: rank 0's minor faults a call (a "
        "fresh buffer from the system: gloo's reduce_scatter clones its input, its all_gather "
        "lands in a temporary, above malloc's mmap threshold that memory is new every call)",
        *table(header, body, "lrrrrrrrrlr"),
    ]


def _llama_missing() -> str | None:
    try:
        import transformers  # noqa: F401
    except ImportError as err:
        return f"{LLAMA}: skipped: needs transformers ({err})"
    return None


def run(
    quick: bool = False,
    *,
    models: tuple[str, ...] | None = None,
    memory_models: tuple[str, ...] | None = None,
    hsdp_models: tuple[str, ...] | None = None,
    rounds: int | None = None,
    steps: int | None = None,
    pin: bool = True,
    compile: bool | None = None,
    parts: tuple[str, ...] = ("speed", "memory", "collectives", "counts", "hsdp"),
    only: tuple[str, ...] = (),
    in_place: bool = False,
) -> list[Row]:
    """Spawn the ranks: count and time every side, measure each one's memory, time the
    collectives; then the same for hybrid sharding on 4 ranks (``"hsdp"`` in ``parts``)."""
    args = argparse.Namespace(
        models=list(models or (("small_mlp",) if quick else (SPEED_MODEL, LLAMA))),
        # --quick: every side checked and counted as in a full run, timed in 2 rounds of 1 step
        rounds=rounds or (2 if quick else None),
        steps=steps or (1 if quick else 3),
        compile=(not quick) if compile is None else compile,
        sizes=(64 * 1024, 4 * MiB) if quick else SIZES,
        parts=parts,
        notes={},
        only=only and (DDP_ADAMW, *(s for s in only if s != DDP_ADAMW)),
        fr={"in_place": True} if in_place else {},
    )
    args.sides = _chosen(args)
    llama = _chosen(args, LLAMA_SPEED)
    args.sides_of = {LLAMA: llama}
    missing = _llama_missing()
    if missing is not None:
        args.notes[LLAMA] = missing
    chosen = list(memory_models or (("small_mlp",) if quick else (MEMORY_MODEL, LLAMA)))
    meshed = list(hsdp_models or (("small_mlp",) if quick else (HSDP_MODEL,)))
    if missing is not None:
        args.models = [m for m in args.models if m != LLAMA]
        chosen = [m for m in chosen if m != LLAMA]
        meshed = [m for m in meshed if m != LLAMA]
    results: dict[str, Any] = {}
    if "speed" not in parts:
        args.models = []
    if args.models or "collectives" in parts:
        results = on_two_ranks(_speed, args, pin=pin, group_timeout=600, limit=7200)
    hsdp: dict[str, Any] = {}
    mesh_sides = _chosen(args, HSDP_SIDES)
    if "hsdp" in parts and "speed" in parts and len(mesh_sides) > 1 and meshed:
        on4 = argparse.Namespace(**vars(args))
        on4.models, on4.sides, on4.sides_of = meshed, mesh_sides, {}
        on4.parts = tuple(p for p in parts if p != "collectives")
        hsdp = on_ranks(_speed, on4, HSDP_WORLD, pin=pin, group_timeout=600, limit=7200)
    counts = {(name, 2): per for name, per in results.get("counts", {}).items()}
    counts.update({(name, HSDP_WORLD): per for name, per in hsdp.get("counts", {}).items()})
    memory = {}
    if "memory" in parts:
        measured = [DDP_ADAMW, ZERO[2]] if quick and not only else args.sides
        runs = [
            (name, name, _chosen(args, LLAMA_MEMORY) if name == LLAMA else measured, 2)
            for name in chosen
        ]
        if "hsdp" in parts and not quick:
            runs += [(name, _on_mesh(name), mesh_sides, HSDP_WORLD) for name in meshed]
        for name, label, among, world in runs:
            for side in among:
                try:  # its ranks' output says why, above the report
                    memory[(label, side)] = on_ranks(
                        _memory,
                        (name, side, True, 3, args.fr),
                        world,
                        pin=pin,
                        group_timeout=600,
                        limit=1800,
                    )
                except RuntimeError as err:
                    args.notes[(label, side)] = f"{side} on {label}: memory not measured: {err}"
    notes = list(args.notes.values()) + list(results.get("notes", {}).values())
    notes += [f"{n} (4 ranks)" for n in hsdp.get("notes", {}).values()]
    _DETAILS[:] = ["freplicate's sides: AdamW in place (--in-place)"] if in_place else []
    rows = []
    for got, on in ((results, None), (hsdp, HSDP_WORLD)):
        for name in [m for m in got if m not in ("notes", "collectives", "counts")]:
            ran, t, worst = got[name]
            label = name if on is None else _on_mesh(name)
            agreement = ", ".join(
                f"{s} {w:.1e}" + (f" (of {sides.reference(s, worst)}'s)" if s in REFERENCE else "")
                for s, w in worst.items()
                if s != DDP_ADAMW
            )
            _DETAILS.append(f"{label}: largest parameter difference to {DDP_ADAMW} after 3 "
                            f"steps, of its largest update: {agreement}")  # fmt: skip
            for side, base, target in PAIRS:
                if side in ran and base in ran:
                    i, j = ran.index(side), ran.index(base)
                    held = target if name in HELD_ON.get((side, base), (SPEED_MODEL,)) else None
                    rows.append(
                        Row(NAME, f"AdamW step: {side} / {base}", label,
                            t.median(i), t.median(j), t.ratio(i, j), None if on else held)
                    )  # fmt: skip
    if counts:
        _DETAILS.extend(_count_table(counts))
    if memory:
        _DETAILS.extend(_memory_tables(memory, notes))
    elif notes:
        _DETAILS.extend(["", *notes])
    if "collectives" in results:
        _DETAILS.extend(_collective_table(results["collectives"]))
    return rows


def _on_mesh(model: str) -> str:
    """A model's name in the rows of hybrid sharding (4 ranks, a 2 x 2 mesh)."""
    return f"{model}, 4 ranks"


def _count_table(counts: dict[tuple[str, int], Any]) -> list[str]:
    from freplicate._demo._table import table

    header = ["collectives (rank 0, one warm step)", "model", "ranks", "collectives", "by kind"]
    header += ["elements in", "elements on the wire", "MiB (larger of in, out)", "waits"]
    body = []
    for (model, world), per in counts.items():
        for side, got in per.items():
            if "failed" in got:
                body.append([side, model, str(world), got["failed"][:60], "", "", "", "", ""])
                continue
            kinds = ", ".join(f"{k.split('.')[-1]} {n}" for k, n in got["by_kind"].items())
            body.append(
                [
                    side,
                    model,
                    str(world),
                    f"{got['collectives']:.0f}",
                    kinds,
                    f"{got['elements_in']:,.0f}",
                    f"{got['elements_wire']:,.0f}",
                    _mib(got["bytes_full"]),
                    f"{got['waits']:.0f}",
                ]
            )
    return [
        "",
        "counts (benchmarks.count_distributed's counting; not times, load does not move them): "
        "the collectives one warm step launches from Python on rank 0, by kind; elements in: "
        "what the rank hands in (a reduce-scatter its full input, an all-gather its shard); on "
        "the wire: what it sends in a ring on the collective's group of 2 (an all-reduce "
        "2(W-1)/W of it; on gloo fr's reduce-scatter travels as an all-reduce); MiB: the "
        "larger of in and out, in their dtype; waits: Work.wait calls from Python. DDP's "
        "all-reduces are launched by its reducer in C++: not counted",
        *table(header, body, "llrrlrrrr"),
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=TITLE)
    parser.add_argument("--quick", action="store_true", help="few rounds, for a smoke run")
    parser.add_argument("--models", nargs="*", default=None, choices=(*MODELS, DEEP_MLP, LLAMA))
    parser.add_argument(
        "--memory-models", nargs="*", default=None, choices=(*MODELS, DEEP_MLP, LLAMA)
    )
    parser.add_argument(
        "--hsdp-models", nargs="*", default=None, choices=(*MODELS, DEEP_MLP, LLAMA),
        help=f"hybrid sharding's models, on {HSDP_WORLD} ranks (default: {HSDP_MODEL})",
    )  # fmt: skip
    parser.add_argument("--no-compile", dest="compile", action="store_false", default=None)
    parts = ["speed", "memory", "collectives", "counts", "hsdp"]
    parser.add_argument(
        "--part", nargs="*", default=parts, choices=parts,
        help="hsdp: the speed, counts and memory parts asked for, on 4 ranks (a 2 x 2 mesh)",
    )  # fmt: skip
    parser.add_argument(
        "--sides", nargs="*", default=[], choices=(*SIDES, FSDP2_HSDP, ZERO3_HSDP),
        help=f"only these sides (and {DDP_ADAMW}, every figure's baseline)",
    )  # fmt: skip
    parser.add_argument(
        "--in-place", action="store_true",
        help="freplicate's sides update their shards and AdamW moments in place (torch.optim's "
        "loop) instead of docs/sharding.md's out-of-place AdamW",
    )  # fmt: skip
    two_rank_arguments(parser)
    args = parser.parse_args(argv)
    rows = run(
        args.quick,
        models=tuple(args.models) if args.models else None,
        memory_models=tuple(args.memory_models) if args.memory_models else None,
        hsdp_models=tuple(args.hsdp_models) if args.hsdp_models else None,
        rounds=args.rounds,
        steps=args.steps,
        pin=args.pin,
        compile=args.compile,
        parts=tuple(args.part),
        only=tuple(args.sides),
        in_place=args.in_place,
    )
    show(TITLE, rows)
    print("\n".join(details()))


if __name__ == "__main__":
    main()
