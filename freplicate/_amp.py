"""fp16 dynamic loss scaling on trees: ``torch.amp.GradScaler``'s arithmetic as pure functions.

``GradScaler`` keeps its scale and growth tracker inside the object and
mutates ``.grad`` in place; here the options are an immutable object, the
state a plain dict of two tensors that goes in and out of every call, and
the gradients a new tree. The arithmetic is GradScaler's own kernels
(``_amp_foreach_non_finite_check_and_unscale_``, ``_amp_update_scale_``) in
their functional form, which run the in-place kernel on copies, so the
scales, the skipped steps and the unscaled gradients are GradScaler's bit
for bit. Nothing reads a value back to the host: where GradScaler skips
``optimizer.step()`` after a Python ``if``, ``GradScaler.step`` here selects
the old trees with ``torch.where``, so a compiled step stays one graph.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ._devices import as_device
from ._torch import aten_op
from ._tree import flatten_in_order, paths_of, unflatten
from ._typing import DeviceSpec, T

__all__ = ["GradScaler"]

_NAME = "fr.GradScaler"
_KEYS = ("scale", "growth_tracker")


def _aten(name: str) -> Any:
    # GradScaler's kernels, through the functional ops torch generates for them (they copy
    # their inputs before the in-place kernel runs)
    return aten_op(name, _NAME)


def _check_state(caller: str, state: Any) -> tuple[torch.Tensor, torch.Tensor]:
    if not (isinstance(state, dict) and all(isinstance(state.get(k), torch.Tensor) for k in _KEYS)):
        raise TypeError(
            f"{caller}: state must be the dict of tensors that init() returns "
            f"({{'scale': ..., 'growth_tracker': ...}}), got {type(state).__name__}"
        )
    return state["scale"], state["growth_tracker"]


@dataclass(frozen=True)
class GradScaler:
    """Dynamic loss scaling for float16 training: ``torch.amp.GradScaler`` as pure functions.

    The options are fields of this immutable object (``torch.amp.GradScaler``'s
    arguments and defaults); the state is a plain dict of two 0-dim tensors
    (``{"scale": float32, "growth_tracker": int32}``) that ``init`` makes and
    ``update`` replaces, so ``torch.save`` / ``torch.load(weights_only=True)``
    take it as it is. A step, for fp32 parameters and a loss computed under
    ``torch.autocast(..., dtype=torch.float16)`` inside the loss function:

    1. ``scaler.scale(state, loss)`` in the loss function (differentiate that);
    2. ``grads, found_inf = scaler.unscale(state, grads)``: the true gradients
       and a 0-dim flag, non-zero where any gradient is inf or NaN;
    3. the optimizer on ``grads`` (clip first if you clip), then
       ``scaler.step(found_inf, updated, current)``: the updated trees, or
       the current ones where ``found_inf`` (GradScaler skips
       ``optimizer.step()``);
    4. ``state = scaler.update(state, found_inf)``: the scale backs off after
       an overflow and grows after ``growth_interval`` clean steps.

    Every method is pure (no input is modified) and reads nothing back to the
    host, so the step compiles to one graph. Across processes, gradients
    from ``fr.distributed.grad_and_value`` are already reduced and carry any
    rank's inf; for gradients that are not (sharded, or local before a
    reduction of your own), ``unscale(..., across_ranks=True)`` sums the flags
    over the ranks, so one rank's overflow skips the step on every rank.

    >>> import freplicate as fr
    >>> scaler = fr.GradScaler(init_scale=2.0**16, growth_interval=2)
    >>> state = scaler.init()
    >>> state
    {'scale': tensor(65536.), 'growth_tracker': tensor(0, dtype=torch.int32)}
    >>> grads, found_inf = scaler.unscale(state, {"w": torch.tensor([65536.0, float("inf")])})
    >>> grads, found_inf
    ({'w': tensor([1., inf])}, tensor(1.))
    >>> scaler.update(state, found_inf)["scale"]  # an overflow: back off, skip the step
    tensor(32768.)

    Args:
        init_scale: the first scale.
        growth_factor: the scale's factor after ``growth_interval`` clean steps (> 1).
        backoff_factor: the scale's factor after a step with inf or NaN (in (0, 1)).
        growth_interval: how many consecutive clean steps make the scale grow.

    Raises:
        ValueError: an option out of its range.
        TypeError: an option of the wrong type.
    """

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000

    def __post_init__(self) -> None:
        for name in ("init_scale", "growth_factor", "backoff_factor"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"{_NAME}: {name} must be a number, got {value!r}")
        if not (math.isfinite(self.init_scale) and self.init_scale > 0):
            raise ValueError(
                f"{_NAME}: init_scale must be a finite positive number, got {self.init_scale}"
            )
        if not self.growth_factor > 1.0:
            raise ValueError(f"{_NAME}: growth_factor must be > 1.0, got {self.growth_factor}")
        if not 0.0 < self.backoff_factor < 1.0:
            raise ValueError(
                f"{_NAME}: backoff_factor must be in (0, 1), got {self.backoff_factor}"
            )
        interval = self.growth_interval
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise ValueError(f"{_NAME}: growth_interval must be an int >= 1, got {interval!r}")

    def init(self, device: DeviceSpec = "cpu") -> dict[str, torch.Tensor]:
        """The first state: ``init_scale`` and no clean step yet, on ``device``.

        >>> fr.GradScaler(init_scale=1024.0).init()
        {'scale': tensor(1024.), 'growth_tracker': tensor(0, dtype=torch.int32)}

        Args:
            device: where the scale lives (that of the loss, as GradScaler puts it).

        Returns:
            ``{"scale": float32 0-dim, "growth_tracker": int32 0-dim}``.
        """
        dev = as_device(device, caller=f"{_NAME}.init")
        return {
            "scale": torch.full((), self.init_scale, dtype=torch.float32, device=dev),
            "growth_tracker": torch.full((), 0, dtype=torch.int32, device=dev),
        }

    def scale(self, state: dict[str, torch.Tensor], outputs: T) -> T:
        """``outputs`` times the current scale: every tensor leaf, as ``GradScaler.scale``.

        >>> scaler = fr.GradScaler(init_scale=8.0)
        >>> scaler.scale(scaler.init(), torch.tensor(0.5))
        tensor(4.)

        Args:
            state: the scaler's state.
            outputs: a loss, or a tree of them (other leaves pass through).

        Returns:
            The scaled tensors, differentiable (the gradients come out scaled).

        Raises:
            TypeError: ``state`` is not a scaler state.
        """
        scale, _ = _check_state(f"{_NAME}.scale", state)
        leaves, spec = flatten_in_order(outputs)
        return unflatten(  # type: ignore[no-any-return]
            spec,
            [x * scale.to(x.device) if isinstance(x, torch.Tensor) else x for x in leaves],
        )

    def unscale(
        self,
        state: dict[str, torch.Tensor],
        grads: T,
        *,
        across_ranks: bool = False,
        group: Any = None,
    ) -> tuple[T, torch.Tensor]:
        """The gradients divided by the scale, and whether any of them is inf or NaN.

        ``GradScaler.unscale_`` on a new tree: every tensor leaf times
        ``1 / scale`` (the reciprocal taken in float64, as GradScaler takes
        it), checked for inf and NaN per device and dtype by GradScaler's
        kernel. Sparse COO leaves are unscaled in their values. ``None`` and
        other non-tensor leaves pass through.

        >>> scaler = fr.GradScaler(init_scale=4.0)
        >>> scaler.unscale(scaler.init(), {"w": torch.tensor([2.0, 8.0]), "frozen": None})
        ({'w': tensor([0.5000, 2.0000]), 'frozen': None}, tensor(0.))

        Args:
            state: the scaler's state.
            grads: the gradients of the scaled loss.
            across_ranks: sum the flag over the ranks of ``group`` with
                ``fr.distributed.all_reduce`` (a collective: every rank
                calls it), for gradients not yet reduced across ranks.
            group: the process group for ``across_ranks`` (default: the
                default group).

        Returns:
            ``(grads, found_inf)``: the unscaled gradients, and a float32
            0-dim tensor on the scale's device, non-zero where a gradient
            (on any rank, with ``across_ranks``) is inf or NaN.

        Raises:
            TypeError: a float16 gradient (as GradScaler: keep the parameters
                in float32 and let autocast make the float16 activations), an
                integer one, or a bad ``state``; each names its path.
        """
        caller = f"{_NAME}.unscale"
        scale, _ = _check_state(caller, state)
        leaves, spec = flatten_in_order(grads)
        at = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        for i in at:
            g = leaves[i]
            if g.dtype == torch.float16:
                raise TypeError(
                    f"{caller}: the gradient at {paths_of(spec)[i]} is float16, which GradScaler "
                    "refuses to unscale: keep the parameters in float32 and compute in float16 "
                    "under torch.autocast"
                )
            if not g.is_floating_point():
                raise TypeError(
                    f"{caller}: the gradient at {paths_of(spec)[i]} is {g.dtype}; gradients are "
                    "floating-point: leave other tensors out of the tree"
                )
        inv_scale = scale.double().reciprocal().float()
        # GradScaler's grouping: one flag per device, one kernel call per (device, dtype)
        groups: dict[torch.device, dict[torch.dtype, list[int]]] = {}
        for i in at:
            values = _values(leaves[i])
            groups.setdefault(values.device, {}).setdefault(values.dtype, []).append(i)
        out = list(leaves)
        flags = []
        unscale = _aten("_amp_foreach_non_finite_check_and_unscale")
        with torch.no_grad():
            for device, by_dtype in groups.items():
                found = torch.zeros((), dtype=torch.float32, device=device)
                inv = inv_scale.to(device)
                for idx in by_dtype.values():
                    done, found = unscale([_values(leaves[i]) for i in idx], found, inv)
                    for i, values in zip(idx, done):
                        out[i] = _with_values(leaves[i], values)
                flags.append(found.to(scale.device))
            found_inf = flags[0] if flags else torch.zeros((), device=scale.device)
            for more in flags[1:]:
                found_inf = found_inf + more
        if across_ranks:
            from . import distributed

            found_inf = distributed.all_reduce(found_inf, op="sum", group=group)
        return unflatten(spec, out), found_inf

    def update(
        self, state: dict[str, torch.Tensor], found_inf: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """The next state, as ``GradScaler.update()`` leaves it after a step that found ``found_inf``.

        After inf or NaN: the scale times ``backoff_factor``, the tracker 0.
        Otherwise the tracker counts one more clean step, and at
        ``growth_interval`` the scale grows by ``growth_factor`` (unless that
        overflows float32) and the tracker restarts at 0.

        >>> scaler = fr.GradScaler(init_scale=8.0, growth_interval=1)
        >>> scaler.update(scaler.init(), torch.tensor(0.0))
        {'scale': tensor(16.), 'growth_tracker': tensor(0, dtype=torch.int32)}

        Args:
            state: the scaler's state.
            found_inf: the flag ``unscale`` returned (several flags, e.g. one
                per optimizer, may be added up).

        Returns:
            A new state; ``state`` is left as it was.

        Raises:
            TypeError: ``state`` is not a scaler state.
        """
        scale, tracker = _check_state(f"{_NAME}.update", state)
        new_scale, new_tracker = _aten("_amp_update_scale")(
            scale,
            tracker,
            found_inf.to(scale.device),
            self.growth_factor,
            self.backoff_factor,
            self.growth_interval,
        )
        return {"scale": new_scale, "growth_tracker": new_tracker}

    def step(self, found_inf: torch.Tensor, updated: T, current: T) -> T:
        """``updated`` where no gradient was inf or NaN, else ``current``: the step GradScaler skips.

        Leaf by leaf ``torch.where(found_inf != 0, current, updated)``, so
        the choice is made on the device, without a host read; the trees
        (parameters, optimizer state) must have one structure. Non-tensor
        leaves come from ``updated``. An eager loop may instead skip the
        optimizer in Python: ``if not found_inf.item(): ...``.

        >>> scaler = fr.GradScaler()
        >>> scaler.step(torch.tensor(1.0), {"w": torch.tensor([9.0])}, {"w": torch.tensor([1.0])})
        {'w': tensor([1.])}

        Args:
            found_inf: the flag ``unscale`` returned.
            updated: the trees after the optimizer's step.
            current: the trees before it.

        Returns:
            A tree of ``updated``'s structure.

        Raises:
            ValueError: ``updated`` and ``current`` differ in structure (naming the path).
        """
        new_leaves, spec = flatten_in_order(updated)
        old_leaves, old_spec = flatten_in_order(current)
        if old_spec != spec:
            from ._tree import structure_difference

            at, mine, theirs = structure_difference(updated, current)
            raise ValueError(
                f"{_NAME}.step: updated and current differ at {at}: {mine} in updated, "
                f"{theirs} in current"
            )
        skip: dict[torch.device, torch.Tensor] = {}
        out = []
        for new, old in zip(new_leaves, old_leaves):
            if isinstance(new, torch.Tensor):
                flag = skip.get(new.device)
                if flag is None:
                    flag = skip[new.device] = found_inf.to(new.device) != 0
                new = torch.where(flag, old, new)
            out.append(new)
        return unflatten(spec, out)  # type: ignore[no-any-return]


def _values(g: torch.Tensor) -> torch.Tensor:
    # what GradScaler checks and unscales: a sparse gradient's stored values
    return g._values() if g.is_sparse else g


def _with_values(g: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    if not g.is_sparse:
        return values
    return torch.sparse_coo_tensor(g._indices(), values, g.shape, is_coalesced=g.is_coalesced())
