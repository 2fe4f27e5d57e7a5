"""The wire format: each kind of collective as one object, from its buffers to its rules.

A *kind* is what a call's buckets go through: ``ALL_REDUCE`` (``all_reduce``,
gradients, ``sync_buffers``), ``BROADCAST`` (an all-reduce that only ``src``
fills), ``REDUCE_SCATTER`` (``reduce_scatter``, sharded gradients) and
``ALL_GATHER`` (``all_gather``). Each is one object that owns everything
about it, so that nothing above this file tests a kind's name:

* its *format*: how many chunks a bucket travels as (``chunks``), what one
  tensor takes in one chunk (``cell``), the sizes of the buffers it sends,
  receives and leaves results in (``sizes``);
* its *copy-in and copy-out*: tensors into a send buffer (``pack``, or
  ``joined`` for a traced reduction), nothing of this rank's (``fill``), the
  flag words (``put_words`` / ``words_of``), landed values back out as views
  (``land``, ``views``);
* its *transport*: the eager asynchronous collective (``start``) and the
  traced functional one (``start_traced``);
* its *rules*, as JAX gives ``psum`` / ``all_gather`` / ``psum_scatter``:
  ``transpose`` (reverse mode), ``tangent`` (forward mode) and ``batch``
  (``vmap``: the batched tensor as a whole, one collective per call), written
  with ``apply``, which runs a collective of any kind (``_rules``).

The format. A bucket's tensors sit in *runs* (consecutive tensors of one
shape and memory format: one stack packs them, one unbind views them back).
A reduction's bucket is one chunk: every tensor whole, then the flag words.
A reduce-scatter's and an all-gather's is W chunks, rank-major: chunk r holds
rows [r*c, (r+1)*c) of every tensor (c = ceil(d0 / W), zero-padded, as
``torch.chunk`` cuts: FSDP2's copy-in), then the words; a tensor *held whole*
by every rank (a 0-dim one) takes W slots in every chunk of a reduce-scatter,
each rank's value in its own, added by each rank in rank order after they
land (the same bits on every rank), and stays out of an all-gather's buckets
(each rank keeps its own). Every
tensor's place starts at a multiple of 64 bytes (its *slot* is
rounded up), as torch's allocator aligns a tensor of its own: CPU kernels
(matmul) round differently on unaligned data. A tensor is laid out in its own
memory order (``channels_last`` stays ``channels_last``: the views come back
with its strides, as DDP's bucket views follow the parameters').
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, TypeVar, overload

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .._torch import chunk_cat, is_compiling
from ._group import comm_error

__all__ = [
    "ALIGN",
    "ALL_GATHER",
    "ALL_REDUCE",
    "BROADCAST",
    "KINDS",
    "REDUCE_SCATTER",
    "Apply",
    "Bucket",
    "Kind",
    "Part",
    "Run",
    "Signature",
    "Sizes",
    "Spec",
    "adds_as_bits",
    "aligned",
    "carrier",
    "order_of",
    "real_view",
    "replaced",
    "valid_rows",
]

T = TypeVar("T")

#: bytes every tensor's place in a buffer starts at a multiple of (torch's CPU allocator's)
ALIGN = 64

#: a bucket's tensors of one run: one tensor holding them stacked, or a sequence of them
Part = torch.Tensor | Sequence[torch.Tensor]


class Run(NamedTuple):
    """Consecutive tensors of one shape and memory order in a bucket: where each chunk holds them."""

    shape: tuple[int, ...]
    order: (
        tuple[int, ...] | None
    )  # the dims from outermost to innermost in memory; None: contiguous
    whole: bool  # held whole by every rank (a 0-dim tensor): its value in every chunk
    n: int  # how many tensors
    cell: tuple[int, ...]  # what one tensor holds in one chunk (its rows; itself, whole)
    size: int  # elements of a cell
    slot: int  # elements a cell takes: its size rounded up to the alignment
    start: int  # offset of the run in a chunk

    @property
    def width(self) -> int:
        """Elements of the run in one chunk."""
        return self.n * self.slot

    @property
    def rows(self) -> int:
        """Rows of each tensor in one chunk (1 for a tensor held whole)."""
        return 1 if self.whole else self.cell[0]


class Bucket(NamedTuple):
    """One bucket: its tensors (positions in ``Layout.sigs``) and its flat buffer's shape."""

    members: tuple[int, ...]
    runs: tuple[Run, ...]
    dtype: torch.dtype  # the tensors'
    comm: torch.dtype  # what the buffer travels in
    device: torch.device
    maximum: bool  # reduced with MAX (booleans, as uint8: a logical or) instead of SUM
    extra: int  # flag words at the end of each chunk
    chunk: int  # elements of one chunk: its runs, then the flag words
    chunks: int  # chunks in the full buffer: 1 for a reduction, W for scatter and gather
    widths: tuple[int, ...]  # a chunk cut in its runs, a padding, the words (``split_with_sizes``)
    gathered: tuple[Run, ...] = ()  # an all-gather's runs as its results hold them (whole)
    ranks: int = 1  # the ranks whose rows the tensors are cut into (the group's size)

    @property
    def data(self) -> int:
        """Elements of a chunk before its flag words."""
        return self.chunk - self.extra

    @property
    def bits(self) -> bool:
        """The tensors travel as their bytes: ``comm`` is a same-size integer the backend carries
        in their place (``carrier``), packed from and viewed back as ``dtype`` without a cast."""
        return (
            self.comm != self.dtype
            and self.comm.itemsize == self.dtype.itemsize
            and self.dtype != torch.bool  # a bool bucket casts to uint8 (reduced with MAX)
        )


class Sizes(NamedTuple):
    """A bucket's buffers: elements sent, received (``None``: in place), results (``None``: landed).

    ``*_kept``: how many buffers of each its pool keeps (3 where results view
    it and a loop holds one result while asking for the next; else 1).
    """

    send: int
    send_kept: int
    recv: int | None
    recv_kept: int
    res: int | None


#: a tensor's shape and memory order (``order_of``): what a rule needs of a call's inputs
Signature = tuple[tuple[int, ...], tuple[int, ...] | None]


