"""Mixed precision as FSDP2 has it: ``MixedPrecisionPolicy`` read once, its casts in one place.

``apply_sharded`` and the ZeRO-2 step take FSDP2's own policy object
(``torch.distributed.fsdp.MixedPrecisionPolicy``), with its meaning:

* ``param_dtype``: the parameters are cast to it before they are gathered
  (the wire carries it) and the forward computes in it; the shards, and the
  optimizer that updates them, keep their own dtype;
* ``reduce_dtype``: the gradients are cast to it before they are reduced
  (``None``: reduced in ``param_dtype``), and reach the shards in the shards'
  own dtype;
* ``output_dtype``: the forward's floating-point outputs are cast to it;
* ``cast_forward_inputs``: the forward's floating-point inputs are cast to
  ``param_dtype``.

A cast is ``Tensor.to`` (differentiable: the gradient of a cast is the
cast back), of floating-point tensors only, as FSDP2's ``_cast_fp_tensor``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import optree
import torch
import torch.utils._pytree as pytree

from .._tree import NAMESPACE, describe

__all__ = [
    "Precision",
    "around",
    "cast",
    "cast_inputs",
    "cast_output",
    "precision_of",
    "wire_compress",
]


class Precision(NamedTuple):
    """A checked ``MixedPrecisionPolicy``: the dtypes (``None``: unchanged)."""

    param: torch.dtype | None
    reduce: torch.dtype | None
    output: torch.dtype | None
    inputs: bool  # cast the forward's floating-point inputs to ``param``

    @property
    def wire(self) -> torch.dtype | None:
        """The dtype the gradients are reduced in (``reduce_dtype``, else ``param_dtype``)."""
        return self.reduce if self.reduce is not None else self.param


def precision_of(caller: str, mp_policy: Any) -> Precision | None:
    """``mp_policy`` checked: ``None`` for no policy (or one that changes nothing).

    Raises:
        TypeError: ``mp_policy`` is not a ``MixedPrecisionPolicy``.
        ValueError: a dtype that is not floating point.
    """
    if mp_policy is None:
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy  # only where a policy is given

    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(
            f"{caller}: mp_policy must be a torch.distributed.fsdp.MixedPrecisionPolicy "
            f"(FSDP2's) or None, got {describe(mp_policy)}"
        )
    for field in ("param_dtype", "reduce_dtype", "output_dtype"):
        dtype = getattr(mp_policy, field)
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(
                f"{caller}: mp_policy.{field} must be a floating-point torch.dtype or None, "
                f"got {dtype!r}"
            )
    precision = Precision(
        mp_policy.param_dtype,
        mp_policy.reduce_dtype,
        mp_policy.output_dtype,
        bool(mp_policy.cast_forward_inputs),
    )
    if precision.param is None and precision.reduce is None and precision.output is None:
        return None
    return precision


def cast(t: Any, dtype: torch.dtype | None) -> Any:
    """``t`` in ``dtype`` when it is a floating-point tensor of another dtype; else ``t``."""
    if dtype is None or not isinstance(t, torch.Tensor) or not t.is_floating_point():
        return t
    return t if t.dtype == dtype else t.to(dtype)


def cast_inputs(precision: Precision | None, args: Any, kwargs: Any) -> tuple[Any, Any]:
    """A forward's arguments as the policy has them (floating-point ones in ``param_dtype``)."""
    if precision is None or not precision.inputs or precision.param is None:
        return args, kwargs
    dtype = precision.param
    return pytree.tree_map(lambda t: cast(t, dtype), (args, kwargs))  # type: ignore[no-any-return]


def cast_output(precision: Precision | None, out: Any) -> Any:
    """A forward's output as the policy has it (floating-point tensors in ``output_dtype``)."""
    if precision is None or precision.output is None:
        return out
    dtype = precision.output
    return pytree.tree_map(lambda t: cast(t, dtype), out)


def around(fn: Callable[..., Any], precision: Precision, argnums: int) -> Callable[..., Any]:
    """``fn`` with its differentiated argument (``argnums``) in ``param_dtype``: a cast in the
    graph, so that each gradient comes back in its leaf's own dtype. Its other arguments are
    left as they are: a step cannot tell a module's inputs from a loss's targets."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        n = argnums + len(args) if argnums < 0 else argnums
        if not 0 <= n < len(args):
            return fn(*args, **kwargs)  # the differentiation names the bad argnums
        tree = optree.tree_map(lambda t: cast(t, precision.param), args[n], namespace=NAMESPACE)
        return fn(*args[:n], tree, *args[n + 1 :], **kwargs)

    return run


def wire_compress(caller: str, precision: Precision | None, compress: Any) -> Any:
    """The step's ``compress`` (its buckets' dtype on the wire) that sends the policy's
    ``reduce_dtype`` (else ``param_dtype``): float32 gradients sent as they are.

    Raises:
        ValueError: both ``compress`` and a policy that reduces in a dtype of its own; a
            reduce dtype the step cannot send; an ``output_dtype`` (a step has no module).
    """
    if precision is None:
        return compress
    if precision.output is not None:
        raise ValueError(
            f"{caller}: mp_policy.output_dtype casts a module's outputs; a step has no module "
            "(cast fn's output in fn, or give output_dtype to apply_sharded)"
        )
    names = {torch.float32: None, torch.bfloat16: "bf16", torch.float16: "fp16"}
    wire = precision.wire
    if wire is None:
        return compress
    if wire not in names:
        raise ValueError(
            f"{caller}: mp_policy reduces in {wire}; a step reduces float32 gradients in "
            "torch.float32, torch.bfloat16 or torch.float16"
        )
    if compress is not None and names[wire] != compress:
        raise ValueError(
            f"{caller}: give compress={compress!r} or an mp_policy that reduces in {wire}, "
            "not both: each says the dtype the gradients travel in"
        )
    return names[wire]
