"""Copy-in and copy-out: tensors into a bucket's flat buffer and results back out, as views.

Plain tensor ops on buffers the transport hands out, the same eagerly and
while Dynamo traces. A bucket's *parts* come one per run (``Layout``): a
tensor holding the run's tensors stacked (a stacked leaf's gradient), or a
sequence of them.

* reduce: each run's tensors side by side, whole; results are views of the
  landed buffer (one ``unbind`` a run).
* scatter: ``chunk_cat`` lays the rows out rank-major (FSDP2's copy-in);
  results are views of this rank's landed chunk, its valid rows only.
* gather: this rank's rows into its chunk, zero-padded; the landed chunks
  are copied rank-major to tensor-major (one strided copy a run) and the
  results are views of that copy.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .._torch import chunk_cat
from ._layout import Bucket, Run, valid_rows

__all__ = ["fill", "pack", "put_words", "results", "words_of"]

Part = torch.Tensor | Sequence[torch.Tensor]


def _stacked(part: Part, run: Run) -> torch.Tensor:
    """The run's tensors as one ``(count, *shape)`` tensor (a copy unless given so)."""
    if isinstance(part, torch.Tensor):
        return part
    return torch.stack(list(part)) if run.n > 1 else part[0].unsqueeze(0)


def pack(
    kind: str,
    bucket: Bucket,
    send: torch.Tensor,
    parts: Sequence[Part],
    rank: int,
    scale: float | None,
) -> None:
    """Copy ``parts`` into ``send`` (multiplied by ``scale`` where given), ``kind``'s way.

    Collectives are not differentiable: autograd records nothing of this.
    """
    with torch.no_grad():
        _pack(kind, bucket, send, parts, rank, scale)


def _pack(
    kind: str,
    bucket: Bucket,
    send: torch.Tensor,
    parts: Sequence[Part],
    rank: int,
    scale: float | None,
) -> None:
    w = bucket.chunks
    if kind == "reduce":
        for run, part in zip(bucket.runs, parts):
            dst = send[run.start : run.start + run.width].view(run.n, *run.shape)
            if isinstance(part, torch.Tensor):
                if scale is None:
                    dst.copy_(part)
                else:
                    torch.mul(part, scale, out=dst)  # DDP's: a mean multiplies as it copies
            else:
                torch.stack(list(part), out=dst)
                if scale is not None:
                    dst.mul_(scale)
        return
    if kind == "scatter":
        grid = send.view(w, bucket.chunk)
        for run, part in zip(bucket.runs, parts):
            tensors = list(part.unbind(0)) if isinstance(part, torch.Tensor) else list(part)
            if not run.shape:  # a 0-dim tensor: its value in every rank's chunk
                tensors = [t.reshape(1).expand(w) for t in tensors]
            chunk_cat(tensors, w, grid[:, run.start : run.start + run.width])
        if scale is not None:
            grid[:, : bucket.data].mul_(scale)
        return
    for run, part in zip(bucket.runs, parts):  # gather: this rank's rows, zero-padded
        valid = valid_rows(run.rows, run.shape[0], rank)
        dst = send[run.start : run.start + run.width].view(run.n, run.rows, *run.row)
        dst[:, :valid].copy_(_stacked(part, run))
        if valid < run.rows:
            dst[:, valid:].zero_()


def fill(kind: str, bucket: Bucket, send: torch.Tensor) -> None:
    """Nothing of this rank's: -0.0, the sum's neutral element for every value (0 for integers)."""
    data = (
        send.view(bucket.chunks, bucket.chunk)[:, : bucket.data]
        if kind == "scatter"
        else send[: bucket.data]
    )
    data.fill_(-0.0 if data.is_floating_point() or data.is_complex() else 0)


def put_words(kind: str, bucket: Bucket, send: torch.Tensor, words: torch.Tensor) -> None:
    """Write the flag ``words`` at the end of every chunk this rank sends."""
    if kind == "scatter":
        send.view(bucket.chunks, bucket.chunk)[:, -bucket.extra :] = words
    else:
        send[-bucket.extra :] = words


def words_of(kind: str, bucket: Bucket, landed: torch.Tensor) -> torch.Tensor:
    """The landed flag words, summed over the ranks."""
    if kind == "gather":
        return landed.view(bucket.chunks, bucket.chunk)[:, -bucket.extra :].sum(0)
    return landed[-bucket.extra :]


def results(
    kind: str, bucket: Bucket, landed: torch.Tensor, res: torch.Tensor | None, rank: int
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The bucket's results in member order, and the buffer they view.

    ``res``: a buffer of the tensors' dtype to copy the landed values into
    (another dtype travelled, or a gather's tensor-major copy); ``None``:
    the results view ``landed`` itself.
    """
    if kind == "gather":
        assert res is not None
        return _gathered(bucket, landed, res), res
    if res is not None:
        res.copy_(landed[: bucket.data])
    else:
        res = landed
    out: list[torch.Tensor] = []
    for run in bucket.runs:
        region = res[run.start : run.start + run.width]
        if kind == "reduce" or not run.shape:
            out += region.view(run.n, *run.shape).unbind(0)
        else:
            valid = valid_rows(run.rows, run.shape[0], rank)
            out += region.view(run.n, run.rows, *run.row)[:, :valid].unbind(0)
    return out, res


def _gathered(bucket: Bucket, landed: torch.Tensor, res: torch.Tensor) -> list[torch.Tensor]:
    w = bucket.chunks
    grid = landed.view(w, bucket.chunk)
    out: list[torch.Tensor] = []
    offset = 0
    for run in bucket.runs:
        src = grid[:, run.start : run.start + run.width].view(w, run.n, run.rows, *run.row)
        dst = res[offset : offset + w * run.width].view(run.n, w, run.rows, *run.row)
        dst.copy_(src.transpose(0, 1))
        offset += w * run.width
        full = dst.view(run.n, w * run.rows, *run.row)[:, : run.shape[0]]
        out += full.unbind(0)
    return out