class Spec(NamedTuple):
    """One collective call, all but its data: what ``_rules.apply`` runs, and rules rewrite.

    ``paths``: each tensor's path in the caller's tree (errors name it);
    ``whole``: per tensor, whether it is held whole by every rank (``None``:
    the 0-dim ones); ``like``: an all-gather's full tensors' shapes and
    memory orders (its inputs are shards); ``pooled``: its buffers kept in
    pools for the next call (``False``: fresh ones, let go with the results:
    ZeRO-3's units, where memory is the point); ``dtype``: what its
    floating-point tensors travel and come back in, cast as they are packed
    (eagerly: ZeRO-3's backward reduces in an mp_policy's ``reduce_dtype``
    with no copy of the cotangents in it; ``None``: their own).
    """

    options: Any  # _options.Options, whose ``kind`` names one of the objects below
    group: Any
    world: int
    caller: str
    check: bool
    paths: tuple[str, ...]
    whole: tuple[bool, ...] | None = None
    like: tuple[Signature, ...] | None = None
    pooled: bool = True  # eagerly, buffers kept for the next call of the layout (a step's)
    dtype: torch.dtype | None = None

    def wholes(self, shapes: Sequence[Sequence[int]]) -> tuple[bool, ...]:
        """Per tensor of these shapes, whether it is held whole."""
        return self.whole if self.whole is not None else tuple(len(s) == 0 for s in shapes)


#: runs a collective of the spec's kind on tensors, through the rules where they apply
Apply = Callable[[Spec, Sequence[torch.Tensor]], list[torch.Tensor]]


def replaced(nt: T, **changes: Any) -> T:
    """``nt._replace(**changes)``, in a form Dynamo traces (``_replace`` maps ``dict.pop``).

    >>> replaced(Sizes(1, 1, None, 1, None), recv=2)
    Sizes(send=1, send_kept=1, recv=2, recv_kept=1, res=None)
    """
    fields: tuple[str, ...] = nt._fields  # type: ignore[attr-defined]
    return type(nt)(*[changes.get(name, value) for name, value in zip(fields, nt)])  # type: ignore[call-overload]


def valid_rows(rows: int, d0: int, rank: int) -> int:
    """How many of a chunk's ``rows`` hold rows of a tensor of ``d0`` rows on ``rank``.

    >>> [valid_rows(2, 5, r) for r in range(4)]
    [2, 2, 1, 0]
    """
    return max(0, min(rows, d0 - rank * rows))


def order_of(t: torch.Tensor) -> tuple[int, ...] | None:
    """The dims of a dense tensor from outermost to innermost in memory (``None``: contiguous).

    A tensor that is not dense (a strided slice, an expanded one) has no
    memory format to keep: ``None`` too, and its result comes contiguous.

    >>> order_of(torch.empty(2, 3, 4, 5).to(memory_format=torch.channels_last))
    (0, 2, 3, 1)
    >>> order_of(torch.empty(3, 4).t()), order_of(torch.empty(3, 4)[:, :2])
    ((1, 0), None)
    """
    if t.is_contiguous() or t.layout != torch.strided:
        return None
    strides = t.stride()
    dims = sorted(range(t.dim()), key=lambda d: -strides[d])
    expected = 1
    for d in reversed(dims):
        if t.shape[d] != 1 and strides[d] != expected:
            return None
        expected *= t.shape[d]
    return tuple(dims)


_FLOAT8 = tuple(
    getattr(torch, name)
    for name in (
        "float8_e4m3fn",
        "float8_e5m2",
        "float8_e4m3fnuz",
        "float8_e5m2fnuz",
        "float8_e8m0fnu",
    )
    if hasattr(torch, name)
)
#: per backend, the dtypes it cannot carry (torch 2.13's gloo, measured: "Invalid scalar type"
#: for all-reduce, all-gather, broadcast and reduce-scatter alike) and the same-size integer
#: their bytes travel as (``None``: it carries none of that size)
_UNCARRIED: dict[str, dict[torch.dtype, torch.dtype | None]] = {
    "gloo": {
        **dict.fromkeys(_FLOAT8, torch.uint8),
        torch.uint32: torch.int32,
        torch.uint64: torch.int64,
        torch.int16: None,
        torch.uint16: None,
    }
}


def carrier(dtype: torch.dtype, backend: str) -> torch.dtype | None:
    """The dtype a buffer of ``dtype`` travels in on ``backend``: itself where the backend
    carries it, else a same-size integer its bytes travel as (``None``: none there).

    A copy (a gather, a broadcast) of the bytes is a copy of the values; so is a sum of integers
    (two's complement adds the same bits signed or unsigned); a sum of float8 values is not
    (``adds_as_bits``).

    >>> carrier(torch.float8_e4m3fn, "gloo"), carrier(torch.float32, "gloo")
    (torch.uint8, torch.float32)
    >>> carrier(torch.float8_e4m3fn, "nccl"), carrier(torch.int16, "gloo")
    (torch.float8_e4m3fn, None)
    """
    return _UNCARRIED.get(backend, {}).get(dtype, dtype)


def adds_as_bits(dtype: torch.dtype) -> bool:
    """Whether a sum of ``dtype``'s bytes, as the integer ``carrier`` gives, is the sum of its values."""
    return not (dtype.is_floating_point or dtype.is_complex)


def real_view(t: torch.Tensor) -> torch.Tensor:
    """Collectives take complex buffers as their real view."""
    return torch.view_as_real(t).view(-1) if t.is_complex() else t


