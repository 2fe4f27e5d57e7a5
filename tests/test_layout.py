"""The pure layout of ``fr.distributed``: buckets as DDP cuts them, chunks, fingerprints, texts.

No process group: the layout is plain data built from signatures, and its
oracle is DDP's own bucket assignment (``dist._compute_bucket_assignment_by_size``).
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist

from freplicate._distributed import _flags
from freplicate._distributed._layout import Tree, build, difference
from freplicate._distributed._options import Options
from freplicate._distributed._wire import ALIGN, valid_rows

CPU = torch.device("cpu")


def layout_of(
    shapes,
    dtypes=None,
    *,
    cap=25.0,
    kind="all_reduce",
    world=1,
    op="sum",
    orders=None,
    backend="nccl",
    overlap=True,
):
    dtypes = dtypes or [torch.float32] * len(shapes)
    orders = orders or [None] * len(shapes)
    sigs = [(tuple(s), d, CPU, torch.strided, o) for s, d, o in zip(shapes, dtypes, orders)]
    paths = [f"['{i}']" for i in range(len(shapes))]
    options = Options(kind, op, cap, None, overlap=overlap)
    return build(Tree(paths, sigs), options, world, "fr.test", CPU, backend)


def ddp_buckets(shapes, dtypes, cap_mb):
    """DDP's buckets for tensors in the order their gradients become ready (the reverse)."""
    tensors = [torch.empty(s, dtype=d) for s, d in zip(shapes, dtypes)][::-1]
    cap = int(cap_mb * 1024 * 1024)
    first = 1024 * 1024 if cap_mb == 25.0 else cap
    n = len(tensors)
    got, _ = dist._compute_bucket_assignment_by_size(
        tensors, [first, cap], [False] * n, list(range(n))
    )
    return sorted(sorted(n - 1 - i for i in b) for b in got)


@pytest.mark.parametrize("seed", range(12))
def test_buckets_are_ddps(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 30)
    shapes = [tuple(rng.choice([1, 3, 16, 64, 300]) for _ in range(rng.randint(0, 2))) for _ in range(n)]
    dtypes = [rng.choice([torch.float32, torch.float32, torch.float64, torch.float16]) for _ in range(n)]
    cap = rng.choice([25.0, 0.0005, 0.002, 0.01])
    layout = layout_of(shapes, dtypes, cap=cap)
    ours = sorted(sorted(b.members) for b in layout.buckets)
    assert ours == ddp_buckets(shapes, dtypes, cap), (shapes, cap)


def test_a_ready_tree_is_cut_at_the_cap_alone():
    """Outside a backward pass nothing starts early: no 1 MiB first bucket (a gradient step's)."""
    shapes = [(256, 256)] * 6  # 256 KiB each: DDP's cut makes a 1 MiB bucket, then the rest
    step = layout_of(shapes)
    ready = layout_of(shapes, overlap=False)
    assert [len(b.members) for b in step.buckets] == [4, 2]
    assert [len(b.members) for b in ready.buckets] == [6]


def test_the_first_bucket_carries_the_first_words_and_the_last_its_own():
    layout = layout_of([(300,)] * 5, cap=0.001)
    extras = [b.extra for b in layout.buckets]
    assert extras[0] == _flags.FIRST and extras[-1] == _flags.LAST and set(extras[1:-1]) <= {0}
    one = layout_of([(3,)])
    assert [b.extra for b in one.buckets] == [_flags.FIRST]  # first and last: one set of words


