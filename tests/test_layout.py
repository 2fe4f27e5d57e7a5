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
from freplicate._distributed._layout import build, difference, valid_rows
from freplicate._distributed._options import Options

CPU = torch.device("cpu")


def layout_of(shapes, dtypes=None, *, cap=25.0, kind="reduce", world=1, op="sum"):
    dtypes = dtypes or [torch.float32] * len(shapes)
    sigs = [(tuple(s), d, CPU, torch.strided) for s, d in zip(shapes, dtypes)]
    paths = [f"['{i}']" for i in range(len(shapes))]
    return build(paths, sigs, None, Options(kind, op, cap, None), world, "fr.test", CPU)


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


def test_the_first_bucket_carries_the_first_words_and_the_last_its_own():
    layout = layout_of([(300,)] * 5, cap=0.001)
    extras = [b.extra for b in layout.buckets]
    assert extras[0] == _flags.FIRST and extras[-1] == _flags.LAST and set(extras[1:-1]) <= {0}
    one = layout_of([(3,)])
    assert [b.extra for b in one.buckets] == [_flags.FIRST]  # first and last: one set of words


def test_a_layout_without_tensors_has_a_bucket_of_words():
    layout = build(["['n']"], [None], [-1], Options("reduce", "sum", 25.0, None), 1, "fr.test", CPU)
    assert [(b.members, b.chunk) for b in layout.buckets] == [((), _flags.FIRST)]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_scatter_chunks_are_torch_chunk_rows_padded(world):
    layout = layout_of([(5, 3), (1, 2), (), (0, 4), (7,)], kind="scatter", world=world)
    for bucket in layout.buckets:
        assert bucket.chunks == world
        for run in bucket.runs:
            if not run.shape:  # a 0-dim tensor: one value in every rank's chunk
                assert run.rows == 1 and run.width == run.n
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
    sig = [((3, 3), torch.float32, CPU, torch.sparse_coo)]
    with pytest.raises(TypeError, match=r"layout torch\.sparse_coo, .* \(a scatter takes dense tensors only\)"):
        build(["['s']"], sig, None, Options("scatter", "sum", 25.0, None), 2, "fr.test", CPU)
