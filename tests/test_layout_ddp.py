"""Memory formats and 64-byte alignment across ranks, beside DistributedDataParallel (2 gloo ranks).

DDP's gradients are views of its buckets laid out with each parameter's
strides (``as_strided`` where the parameter is dense), so a ``channels_last``
parameter gets a ``channels_last`` gradient; its parameters are tensors of
their own, which torch's allocator starts at a multiple of 64 bytes.
``fr.distributed``'s results are views of its buckets too: every tensor's
place starts at a multiple of 64 bytes and keeps its memory order, so a
step of ``fr.distributed.grad_and_value`` computes on the same data in the
same layout as DDP's, and gives DDP's results bit for bit. Some CPU kernels
round differently on data 8 or 40 bytes past a 64-byte boundary (the old
wire format's offsets); ``test_the_bitwise_test_can_see_a_misalignment``
shows that the large-layer loop below would catch it on this machine.

Rank-side code: ``_layout_workers.py``. What the collectives keep:

==============================  ======================================================
kind                            result's memory order
==============================  ======================================================
broadcast, all_reduce           the input's (``channels_last``, transposed, any dense order)
reduce_scatter, all_gather      the input's where dim 0 is outermost in memory (rows are
                                what the chunks cut: ``channels_last`` is kept); a
                                transposed 2-D weight (dim 0 innermost) comes back contiguous
==============================  ======================================================
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))  # the spawned ranks import the workers by name
import _dist_workers as w
import _layout_workers as lw

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")


@pytest.fixture(scope="module")
def job() -> dict[str, list[Any]]:
    return lw.run(lw.SCENARIOS, pg_timeout=60.0, deadline=400.0)


def size_one_free(strides: tuple[int, ...], shape: tuple[int, ...]) -> tuple[int | None, ...]:
    """``strides`` with those of dims of size 1 (which address nothing) left out."""
    return tuple(s if n != 1 else None for s, n in zip(strides, shape))


# --- (a) the channels_last conv net ---------------------------------------------------------


def test_channels_last_conv_net_trains_bit_for_bit_beside_ddp(job) -> None:
    for rank, res in enumerate(w.ok(job, "channels_last_conv_beside_ddp")):
        start = res["start"]
        # the conv weights are channels_last, and broadcast keeps them so, aligned
        assert start["conv.weight"] == ((27, 1, 9, 3), 0)
        assert res["broadcast"] == {k: (s, 0) for k, (s, _) in start.items()}
        for i, (ddp, ours) in enumerate(zip(res["ddp"], res["fr"])):
            where = f"rank {rank}, step {i}"
            assert torch.equal(ours["out"], ddp["out"]), where
            assert torch.equal(ours["loss"], ddp["loss"]), where
            for part in ("grads", "params", "buffers"):
                assert ours[part].keys() == ddp[part].keys()
                for k in ddp[part]:
                    assert torch.equal(ours[part][k], ddp[part][k]), f"{where}: {part} {k}"
                    assert ours[part][k].stride() == ddp[part][k].stride(), f"{where}: {part} {k}"
            for k, (strides, misaligned) in ours["grad_layouts"].items():
                # the gradients are views of the buckets, with DDP's (the parameter's) strides
                assert strides == ddp["grad_layouts"][k][0] == start[k][0], f"{where}: {k}"
                assert misaligned == 0, f"{where}: {k}"
            for k, p in ours["params"].items():
                assert p.stride() == start[k][0], f"{where}: {k}"
    a, b = (res["fr"][-1]["params"] for res in job["channels_last_conv_beside_ddp"])
    assert all(torch.equal(a[k], b[k]) for k in a)


# --- (b) every collective of every dtype ------------------------------------------------------


def sum_of(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a | b if a.dtype == torch.bool else a + b


def rows(t: torch.Tensor, rank: int) -> torch.Tensor:
    if t.dim() == 0:
        return t
    parts = t.chunk(2) if t.shape[0] else (t, t)
    return parts[rank] if rank < len(parts) else t[t.shape[0] :]


def expected_values(kind: str, inputs: list[dict[str, torch.Tensor]], rank: int) -> dict[str, Any]:
    a, b = inputs
    if kind == "broadcast":
        return a
    if kind == "all_reduce":
        return {k: sum_of(a[k], b[k]) for k in a}
    if kind in ("all_reduce_mean", "small_buckets"):
        return {k: (a[k] + b[k]) / 2 for k in a}
    if kind == "reduce_scatter":
        return {k: rows(sum_of(a[k], b[k]), rank) for k in a}
    # all_gather(shard(t), t): each rank's rows (a 0-dim tensor: each rank keeps its own)
    return {
        k: torch.cat([rows(a[k], 0), rows(b[k], 1)]) if a[k].dim() else inputs[rank][k] for k in a
    }


def test_every_collective_keeps_the_memory_format_and_aligns_every_dtype(job) -> None:
    results = w.ok(job, "collectives_keep_formats")
    for dtype in lw.DTYPES:
        inputs = [results[r][str(dtype)]["inputs"] for r in range(2)]
        for rank in range(2):
            observed = results[rank][str(dtype)]
            kinds = [k for k in observed if k != "inputs"]
            assert len(kinds) == (6 if dtype.is_floating_point or dtype.is_complex else 4)
            for kind in kinds:
                got, layouts = observed[kind]["values"], observed[kind]["layouts"]
                want = expected_values(kind, inputs, rank)
                for k, t in inputs[rank].items():
                    where = f"{dtype}, {kind}, rank {rank}, {k}"
                    value = got[k]
                    if kind in ("all_reduce_mean", "small_buckets"):
                        torch.testing.assert_close(value, want[k], rtol=0, atol=0, msg=where)
                    else:
                        assert torch.equal(value, want[k]), where
                    strides, misaligned = layouts[k]
                    assert misaligned in (0, None), where  # None: an empty tensor
                    assert misaligned is not None or value.numel() == 0, where
                    shape = tuple(value.shape)
                    wanted = keeps(kind, t, shape)
                    # a dim of size 1 addresses nothing: its stride is checked in the xfail below
                    assert size_one_free(strides, shape) == size_one_free(wanted, shape), where


def keeps(kind: str, t: torch.Tensor, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides a result of ``shape`` has when the kind keeps ``t``'s memory order (only
    where dim 0 is outermost for the row-cutting kinds), contiguous ones otherwise."""
    dims = sorted(range(t.dim()), key=lambda d: (-t.stride(d), -t.shape[d]))
    if t.dim() > 1 and kind in ("reduce_scatter", "all_gather") and dims[0] != 0:
        dims = list(range(t.dim()))
    strides = [0] * t.dim()
    step = 1
    for d in reversed(dims):
        strides[d] = step
        step *= max(shape[d], 1)
    return tuple(strides)


