"""``check_against_ddp``: a training loop on ``fr.distributed`` against ``DistributedDataParallel``.

On every rank of a ``RankPool``, two copies of the module run the same
phases on the same data: the loop the guide to ``fr.distributed`` writes
(``fr.distributed.sync_buffers``, ``fr.distributed.grad_and_value``, an SGD
update as a new tree), and DDP with ``torch.optim.SGD``. A phase is a
training step, an evaluation forward, or a forward under ``torch.no_grad``.
The buffers are synced where DDP syncs them: before a forward that is the
first, or whose previous forward ran with gradients (DDP's
``require_forward_param_sync``); an evaluation right after training is such
a forward, the training step after an evaluation is not. The ranks send
back what each side computed, and the caller compares: outputs, losses,
gradients, buffers and parameters, phase by phase, naming the rank, the
phase and the path of the first difference.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Literal

import optree
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import freplicate as fr

from ._assertions import assert_trees_close, check_tolerances
from ._oracle import arguments_of as _oracle_arguments
from ._oracle import weighted_loss as _weighted_loss
from ._pool import RankPool

__all__ = ["check_against_ddp"]

Phase = Literal["step", "eval", "no_grad"]
_PHASES = ("step", "eval", "no_grad")
_CALLER = "check_against_ddp"
# DDP options that change both sides: check_against_ddp's own arguments
_OWN = {
    "broadcast_buffers": "sync_buffers",
    "forward_sync_buffers": "sync_buffers",
    "bucket_cap_mb": "bucket_cap_mb",
}
# DDP's name for its buffer sync before a forward (torch 2.13 renamed broadcast_buffers)
_SYNC_OPTION = (
    "forward_sync_buffers"
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
    else "broadcast_buffers"
)


def check_against_ddp(
    module: nn.Module,
    inputs: Sequence[Any],
    *,
    pool: RankPool | None = None,
    phases: Sequence[Phase] = ("step", "step", "eval", "step"),
    lr: float = 0.1,
    loss: Callable[[Any], torch.Tensor] | None = None,
    sync_buffers: bool = True,
    bucket_cap_mb: float = 25.0,
    ddp_options: Mapping[str, Any] | None = None,
    rtol: float | None = None,
    atol: float | None = None,
) -> None:
    """Assert that a loop on ``fr.distributed`` gives DDP's outputs, gradients, buffers, parameters.

    Every rank runs ``phases`` twice from the same module, on its own
    ``inputs[rank]``: once as ``fr.distributed``'s guide writes the loop,
    once with ``DistributedDataParallel`` and ``torch.optim.SGD``. The
    phases:

    - ``"step"``: a training step in the module's own mode: the forward,
      the gradients of ``loss`` of the output averaged over the ranks
      (``fr.distributed.grad_and_value``, against DDP's ``backward``), and an
      SGD update with learning rate ``lr``;
    - ``"eval"``: a forward under ``torch.no_grad`` in eval mode;
    - ``"no_grad"``: a forward under ``torch.no_grad`` in the module's own
      mode (BatchNorm in training mode updates its statistics).

    With ``sync_buffers`` (DDP's default), the functional side calls
    ``fr.distributed.sync_buffers`` before a forward exactly where DDP
    broadcasts rank 0's buffers: before the first forward, and before each
    forward whose previous one was a ``"step"`` (so before an evaluation
    that follows training, and not before the step after it). Dropout and
    other random draws see the same seed on both sides (one per rank and
    phase). The comparison, phase by phase on every rank: the outputs, the
    loss, the gradients of the parameters that require grad (zero where DDP
    leaves ``None``, sparse ones by value), the buffers after the forward
    and the parameters after the update, with ``assert_trees_close(rtol=,
    atol=)``; on CPU the two sides agree to the bit (``rtol=0, atol=0``).
    It also checks that the functional side left the module's tensors and
    the inputs as they were.

    Args:
        module: the module, the same on every rank (it is sent to each); the
            caller's is never modified.
        inputs: one entry per rank: rank ``r``'s inputs, used in every
            phase, as a tuple of positional arguments (a single tensor may be
            given as is; a dict is taken as keyword arguments).
        pool: the ranks to run on, which must number ``len(inputs)``;
            ``None`` starts ``len(inputs)`` ranks for this call alone (seconds:
            give a pool shared by many calls, e.g. a fixture).
        phases: what to run, in order (above).
        lr: the SGD learning rate of both sides.
        loss: the scalar to differentiate, from the module's output; a
            function the ranks can import. Default: every element of every
            floating-point output weighted by a fixed random number, summed.
        sync_buffers: whether buffers are synced before forwards (DDP's
            ``broadcast_buffers``, ``forward_sync_buffers`` since torch 2.13);
            ``False``: on neither side.
        bucket_cap_mb: the bucket size of both sides.
        ddp_options: further keyword arguments of ``DistributedDataParallel``
            (``static_graph=True`` for a reentrant activation checkpoint,
            ...), over ``find_unused_parameters=True``.
        rtol: relative tolerance, given together with ``atol`` (or neither).
        atol: absolute tolerance, given together with ``rtol``.

    Raises:
        AssertionError: the two sides differ (the message names the rank,
            the phase, what differs and its path), or the functional side
            modified the module or the inputs.
        ValueError: ``inputs`` does not hold one entry per rank, an unknown
            phase, one tolerance without the other, or ``ddp_options`` holding
            an option that is an argument of its own.
        TypeError: an argument of the wrong type.
        Exception: whatever a rank raised, as ``RankPool.run`` raises it.

    The module's class, its inputs and ``loss`` travel to the ranks by
    pickling, so they must be importable there (``RankPool.run``).

    >>> model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
    >>> batches = [(torch.randn(4, 3, 8, 8),), (torch.randn(4, 3, 8, 8),)]
    >>> with fr.testing.RankPool(2) as pool:  # doctest: +SKIP
    ...     fr.testing.check_against_ddp(model, batches, pool=pool, rtol=0, atol=0)
    """
    check_tolerances(rtol, atol, _CALLER)
    if not isinstance(module, nn.Module):
        raise TypeError(f"{_CALLER}: module must be an nn.Module, got {type(module).__name__}")
    if not isinstance(inputs, (list, tuple)):
        raise TypeError(
            f"{_CALLER}: inputs must be a list with one entry per rank, got {type(inputs).__name__}"
        )
    for r, entry in enumerate(inputs):
        _arguments(entry, f"inputs[{r}]")
    if pool is not None and not isinstance(pool, RankPool):
        raise TypeError(f"{_CALLER}: pool must be a fr.testing.RankPool, got {type(pool).__name__}")
    if pool is None and not inputs:
        raise ValueError(f"{_CALLER}: inputs must hold one entry per rank, got none")
    if pool is not None and len(inputs) != pool.world_size:
        raise ValueError(
            f"{_CALLER}: inputs must hold one entry per rank: {pool.world_size} for the pool's "
            f"{pool.world_size} ranks, got {len(inputs)}"
        )
    order: list[str] = list(phases)
    for i, phase in enumerate(order):
        if phase not in _PHASES:
            raise ValueError(f"{_CALLER}: phases[{i}] must be one of {_PHASES}, got {phase!r}")
    if isinstance(lr, bool) or not isinstance(lr, (int, float)):
        raise TypeError(f"{_CALLER}: lr must be a number, got {lr!r}")
    options = dict(ddp_options or {})
    for key, own in _OWN.items():
        if key in options:
            raise ValueError(
                f"{_CALLER}: ddp_options must not hold {key!r}: pass {own}= to "
                f"{_CALLER} itself, which sets it on both sides"
            )
    setup = {
        "phases": order,
        "lr": float(lr),
        "loss": loss,
        "sync_buffers": bool(sync_buffers),
        "bucket_cap_mb": bucket_cap_mb,
        "ddp_options": {"find_unused_parameters": True, **options},
    }
    if pool is None:
        with RankPool(len(inputs)) as ranks:
            results = ranks.run(_on_rank, module, list(inputs), setup)
    else:
        results = pool.run(_on_rank, module, list(inputs), setup)
    _compare(results, order, rtol, atol)


def _arguments(inputs: Any, where: str) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(args, kwargs)`` from what ``check_against_stateful`` takes, as it reads them."""
    try:
        return _oracle_arguments(inputs)
    except TypeError:
        raise TypeError(
            f"{_CALLER}: {where} must be a tuple of positional arguments, a tensor, or a dict of "
            f"keyword arguments, got {type(inputs).__name__}"
        ) from None


def _compare(results: list[dict[str, Any]], phases: list[str], rtol: Any, atol: Any) -> None:
    for rank, got in enumerate(results):
        if got["modified"]:
            raise AssertionError(
                f"{_CALLER}: on rank {rank}, the fr.distributed loop modified {got['modified']}"
            )
    for i, phase in enumerate(phases):
        for rank, got in enumerate(results):
            ours, theirs = got["fr"][i], got["ddp"][i]
            for what in ("outputs", "loss", "gradients", "buffers", "parameters"):
                if what not in theirs:
                    continue
                try:
                    assert_trees_close(ours[what], theirs[what], rtol=rtol, atol=atol)
                except AssertionError as err:
                    raise AssertionError(
                        f"{_CALLER}: {what} of the fr.distributed loop differ from DDP's on rank "
                        f"{rank}, phases[{i}] ({phase!r}): {err}"
                    ) from None


# --- the rank side


def _on_rank(module: nn.Module, inputs: list[Any], setup: dict[str, Any]) -> dict[str, Any]:
    """Both sides' phases on this rank; what each computed, detached, phase by phase."""
    rank = dist.get_rank()
    args, kwargs = _arguments(inputs[rank], f"inputs[{rank}]")
    before = _snapshot(module, inputs[rank], f"inputs[{rank}]")
    ddp = _DDPSide(*copy.deepcopy((module, args, kwargs)), setup)  # a module and inputs of its own
    ours = _FunctionalSide(module, args, kwargs, setup)
    fr_phases, ddp_phases = [], []
    for i, phase in enumerate(setup["phases"]):
        seed = 10_007 * rank + i  # dropout draws alike on both sides, unlike across ranks
        ddp_phases.append(ddp.run(phase, seed))
        fr_phases.append(ours.run(phase, seed))
    return {"fr": fr_phases, "ddp": ddp_phases, "modified": _modified(before)}


def _loss_of(setup: dict[str, Any], out: Any) -> torch.Tensor:
    value = setup["loss"](out) if setup["loss"] is not None else _weighted_loss(out)
    if not isinstance(value, torch.Tensor):
        raise ValueError(
            f"{_CALLER}: the module's output holds no floating-point tensor to differentiate; "
            "pass loss="
        )
    return value


class _Side:
    """One side: its module and inputs; ``run(phase, seed)`` gives what it computed."""

    def __init__(
        self,
        module: nn.Module,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        setup: dict[str, Any],
    ) -> None:
        self.module, self.args, self.kwargs, self.setup = module, args, kwargs, setup
        self.training = module.training
        self.start()

    def start(self) -> None:
        """The side's own set-up, before its first phase."""

    @contextlib.contextmanager
    def _phase(self, phase: str, seed: int) -> Iterator[None]:
        """One forward: eval mode for ``"eval"``, gradients for ``"step"`` only, the seed drawn."""
        self.module.train(self.training and phase != "eval")
        torch.manual_seed(seed)
        try:
            with torch.set_grad_enabled(phase == "step"):
                yield
        finally:
            self.module.train(self.training)


class _DDPSide(_Side):
    """DDP and ``torch.optim.SGD`` (on a deep copy of the module and the inputs)."""

    def start(self) -> None:
        self.ddp = DistributedDataParallel(
            self.module,
            bucket_cap_mb=self.setup["bucket_cap_mb"],
            **{_SYNC_OPTION: self.setup["sync_buffers"]},
            **self.setup["ddp_options"],
        )
        trainable = [p for p in self.module.parameters() if p.requires_grad]
        self.optimizer = torch.optim.SGD(trainable, lr=self.setup["lr"], foreach=False)

    def run(self, phase: str, seed: int) -> dict[str, Any]:
        with self._phase(phase, seed):
            out = self.ddp(*self.args, **self.kwargs)  # DDP syncs the buffers where it does
        got = {"outputs": _copied(out), "buffers": _copied(dict(self.module.named_buffers()))}
        if phase != "step":
            return got
        value = _loss_of(self.setup, out)
        value.backward()
        got["loss"] = value.detach()
        got["gradients"] = {
            name: _copied(p.grad) if p.grad is not None else torch.zeros_like(p)
            for name, p in self.module.named_parameters()
            if p.requires_grad
        }
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        got["parameters"] = _copied(dict(self.module.named_parameters()))
        return got


class _FunctionalSide(_Side):
    """The loop of fr.distributed's guide: sync_buffers, grad_and_value, a new parameter tree."""

    def start(self) -> None:
        state = fr.state(self.module)
        self.trainable, self.frozen = fr.partition(state.params, self.module)
        self.buffers = state.buffers
        self.sync_next = self.setup["sync_buffers"]  # DDP syncs before its first forward
        self.step = fr.distributed.grad_and_value(
            self._loss, has_aux=True, bucket_cap_mb=self.setup["bucket_cap_mb"]
        )

    def _loss(self, trainable: dict[str, torch.Tensor], buffers: Any) -> Any:
        out, new = self._apply(trainable, buffers)
        return _loss_of(self.setup, out), (out, new.buffers)

    def _apply(self, trainable: dict[str, torch.Tensor], buffers: Any) -> Any:
        state = fr.State(fr.combine(trainable, self.frozen), buffers)
        return fr.apply(self.module, state, *self.args, **self.kwargs)

    def run(self, phase: str, seed: int) -> dict[str, Any]:
        if self.sync_next:
            self.buffers = fr.distributed.sync_buffers(self.buffers)
        # DDP's rule: the forward after one that ran with gradients syncs, any other does not
        self.sync_next = self.setup["sync_buffers"] and phase == "step"
        with self._phase(phase, seed):
            if phase != "step":
                out, new = self._apply(self.trainable, self.buffers)
                self.buffers = new.buffers
                return {"outputs": _copied(out), "buffers": _copied(dict(self.buffers))}
            grads, (value, (out, self.buffers)) = self.step(self.trainable, self.buffers)
        lr = self.setup["lr"]
        # torch.optim.SGD's own update, p.add_(g, alpha=-lr), out of place
        self.trainable = {k: torch.add(p, grads[k], alpha=-lr) for k, p in self.trainable.items()}
        return {
            "outputs": _copied(out),
            "buffers": _copied(dict(self.buffers)),
            "loss": value.detach(),
            "gradients": _copied(grads),
            "parameters": _copied(fr.combine(self.trainable, self.frozen)),
        }


def _dense(t: torch.Tensor) -> torch.Tensor:
    return t.to_dense() if t.is_sparse else t


def _copied(tree: Any) -> Any:
    """Detached copies of the tensor leaves: DDP's module updates its own in place later."""
    return optree.tree_map(
        lambda x: _dense(x.detach()).clone() if isinstance(x, torch.Tensor) else x, tree
    )


def _snapshot(
    module: nn.Module, inputs: Any, name: str
) -> list[tuple[str, torch.Tensor, int, torch.Tensor]]:
    found = [
        (f"the module's {key!r}", t)
        for key, t in (*module.named_parameters(), *module.named_buffers())
    ]
    accessors, leaves, _ = optree.tree_flatten_with_accessor(inputs)
    found += [(a.codify(name), t) for a, t in zip(accessors, leaves) if isinstance(t, torch.Tensor)]
    return [(what, t, t._version, _copied(t)) for what, t in found]


def _modified(before: list[tuple[str, torch.Tensor, int, torch.Tensor]]) -> list[str]:
    return [
        what
        for what, t, version, value in before
        if t._version != version or not torch.equal(_dense(t.detach()), value)
    ]