def aligned(size: int, dtype: torch.dtype, comm: torch.dtype) -> int:
    """``size`` rounded up so that the next place starts aligned in both dtypes."""
    step = ALIGN // min(dtype.itemsize, comm.itemsize)
    return -(-size // step) * step


def _inverse(order: Sequence[int]) -> list[int]:
    inv = [0] * len(order)
    for i, d in enumerate(order):
        inv[d] = i
    return inv


def _cells(region: torch.Tensor, run: Run, lead: int = 0) -> torch.Tensor:
    """``region`` (``lead`` dims, then the run's width) as ``(*lead, n, *cell)`` in the run's order.

    The cells are views of the buffer with the tensors' own strides
    (``channels_last`` ones too): packing copies into them, results are them.
    """
    front = region.shape[:lead]
    flat = region if run.slot == run.size else region.view(*front, run.n, run.slot)[..., : run.size]
    if run.order is None:
        return flat.view(*front, run.n, *run.cell)
    physical = flat.view(*front, run.n, *(run.cell[d] for d in run.order))
    back = [lead + 1 + d for d in _inverse(run.order)]
    return physical.permute(*range(lead + 1), *back)


def _stacked(part: Part, run: Run) -> torch.Tensor:
    """The run's tensors as one ``(n, *shape)`` tensor (a copy unless given so)."""
    if isinstance(part, torch.Tensor):
        return part
    return torch.stack(list(part)) if run.n > 1 else part[0].unsqueeze(0)


def _physical_flat(t: torch.Tensor, run: Run, lead: int) -> torch.Tensor:
    """``t`` (``lead`` dims, then a cell) as ``(*lead, size)`` in the run's memory order."""
    if run.order is not None:
        t = t.permute(*range(lead), *(lead + d for d in run.order))
    return t.reshape(*t.shape[:lead], run.size)


def _slotted(flat: torch.Tensor, run: Run) -> torch.Tensor:
    """``(..., size)`` padded with zeros to ``(..., slot)``: the run's places, aligned."""
    return flat if run.slot == run.size else F.pad(flat, (0, run.slot - run.size))


def _value(part: Part, run: Run, send: Any) -> torch.Tensor:
    """What a rank sends of a run, as ``(n, *shape)``: its tensors times the scale, or (sending
    nothing of its own, as ``broadcast`` off its source) the neutral element, in their graph."""
    stacked = _stacked(part, run)
    if not send.sending:
        off = torch.zeros((), dtype=torch.bool, device=stacked.device)
        return torch.where(off, stacked, _neutral(stacked.dtype))
    return stacked if send.scale is None else stacked * send.scale


def _neutral(dtype: torch.dtype) -> float:
    """The sum's neutral element that leaves every value as it is, bit for bit (-0.0 + x is x)."""
    return -0.0 if dtype.is_floating_point or dtype.is_complex else 0


class Kind:
    """One kind of collective: its format, copy-in and copy-out, transport and rules.

    The base class is a reduction (``ALL_REDUCE``'s format): one chunk, every
    tensor whole. Instances are singletons; they pickle by name.
    """

    name = "all_reduce"
    takes_sparse = True  # sparse COO tensors travel (reduced one by one, after the buckets)
    gathers = False  # the inputs are shards: a tensor held whole stays out of the buckets
    divides = True  # a mean multiplies by 1 / W as it packs (an all-gather's op is its transpose's)
    needs_rank = False  # its copy-in or copy-out reads this rank's place
    adds = True  # its result is arithmetic on the ranks' values (not a copy of one rank's)
    # eagerly, its buffers kept for the layout's next call: an all-reduce's results are the
    # gradients, and its buffer the one DDP keeps as its bucket; ZeRO's kinds keep none (below)
    kept = True

    def __repr__(self) -> str:
        return self.name

    def __reduce__(self) -> tuple[Any, ...]:
        return (_kind_named, (self.name,))

    def sends(self, options: Any) -> bool:
        """Whether this rank sends its tensors (a broadcast: its source only)."""
        return True

    def on(self, backend: str, nbytes: int) -> Kind:
        """The kind whose wire format carries this one on ``backend`` for a call of ``nbytes``:
        itself, or (chosen at the leaf, by measurement: docs/sharding.md) another that gives
        the same values faster or in less memory there."""
        return self

    # --- format --------------------------------------------------------------------------

    def chunks(self, world: int) -> int:
        """Chunks a bucket travels as over ``world`` ranks."""
        return 1

    def cell(self, shape: tuple[int, ...], whole: bool, world: int) -> tuple[int, ...]:
        """What one tensor of ``shape`` holds in one chunk (its shape there)."""
        return shape

    def keeps(self, order: tuple[int, ...] | None) -> tuple[int, ...] | None:
        """The memory order a tensor travels in (rows must be outermost where chunks are rows)."""
        return order

    def run(
        self,
        shape: tuple[int, ...],
        order: tuple[int, ...] | None,
        whole: bool,
        n: int,
        start: int,
        world: int,
        dtypes: tuple[torch.dtype, torch.dtype],
    ) -> Run:
        """A run of ``n`` tensors of ``shape`` at ``start`` of each chunk (``dtypes``: the
        tensors' and the one they travel in, which both align)."""
        cell = self.cell(shape, whole, world)
        size = math.prod(cell)
        return Run(shape, order, whole, n, cell, size, aligned(size, *dtypes), start)

    def gathered(self, runs: Sequence[Run], world: int, dtype: torch.dtype) -> tuple[Run, ...]:
        """The runs as the results' own buffer holds them, where it differs from a chunk's."""
        return ()

    def sizes(self, bucket: Bucket, lean: bool = False) -> Sizes:
        """The bucket's buffers (a reduction: in place, results viewing it where dtypes agree).

        ``lean``: buffers not kept between calls (ZeRO-3's units), where results
        that view a buffer larger than themselves would hold all of it.
        """
        same = _same(bucket)
        return Sizes(bucket.chunk, 3 if same else 1, None, 1, None if same else bucket.data)

    # --- copy-in -------------------------------------------------------------------------

    def pack(
        self, bucket: Bucket, send: torch.Tensor, parts: Sequence[Part], rank: int, scale: Any
    ) -> None:
        """Copy ``parts`` (one per run) into ``send``, multiplied by ``scale`` where given.

        No autograd: a collective's graph is its rules' (``_rules``).
        """
        if bucket.comm != bucket.dtype:
            parts = _as_comm(bucket, parts)
        grad = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)  # ``no_grad`` at C speed: this runs for every bucket
        try:
            for run, part, region in zip(bucket.runs, parts, send.split_with_sizes(bucket.widths)):
                # contiguous, unpadded cells (``_cells``' first case) without its call
                cells = (
                    region.view(run.n, *run.cell)
                    if run.order is None and run.slot == run.size
                    else _cells(region, run)
                )
                if isinstance(part, torch.Tensor) or len(part) == 1:
                    # one pass: DDP's mean multiplies as it copies (a run of one tensor too)
                    src, out = (
                        (part, cells) if isinstance(part, torch.Tensor) else (part[0], cells[0])
                    )
                    if scale is None:
                        out.copy_(src)
                    else:
                        torch.mul(src, scale, out=out)
                elif run.slot == run.size and run.order is None:  # the cells are contiguous
                    torch.stack(list(part), out=cells)
                    if scale is not None:
                        cells.mul_(scale)
                else:  # padded cells: stacked first (a stack into strided cells is ~4x slower,
                    # measured on 400 small tensors), then one pass copies, scaled, into them
                    stacked = torch.stack(list(part))
                    if scale is None:
                        cells.copy_(stacked)
                    else:
                        torch.mul(stacked, scale, out=cells)
        finally:
            torch._C._set_grad_enabled(grad)

    def joined(
        self, bucket: Bucket, parts: Sequence[Part] | None, send: Any, words: Any, rank: int
    ) -> torch.Tensor:
        """The traced send buffer as one new tensor: ``pack``, ``fill`` and ``put_words``' values.

        Plain differentiable ops (``cat``, ``pad``, views): while tracing, the
        functional collectives' own autograd formulas are the kinds' transposes
        (all-reduce <-> all-reduce, all-gather <-> reduce-scatter, sums), so
        a graph-carrying input keeps its graph through the compiled call. A
        ``cat`` also lays out as one contiguous copy a tensor under Inductor,
        where writes into views of one buffer become one loop over it that
        tests every region for every element (docs/compile.md). ``send`` is
        the call's ``Send``: a rank that sends nothing of its own (``parts``
        given, ``send.sending`` false) sends its neutral elements, still
        joined to its tensors' graph.
        """
        comm = bucket.comm
        parts = _as_comm(bucket, parts)
        if parts is None:  # nothing of this rank's, and no graph to keep
            pieces = [torch.full((bucket.data,), _neutral(comm), dtype=comm, device=bucket.device)]
        else:
            pieces = [
                _slotted(_physical_flat(_value(part, run, send), run, 1), run).reshape(-1).to(comm)
                for run, part in zip(bucket.runs, parts)
            ]
        if words is not None:
            pieces.append(words.to(comm))
        return torch.cat(pieces)

    def fill(self, bucket: Bucket, send: torch.Tensor) -> None:
        """Nothing of this rank's: the sum's neutral element in every value."""
        send[: bucket.data].fill_(_neutral(send.dtype))

    def put_words(self, bucket: Bucket, send: torch.Tensor, words: torch.Tensor) -> None:
        """Write the flag ``words`` at the end of every chunk this rank sends."""
        send[-bucket.extra :].copy_(words)

    def words_of(self, bucket: Bucket, landed: torch.Tensor) -> torch.Tensor:
        """The landed flag words, summed over the ranks."""
        return landed[-bucket.extra :]

    def words_max(self, bucket: Bucket) -> bool:
        """Whether the landed words are the ranks' maximum (a boolean reduction), not their sum."""
        return bucket.maximum

    # --- copy-out ------------------------------------------------------------------------

    def views(self, bucket: Bucket, buf: torch.Tensor, rank: int) -> list[torch.Tensor]:
        """The bucket's results in member order, as views of ``buf``: no value is read.

        ``buf`` is where the results live (the landed buffer, or the result
        buffer ``land`` copies it into); made while the collective is in
        flight, the views cost no time after it.
        """
        out: list[torch.Tensor] = []
        typed = buf if bucket.comm == bucket.dtype else _typed(bucket, buf)
        regions = typed[: bucket.chunk - bucket.extra].split_with_sizes(bucket.widths[:-1])
        for run, region in zip(bucket.runs, regions):
            # contiguous, unpadded cells (``_cells``' first case) without its call
            cells = (
                region.view(run.n, *run.cell)
                if run.order is None and run.slot == run.size
                else _cells(region, run)
            )
            if run.n == 1:
                out.append(cells[0])
            else:
                out += cells.unbind(0)
        return out

    def land(
        self, bucket: Bucket, landed: torch.Tensor, res: torch.Tensor | None, rank: int
    ) -> torch.Tensor:
        """Copy the landed values into ``res`` (``None``: they stay); the buffer results view."""
        if res is None:
            return landed
        res.copy_(landed[: bucket.data])
        return res

    # --- transport -----------------------------------------------------------------------

    def start(
        self, send: torch.Tensor, recv: torch.Tensor | None, maximum: bool, group: Any, caller: str
    ) -> Any:
        """Start the eager collective from ``send`` (into ``recv``); its work handle."""
        op = dist.ReduceOp.MAX if maximum else dist.ReduceOp.SUM
        try:
            flat = real_view(send) if send.is_complex() else send  # (no call: every bucket)
            return dist.all_reduce(flat, op=op, group=group, async_op=True)
        except Exception as err:
            raise comm_error(caller, err)  # noqa: B904 - comm_error chains it

    def start_traced(
        self, ops: Any, flat: torch.Tensor, maximum: bool, world: int, name: str
    ) -> Any:
        """The traced (functional) collective of ``flat``: Dynamo writes it into the graph."""
        return ops.all_reduce(flat, "max" if maximum else "sum", name)

    # --- rules ---------------------------------------------------------------------------

    def transpose(
        self, spec: Spec, cts: Sequence[torch.Tensor], inputs: Sequence[Signature], apply: Apply
    ) -> list[torch.Tensor]:
        """The cotangents of the inputs (``inputs``: their shapes and orders).

        ``all_reduce``'s is itself: a sum's is the sum, a mean's the sum / W,
        which is the mean.
        """
        return apply(spec, cts)

    def tangent(
        self, spec: Spec, tangents: Sequence[torch.Tensor], apply: Apply
    ) -> list[torch.Tensor]:
        """The tangents of the results: every collective is linear, so the same collective."""
        return apply(spec, tangents)

    def batch(
        self, spec: Spec, tensors: Sequence[torch.Tensor], dims: Sequence[int | None], apply: Apply
    ) -> tuple[list[torch.Tensor], list[int | None]]:
        """Under ``vmap``: the batched tensors as a whole, in one collective.

        Elementwise across ranks, a reduction is indifferent to where the
        batch dim is: each tensor goes as it is, and comes back with its dim.
        """
        return apply(spec, tensors), list(dims)