def test_a_transposed_weight_comes_back_contiguous_from_the_row_cutting_kinds(job) -> None:
    """What the table in the module's text says, seen: rows are what an all-gather's chunks
    cut, so a weight stored transposed (dim 0 innermost) travels row-major."""
    for rank, res in enumerate(w.ok(job, "collectives_keep_formats")):
        observed = res[str(torch.float32)]
        assert observed["inputs"]["c_transposed"].stride() == (1, 5)
        assert observed["broadcast"]["layouts"]["c_transposed"][0] == (1, 5)
        assert observed["all_reduce"]["layouts"]["c_transposed"][0] == (1, 5)
        assert observed["reduce_scatter"]["layouts"]["c_transposed"][0] == (7, 1), rank
        assert observed["all_gather"]["layouts"]["c_transposed"][0] == (7, 1)
        # channels_last has its rows outermost: kept by all four
        for kind in ("broadcast", "all_reduce", "reduce_scatter", "all_gather"):
            assert observed[kind]["layouts"]["b_channels_last"][0] == (18, 1, 9, 3), kind


@pytest.mark.xfail(
    strict=True,
    reason="lead's _wire.order_of: a tensor that is_contiguous() travels contiguous, so the "
    "stride of a dim of size 1 is lost: a depthwise conv weight (C, 1, k, k) in channels_last "
    "(strides (9, 1, 3, 1), which suggest_memory_format reads as channels_last) comes back "
    "(9, 9, 3, 1) (read as contiguous), where DDP's bucket view keeps (9, 1, 3, 1); a conv of a "
    "contiguous input then gives a contiguous output instead of a channels_last one. "
    "_pack.memory_order keeps it.",
)
def test_a_depthwise_channels_last_weight_keeps_its_strides(job) -> None:
    for res in w.ok(job, "collectives_keep_formats"):
        observed = res[str(torch.float32)]
        assert observed["inputs"]["e_depthwise"].stride() == (9, 1, 3, 1)
        for kind in ("broadcast", "all_reduce", "all_gather"):
            assert observed[kind]["layouts"]["e_depthwise"][0] == (9, 1, 3, 1), kind


# --- (c) large layers: ZeRO-2 on gathered parameters, bit for bit ---------------------------


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_zero2_on_large_layers_is_bitwise_ddp(job, optimizer: str) -> None:
    for rank, res in enumerate(w.ok(job, "large_layers_beside_ddp")):
        for i, (ddp, ours) in enumerate(zip(res[f"ddp_{optimizer}"], res[f"zero2_{optimizer}"])):
            where = f"rank {rank}, step {i} ({lw.ROWS[i]} rows)"
            assert torch.equal(ours["out"], ddp["out"]), where
            for k, p in ddp["params"].items():
                assert torch.equal(ours["params"][k], p), f"{where}: {k}"
            # every step computed on parameters that broadcast / all_gather left aligned
            assert {m for _, m in ours["computed_on"].values()} == {0}, where


def test_the_bitwise_test_can_see_a_misalignment(job) -> None:
    """Evidence, not a property of fr: the loop above would have caught parameters left 8 or 40
    bytes past a 64-byte boundary on this machine (a row alone, steps 0 and 2, takes kernels
    that read where the weights start). Skipped where every kernel rounds alike."""
    flags = w.ok(job, "unaligned_parameters_round_differently")
    if not any(any(f) for f in flags):
        pytest.skip("this machine's kernels round alike at every offset: nothing to see")


def test_memory_formats_that_differ_across_ranks_are_refused(job) -> None:
    for message in w.ok(job, "formats_differ_across_ranks"):
        assert message is not None, "a rank reduced tensors of different memory formats"
        assert "the tensor at ['w'] differs across ranks in memory format" in message, message
