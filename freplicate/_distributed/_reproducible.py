"""Gradients reproducible across world sizes: grains, one summation tree, randomness by position.

``fr.distributed.grad_and_value(fn, grain=G)`` comes here. The global batch
is cut into *grains* of ``G`` samples; grain ``p`` (its global position: rank
``r`` of ``W`` holds grains ``r*m .. r*m + m - 1``, ``m`` grains per rank)
has its gradient computed alone, by the same ops on every rank, its random
numbers drawn from a generator seeded by ``(seed, step, p)`` and not by the
rank. The ``N = m*W`` grains' gradients are summed as the perfect binary tree
over their positions: within a rank by pairwise sums as the grains come (a
binary counter keeps one partial sum per level, ``log2(m) + 1`` at most),
across ranks by recursive halving (level ``k``: rank ``r`` and ``r ^ 2**k``
each keep half of their segment and add the partner's copy of it, the lower
ranks' sum on the left) then recursive doubling (the same partners swap their
reduced halves back). The mean is divided once, at the end.

When the trees align: the tree over ``N`` leaves that a binary counter builds
has as nodes exactly the blocks ``[j*2**l, (j+1)*2**l)``. A rank's grains
form one such block, so that its local sum *is* a node of the one-process
tree, exactly when ``m`` is a power of two; the ranks' blocks then join
pairwise, ``r`` with ``r ^ 1``, then with ``r ^ 2``, ..., which is recursive
halving's order when ``W`` is a power of two. So with ``m`` and ``W`` powers of
two every element of the result is the same sum, in the same order, as one
process adding all ``N`` grains: the same bits on 1, 2, 4, ... ranks for the
same global batch and grain. Anything else is refused (``ValueError``):
``m`` not a power of two would split a rank's block across nodes, and a
world size that is not a power of two has no fixed partners.

Each rank sends ``2 * n * (W - 1) / W`` elements of an ``n``-element
gradient per dtype (halving then doubling; a few elements more or less
where a segment halves unevenly), a ring all-reduce's count.

ZeRO-3 (a loss through ``apply_sharded``): the gradient reaches the shards
through each unit's gather's transpose, inside every grain's backward, so
the ranks' grains are summed *before* a rank's own: the tree is taken over
the grains in bit-reversed order of position. With ``i = j*W + t`` the
tree's leaf order, leaf ``i`` is position ``bitrev_N(i)``, which is rank
``bitrev_W(t)``'s local grain ``bitrev_m(j)``: step ``j`` of every rank runs
its grain ``bitrev_m(j)``; each unit's transpose sends every rank its rows
(one ``all_to_all``: a ring reduce-scatter's bytes) and each rank sums the
``W`` ranks' rows as the tree over ``t`` (``_Gathering``); the binary
counter then joins the steps. One process (``apply_sharded`` is ``fr.apply``
there) runs its ``N`` grains in the order ``bitrev_N``: the same tree. These
bits are the ZeRO-3 mode's own, equal on every world size, not the
replicated mode's (whose tree joins a rank's grains first).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import optree
import torch
import torch.distributed as dist

from .._checks import check_int
from .._pack import Layout, device_dtype, group_by, layout_of, memory_order, pack, unpack
from .._torch import is_compiling, transform_level
from .._tree import NAMESPACE, flatten_in_order, paths_of
from ._group import collective, comm_device
from ._options import weight_value
from ._wire import Spec, valid_rows

__all__ = [
    "Gathering",
    "Grains",
    "all_to_all",
    "exchange",
    "gathering",
    "grain_seed",
    "halving_doubling",
    "refuse",
    "tree_sum",
]

_MASK = (1 << 64) - 1


def refuse(caller: str, grain: Any, seed: Any, **others: Any) -> None:
    """Check ``grain=`` and ``seed=``; ``NotImplementedError`` for the options it does not take.

    ``others`` are the step's other options as given, by name, with ``True``
    (or a value other than ``None``) where one is asked for.

    >>> refuse("f", 8, 0, shard=True)
    Traceback (most recent call last):
    ...
    NotImplementedError: f: grain= (reproducible across world sizes) does not take shard=True yet; ...
    """
    check_int(caller, "grain", grain)
    if grain < 1:
        raise ValueError(f"{caller}: grain must be a number of samples >= 1, got grain={grain}")
    check_int(caller, "seed", seed)
    for name, value in others.items():
        if value is not None and value is not False:
            shown = repr(value) if isinstance(value, (bool, str)) else type(value).__name__
            raise NotImplementedError(
                f"{caller}: grain= (reproducible across world sizes) does not take "
                f"{name}={shown} yet; drop one of them (docs/reproducible.md says what the "
                "mode covers)"
            )


def grain_seed(seed: int, step: int, position: int) -> int:
    """The seed of grain ``position``'s generator at call ``step``: SplitMix64 of the three.

    Neighbouring keys give unrelated seeds, and no key names a rank.

    >>> grain_seed(0, 0, 0) != grain_seed(0, 0, 1) != grain_seed(0, 1, 0)
    True
    """
    x = 0
    for v in (seed, step, position):
        x = _splitmix((x ^ (v & _MASK)) & _MASK)
    return x >> 1  # below 2**63: any generator takes it


def _splitmix(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def tree_sum(parts: Iterable[list[Any]]) -> list[Any]:
    """The perfect binary tree's sum of ``parts`` (a power of two of them), left operand first.

    The binary counter the step runs: one partial sum per level, a new part
    joined with the partial of its level as long as there is one; the parts
    are drawn one at a time, so at most ``log2(len(parts)) + 1`` are held.

    >>> a, b, c, d = ([torch.tensor([x])] for x in (1e8, 1.0, -1e8, 1.0))
    >>> tree_sum([a, b, c, d])  # (a + b) + (c + d), not ((a + b) + c) + d
    [tensor([0.])]
    """
    stack: list[tuple[int, list[Any]]] = []
    for part in parts:
        level, node = 0, part
        while stack and stack[-1][0] == level:
            node = _add(stack.pop()[1], node, into=level > 0)
            level += 1
        stack.append((level, node))
    assert len(stack) == 1, "tree_sum: a power of two of parts"
    return stack[0][1]


def _add(left: list[Any], right: list[Any], *, into: bool) -> list[Any]:
    """``left + right`` leaf by leaf; ``into``: in ``left``'s tensors, which a sum made (ours).

    A part as it came (a gradient autograd gave, which may be expanded or
    shared) is only ever read. The same bits either way: one rounding each.
    """
    k = [i for i, t in enumerate(left) if isinstance(t, torch.Tensor)]
    a, b = [left[i] for i in k], [right[i] for i in k]
    if into:
        torch._foreach_add_(a, b)
        return left
    out = list(left)
    for i, t in zip(k, torch._foreach_add(a, b)):
        out[i] = t
    return out


class Gathering:
    """The grain now running, as ``apply_sharded`` sees it: ZeRO-3's transposes under ``grain=``.

    ``apply_sharded`` says it ran (``seen``); each unit's gather's transpose
    (``rows``) sums the ranks' cotangents as the tree over the ranks in
    bit-reversed order and hands this rank its rows, each scaled by the
    grain's weight first (``scale``); which tensors the loss differentiates
    (``inputs``, ``Grains.seeing``) and which the gathers took (``gathered``),
    by identity, for ``check``.
    """

    __slots__ = ("caller", "gathered", "inputs", "reduced", "scale", "seen", "world")

    def __init__(self, caller: str, world: int) -> None:
        self.caller, self.world = caller, world
        self.start(None)

    def start(self, scale: float | None) -> None:
        """A new grain, of weight ``scale`` (``None``: none)."""
        self.scale = scale
        self.seen = False
        self.inputs: list[int | None] = []  # the differentiated tensors, as the loss gets them
        self.gathered: set[int] = set()  # those the gathers took
        self.reduced: dict[int, int] = {}  # those whose gradient a transpose gave: how often

    def took(self, shards: Sequence[torch.Tensor]) -> list[int]:
        """A gather (with a graph) took ``shards``: their identities, for its transpose."""
        ids = list(map(id, shards))
        self.gathered.update(ids)
        return ids

    def gave(self, ids: Sequence[int]) -> None:
        """A transpose gave the gradients of the shards ``ids`` (a gather's recomputation under
        activation checkpointing takes them again, but its graph is not differentiated)."""
        for i in ids:
            self.reduced[i] = self.reduced.get(i, 0) + 1

    def check(self, sharded: bool | None, leaves: list[Any], spec: Any) -> None:
        """Every grain alike: all through ``apply_sharded`` or none; and then (on more than one
        rank) every differentiated tensor one its gathers took, or of zero gradient (a shard
        whose unit did not run): a tensor used outside them would not be summed over the
        ranks. (One used outside on another rank only raises there, and so everywhere.)"""
        if self.seen != sharded:
            raise ValueError(
                f"{self.caller}: with grain=, every grain's loss must go through "
                "fr.distributed.apply_sharded or none: the grains differ"
            )
        if not sharded or self.world <= 1:
            return
        for k, (t, i) in enumerate(zip(leaves, self.inputs)):
            if self.reduced.get(i, 0) > 1:  # type: ignore[arg-type]
                raise ValueError(
                    f"{self.caller}: with grain=, the shard at {paths_of(spec)[k]} was gathered "
                    "for two uses in one grain (apply_sharded called twice on it): their "
                    "gradients would each be summed over the ranks, outside the grains' fixed "
                    "tree; run the model once a grain"
                )
            if isinstance(t, torch.Tensor) and i not in self.gathered and t.any():
                raise ValueError(
                    f"{self.caller}: with grain= and fr.distributed.apply_sharded, every "
                    "differentiated tensor must be a shard its gathers take; the one at "
                    f"{paths_of(spec)[k]} is used outside them (its gradient would not be "
                    "summed over the ranks)"
                )

    def rows(
        self, spec: Spec, cts: Sequence[torch.Tensor], inputs: Sequence[Any], wanted: list[int]
    ) -> list[Any]:
        """The gradients of the gather ``spec``'s shards ``wanted`` (``None`` for the others):
        this rank's rows of the cotangents ``cts`` summed over the ranks, in the fixed tree.

        Per dtype and device one buffer of ``W`` equal blocks, block ``q`` rank ``q``'s rows
        of every tensor (zero rows after a late rank's last; a whole tensor all of it, in
        every block), exchanged by one ``all_to_all`` (a ring reduce-scatter's bytes); the
        blocks received are summed as the perfect tree over ``t``, rank ``bitrev(t)``'s the
        ``t``-th leaf.
        """
        if spec.world != self.world:
            raise ValueError(
                f"{self.caller}: apply_sharded's group has {spec.world} ranks and the step's "
                f"{self.world}: give grad_and_value the group the shards are of"
            )
        grads: list[Any] = [None] * len(cts)
        world, group = spec.world, spec.group
        rank = dist.get_rank(group) if world > 1 else 0
        wholes = spec.wholes([c.shape for c in cts])
        for members in group_by(wanted, lambda k: device_dtype(cts[k])).values():
            ks = [wanted[i] for i in members]
            ts = [cts[k] for k in ks]
            send, layout, rows = _blocks(
                ts, [wholes[k] for k in ks], world, lambda q: q, self.scale
            )
            size = layout.size
            recv = send
            if world > 1:
                recv = torch.empty_like(send)
                all_to_all(send, recv, group, self.caller)
            with torch.no_grad():
                blocks = [recv[bitrev(t, world) * size :][:size] for t in range(world)]
                (total,) = tree_sum([[b] for b in blocks])
            for k, got in zip(ks, _kept(ts, rows, rank, total, layout)):
                if tuple(got.shape) != tuple(inputs[k][0]):
                    raise ValueError(
                        f"{self.caller}: the shard at {spec.paths[k]} has shape "
                        f"{tuple(inputs[k][0])}, not this rank's rows {tuple(got.shape)} of "
                        "its parameter (fr.distributed.shard's)"
                    )
                grads[k] = got
        return grads


def all_to_all(send: torch.Tensor, recv: torch.Tensor, group: Any, caller: str) -> None:
    """Block ``q`` of ``send`` to rank ``q``; rank ``q``'s block for this rank into ``recv``'s
    block ``q`` (``W`` equal blocks each)."""
    with collective(caller):
        dist.all_to_all_single(recv, send, group=group)


_NOW = threading.local()


def gathering() -> Gathering | None:
    """The reproducible grain running on this thread (``apply_sharded`` reads it), if any."""
    return getattr(_NOW, "grain", None)


@contextlib.contextmanager
def _running(now: Gathering) -> Iterator[None]:
    before = gathering()
    _NOW.grain = now
    try:
        yield
    finally:
        _NOW.grain = before


def _weights_sum(weights: list[float], rank: int, world: int, group: Any, caller: str) -> float:
    """The grains' weights summed as ZeRO-3's gradients are: the tree over leaf ``i``, position
    ``bitrev_N(i)`` (every rank's weights gathered: ``m`` numbers a rank)."""
    mine = torch.tensor(weights, dtype=torch.float64, device=comm_device(group))
    rows = [mine]
    if world > 1:
        rows = [torch.empty_like(mine) for _ in range(world)]
        with collective(caller):
            dist.all_gather(rows, mine, group=group)
    every = torch.cat(rows).cpu()  # position p = rank * m + local grain
    n = every.numel()
    (total,) = tree_sum([[every[bitrev(i, n)]] for i in range(n)])
    return float(total)


class Grains:
    """A reproducible step's own part: grain size, seed, and the calls made so far (``step``).

    ``step`` keys the random numbers of the next call; a job resumed at step
    ``t`` sets it to ``t`` (it counts this object's calls, starting at 0).
    """

    def __init__(
        self,
        grain: int,
        seed: int,
        caller: str,
        *,
        op: str,
        argnums: int,
        has_aux: bool,
        shard: bool = False,
    ) -> None:
        self.grain = grain
        self.seed = seed
        self.caller = caller
        self.op, self.argnums, self.has_aux = op, argnums, has_aux  # the step's, fixed
        self.shard = shard  # ZeRO-2: this rank's rows of each gradient (halving only)
        self.step = 0
        self.checked = False  # the parameters' checksum goes with the first call only

    def __call__(
        self,
        local: Callable[..., tuple[Any, Any]],
        batches: list[tuple[tuple[Any, ...], dict[str, Any]]],
        *,
        group: Any,
        world: int,
        checksums: Callable[[], list[int]] | None,
        weight: Callable[..., Any] | None = None,
        failed: BaseException | None = None,
    ) -> tuple[Any, Any, list[Any]]:
        """This rank's grains' gradients, summed with every rank's in the fixed tree; its value
        and each batch's (``(value, [aux of each grain])`` with ``has_aux``).

        ``batches``: the positional and keyword arguments of one call, or of each of
        ``accumulate``'s micro-batches: their grains, in order, are this rank's block of the
        step's grains, as if the batches were one. ``weight``: a function of a grain's
        arguments; each grain's gradient is multiplied by its weight, the weights are summed
        in the same tree, and the mean divides by their sum. ``failed``: what went wrong on
        this rank before its batches were in hand (``accumulate`` drawing them), announced to
        the peers in this call as a failure of its own code, then raised.
        """
        caller, op, has_aux = self.caller, self.op, self.has_aux
        world = max(world, 1)
        n = self.argnums
        for args, kwargs in batches:
            n = self._refuse(args, kwargs, world)
        rank = dist.get_rank(group) if world > 1 else 0
        step, self.step = self.step, self.step + 1
        cuts, weights, m = self._before(batches, n, world, group, rank, weight, failed)
        error: BaseException | None = None
        summed: list[Any] = []
        spec: Any = None
        values: list[Any] = []
        sharded: list[float] | None = None  # ZeRO-3: each grain's weight
        try:
            summed, spec, values, sharded = self._grains(local, cuts, m, rank, world, step, weights)
        except BaseException as err:  # announced to the peers before it propagates
            error = err
        sizes = [t.numel() for t in summed[:-1] if isinstance(t, torch.Tensor)]
        if sharded is not None:  # ZeRO-3: rows, which differ across ranks by design
            sizes, checksums = [], None
        if world > 1:
            first = checksums is not None and not self.checked and error is None
            sums = checksums() if first else []  # type: ignore[misc]
            self.checked = True
            _agree(caller, group, rank, error, m, sum(sizes), sum(sums) % (1 << 62))
        if error is not None:
            raise error
        *grads, loss = summed
        if sharded is not None:  # ZeRO-3: reduced over the ranks already, grain by grain
            grads = self._sharded(grads, sharded, m, rank, world, group, weight)
        else:
            reduce = _scattered if self.shard else _reduced
            if weight is None:
                grads = reduce(grads, rank, world, group, m * world, op, caller)
            else:  # the weights' sum rides as the last leaf (float64), reduced in the same tree
                *grads, total = reduce(grads, rank, world, group, None, "sum", caller)
                grads = _divided(grads, float(total))
        value = loss / m  # this rank's mean of its grains' values, not reduced
        out = optree.tree_unflatten(spec, grads)
        whole = (value, [v[1] for v in values]) if has_aux else value
        return out, whole, _per_batch(values, cuts, has_aux)

    def _sharded(
        self,
        grads: list[Any],
        weights: list[float],
        m: int,
        rank: int,
        world: int,
        group: Any,
        weight: Callable[..., Any] | None,
    ) -> list[Any]:
        """ZeRO-3's rows, summed over the ranks grain by grain already: the mean (or the
        weighted mean, its weights summed in the same tree) alone."""
        if self.shard:
            raise ValueError(
                f"{self.caller}: shard=True gives ZeRO-2's rows of replicated parameters; a loss "
                "through fr.distributed.apply_sharded differentiates the shards, whose "
                "gradients are rows already: leave out shard=True"
            )
        if weight is not None:
            return _divided(grads, _weights_sum(weights, rank, world, group, self.caller))
        return _divided(grads, m * world) if self.op == "mean" else grads

    def _before(
        self,
        batches: list[tuple[tuple[Any, ...], dict[str, Any]]],
        n: int,
        world: int,
        group: Any,
        rank: int,
        weight: Callable[..., Any] | None,
        failed: BaseException | None,
    ) -> tuple[list[Any], list[float] | None, int]:
        """The batches' grains (their cuts), each grain's weight, and how many: agreed with the
        peers before any grain runs (ZeRO-3's grains exchange rows as they run, so a rank
        whose batch or weights fail must say so first, or its peers would wait in a grain)."""
        error: BaseException | None = None
        cuts: list[Any] = []
        weights: list[float] | None = None
        m = 0
        try:
            if failed is not None:
                raise failed
            cuts = [_cut(args, kwargs, n, self.grain, self.caller) for args, kwargs in batches]
            m = sum(k for k, _ in cuts)
            if weight is not None:
                weights = [
                    weight_value(self.caller, weight(*args, **kwargs), "weight(*grain)")
                    for count, cut in cuts
                    for args, kwargs in map(cut, range(count))
                ]
        except BaseException as err:  # announced to the peers before it propagates
            error = err
        if world > 1:
            _agree(self.caller, group, rank, error, m, 0, 0)
        if error is not None:
            raise error
        if not _power_of_two(m):
            raise ValueError(
                f"{self.caller}: grain={self.grain} cuts this rank's batch into {m} grains; the "
                "grains per rank must be a power of two (1, 2, 4, ...) for the rank's sum to "
                "be a node of the one-process tree: give each rank a batch of grain * 2**k "
                "samples"
            )
        return cuts, weights, m

    def seeing(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn``, telling the running grain (if any) which tensors it differentiates."""
        n = self.argnums

        def run(*args: Any, **kwargs: Any) -> Any:
            now = gathering()
            if now is not None:
                leaves, _ = flatten_in_order(args[n])
                now.inputs = [id(t) if isinstance(t, torch.Tensor) else None for t in leaves]
            return fn(*args, **kwargs)

        return run

    def _refuse(self, args: tuple[Any, ...], kwargs: dict[str, Any], world: int) -> int:
        """What the mode cannot run, raised before anything runs; the differentiated argument's
        position."""
        caller, argnums = self.caller, self.argnums
        if is_compiling() or transform_level() is not None or _carries_graph(args, kwargs):
            raise NotImplementedError(
                f"{caller}: grain= (reproducible across world sizes) runs eagerly only, on "
                "arguments without an autograd graph: not under torch.compile, torch.func "
                "transforms or with inputs that require grad"
            )
        if not _power_of_two(world):
            raise ValueError(
                f"{caller}: grain= needs a world size that is a power of two (1, 2, 4, 8, ...) "
                f"for its fixed summation tree, got {world} ranks; run on a power of two of "
                "ranks, or without grain="
            )
        if not -len(args) <= argnums < len(args):
            raise TypeError(
                f"{caller}: the step needs the differentiated argument args[{argnums}], got "
                f"{len(args)} positional argument(s)"
            )
        return argnums % len(args)

    def _grains(
        self,
        local: Callable[..., tuple[Any, Any]],
        cuts: list[tuple[int, Callable[[int], tuple[tuple[Any, ...], dict[str, Any]]]]],
        m: int,
        rank: int,
        world: int,
        step: int,
        weights: list[float] | None,
    ) -> tuple[list[Any], Any, list[Any], list[float] | None]:
        """The rank's ``m`` grains, each alone, summed by the binary counter (value last; with
        ``weights``, each gradient times its grain's weight, and the weight before the value);
        each grain's value (``(value, aux)`` with ``has_aux``), in the grains' order; and, where
        the loss went through ``apply_sharded`` (ZeRO-3: the grains then run in bit-reversed
        order, their gradients reduced over the ranks in their gathers' transposes), each
        grain's weight (``None`` otherwise)."""
        spec: Any = None
        values: list[Any] = [None] * m
        has_aux = self.has_aux
        grains = [(cut, k) for count, cut in cuts for k in range(count)]
        now = Gathering(self.caller, world)
        sharded: bool | None = None  # the first grain tells: through apply_sharded or not

        def parts() -> Iterator[list[Any]]:
            nonlocal spec, sharded
            for j in range(m):
                i = bitrev(j, m) if sharded else j  # bitrev(0) == 0: the first grain is alike
                cut, k = grains[i]
                args, kwargs = cut(k)
                w = None if weights is None else weights[i]
                now.start(w)
                with _keyed(grain_seed(self.seed, step, rank * m + i), args, kwargs), _running(now):
                    grads, value = local(*args, **kwargs)
                values[i] = (value[0].detach(), value[1]) if has_aux else value.detach()
                if has_aux:
                    value = value[0]
                leaves, spec = flatten_in_order(grads)
                _refuse_sparse(leaves, spec, self.caller)
                if sharded is None:
                    sharded = now.seen
                now.check(sharded, leaves, spec)
                if sharded and w is not None and world == 1:  # no gather: scaled here
                    leaves = _scaled(leaves, w)
                if w is None or sharded:  # (on ranks ZeRO-3's transposes scaled it)
                    yield [*leaves, value.detach()]
                    continue
                yield [*_scaled(leaves, w), torch.tensor(w, dtype=torch.float64), value.detach()]

        summed = tree_sum(parts())
        return summed, spec, values, (weights or [1.0] * m) if sharded else None


def _scaled(leaves: list[Any], w: float) -> list[Any]:
    """Each tensor leaf times ``w`` (a grain's weight), the others as they are."""
    k = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor)]
    out = list(leaves)
    if not k:  # nothing differentiated (a module without parameters)
        return out
    for i, t in zip(k, torch._foreach_mul([leaves[i] for i in k], w)):
        out[i] = t
    return out


def _divided(leaves: list[Any], total: float) -> list[Any]:
    """The mean: the sums over ``total``, the grains' count or their weights' sum (zeros where
    every weight is 0)."""
    return [
        (t / total if total else torch.zeros_like(t))
        if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())
        else t
        for t in leaves
    ]


def _per_batch(values: list[Any], cuts: list[tuple[int, Any]], has_aux: bool) -> list[Any]:
    """Each batch's mean of its grains' values (with ``has_aux``: and its grains' auxes)."""
    out, i = [], 0
    for count, _ in cuts:
        mine = values[i : i + count]
        i += count
        losses = [v[0] for v in mine] if has_aux else mine
        mean = torch.stack(losses).sum() / count
        out.append((mean, [v[1] for v in mine]) if has_aux else mean)
    return out


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _carries_graph(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    leaves: list[Any] = optree.tree_leaves((args, kwargs), namespace=NAMESPACE)  # type: ignore[arg-type]
    return torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in leaves
    )


def _cut(
    args: tuple[Any, ...], kwargs: dict[str, Any], n: int, grain: int, caller: str
) -> tuple[int, Callable[[int], tuple[tuple[Any, ...], dict[str, Any]]]]:
    """How many grains the batch makes, and grain ``i``'s arguments (its rows, fresh copies).

    Every tensor of the arguments but ``args[n]`` is batch-major: its rows are
    the samples. A grain's rows are copied into tensors of their own, so that
    a kernel whose path depends on an address's alignment takes the same path
    on every rank.
    """
    others = ({i: a for i, a in enumerate(args) if i != n}, kwargs)
    leaves, spec = flatten_in_order(others)
    rows = {
        k: t.shape[0] if t.dim() else None
        for k, t in enumerate(leaves)
        if isinstance(t, torch.Tensor)
    }
    paths = paths_of(spec)
    if not rows:
        raise ValueError(
            f"{caller}: grain={grain} cuts the batch, but the step's arguments other than "
            f"args[{n}] hold no tensor"
        )
    sizes = set(rows.values())
    if None in sizes or len(sizes) > 1:
        shown = ", ".join(f"{_name(paths[k])}: {r}" for k, r in rows.items())
        raise ValueError(
            f"{caller}: grain= cuts every tensor of the step's other arguments along its first "
            f"dimension (the samples), which must be alike: rows {shown}"
        )
    (size,) = sizes
    assert size is not None
    if size % grain:
        raise ValueError(
            f"{caller}: grain={grain} does not divide this rank's batch of {size} samples; give "
            "each rank a multiple of grain samples"
        )

    def cut(i: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
        part = [
            t[i * grain : (i + 1) * grain].clone() if isinstance(t, torch.Tensor) else t
            for t in leaves
        ]
        positional: Any
        kw: Any
        positional, kw = optree.tree_unflatten(spec, part)  # type: ignore[misc]
        return tuple(positional.get(k, a) for k, a in enumerate(args)), kw

    return size // grain, cut


def _name(path: str) -> str:
    """A leaf's path in ``({position: arg}, kwargs)`` as the caller would write it."""
    return ("args" if path.startswith("[0]") else "kwargs") + path[3:]


@contextlib.contextmanager
def _keyed(seed: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Iterator[None]:
    """The CPU generator and the arguments' CUDA ones seeded by ``seed``, restored after."""
    leaves: list[Any] = optree.tree_leaves((args, kwargs), namespace=NAMESPACE)  # type: ignore[arg-type]
    cuda = sorted(
        {t.device.index or 0 for t in leaves if isinstance(t, torch.Tensor) and t.is_cuda}
    )
    with torch.random.fork_rng(devices=cuda):
        torch.default_generator.manual_seed(seed)
        for d in cuda:
            torch.cuda.default_generators[d].manual_seed(seed)
        yield


def _refuse_sparse(leaves: list[Any], spec: Any, caller: str) -> None:
    for k, t in enumerate(leaves):
        if isinstance(t, torch.Tensor) and t.layout != torch.strided:
            raise NotImplementedError(
                f"{caller}: grain= sums dense gradients only; the gradient at "
                f"{paths_of(spec)[k]} is {t.layout}"
            )


def _agree(
    caller: str, group: Any, rank: int, error: BaseException | None, m: int, n: int, sums: int
) -> None:
    """Every rank learns whether another failed or differs, before any gradient moves."""
    words = [rank + 1 if error is not None else 0, m, -m, n, -n, sums, -sums]
    info = torch.tensor(words, dtype=torch.int64, device=comm_device(group))
    with collective(caller):
        dist.all_reduce(info, op=dist.ReduceOp.MAX, group=group)
    failed, m_hi, m_lo, n_hi, n_lo, s_hi, s_lo = (int(v) for v in info)
    if error is not None:
        return
    if failed:
        raise RuntimeError(f"{caller}: rank {failed - 1} raised in its grains (see its error)")
    if m_hi != -m_lo:
        raise ValueError(
            f"{caller}: ranks hold different numbers of grains ({-m_lo} to {m_hi}); grain= "
            "needs the same batch size on every rank"
        )
    if n_hi != -n_lo:
        raise ValueError(
            f"{caller}: the ranks' gradients differ in size ({-n_lo} to {n_hi} elements); "
            "every rank must differentiate the same tree"
        )
    if s_hi != -s_lo:
        raise ValueError(
            f"{caller}: the differentiated parameters differ across ranks on the first call; "
            "broadcast them first (fr.distributed.broadcast)"
        )


def _reduced(
    leaves: list[Any], rank: int, world: int, group: Any, total: int | None, op: str, caller: str
) -> list[Any]:
    """The leaves summed over the ranks (one flat buffer per dtype and device, ``_pack``'s:
    each leaf in its memory order, channels_last kept; unpadded, so that the bytes sent are a
    ring all-reduce's), then the mean. The buffer is a copy: a leaf may be autograd's own."""
    out = list(leaves)
    tensors = [k for k, t in enumerate(leaves) if isinstance(t, torch.Tensor)]
    for members in group_by(tensors, lambda k: device_dtype(leaves[k])).values():
        ks = [tensors[i] for i in members]
        ts = [leaves[k] for k in ks]
        layout = layout_of(ts)._replace(pads=(0,) * len(ts))
        flat = pack(ts, layout)
        if len(ts) == 1:
            flat = flat.clone()  # pack gives one tensor's own storage as its buffer
        if world > 1:
            halving_doubling(flat, rank, world, group, caller)
        if op == "mean" and total and (flat.is_floating_point() or flat.is_complex()):
            flat.div_(total)
        for k, view in zip(ks, unpack(flat, layout)):
            out[k] = view
    return out


def halving_doubling(flat: torch.Tensor, rank: int, world: int, group: Any, caller: str) -> None:
    """Sum ``flat`` (a buffer of this rank's own) over the ranks, in place.

    Level ``k`` pairs rank ``r`` with ``r ^ 2**k``: the rank whose bit ``k``
    is 0 holds the lower block of ranks, keeps the lower half of the current
    segment, and its partial is the left operand of the sum on both sides.
    """
    segments, (lo, hi) = halving(flat, rank, world, group, caller)
    for level in reversed(range(len(segments))):  # each level's halves swapped back
        (glo, ghi), parent = segments[level]
        exchange(flat[lo:hi], flat[glo:ghi], rank ^ (1 << level), group, caller)
        lo, hi = parent


def halving(
    flat: torch.Tensor, rank: int, world: int, group: Any, caller: str
) -> tuple[list[tuple[tuple[int, int], tuple[int, int]]], tuple[int, int]]:
    """Recursive halving of ``flat`` in place: per level, the half given away and the segment
    it was halved from; and the segment kept last, which holds the sum over every rank. Rank
    ``r`` keeps the ``bitrev(r)``-th of ``world`` equal segments where ``flat``'s size
    divides by ``world`` (``_scattered``'s blocks)."""
    segments: list[tuple[tuple[int, int], tuple[int, int]]] = []  # (given half, segment)
    lo, hi = 0, flat.numel()
    level = 0
    while (1 << level) < world:
        peer = rank ^ (1 << level)
        mid = lo + (hi - lo) // 2
        low = rank < peer
        keep, give = ((lo, mid), (mid, hi)) if low else ((mid, hi), (lo, mid))
        theirs = torch.empty(keep[1] - keep[0], dtype=flat.dtype, device=flat.device)
        exchange(flat[give[0] : give[1]], theirs, peer, group, caller)
        mine = flat[keep[0] : keep[1]]
        # in place, the lower ranks' partial still the left operand (no temporary, no copy)
        left, right = (mine, theirs) if low else (theirs, mine)
        torch.add(left, right, out=mine)
        segments.append((give, (lo, hi)))
        lo, hi = keep
        level += 1
    return segments, (lo, hi)


def bitrev(r: int, world: int) -> int:
    """``r``'s ``log2(world)`` bits reversed: the segment recursive halving leaves rank ``r``.

    >>> [bitrev(r, 4) for r in range(4)]
    [0, 2, 1, 3]
    """
    out, bit = 0, 1
    while bit < world:
        out = (out << 1) | (1 if r & bit else 0)
        bit <<= 1
    return out


def _scattered(
    leaves: list[Any], rank: int, world: int, group: Any, total: int | None, op: str, caller: str
) -> list[Any]:
    """ZeRO-2's reduction: this rank's rows of each leaf summed over the ranks (``fr.shard``'s
    rows: ``ceil(d0 / W)`` a rank), by recursive halving alone, each element in the order
    ``_reduced`` adds it; a 0-dim leaf held whole, reduced whole (``_reduced``).

    One buffer per dtype and device of ``W`` equal blocks, rank ``q``'s rows of every leaf
    (zero rows after a late rank's last) at block ``bitrev(q)``: the block halving leaves
    rank ``q``. Each rank sends a ring reduce-scatter's elements (with the padding rows).
    This rank's block is copied out, so that its gradients hold their rows alone."""
    out = list(leaves)
    whole = [k for k, t in enumerate(leaves) if isinstance(t, torch.Tensor) and not t.dim()]
    if whole:
        for k, t in zip(
            whole, _reduced([leaves[k] for k in whole], rank, world, group, total, op, caller)
        ):
            out[k] = t
    rowed = [k for k, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.dim()]
    for members in group_by(rowed, lambda k: device_dtype(leaves[k])).values():
        ks = [rowed[i] for i in members]
        ts = [leaves[k] for k in ks]
        flat, layout, rows = _blocks(ts, [False] * len(ts), world, lambda q: bitrev(q, world))
        size = layout.size
        at = bitrev(rank, world) * size
        if world > 1:
            _, kept = halving(flat, rank, world, group, caller)
            assert kept == (at, at + size), "halving keeps this rank's block"
        mine = flat[at : at + size].clone()
        del flat
        if op == "mean" and total and (mine.is_floating_point() or mine.is_complex()):
            mine.div_(total)
        for k, view in zip(ks, _kept(ts, rows, rank, mine, layout)):
            out[k] = view
    return out


def _blocks(
    ts: list[torch.Tensor],
    wholes: Sequence[bool],
    world: int,
    at: Callable[[int], int],
    scale: float | None = None,
) -> tuple[torch.Tensor, Layout, list[int | None]]:
    """One new buffer of ``world`` equal blocks, rank ``q``'s rows of every tensor of ``ts``
    (one dtype and device; ``fr.distributed.shard``'s rows, ``ceil(d0 / W)``, zero rows after
    a late rank's last; a whole tensor all of it) at block ``at(q)``, times ``scale`` where
    given; its layout of one block, and each tensor's rows (``None``: whole). ``ts`` are only
    read."""
    rows = [None if whole else -(-t.shape[0] // world) for t, whole in zip(ts, wholes)]
    shapes = tuple(
        t.shape if c is None else torch.Size((c, *t.shape[1:])) for c, t in zip(rows, ts)
    )
    orders = tuple(_rows_outside(memory_order(t)) for t in ts)
    numels = tuple(s.numel() for s in shapes)
    layout = Layout(shapes, numels, ts[0].dtype, ts[0].device, orders, (0,) * len(ts))
    size = layout.size
    flat = torch.zeros(size * world, dtype=layout.dtype, device=layout.device)
    with torch.no_grad():
        for q in range(world):
            start = at(q) * size
            for c, t, block in zip(rows, ts, unpack(flat[start : start + size], layout)):
                src = t if c is None else t[q * c : q * c + valid_rows(c, t.shape[0], q)]
                out = block if c is None else block[: src.shape[0]]
                if scale is None:
                    out.copy_(src)  # into the new buffer: ``ts`` are only read
                else:
                    torch.mul(src, scale, out=out)
    return flat, layout, rows


def _kept(
    ts: Sequence[torch.Tensor],
    rows: Sequence[int | None],
    rank: int,
    block: torch.Tensor,
    layout: Layout,
) -> list[torch.Tensor]:
    """``rank``'s rows of each of ``ts`` out of its ``block`` of ``_blocks``' buffer (views)."""
    return [
        view if c is None else view[: valid_rows(c, t.shape[0], rank)]
        for t, c, view in zip(ts, rows, unpack(block, layout))
    ]


def _rows_outside(order: tuple[int, ...] | None) -> tuple[int, ...] | None:
    """A memory order whose rows are outermost (a rank's rows are then one run), else none."""
    return order if order is None or order[0] == 0 else None


def exchange(send: torch.Tensor, recv: torch.Tensor, peer: int, group: Any, caller: str) -> None:
    """Send ``send`` to ``peer`` (a rank of ``group``) and receive its ``recv``, together."""
    target = peer if group is None else dist.get_global_rank(group, peer)
    ops = [
        dist.P2POp(f, t, target, group)
        for f, t in ((dist.isend, send), (dist.irecv, recv))
        if t.numel()  # both sides skip an empty half alike: its sizes are the peer's mirror
    ]
    if not ops:
        return
    with collective(caller):
        for work in dist.batch_isend_irecv(ops):
            work.wait()
