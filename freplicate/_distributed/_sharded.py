"""``apply_sharded``: fully sharded data parallelism (ZeRO-3) by differentiating the all-gather.

A rank holds its rows of every parameter (``shard``'s); ``apply_sharded``
runs the module's forward as ``fr.apply`` does, gathering each *unit*'s
full parameters just before the unit's forward and letting them go after
it. The all-gather is a primitive (``_rules``): its transpose, the
reduce-scatter of the gradient (``op``), is what reaches the shards, so any
autograd of the caller's (``fr.grad_and_value``, ``loss.backward()``) gives
each rank its rows of DDP's gradient, with nothing of ZeRO-3's own in the
backward pass. Eagerly, three things keep memory and time down:

* *prefetch*: the next unit's gather is started when a unit's gather has
  landed, so it travels while the unit computes;
* *release*: after its forward, a unit's copies of the module hold a
  stand-in again (which names the parameter if it is used outside its unit);
* *recompute*: autograd saves no gathered parameter. A saved-tensor hook
  (``torch.autograd.graph.saved_tensors_hooks``) turns every tensor saved
  from a gathered buffer into a token (the unit, the buffer, the view), and
  the backward pass gathers the unit again when it first needs one, the unit
  before it prefetched; a gradient taken with ``create_graph`` gathers it
  differentiably, so that second order holds. The last unit is the
  exception: the backward pass starts with it, so its parameters are kept
  from its forward (their values, no graph) rather than gathered again.

The transpose reaches the shards that require grad only: a frozen
parameter (``fr.partition``'s, a shard without grad) is gathered and never
reduce-scattered, and a unit whose parameters are all frozen sends nothing
in the backward pass.

At any moment a rank holds its shards, the parameters outside every unit,
and at most two units' full parameters. Under ``torch.compile`` and inside
``torch.func`` transforms the units are gathered in order before the forward
through the same primitive, and kept for the backward pass: the same values
and gradients, without the bound on memory (docs/sharding.md).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import optree
import torch
import torch.distributed as dist
from torch import nn

from .. import _apply
from .._checks import check_op
from .._state import State
from .._torch import is_compiling, transform_level
from .._tree import describe
from ._group import ProtocolError, comm_device, forward_ad_level, groups_of, world_size
from ._options import Options
from ._precision import Precision, cast, cast_inputs, cast_output, precision_of
from ._reproducible import gathering
from ._rules import Pending, apply, as_rule, failed, needs_rules, plain, transposed
from ._units import Units, units_of
from ._wire import ALL_GATHER, ALL_REDUCE, Spec, order_of, replaced, valid_rows

if TYPE_CHECKING:
    from torch.distributed.fsdp import MixedPrecisionPolicy

__all__ = ["apply_sharded"]

_CALLER = "fr.distributed.apply_sharded"


def apply_sharded(
    module: nn.Module,
    state: State,
    /,
    *args: Any,
    units: Sequence[str] | None = None,
    op: str = "mean",
    group: Any = None,
    mp_policy: MixedPrecisionPolicy | None = None,
    **kwargs: Any,
) -> tuple[Any, State]:
    """``fr.apply`` for a state of this rank's shards: each unit's parameters gathered as it runs.

    ``state.params`` are this rank's rows of the full parameters
    (``fr.distributed.shard(fr.state(model).params)``), ``state.buffers``
    whole; ``module`` supplies the full shapes (it may live on the ``meta``
    device: its own tensors are not read). Each unit (a submodule, named as
    ``named_modules()`` names it; by default one per block of each container
    of repeated blocks, such as a ``ModuleList`` of decoder layers, and the
    modules beside the blocks that hold parameters, each a unit: each direct
    child that holds parameters in a model without repeated blocks; a
    ``UserWarning`` when one default unit holds most of the parameters) has
    its full parameters all-gathered just before its forward and released
    after it; parameters outside every unit, and those reachable from two
    units (tied, or of a module both hold), are gathered for the whole call.
    The all-gather is differentiable: the gradient reaching ``state.params``
    is this rank's rows of the full gradient reduced over
    the ranks (``op="mean"``, DDP's average, or ``"sum"``), a reduce-scatter.
    Output, new buffers and gradients equal ``fr.apply`` on
    ``all_gather(state.params, like)`` followed by ``reduce_scatter`` of the
    gradient. Eagerly the next unit's gather is started while a unit runs,
    and no gathered parameter but the last unit's (with which the backward
    pass starts) is kept for the backward pass: it gathers each other unit
    again when it reaches it; frozen shards are gathered, never reduced.
    Collective: every rank calls it, with the
    same module, units and layout.

    A ZeRO-3 step: ``grads, loss = fr.grad_and_value(loss_fn)(shards, *batch)``
    where ``loss_fn`` calls ``apply_sharded``; then any elementwise optimizer
    on the shards, with no all-gather after it.

    Args:
        module: the module whose forward runs (never modified).
        state: ``fr.State(shards, buffers)``.
        *args: positional arguments of the forward.
        units: the submodules gathered one at a time (qualified names).
        op: ``"mean"`` or ``"sum"``: how the gradient is reduced over the ranks.
        group: the process group (default: the default group); a
            ``DeviceMesh`` (FSDP2's: 1-D, or 2-D ``(replicate, shard)``) or a
            pair of groups ``(replicate_group, shard_group)`` in that order:
            hybrid sharding (HSDP), rows over the shard group (the shards
            ``fr.distributed.shard(params, group=mesh)`` gives), each
            gradient's rows reduce-scattered over it, then all-reduced over
            the replicate group (``op`` over all the ranks); eagerly only.
        mp_policy: FSDP2's ``torch.distributed.fsdp.MixedPrecisionPolicy``,
            with its meaning: each parameter cast to ``param_dtype`` before
            its gather (the wire carries it) and the forward computed in it,
            the gradients reduce-scattered in ``reduce_dtype`` (default
            ``param_dtype``) and given to the shards in their own dtype, the
            call's floating-point outputs in ``output_dtype``, and (with
            ``cast_forward_inputs``) the floating-point inputs of the call and
            of each unit cast to ``param_dtype``: ``fully_shard`` on each unit
            and on the module, the module's policy with ``output_dtype``
            (a unit's output is never cast: the next layer computes in
            ``param_dtype``). ``None``: everything in its own dtype.
        **kwargs: keyword arguments of the forward.

    Returns:
        ``(output, State(state.params, new_buffers))``; without a process
        group or with one rank, ``fr.apply``'s (the shards are the whole).

    Raises:
        TypeError: a bad ``units`` or ``state``; ``module`` not an nn.Module.
        ValueError: a bad ``op``; a unit that is not a submodule; a shard whose
            shape is not this rank's rows of the parameter (naming its path); a
            meta parameter or buffer of ``module`` the state leaves out (naming it).
        KeyError: ``state`` names a parameter the module does not have.
        RuntimeError: a unit's parameter used outside the unit's forward
            (naming it); a collective's failure, as for every fr.distributed call.

    Examples:
        >>> model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
        >>> shards = fr.distributed.shard(fr.state(model).params)
        >>> out, _ = fr.distributed.apply_sharded(model, fr.State(shards, {}), torch.ones(1, 4))
        >>> out.shape  # no process group here: fr.apply
        torch.Size([1, 2])
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"{_CALLER}: module must be an nn.Module, got {describe(module)}")
    check_op(_CALLER, op)
    precision = precision_of(_CALLER, mp_policy)
    plan = units_of(module, units)
    groups = groups_of(group, _CALLER)
    group = groups.shard
    world = world_size(group, _CALLER)
    replicas = 0 if groups.replicate is None else world_size(groups.replicate, _CALLER)
    if world <= 1 and replicas > 1:
        raise ValueError(
            f"{_CALLER}: group's shard group has one rank and its replicate group {replicas}: "
            "nothing to shard (replicated training is fr.distributed.grad_and_value's)"
        )
    grain = gathering()
    if grain is not None:  # under grad_and_value(grain=): ZeRO-3's gradient in the fixed tree
        grain.seen = True
        if precision is not None or replicas > 1:
            raise NotImplementedError(
                f"{_CALLER}: under grad_and_value(grain=) (reproducible across world sizes) "
                "apply_sharded takes neither mp_policy nor hybrid sharding yet"
            )
    args, kwargs = cast_inputs(precision, args, kwargs)
    if world <= 1:
        dtype = None if precision is None else precision.param
        params = {n: cast(t, dtype) for n, t in state.params.items()}
        out, new = _bound(module, State(params, state.buffers), args, kwargs, plan, precision)
        return cast_output(precision, out), State(state.params, new.buffers)
    _apply.check_bindable(_CALLER, state)
    rank = dist.get_rank(group)
    _check_shards(plan, state.params, rank, world)
    _check_held(module, state)
    spec = Spec(replaced(_OPTIONS, op=op), group, world, _CALLER, True, (), pooled=False)
    replicate = None
    if replicas > 1:  # HSDP: the gradient's rows all-reduced over the replicas too
        options = replaced(_CLOSING, op=op)
        replicate = Spec(options, groups.replicate, replicas, _CALLER, True, (), pooled=False)
    session = _Session(plan, state.params, spec, precision, replicate)
    if is_compiling() or transform_level() is not None or torch.is_inference_mode_enabled():
        out, new = session.all_at_once(module, state, args, kwargs)
    else:
        out, new = session.unit_by_unit(module, state, args, kwargs)
    return cast_output(precision, out), new