class Broadcast(Kind):
    """``broadcast``: an all-reduce only ``src`` fills (the others send -0.0: x + -0.0 is x)."""

    name = "broadcast"
    adds = False  # a sum of src's values and every other rank's neutral element: a copy

    def sends(self, options: Any) -> bool:
        return bool(dist.get_rank() == options.src)

    def transpose(
        self, spec: Spec, cts: Sequence[torch.Tensor], inputs: Sequence[Signature], apply: Apply
    ) -> list[torch.Tensor]:
        """The sum over ranks of the cotangents, on ``src``; zeros elsewhere.

        An all-reduce, then a ``where`` that keeps it in every rank's graph, so
        that its own transpose (a broadcast) runs on every rank.
        """
        options = replaced(spec.options, kind=ALL_REDUCE.name, src=None)
        summed = apply(replaced(spec, options=options), cts)
        if self.sends(spec.options):
            return summed
        off = torch.zeros((), dtype=torch.bool)
        return [torch.where(off.to(s.device), s, 0) for s in summed]


class _Rowed(Kind):
    """The kinds whose chunks are rows: W rank-major chunks, a tensor held whole in each."""

    takes_sparse = False
    needs_rank = True
    # ZeRO's collectives, where memory is the point: a pooled all-gather keeps a whole spare
    # copy of the parameters idle (the caller still holds the last step's while the next is
    # gathered), a reduce-scatter a full-size send buffer for a gradient it gives out a
    # W-th of; fresh buffers, let go with the call or its results (the Llama's ZeRO-1/2 peak
    # heap 0.88 / 0.85 of DDP's, 1.06 / 1.15 pooled: docs/benchmarks.md)
    kept = False

    def chunks(self, world: int) -> int:
        return world

    def cell(self, shape: tuple[int, ...], whole: bool, world: int) -> tuple[int, ...]:
        if whole:
            return shape
        return (-(-shape[0] // world), *shape[1:])

    def keeps(self, order: tuple[int, ...] | None) -> tuple[int, ...] | None:
        return order if order is not None and order[0] == 0 else None

    def batch(
        self, spec: Spec, tensors: Sequence[torch.Tensor], dims: Sequence[int | None], apply: Apply
    ) -> tuple[list[torch.Tensor], list[int | None]]:
        """The batch dim behind the rows (dim 1), so that each entry is cut by its own rows.

        A tensor whose entries are held whole (0-dim each) keeps it in front:
        it goes whole.
        """
        logical = [
            t.shape if d is None else t.shape[:d] + t.shape[d + 1 :] for t, d in zip(tensors, dims)
        ]
        wholes = spec.wholes(logical)
        moved = [
            t if d is None else t.movedim(d, 0 if whole else 1)
            for t, d, whole in zip(tensors, dims, wholes)
        ]
        like = None
        if spec.like is not None:  # the full shapes grow the batch dim behind their rows too
            like = tuple(
                sig if d is None else _batched_like(sig, t.shape[d], whole)
                for sig, t, d, whole in zip(spec.like, tensors, dims, wholes)
            )
        out = apply(replaced(spec, whole=wholes, like=like), moved)
        return out, [None if d is None else (0 if whole else 1) for d, whole in zip(dims, wholes)]


class ReduceScatter(_Rowed):
    """``reduce_scatter``: every rank sends all chunks; each receives its own, summed.

    A tensor held whole (0-dim) takes W *slots* in every chunk: each rank
    puts its value in its own slot and the neutral element in the others,
    so that every slot lands exactly one rank's value (x + -0.0 is x), and
    every rank adds the W slots itself, in rank order (``land``): the same
    bits on every rank. Summed by the wire instead, each chunk's copy would
    be added in another order of the ranks (gloo's ring all-reduce, which
    carries a reduce-scatter there, and a ring reduce-scatter alike), and
    the replicas of a whole parameter would drift apart in the last bit.
    """

    name = "reduce_scatter"

    def cell(self, shape: tuple[int, ...], whole: bool, world: int) -> tuple[int, ...]:
        return (world, *shape) if whole else super().cell(shape, whole, world)

    def run(
        self,
        shape: tuple[int, ...],
        order: tuple[int, ...] | None,
        whole: bool,
        n: int,
        start: int,
        world: int,
        dtypes: tuple[torch.dtype, torch.dtype],
    ) -> Run:
        """A whole tensor's slots are laid out contiguous (its result comes contiguous)."""
        return super().run(shape, None if whole else order, whole, n, start, world, dtypes)

    def on(self, backend: str, nbytes: int) -> Kind:
        """On gloo, an all-reduce of the whole buffer in place (``ReduceScatterBySum``): gloo's
        own reduce-scatter clones its input, all-reduces it and copies a chunk out (0.9-2.8x
        an all-reduce of the bytes, measured: docs/sharding.md)."""
        return REDUCE_SCATTER_BY_SUM if backend == "gloo" else self

    def sizes(self, bucket: Bucket, lean: bool = False) -> Sizes:
        same = _same(bucket)
        res = None if same else bucket.data
        return Sizes(bucket.chunk * bucket.chunks, 1, bucket.chunk, 3 if same else 1, res)

    def pack(
        self, bucket: Bucket, send: torch.Tensor, parts: Sequence[Part], rank: int, scale: Any
    ) -> None:
        w = bucket.chunks
        grid = send.view(w, bucket.chunk)
        parts = _as_comm(bucket, parts)
        with torch.no_grad():
            for run, part in zip(bucket.runs, parts):
                region = grid[:, run.start : run.start + run.width]
                if run.whole:  # this rank's slot in every chunk, the neutral element elsewhere
                    slots = _cells(region, run, 1)  # (w, n, W, *shape)
                    slots.fill_(_neutral(send.dtype))
                    stacked = _stacked(part, run)  # (n, *shape); batched: (n, *batch, *shape)
                    slots[:, :, rank].copy_(stacked.unsqueeze(0).expand(w, *stacked.shape))
                elif run.slot == run.size and run.order is None:
                    tensors = list(part.unbind(0)) if isinstance(part, torch.Tensor) else list(part)
                    _chunk_cat(tensors, w, region)  # FSDP2's copy-in, one kernel
                else:
                    _cells(region, run, 1).copy_(_rank_major(_stacked(part, run), run, w, rank))
            if scale is not None:
                grid[:, : bucket.data].mul_(scale)

    def joined(
        self, bucket: Bucket, parts: Sequence[Part] | None, send: Any, words: Any, rank: int
    ) -> torch.Tensor:
        """Every rank's rows of every tensor, rank-major, then the words in each chunk."""
        w, comm = bucket.chunks, bucket.comm
        parts = _as_comm(bucket, parts)
        if parts is None:
            cols = [torch.full((w, bucket.data), _neutral(comm), dtype=comm, device=bucket.device)]
        else:
            cols = [
                _slotted(
                    _physical_flat(_rank_major(_value(part, run, send), run, w, rank), run, 2), run
                )
                .reshape(w, -1)
                .to(comm)
                for run, part in zip(bucket.runs, parts)
            ]
        pad = bucket.widths[-2]
        if parts is not None and pad:
            cols.append(torch.zeros((w, pad), dtype=comm, device=bucket.device))
        if words is not None:
            cols.append(words.to(comm).unsqueeze(0).expand(w, -1))
        return torch.cat(cols, dim=1).reshape(-1)

    def fill(self, bucket: Bucket, send: torch.Tensor) -> None:
        send.view(bucket.chunks, bucket.chunk)[:, : bucket.data].fill_(_neutral(send.dtype))

    def put_words(self, bucket: Bucket, send: torch.Tensor, words: torch.Tensor) -> None:
        send.view(bucket.chunks, bucket.chunk)[:, -bucket.extra :].copy_(words)

    def views(self, bucket: Bucket, buf: torch.Tensor, rank: int) -> list[torch.Tensor]:
        """This rank's rows of each tensor; a whole one's first slot, where ``land`` adds them."""
        out: list[torch.Tensor] = []
        buf = _typed(bucket, buf)
        for run in bucket.runs:
            cells = _cells(buf[run.start : run.start + run.width], run)
            if run.whole:
                cells = cells[:, 0]
            else:
                cells = cells[:, : valid_rows(run.rows, run.shape[0], rank)]
            out += cells.unbind(0)
        return out

    def land(
        self, bucket: Bucket, landed: torch.Tensor, res: torch.Tensor | None, rank: int
    ) -> torch.Tensor:
        """This rank's chunk, each whole tensor's slots added (in the dtype the bucket travels
        in, as the wire would add them), copied into ``res`` where given."""
        landed = _added(bucket, landed)
        if res is None:
            return landed
        res.copy_(landed[: bucket.data])
        return res

    def start(
        self, send: torch.Tensor, recv: torch.Tensor | None, maximum: bool, group: Any, caller: str
    ) -> Any:
        op = dist.ReduceOp.MAX if maximum else dist.ReduceOp.SUM
        # torch 2.13's names: the older ones warn (FutureWarning) at every call
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        assert recv is not None
        try:
            return scatter(real_view(recv), real_view(send), op=op, group=group, async_op=True)
        except Exception as err:
            raise comm_error(caller, err)  # noqa: B904 - comm_error chains it

    def start_traced(
        self, ops: Any, flat: torch.Tensor, maximum: bool, world: int, name: str
    ) -> Any:
        return ops.reduce_scatter_tensor(flat, "max" if maximum else "sum", world, name)

    def transpose(
        self, spec: Spec, cts: Sequence[torch.Tensor], inputs: Sequence[Signature], apply: Apply
    ) -> list[torch.Tensor]:
        """Every rank's rows of the cotangents gathered (a mean: / W); a whole one all-reduced."""
        wholes = spec.wholes([shape for shape, _ in inputs])
        out: list[Any] = [None] * len(cts)
        rowed = [k for k, whole in enumerate(wholes) if not whole]
        kept = [k for k, whole in enumerate(wholes) if whole]
        if rowed:
            sub = _subset(spec, rowed, ALL_GATHER, "sum", like=tuple(inputs[k] for k in rowed))
            for k, g in zip(rowed, apply(sub, [cts[k] for k in rowed])):
                out[k] = g / spec.world if spec.options.op == "mean" else g
        if kept:
            sub = _subset(spec, kept, ALL_REDUCE, spec.options.op, like=None)
            for k, r in zip(kept, apply(sub, [cts[k] for k in kept])):
                out[k] = r
        return out


class AllGather(_Rowed):
    """``all_gather``: each rank sends its rows in its chunk; every rank receives all.

    ``op`` is that of its transpose, ``reduce_scatter(op)``: ``"sum"`` for
    ``fr.distributed.all_gather``, the step's own for ZeRO-3.
    """

    name = "all_gather"
    gathers = True
    divides = False
    adds = False

    def on(self, backend: str, nbytes: int) -> Kind:
        """On gloo, from 4 MiB, an all-reduce of the whole tensors in place, each rank's rows
        and the neutral element elsewhere (``AllGatherBySum``): the results land where they
        live, with no landing buffer, copy-out or gloo's own temporary (a full copy). Chosen
        for memory: alone, gloo's all-gather is faster up to 16 MiB (0.6-0.8x an all-reduce,
        this 1.05x) and slower from 64 MiB (1.6x, this 1.2x); whole ZeRO steps measured the
        same with the switch at 4 or 32 MiB (docs/sharding.md)."""
        return ALL_GATHER_BY_SUM if backend == "gloo" and nbytes >= _BY_SUM_BYTES else self

    def gathered(self, runs: Sequence[Run], world: int, dtype: torch.dtype) -> tuple[Run, ...]:
        """Every tensor whole, tensor-major: each one's rows of every rank side by side."""
        out, start = [], 0
        for run in runs:
            size = world * run.size
            full = Run(
                run.shape,
                run.order,
                run.whole,
                run.n,
                (world * run.rows, *run.cell[1:]),
                size,
                aligned(size, dtype, dtype),
                start,
            )
            out.append(full)
            start += full.width
        return tuple(out)

    def sizes(self, bucket: Bucket, lean: bool = False) -> Sizes:
        w = bucket.chunks
        res = sum(run.width for run in bucket.gathered)
        return Sizes(bucket.chunk, 1, bucket.chunk * w, 1, res)

    def pack(
        self, bucket: Bucket, send: torch.Tensor, parts: Sequence[Part], rank: int, scale: Any
    ) -> None:
        parts = _as_comm(bucket, parts)
        with torch.no_grad():
            for run, part in zip(bucket.runs, parts):  # this rank's rows, zero-padded
                valid = valid_rows(run.rows, run.shape[0], rank)
                cells = _cells(send[run.start : run.start + run.width], run)
                cells[:, :valid].copy_(_stacked(part, run))
                if valid < run.rows:
                    cells[:, valid:].zero_()

    def joined(
        self, bucket: Bucket, parts: Sequence[Part] | None, send: Any, words: Any, rank: int
    ) -> torch.Tensor:
        """This rank's rows of every tensor, zero-padded, then the words: its one chunk."""
        comm = bucket.comm
        parts = _as_comm(bucket, parts)
        if parts is None:
            pieces = [torch.zeros(bucket.data, dtype=comm, device=bucket.device)]
        else:
            pieces = []
            for run, part in zip(bucket.runs, parts):
                stacked = _stacked_scaled(part, run, send)
                short = run.rows - stacked.shape[1]
                if short:
                    stacked = F.pad(stacked, [0, 0] * (len(run.shape) - 1) + [0, short])
                flat = _slotted(_physical_flat(stacked, run, 1), run)
                pieces.append(flat.reshape(-1).to(comm))
        pad = bucket.widths[-2]
        if parts is not None and pad:
            pieces.append(torch.zeros(pad, dtype=comm, device=bucket.device))
        if words is not None:
            pieces.append(words.to(comm))
        return torch.cat(pieces)

    def words_of(self, bucket: Bucket, landed: torch.Tensor) -> torch.Tensor:
        return landed.view(bucket.chunks, bucket.chunk)[:, -bucket.extra :].sum(0)

    def words_max(self, bucket: Bucket) -> bool:
        return False  # every rank's own words, added up here

    def views(self, bucket: Bucket, buf: torch.Tensor, rank: int) -> list[torch.Tensor]:
        """Each tensor's rows of every rank, side by side (tensor-major), its own ones only."""
        out: list[torch.Tensor] = []
        for full in bucket.gathered:
            out += _cells(buf[full.start : full.start + full.width], full)[
                :, : full.shape[0]
            ].unbind(0)
        return out

    def land(
        self, bucket: Bucket, landed: torch.Tensor, res: torch.Tensor | None, rank: int
    ) -> torch.Tensor:
        """The rank-major chunks copied tensor-major into ``res`` (one strided copy a run)."""
        assert res is not None
        w = bucket.chunks
        grid = landed.view(w, bucket.chunk)
        into = res.view(bucket.comm) if bucket.bits else res  # bytes copied as they are
        for run, full in zip(bucket.runs, bucket.gathered):
            src = _cells(grid[:, run.start : run.start + run.width], run, 1)  # (w, n, rows, ...)
            dst = _cells(into[full.start : full.start + full.width], full)  # (n, w * rows, ...)
            dst.unflatten(1, (w, run.rows)).copy_(src.transpose(0, 1))
        return res

    def start(
        self, send: torch.Tensor, recv: torch.Tensor | None, maximum: bool, group: Any, caller: str
    ) -> Any:
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        assert recv is not None
        try:
            return gather(real_view(recv), real_view(send), group=group, async_op=True)
        except Exception as err:
            raise comm_error(caller, err)  # noqa: B904 - comm_error chains it

    def start_traced(
        self, ops: Any, flat: torch.Tensor, maximum: bool, world: int, name: str
    ) -> Any:
        return ops.all_gather_into_tensor(flat, world, name)

    def transpose(
        self, spec: Spec, cts: Sequence[torch.Tensor], inputs: Sequence[Signature], apply: Apply
    ) -> list[torch.Tensor]:
        """``reduce_scatter(op)`` of the cotangents (a whole one: ``all_reduce(op)``)."""
        return apply(
            replaced(spec, options=replaced(spec.options, kind=REDUCE_SCATTER.name), like=None), cts
        )


def _subset(spec: Spec, ks: Sequence[int], kind: Kind, op: Any, like: Any) -> Spec:
    """``spec`` for the tensors ``ks`` only, as a call of ``kind`` with ``op``."""
    whole = None if spec.whole is None else tuple(spec.whole[k] for k in ks)
    options = replaced(spec.options, kind=kind.name, op=op)
    return replaced(
        spec, options=options, paths=tuple(spec.paths[k] for k in ks), whole=whole, like=like
    )


def _batched_like(sig: Signature, size: int, whole: bool) -> Signature:
    """A full shape under ``vmap``: the batch dim in front of a whole one, else behind its rows.

    Its memory order is not kept: the batch dim sits inside each entry's rows.
    """
    shape, _ = sig
    return ((size, *shape) if whole else (shape[0], size, *shape[1:])), None


def _rank_major(stacked: torch.Tensor, run: Run, w: int, rank: int) -> torch.Tensor:
    """``(n, *shape)`` as ``(w, n, *cell)``: each rank's rows (zero-padded), or, held whole, the
    tensors in ``rank``'s slot of every chunk and the neutral element in the others."""
    if run.whole:
        before, after = rank, w - 1 - rank
        pad = [0, 0] * (len(run.shape)) + [before, after]
        spread = F.pad(stacked.unsqueeze(1), pad, value=_neutral(stacked.dtype))
        return spread.unsqueeze(0).expand(w, *spread.shape)
    pad = [0, 0] * (len(run.shape) - 1) + [0, w * run.rows - run.shape[0]]
    padded = F.pad(stacked, pad) if pad[-1] else stacked
    return padded.view(run.n, w, *run.cell).transpose(0, 1)


def _same(bucket: Bucket) -> bool:
    """Whether results can view the buffer the bucket travels in (its dtype, or its bytes)."""
    return bucket.comm == bucket.dtype or bucket.bits


@overload
def _as_comm(bucket: Bucket, parts: Sequence[Part]) -> Sequence[Part]: ...
@overload
def _as_comm(bucket: Bucket, parts: None) -> None: ...
@overload
def _as_comm(bucket: Bucket, parts: Sequence[Part] | None) -> Sequence[Part] | None: ...
def _as_comm(bucket: Bucket, parts: Sequence[Part] | None) -> Sequence[Part] | None:
    """``parts`` viewed as the integer their bytes travel as, where the bucket travels as bits."""
    if parts is None or not bucket.bits:
        return parts
    comm = bucket.comm
    return [
        p.view(comm) if isinstance(p, torch.Tensor) else [t.view(comm) for t in p] for p in parts
    ]


def _typed(bucket: Bucket, buf: torch.Tensor) -> torch.Tensor:
    """A landed buffer of a bucket that travels as bits, viewed as its tensors' dtype."""
    return buf.view(bucket.dtype) if bucket.bits and buf.dtype == bucket.comm else buf


def _added(bucket: Bucket, mine: torch.Tensor) -> torch.Tensor:
    """``mine`` (this rank's landed chunk) with each whole tensor's slots added into its first,
    in rank order (MAX for booleans): every rank the same bits. Traced, on a copy (the
    landed tensor stays as the collective gave it)."""
    whole = [run for run in bucket.runs if run.whole]
    if not whole:
        return mine
    if is_compiling():
        mine = mine.clone()
    for run in whole:
        slots = _cells(mine[run.start : run.start + run.width], run)  # (n, W, *shape)
        total = slots[:, 0]
        for q in range(1, slots.shape[1]):
            if bucket.maximum:
                total.copy_(torch.maximum(total, slots[:, q]))
            else:
                total.add_(slots[:, q])
    return mine


def _stacked_scaled(part: Part, run: Run, send: Any) -> torch.Tensor:
    """A run's tensors stacked; a mean's transpose scaled as it goes (the functional one sums)."""
    stacked = _stacked(part, run)
    if send.scale is None:
        return stacked
    return torch.ops.freplicate.grad_scaled(stacked, send.scale)  # type: ignore[no-any-return]


def _chunk_cat(tensors: list[torch.Tensor], w: int, region: torch.Tensor) -> None:
    if is_compiling() and not region.is_contiguous():
        # Dynamo takes no out= that is not contiguous (a run beside others, or the
        # words): lay the run out in a buffer of its own, then copy it in
        staged = region.new_empty(region.shape)
        chunk_cat(tensors, w, staged)
        region.copy_(staged)
    else:
        chunk_cat(tensors, w, region)


# --- wire formats of the rowed kinds over an all-reduce (gloo) --------------------------------

_BY_SUM_BYTES = 4 * 2**20


def _rows_of(run: Run, ranks: int, rank: int) -> tuple[int, int]:
    """Where this rank's rows of the run's tensors start, and how many it holds."""
    c = -(-run.shape[0] // ranks)
    return rank * c, valid_rows(c, run.shape[0], rank)


class ReduceScatterBySum(ReduceScatter):
    """``reduce_scatter`` as one all-reduce of its whole buffer, in place: each rank views its chunk.

    ``ReduceScatter``'s format (rank-major chunks of rows, each aligned, the
    words in every chunk, the mean's scale as it packs), carried by an
    all-reduce of the whole buffer instead of a reduce-scatter: every chunk
    comes back summed, and this rank's results are views of its own. Traced,
    the all-reduce's own autograd and the view make its transpose, every
    rank's chunk gathered.
    """

    name = "reduce_scatter/sum"

    def sizes(self, bucket: Bucket, lean: bool = False) -> Sizes:
        """In place; this rank's chunk copied out once into the results' own buffer, so that they
        hold their rows alone (as a reduce-scatter's do), not every rank's chunk: the results
        view the landed buffer only where it is one chunk of their dtype."""
        view = _same(bucket) and bucket.chunks == 1
        res = None if view else bucket.data
        return Sizes(bucket.chunk * bucket.chunks, 3 if view else 1, None, 1, res)

    def words_of(self, bucket: Bucket, landed: torch.Tensor) -> torch.Tensor:
        return landed[bucket.chunk - bucket.extra : bucket.chunk]  # chunk 0's: every chunk's

    def views(self, bucket: Bucket, buf: torch.Tensor, rank: int) -> list[torch.Tensor]:
        if buf.numel() == bucket.chunk * bucket.chunks:  # the landed buffer: this rank's chunk
            buf = buf[rank * bucket.chunk : (rank + 1) * bucket.chunk]
        return super().views(bucket, buf, rank)

    def land(
        self, bucket: Bucket, landed: torch.Tensor, res: torch.Tensor | None, rank: int
    ) -> torch.Tensor:
        """This rank's chunk of the landed buffer, copied into ``res`` (where given)."""
        return super().land(bucket, landed.view(bucket.chunks, bucket.chunk)[rank], res, rank)

    start = Kind.start
    start_traced = Kind.start_traced


class AllGatherBySum(Kind):
    """``all_gather`` as one all-reduce of whole tensors, in place: each rank fills its rows.

    Every rank writes its rows of each tensor where they belong and the
    sum's neutral element everywhere else (-0.0, which leaves every value as
    it is, bit for bit), and the all-reduce of that buffer is the gathered
    tensors, tensor-major: the results are views of it, where they live. A
    tensor held whole stays out of the buffer, as in ``AllGather``.
    """

    name = "all_gather/sum"
    kept = False  # as _Rowed's
    takes_sparse = False
    gathers = True
    divides = False
    adds = False
    needs_rank = True

    def pack(
        self, bucket: Bucket, send: torch.Tensor, parts: Sequence[Part], rank: int, scale: Any
    ) -> None:
        if bucket.comm != bucket.dtype:
            parts = _as_comm(bucket, parts)
        grad = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)  # ``no_grad`` at C speed: this runs for every bucket
        try:
            for run, part, region in zip(bucket.runs, parts, send.split_with_sizes(bucket.widths)):
                cells = _cells(region, run)
                start, valid = _rows_of(run, bucket.ranks, rank)
                neutral = _neutral(send.dtype)
                cells[:, :start].fill_(neutral)
                cells[:, start + valid :].fill_(neutral)
                cells[:, start : start + valid].copy_(_stacked(part, run))
        finally:
            torch._C._set_grad_enabled(grad)

    def joined(
        self, bucket: Bucket, parts: Sequence[Part] | None, send: Any, words: Any, rank: int
    ) -> torch.Tensor:
        comm = bucket.comm
        parts = _as_comm(bucket, parts)
        if parts is None:
            pieces = [torch.full((bucket.data,), _neutral(comm), dtype=comm, device=bucket.device)]
        else:
            pieces = []
            for run, part in zip(bucket.runs, parts):
                stacked = _stacked_scaled(part, run, send)
                start, valid = _rows_of(run, bucket.ranks, rank)
                pad = [0, 0] * (len(run.shape) - 1) + [start, run.shape[0] - start - valid]
                full = F.pad(stacked, pad, value=_neutral(stacked.dtype))
                pieces.append(_slotted(_physical_flat(full, run, 1), run).reshape(-1).to(comm))
        if words is not None:
            pieces.append(words.to(comm))
        return torch.cat(pieces)


ALL_REDUCE = Kind()
BROADCAST = Broadcast()
REDUCE_SCATTER = ReduceScatter()
ALL_GATHER = AllGather()
REDUCE_SCATTER_BY_SUM = ReduceScatterBySum()
ALL_GATHER_BY_SUM = AllGatherBySum()
KINDS: dict[str, Kind] = {
    k.name: k
    for k in (
        ALL_REDUCE,
        BROADCAST,
        REDUCE_SCATTER,
        ALL_GATHER,
        REDUCE_SCATTER_BY_SUM,
        ALL_GATHER_BY_SUM,
    )
}


def _kind_named(name: str) -> Kind:
    return KINDS[name]
