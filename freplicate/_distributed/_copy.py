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

from .._pack import pack as concatenated
from .._torch import chunk_cat, is_compiling
from ._layout import Bucket, Run, valid_rows

__all__ = ["fill", "joined", "land", "pack", "put_words", "views", "words_of"]

Part = torch.Tensor | Sequence[torch.Tensor]


def _stacked(part: Part, run: Run) -> torch.Tensor:
    """The run's tensors as one ``(count, *shape)`` tensor (a copy unless given so)."""
    if isinstance(part, torch.Tensor):
        return part
    return torch.stack(list(part)) if run.n > 1 else part[0].unsqueeze(0)


@torch.no_grad()
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
    w = bucket.chunks
    if kind == "reduce":
        # every run's region in one call (a run of one tensor viewed as that tensor)
        for run, part, region in zip(bucket.runs, parts, send.split_with_sizes(bucket.widths)):
            if isinstance(part, torch.Tensor) or len(part) == 1:
                # one pass: DDP's mean multiplies as it copies (a run of one tensor too)
                if isinstance(part, torch.Tensor):
                    src, out = part, region.view(run.n, *run.shape)
                else:
                    src, out = part[0], region.view(run.shape)
                if scale is None:
                    out.copy_(src)
                else:
                    torch.mul(src, scale, out=out)
            else:
                dst = region.view(run.n, *run.shape)
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
            region = grid[:, run.start : run.start + run.width]
            if is_compiling() and not region.is_contiguous():
                # Dynamo takes no out= that is not contiguous (a run beside others, or the
                # words): lay the run out in a buffer of its own, then copy it in
                staged = region.new_empty(region.shape)
                chunk_cat(tensors, w, staged)
                region.copy_(staged)
            else:
                chunk_cat(tensors, w, region)
        if scale is not None:
            grid[:, : bucket.data].mul_(scale)
        return
    for run, part in zip(bucket.runs, parts):  # gather: this rank's rows, zero-padded
        valid = valid_rows(run.rows, run.shape[0], rank)
        dst = send[run.start : run.start + run.width].view(run.n, run.rows, *run.shape[1:])
        dst[:, :valid].copy_(_stacked(part, run))
        if valid < run.rows:
            dst[:, valid:].zero_()


@torch.no_grad()
def joined(
    bucket: Bucket,
    parts: Sequence[Part] | None,
    scale: float | torch.Tensor | None,
    words: torch.Tensor | None,
) -> torch.Tensor:
    """A reduction's buffer as one new tensor: the parts' tensors (times ``scale``), the words.

    The traced reduction's copy-in: Inductor lays a ``cat`` out as one
    contiguous copy a tensor, where writes into views of one buffer become a
    single loop over it that tests every region for every element (and, for
    some, gathers element by element: docs/compile.md measures the step). The
    values are those of ``pack``, ``fill`` and ``put_words`` bit for bit.
    ``parts`` ``None``: nothing of this rank's (-0.0, or 0 for integers).
    """
    comm = bucket.comm
    pieces: list[torch.Tensor] = []
    if parts is None:
        neutral = -0.0 if comm.is_floating_point or comm.is_complex else 0
        pieces.append(torch.full((bucket.data,), neutral, dtype=comm, device=bucket.device))
    else:
        for part in parts:
            for t in (part,) if isinstance(part, torch.Tensor) else part:
                pieces.append((t if scale is None else t * scale).to(comm))
    if words is not None:
        pieces.append(words.to(comm))
    return concatenated(pieces)


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
        send.view(bucket.chunks, bucket.chunk)[:, -bucket.extra :].copy_(words)
    else:
        send[-bucket.extra :].copy_(words)


def words_of(kind: str, bucket: Bucket, landed: torch.Tensor) -> torch.Tensor:
    """The landed flag words, summed over the ranks."""
    if kind == "gather":
        return landed.view(bucket.chunks, bucket.chunk)[:, -bucket.extra :].sum(0)
    return landed[-bucket.extra :]


def views(kind: str, bucket: Bucket, buf: torch.Tensor, rank: int) -> list[torch.Tensor]:
    """The bucket's results in member order, as views of ``buf``: no value is read.

    ``buf``: where the results live, the landed buffer itself or the result
    buffer that ``land`` copies it into. Made while the collective is in
    flight (its values land in place), so the views cost no time after it.
    """
    out: list[torch.Tensor] = []
    if kind == "gather":  # tensor-major: each tensor's rows of every rank, side by side
        w, offset = bucket.chunks, 0
        for run in bucket.runs:
            full = buf[offset : offset + w * run.width].view(run.n, w * run.rows, *run.shape[1:])
            out += full[:, : run.shape[0]].unbind(0)
            offset += w * run.width
        return out
    if kind == "reduce":  # every run's region in one call; a run of one tensor is its view
        for run, region in zip(
            bucket.runs, buf[: bucket.data].split_with_sizes(bucket.widths[:-1])
        ):
            if run.n == 1:
                out.append(region.view(run.shape))
            else:
                out += region.view(run.n, *run.shape).unbind(0)
        return out
    for run in bucket.runs:
        region = buf[run.start : run.start + run.width]
        if not run.shape:
            out += region.view(run.n, *run.shape).unbind(0)
        else:
            valid = valid_rows(run.rows, run.shape[0], rank)
            out += region.view(run.n, run.rows, *run.shape[1:])[:, :valid].unbind(0)
    return out


def land(kind: str, bucket: Bucket, landed: torch.Tensor, res: torch.Tensor | None) -> torch.Tensor:
    """Copy the landed values into ``res``, where the results live; the buffer they view.

    ``res``: a buffer of the tensors' dtype (another dtype travelled, or a
    gather's tensor-major copy of the rank-major landed one); ``None``: the
    results view ``landed`` itself.
    """
    if res is None:
        return landed
    if kind != "gather":
        res.copy_(landed[: bucket.data])
        return res
    w = bucket.chunks
    grid = landed.view(w, bucket.chunk)
    offset = 0
    for run in bucket.runs:
        src = grid[:, run.start : run.start + run.width].view(w, run.n, run.rows, *run.shape[1:])
        dst = res[offset : offset + w * run.width].view(run.n, w, run.rows, *run.shape[1:])
        dst.copy_(src.transpose(0, 1))
        offset += w * run.width
    return res