_OPTIONS = Options(ALL_GATHER.name, "mean", 25.0, None)
_CLOSING = Options(ALL_REDUCE.name, "sum", 25.0, None)
#: the call whose last unit is kept for its backward (weakly): one at most, of all calls
_KEEPER: list[weakref.ref[Any] | None] = [None]


def _check_shards(plan: Units, params: dict[str, Any], rank: int, world: int) -> None:
    """Every shard this rank's rows of its parameter (``shard``'s split); unknown names refused."""
    unknown = [n for n in params if n not in plan.full]
    if unknown:
        raise KeyError(
            f"{_CALLER}: state.params names {unknown}, which the module does not have (its "
            f"parameters: {list(plan.full)[:8]}{' ...' if len(plan.full) > 8 else ''})"
        )
    for name, t in params.items():
        shape = plan.full[name][0]
        want = (
            shape if not shape else (valid_rows(-(-shape[0] // world), shape[0], rank), *shape[1:])
        )
        if t is not None and tuple(t.shape) != want:
            raise ValueError(
                f"{_CALLER}: state.params[{name!r}] must be rank {rank}'s rows of the parameter "
                f"of shape {shape} over {world} ranks (fr.distributed.shard): shape {want}, got "
                f"{tuple(t.shape)}"
            )


def _check_held(module: nn.Module, state: State) -> None:
    """A tensor the state leaves out falls back to the module's own: not a meta one."""
    missing = [n for n, p in module.named_parameters() if n not in state.params and p.is_meta]
    if missing:
        raise ValueError(
            f"{_CALLER}: state.params leaves out {missing}, whose module tensors are on the meta "
            "device (no values): give their shards in the state"
        )
    absent = [n for n, b in module.named_buffers() if n not in state.buffers and b.is_meta]
    if absent:
        raise ValueError(
            f"{_CALLER}: state.buffers leaves out {absent}, whose module tensors are on the meta "
            "device (no values; a model built under torch.device('meta') holds the buffers its "
            "__init__ computes, a rotary embedding's inv_freq, there too): give them in the "
            "state, from fr.distributed.materialize(model, init=...) (a Hugging Face model's: "
            "init=model._init_weights) or fr.state(model).buffers of the model built on a device"
        )


class _Token(NamedTuple):
    """A saved tensor that was a view of a unit's gathered buffer: gathered again to unpack."""

    unit: str
    base: int  # which of the unit's result buffers
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


class _Gathered(torch.autograd.Function):
    """A unit's gather, finished (a started ``Pending``) or run now (its ``Spec``).

    Its transpose, the reduce-scatter of the cotangents, reaches the shards
    that need a gradient only (``ctx.needs_input_grad``): a frozen shard (one
    that does not require grad) is gathered and never reduced, and a unit
    none of whose shards needs one sends nothing in the backward pass. Every
    rank must pass the same shards with and without grad (the same trainable
    and frozen split): the reduce-scatter's paths are part of its layout, so
    where ranks differ the layout check sees it as it sees any other tree that
    differs (a ``ValueError`` on every rank where it probes: a layout's first
    use, every call in the debug mode; ``_agree``).
    """

    @staticmethod
    def forward(  # type: ignore[override]
        source: Pending | Spec,
        precision: Precision | None,
        replicate: Spec | None,
        *shards: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        if isinstance(source, Pending):
            return tuple(source.finish())
        return tuple(plain(source, _on_wire(precision, shards)))

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        source, precision, replicate, *shards = inputs
        ctx.spec = source.spec if isinstance(source, Pending) else source
        ctx.inputs = [(tuple(t.shape), order_of(t)) for t in shards]
        ctx.reduce = None if precision is None else precision.wire
        ctx.dtypes = [t.dtype for t in shards]
        ctx.replicate = replicate
        ctx.grain = gathering()  # a reproducible step's grain (read here: a CUDA backward
        # runs on autograd's own thread)
        ctx.ids = None if ctx.grain is None else ctx.grain.took(shards)
        ctx.mark_non_differentiable(
            *(o for o in output if not (o.is_floating_point() or o.is_complex()))
        )

    @staticmethod
    def backward(ctx: Any, *cts: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        wanted = [k for k, need in enumerate(ctx.needs_input_grad[3:]) if need]
        if ctx.grain is not None:  # grain=: the ranks' rows summed in the fixed tree
            cts = tuple(cast(c, ctx.reduce) for c in cts)  # (no mp_policy there: refused)
            grads = ctx.grain.rows(ctx.spec, cts, ctx.inputs, wanted)
            ctx.grain.gave([ctx.ids[k] for k in wanted])
        elif torch.is_grad_enabled():  # create_graph: the policy's reduce_dtype cast in the graph
            cts = tuple(cast(c, ctx.reduce) for c in cts)
            grads = transposed(ctx.spec, cts, ctx.inputs, wanted)  # frozen shards: None
        else:  # reduced in the policy's reduce_dtype, cast as packed (no copy of them in it)
            spec = ctx.spec if ctx.reduce is None else replaced(ctx.spec, dtype=ctx.reduce)
            grads = transposed(spec, cts, ctx.inputs, wanted)
        if ctx.replicate is not None and wanted:  # HSDP: the rows reduced over the replicas
            paths = tuple(ctx.spec.paths[k] for k in wanted)
            over = replaced(as_rule(ctx.replicate, "backward"), paths=paths)
            for k, g in zip(wanted, apply(over, [grads[k] for k in wanted])):
                grads[k] = g
        return (None, None, None, *(cast(g, d) for g, d in zip(grads, ctx.dtypes)))


def _on_wire(precision: Precision | None, shards: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The shards as their gather sends them: in the policy's ``param_dtype`` (no graph)."""
    if precision is None or precision.param is None:
        return list(shards)
    return [cast(t.detach(), precision.param) for t in shards]


def _gather(
    source: Pending | Spec,
    shards: Sequence[torch.Tensor],
    precision: Precision | None,
    replicate: Spec | None = None,
) -> list[torch.Tensor]:
    """The gather of ``shards`` (started: ``source`` a ``Pending``; or now, of ``source``'s
    spec), through ``_Gathered`` where autograd reaches them, plainly where it does not."""
    if isinstance(source, Spec) and (is_compiling() or forward_ad_level()):
        _eager_only(replicate)
        return apply(source, _ruled(precision, shards))  # traced, or a tangent: the rules
    if needs_rules(shards, _CALLER):
        return list(_Gathered.apply(source, precision, replicate, *shards))
    return (
        source.finish()
        if isinstance(source, Pending)
        else plain(source, _on_wire(precision, shards))
    )


def _eager_only(replicate: Spec | None) -> None:
    """Hybrid sharding's all-reduce over the replicas rides in ``_Gathered``'s backward, which
    the primitive's rules (traced, transformed) do not run: refused there, but in inference
    mode, where no gradient can be taken."""
    if replicate is not None and not torch.is_inference_mode_enabled():
        raise NotImplementedError(
            f"{_CALLER}: hybrid sharding (a 2-D mesh, or a (replicate, shard) pair of groups) "
            "runs eagerly only (or in inference mode): under torch.compile, a torch.func "
            "transform or forward-mode AD the gather's transpose would not all-reduce over the "
            "replicas"
        )


def _ruled(precision: Precision | None, shards: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The shards cast (differentiably) for a gather through the primitive's own rules, whose
    transpose reduces in the dtype sent: refused where the policy reduces in another."""
    if precision is None or precision.param is None:
        return list(shards)
    if precision.wire != precision.param and not torch.is_inference_mode_enabled():
        raise NotImplementedError(
            f"{_CALLER}: mp_policy with reduce_dtype={precision.reduce} other than "
            f"param_dtype={precision.param} runs eagerly only (or in inference mode): under "
            "torch.compile, a torch.func transform or forward-mode AD the gather's transpose "
            "reduces in the dtype it sent (give reduce_dtype=None or param_dtype there)"
        )
    return [cast(t, precision.param) for t in shards]


class _Session:
    """One call of ``apply_sharded``: its gathers, their prefetch, and its saved-tensor tokens."""

    def __init__(
        self,
        plan: Units,
        shards: dict[str, Any],
        spec: Spec,
        precision: Precision | None,
        replicate: Spec | None,
    ) -> None:
        self.plan = plan
        self.shards = shards
        self.spec = spec
        self.precision = precision
        self.replicate = replicate  # HSDP: the all-reduce over the replicas (its spec)
        self.pending: dict[str, Pending] = {}
        self.started: set[str] = set()  # the units whose gather this call started (eagerly)
        self.order: list[str] = []  # the units as they ran (the backward pass runs them back)
        # a gathered buffer's storage -> (unit, which of its buffers, dtype): no reference kept,
        # so that a unit's buffers go back to their pool once it is released
        self.live: dict[int, tuple[str, int, torch.dtype]] = {}
        self.again: dict[str, tuple[list[torch.Tensor], dict[str, torch.Tensor]]] = {}
        self.tokened: list[str] = []  # the units whose saved tensors are tokens, as they ran
        # the last unit's parameters (predicted: the last of ``units``), kept from its forward to
        # the backward pass, which needs them first: what ``_again`` gives instead of a gather
        self.kept: tuple[str, tuple[list[torch.Tensor], dict[str, torch.Tensor]]] | None = None
        self.done = False  # the forward is over: a stand-in touched now is a recomputation

    # --- one unit's gather ---------------------------------------------------------------

    def _spec(self, names: Sequence[str]) -> Spec:
        like = tuple(self.plan.full[n] for n in names)
        return replaced(self.spec, paths=tuple(f"[{n!r}]" for n in names), like=like)

    def _names(self, unit: str) -> tuple[str, ...]:
        """The unit's parameters this state holds (the others are the module's own)."""
        return tuple(n for n in self.plan.gathers[unit] if self.shards.get(n) is not None)

    def start(self, unit: str) -> None:
        """Start ``unit``'s gather now (a prefetch), unless it is in flight already."""
        names = self._names(unit)
        if names and unit not in self.pending:
            wire = _on_wire(self.precision, [self.shards[n] for n in names])
            self.pending[unit] = Pending(self._spec(names), wire)
            self.started.add(unit)

    def _gathered(self, source: Pending | Spec, names: Sequence[str]) -> list[torch.Tensor]:
        shards = [self.shards[n] for n in names]
        return _gather(source, shards, self.precision, self.replicate)

    def gather(self, unit: str) -> dict[str, torch.Tensor]:
        """``unit``'s full parameters, differentiable; the next unit's gather started."""
        names = self._names(unit)
        if not names:
            return {}
        self.kept = None  # a unit after the last one: the last is not the backward's first
        self.start(unit)
        full = self._gathered(self.pending.pop(unit), names)
        self._track(unit, full)
        following = self._following(unit)
        if following is not None:
            self.start(following)
        elif torch.is_grad_enabled() and not self.done:  # the last unit: kept for the backward
            bases = [t.detach() for t in _bases(full)]  # pass, which starts with it (the values)
            self.kept = (unit, (bases, {n: t.detach() for n, t in zip(names, full)}))
            _KEEPER[0] = weakref.ref(self)
        return dict(zip(names, full))

    def _following(self, unit: str) -> str | None:
        """The unit predicted to run next: the next in ``units``' order (every rank alike)."""
        names = self.plan.names
        k = names.index(unit) + 1
        return names[k] if k < len(names) else None

    def _track(self, unit: str, full: Sequence[torch.Tensor]) -> None:
        """Remember which storages hold ``unit``'s parameters (what the pack hook tokenizes)."""
        for i, base in enumerate(_bases(full)):
            self.live[base.untyped_storage().data_ptr()] = (unit, i, base.dtype)
        if unit not in self.order:
            self.order.append(unit)

    def release(self, unit: str) -> None:
        """``unit``'s forward is over: its storages are no longer its own (once freed, an
        activation may take the same address: it must not be taken for the unit's)."""
        self.live = {ptr: hit for ptr, hit in self.live.items() if hit[0] != unit}

    def settle(self) -> None:
        """Finish every gather still in flight (a prefetch no unit took): every rank alike."""
        for unit in list(self.pending):
            self.pending.pop(unit).finish()

    # --- the call, unit by unit (eager) ----------------------------------------------------

    def unit_by_unit(
        self, module: nn.Module, state: State, args: Any, kwargs: Any
    ) -> tuple[Any, State]:
        keeper = _KEEPER[0]() if _KEEPER[0] is not None else None
        if keeper is not None:  # an earlier call's graph not yet differentiated: its last unit
            keeper.kept = None  # is gathered again (the bound of two units holds across calls)
        values = dict(self.gather_outside(apart=torch.is_grad_enabled()))
        mine = weakref.ref(self)
        stand_ins = {
            n: _stand_in(self.plan.full[n][0], self.shards[n], n, mine)
            for u in self.plan.names
            for n in self._names(u)
        }
        bound = State({**stand_ins, **values}, state.buffers)
        hooks = (
            torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
            if torch.is_grad_enabled()
            else contextlib.nullcontext()
        )
        spec = self.spec
        closing = replaced(spec, options=_CLOSING, paths=("<closing>",))
        zero = torch.zeros(1, device=comm_device(spec.group))
        try:
            try:
                with hooks, _named_touches(self.plan):
                    out, new = _apply.bound_call(module, bound, args, kwargs, around=self.around)
            finally:
                self.settle()
                self.done = True
                if self.kept is not None and self.kept[0] not in self.tokened:
                    self.kept = None  # no saved tensor of it: the backward never gathers it
            # the call's last collective, after its forward: a rank whose forward raised after
            # its last gather announces it here, so that every rank raises in this call
            plain(closing, [zero])
        except BaseException as err:  # a failure here: every rank raises, in this call
            if not isinstance(err, ProtocolError):
                self._announce(err, closing, zero)
            if self.replicate is not None:  # and the replicas, whatever it was
                failed(replaced(self.replicate, paths=("<closing>",)), [zero], err)
            raise
        if self.replicate is not None:
            plain(replaced(self.replicate, paths=("<closing>",)), [zero])
        return out, State(state.params, new.buffers)

    def _announce(self, error: BaseException, closing: Spec, zero: torch.Tensor) -> None:
        """This rank's forward failed: it runs, failed, the collective its peers run next (the
        first unit it never gathered, or the closing one), where every rank then raises."""
        for unit in self.plan.names:
            names = self._names(unit)
            if names and unit not in self.started:
                failed(self._spec(names), [self.shards[n] for n in names], error)
                return
        failed(closing, [zero], error)

    def gather_outside(self, apart: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """The parameters outside every unit, gathered for the whole call. ``apart``: each in a
        storage of its own (a copy of the gathered buffer's view), so that one the backward
        pass does not read (an embedding's table: its gradient needs the indices only) is let
        go with the forward instead of kept by the buffer the others' saved views hold."""
        names = tuple(n for n in self.plan.outside if self.shards.get(n) is not None)
        if not names:
            return iter(())
        full = self._gathered(self._spec(names), names)
        if apart and len(_bases(full)) < len(full):
            full = [t.clone() for t in full]
        return zip(names, full)

    def around(self, where: list[str], copies: list[nn.Module], slots: list[Any]) -> None:
        """Wrap each unit's copy: its parameters bound for its forward only."""
        at = {name: k for k, name in enumerate(where)}
        for unit in self.plan.names:
            k = at.get(_apply._name(unit))
            if k is None:
                continue
            if not self._names(unit):  # its parameters gathered for the call (tied, shared)
                _cast_inputs_of(copies[k], self.precision)
                continue
            mine = set(self._names(unit))
            places = [
                (copies[j], key, name)
                for j, key, name in slots
                if name in mine and _inside(where[j], unit)
            ]
            _wrap(copies[k], unit, places, self)

    # --- saved tensors: tokens, gathered again in the backward pass ------------------------

    def pack(self, t: torch.Tensor) -> Any:
        if not self.live or (type(t) is not torch.Tensor and type(t) is not nn.Parameter):
            return t
        hit = self.live.get(t.untyped_storage().data_ptr())
        if hit is None or t.dtype != hit[2]:
            return t
        if hit[0] not in self.tokened:
            self.tokened.append(hit[0])
        return _Token(hit[0], hit[1], tuple(t.shape), tuple(t.stride()), int(t.storage_offset()))

    def unpack(self, saved: Any) -> Any:
        if not isinstance(saved, _Token):
            return saved
        bases = self._again(saved.unit)[0]
        return torch.as_strided(bases[saved.base], saved.size, saved.stride, saved.offset)

    def resolve(self, name: str) -> torch.Tensor:
        """A unit's parameter, gathered again: what a recomputation touching its stand-in gets."""
        unit = next(u for u, names in self.plan.gathers.items() if name in names)
        return self._again(unit)[1][name]

    def _again(self, unit: str) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
        """``unit``'s buffers and parameters gathered again (differentiably under
        ``create_graph``; the last unit's kept from its forward otherwise), every other
        unit's let go."""
        got = self.again.get(unit)
        if got is not None:
            return got
        kept, self.kept = self.kept, None
        if kept is not None and kept[0] == unit and not torch.is_grad_enabled():
            got = kept[1]  # the last unit, kept from the forward: no gather
        else:
            names = self._names(unit)
            shards = [self.shards[n] for n in names]
            pending = self.pending.pop(unit, None)
            if torch.is_grad_enabled():  # a graph to keep (create_graph, a recomputation)
                full = self._gathered(pending or self._spec(names), names)
            else:
                wire = _on_wire(self.precision, shards)
                full = (pending or Pending(self._spec(names), wire)).finish()
            got = (_bases(full), dict(zip(names, full)))
        self.again = {unit: got}
        if not torch.is_grad_enabled():
            self._prefetch_before(unit)
        return got

    def _prefetch_before(self, unit: str) -> None:
        """Start the gather of the unit that ran before ``unit`` (the backward pass's next), if
        it saved tensors: its gather travels while ``unit``'s backward computes."""
        k = self.tokened.index(unit) if unit in self.tokened else 0
        if k > 0 and self.tokened[k - 1] not in self.again:
            self.start(self.tokened[k - 1])

    # --- the call, all units at once (compiled, transformed) -------------------------------

    def all_at_once(
        self, module: nn.Module, state: State, args: Any, kwargs: Any
    ) -> tuple[Any, State]:
        _eager_only(self.replicate)
        values = dict(self.gather_outside())
        for unit in self.plan.names:
            names = self._names(unit)
            if names:
                shards = _ruled(self.precision, [self.shards[n] for n in names])
                values.update(zip(names, apply(self._spec(names), shards)))
        bound = State(values, state.buffers)
        out, new = _bound(module, bound, args, kwargs, self.plan, self.precision)
        return out, State(state.params, new.buffers)


def _bases(full: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """One tensor per distinct storage of ``full``, in order of first appearance."""
    seen: dict[int, torch.Tensor] = {}
    for t in full:
        seen.setdefault(t.untyped_storage().data_ptr(), t)
    return list(seen.values())


def _inside(where: str, unit: str) -> bool:
    """Whether the copy named ``where`` (``module.<name>``) lies in ``unit``."""
    name = where[len("module.") :] if where != "module" else ""
    return unit == "" or name == unit or name.startswith(unit + ".")


def _wrap(copy: nn.Module, unit: str, places: list[Any], session: _Session) -> None:
    """``copy.forward``, this call's: gather, bind, run, release (even when it raises).

    The wrapper holds the call's session weakly: the graph holds it while a backward pass may
    need it (its saved-tensor hooks), and the wrapper and ``copy`` hold each other (a cycle
    the garbage collector takes) but nothing heavy, so that the session, and what it gathered,
    goes with the graph. ``copy`` itself stays strong: a ``checkpoint(block.forward, x)`` keeps
    the wrapper alone, and recomputes through it."""
    forward = copy.forward
    saved = [(m, key, m._parameters[key]) for m, key, _ in places]
    ref = weakref.ref(session)

    def run(*args: Any, **kwargs: Any) -> Any:
        live = ref()
        if live is None:
            raise RuntimeError(
                f"{_CALLER}: the forward of unit {unit!r} was called after its call's graph was "
                "freed; call apply_sharded again"
            )
        args, kwargs = cast_inputs(live.precision, args, kwargs)  # as fully_shard(unit) does
        full = live.gather(unit)
        for m, key, name in places:
            m._parameters[key] = full[name]
        try:
            return forward(*args, **kwargs)
        finally:
            for m, key, stand_in in saved:
                m._parameters[key] = stand_in
            live.release(unit)

    copy.__dict__["forward"] = run


def _bound(
    module: nn.Module,
    state: State,
    args: Any,
    kwargs: Any,
    plan: Units,
    precision: Precision | None,
) -> tuple[Any, State]:
    """``fr.apply`` of a state bound whole (one process; compiled or transformed: every unit
    gathered up front), each unit's inputs cast as ``fully_shard(unit)`` casts them: eagerly
    on the call's copies; compiled, where ``functional_call`` binds ``module`` itself, on the
    units' modules for the trace (their ``forward`` restored after it, as ``functional_call``
    restores the tensors it swaps)."""
    if not _casts_inputs(precision):
        return _apply.apply(module, state, *args, **kwargs)
    if is_compiling():
        held = {id(m): m for m in (module.get_submodule(u) for u in plan.names)}.values()
        saved = [(m, m.__dict__.get("forward")) for m in held]
        try:
            for m in held:
                _cast_inputs_of(m, precision)
            return _apply.apply(module, state, *args, **kwargs)
        finally:
            for m, forward in saved:
                if forward is None:
                    del m.__dict__["forward"]
                else:
                    m.__dict__["forward"] = forward

    def cast_units(where: list[str], copies: list[nn.Module], slots: list[Any]) -> None:
        at = {name: k for k, name in enumerate(where)}
        for unit in plan.names:
            k = at.get(_apply._name(unit))
            if k is not None:
                _cast_inputs_of(copies[k], precision)

    return _apply.bound_call(module, state, args, kwargs, around=cast_units)


def _casts_inputs(precision: Precision | None) -> bool:
    return precision is not None and precision.inputs and precision.param is not None


def _cast_inputs_of(copy: nn.Module, precision: Precision | None) -> None:
    """``copy.forward`` with its inputs cast as ``fully_shard(unit)`` casts them (a unit that
    gathers nothing of its own: its parameters are the call's)."""
    if not _casts_inputs(precision):
        return
    forward = copy.forward

    def run(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = cast_inputs(precision, args, kwargs)
        return forward(*args, **kwargs)

    copy.__dict__["forward"] = run


class _Touched(Exception):
    """A unit's stand-in was used outside the unit's forward: the parameter's name."""


class _StandIn(torch.Tensor):
    """A unit's parameter outside its unit's forward (a meta tensor of its shape).

    Touched during the forward, it raises ``_Touched`` (its name); touched
    once the forward is over, by a recomputation of the unit during the
    backward pass (a non-reentrant activation checkpoint inside the unit),
    it is the parameter gathered again.
    """

    _fr_name: str
    _fr_session: Any  # a weak reference to the call's session

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        leaves: list[Any] = optree.tree_leaves((args, kwargs))  # type: ignore[arg-type]
        found = [a for a in leaves if isinstance(a, _StandIn)]
        session = found[0]._fr_session() if found else None
        if session is None or not session.done:
            raise _Touched(found[0]._fr_name if found else "?")
        real: Any = optree.tree_map(
            lambda a: session.resolve(a._fr_name) if isinstance(a, _StandIn) else a,
            (args, kwargs),  # type: ignore[arg-type]
        )
        with torch._C.DisableTorchFunctionSubclass():
            return func(*real[0], **real[1])


def _stand_in(shape: tuple[int, ...], like: torch.Tensor, name: str, session: Any) -> torch.Tensor:
    s = torch.Tensor._make_subclass(_StandIn, torch.empty(shape, dtype=like.dtype, device="meta"))
    s._fr_name = name
    s._fr_session = session
    return s


@contextlib.contextmanager
def _named_touches(plan: Units) -> Iterator[None]:
    """A stand-in touched: a ``RuntimeError`` naming the parameter and its unit."""
    try:
        yield
    except _Touched as err:
        name = err.args[0]
        unit = next((u for u, names in plan.gathers.items() if name in names), "?")
        raise RuntimeError(
            f"{_CALLER}: the parameter {name!r} of unit {unit!r} was used outside that unit's "
            "forward, where it is not gathered; add the module that uses it to units, or leave "
            "the parameter outside every unit (units=...)"
        ) from None