def test_a_layout_without_tensors_has_a_bucket_of_words():
    options = Options("all_reduce", "sum", 25.0, None)
    layout = build(Tree(["['n']"], [None], [-1]), options, 1, "fr.test", CPU, "gloo")
    assert [(b.members, b.chunk) for b in layout.buckets] == [((), _flags.FIRST)]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_scatter_chunks_are_torch_chunk_rows_padded(world):
    layout = layout_of([(5, 3), (1, 2), (), (0, 4), (7,)], kind="reduce_scatter", world=world)
    for bucket in layout.buckets:
        assert bucket.chunks == world
        for run in bucket.runs:
            if not run.shape:  # a 0-dim tensor: a slot per rank in every rank's chunk
                assert run.whole and run.rows == 1 and run.size == world, run
                continue
            d0 = run.shape[0]
            assert run.rows == -(-d0 // world)
            chunks = torch.arange(d0).chunk(world) if d0 else ()
            for r in range(world):
                want = len(chunks[r]) if r < len(chunks) else 0
                assert valid_rows(run.rows, d0, r) == want


def test_fingerprints_tell_layouts_apart_and_descriptions_name_the_difference():
    a, b = layout_of([(2, 2), (3,)]), layout_of([(2, 3), (3,)])
    assert a.fingerprint != b.fingerprint
    assert layout_of([(2, 2), (3,)]).fingerprint == a.fingerprint
    text = difference(("fr.f", a.description), 0, ("fr.f", b.description), 1)
    assert text.startswith("the tensor at ['0'] differs across ranks: shape (2, 2), dtype torch.float32 on rank 0")
    other = difference(("fr.f", a.description), 0, ("fr.g", a.description), 1)
    assert other.startswith("ranks called different functions: fr.f on rank 0, fr.g on rank 1")


def test_a_mean_of_integers_and_a_sparse_scatter_are_refused_by_path():
    with pytest.raises(TypeError, match=r"^fr\.test: op='mean' needs floating-point .* the leaf at \['0'\] is torch\.int64"):
        layout_of([(3,)], [torch.int64], op="mean")
    sig = [((3, 3), torch.float32, CPU, torch.sparse_coo, None)]
    options = Options("reduce_scatter", "sum", 25.0, None)
    with pytest.raises(TypeError, match=r"layout torch\.sparse_coo, .* \(a reduce_scatter takes dense tensors only\)"):
        build(Tree(["['s']"], sig), options, 2, "fr.test", CPU, "gloo")


@pytest.mark.parametrize("kind", ["all_reduce", "reduce_scatter", "all_gather"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64, torch.uint8])
def test_every_tensor_starts_64_byte_aligned(kind, dtype):
    layout = layout_of([(3,), (5, 7), (5, 7), (1,), (300,), (2, 3, 4)], [dtype] * 6, kind=kind, world=3)
    for bucket in layout.buckets:
        for run in bucket.runs:
            assert run.start * dtype.itemsize % ALIGN == 0
            assert run.slot * dtype.itemsize % ALIGN == 0 and run.slot >= run.size


def test_the_kind_and_the_memory_format_are_part_of_the_fingerprint():
    shapes = [(4, 3), (2,)]
    fingerprints = {
        layout_of(shapes, kind=k, world=2, op="sum").fingerprint
        for k in ("all_reduce", "broadcast", "reduce_scatter", "all_gather")
    }
    assert len(fingerprints) == 4
    a = layout_of([(2, 3, 4, 5)], kind="all_reduce")
    b = layout_of([(2, 3, 4, 5)], kind="all_reduce", orders=[(0, 2, 3, 1)])
    assert a.fingerprint != b.fingerprint
    text = difference(("fr.f", a.description), 0, ("fr.f", b.description), 1)
    assert "memory format" in text and "(0, 2, 3, 1) on rank 1" in text
    c = layout_of(shapes, kind="reduce_scatter", world=2)
    d = layout_of(shapes, kind="all_reduce", world=2)
    text = difference(("fr.f", c.description), 0, ("fr.f", d.description), 1)
    assert text.startswith("ranks called different collectives: reduce_scatter on rank 0, all_reduce on rank 1")


def test_the_rowed_kinds_travel_as_an_all_reduce_on_gloo():
    # chosen at the leaf by the backend and the call's bytes (docs/sharding.md's measurements)
    shapes = [(4096, 512)]  # 8 MiB of float32
    assert layout_of(shapes, kind="reduce_scatter", world=2, backend="gloo").wire == "reduce_scatter/sum"
    assert layout_of(shapes, kind="reduce_scatter", world=2, backend="nccl").wire == "reduce_scatter"
    assert layout_of(shapes, kind="all_gather", world=2, backend="gloo").wire == "all_gather/sum"
    assert layout_of([(4, 3)], kind="all_gather", world=2, backend="gloo").wire == "all_gather"
    by_sum = layout_of(shapes, kind="all_gather", world=2, backend="gloo")
    assert [b.chunks for b in by_sum.buckets] == [1] and by_sum.buckets[0].ranks == 2
