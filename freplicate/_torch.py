"""Every private PyTorch API freplicate uses, each behind a fallback.

PyTorch may move or change these between releases. Each is looked up once,
here; where it is missing or its signature changed, freplicate takes a
slower public path instead of failing at import or on every call.
``FAST_PATHS`` says which are on, and a test asserts that all of them are on
the pinned torch (so a fast path never goes silently off).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = [
    "COMPILED_CALL",
    "FAST_PATHS",
    "compiled_module",
    "engine_grad",
    "is_compiling",
    "storage_use_count",
    "transform_level",
]

FAST_PATHS: dict[str, bool] = {}

# --- the current torch.func transform level (None outside every transform) ---
try:
    from torch._C._functorch import maybe_current_level as _maybe_current_level

    FAST_PATHS["maybe_current_level"] = True
except ImportError:  # pragma: no cover - only on a torch that moved it
    _maybe_current_level = None  # type: ignore[assignment]
    FAST_PATHS["maybe_current_level"] = False


def transform_level() -> int | None:
    """The innermost ``torch.func`` transform's level, or ``None`` outside every transform.

    Without the private accessor, assume a transform may be active (``-1``):
    every caller then takes its transform-safe path, slower but right.
    """
    if _maybe_current_level is None:  # pragma: no cover
        return -1
    return _maybe_current_level()  # type: ignore[no-any-return]


# --- torch.autograd.grad's own call into the engine, without its per-input checks ---
_run_backward = getattr(torch.autograd.graph, "_engine_run_backward", None)
FAST_PATHS["engine_run_backward"] = _run_backward is not None


def engine_grad(value: torch.Tensor, leaves: Sequence[torch.Tensor]) -> tuple[Any, ...]:
    """``torch.autograd.grad(value, leaves, allow_unused=True)``, through the engine directly.

    ``value`` is a real scalar and ``leaves`` the caller's own fresh tensors.
    The first ``TypeError`` (a changed private signature) turns the fast
    path off for the process and answers through ``torch.autograd.grad``.
    """
    global _run_backward
    if _run_backward is not None:
        try:
            return _run_backward(  # type: ignore[no-any-return]
                (value,),
                (torch.ones_like(value, memory_format=torch.preserve_format),),
                False,  # retain_graph
                False,  # create_graph
                tuple(leaves),
                True,  # allow_unused
                accumulate_grad=False,
            )
        except TypeError:
            _run_backward = None
            FAST_PATHS["engine_run_backward"] = False
    return torch.autograd.grad(value, leaves, allow_unused=True)


# --- how many tensors share a storage (fr.distributed's pooled buffers) ---
_use_count = getattr(torch._C, "_storage_Use_Count", None)
FAST_PATHS["storage_use_count"] = _use_count is not None and hasattr(torch.UntypedStorage, "_cdata")


def storage_use_count(t: torch.Tensor) -> int | None:
    """How many references hold ``t``'s storage, or ``None`` where torch cannot tell.

    ``None`` makes a pool keep nothing (every call allocates afresh): never
    a buffer reused while a result still views it.
    """
    if not FAST_PATHS["storage_use_count"]:
        return None
    try:
        return _use_count(t.untyped_storage()._cdata)  # type: ignore[misc, no-any-return]
    except (TypeError, AttributeError, RuntimeError):  # pragma: no cover
        FAST_PATHS["storage_use_count"] = False
        return None


def is_compiling() -> bool:
    """True while Dynamo traces: public functions then take their traceable twins."""
    return torch.compiler.is_compiling()


# ======================================================================================
# fr.apply's view of compiled modules (issue 16 item 5, issue 19). Kept at the end of the
# file, apart from the engine's entries above.
# ======================================================================================

# --- torch.compile(module): an OptimizedModule around the module, whose compiled code is a
# closure over that very module (a copy of the wrapper would run on the original's tensors)


def optimized_module_class() -> type[torch.nn.Module] | None:
    """``torch.compile(module)``'s wrapper class, or ``None`` where this process has none."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    return getattr(eval_frame, "OptimizedModule", None)


def compiled_module(module: torch.nn.Module) -> tuple[torch.nn.Module, Callable[[Any], Any]] | None:
    """For ``torch.compile(m)``: ``(m, wrap)``, ``wrap(copy)`` compiling ``copy`` as ``m`` is; else ``None``.

    ``torch._dynamo`` is never imported here: a process that has not loaded
    it has compiled nothing. Where torch no longer has ``OptimizedModule``
    under its known name, this answers ``None``, and ``fr.apply`` refuses
    the wrapper with a clear error (its instance-level ``forward`` is the
    sign) rather than running it on the module's own tensors.
    """
    optimized = optimized_module_class()
    if optimized is None or not isinstance(module, optimized):
        return None
    inner, ctx = module.__dict__["_modules"].get("_orig_mod"), module.__dict__.get("dynamo_ctx")
    if (
        not isinstance(inner, torch.nn.Module) or ctx is None
    ):  # pragma: no cover - a changed wrapper
        return None
    return inner, lambda copy: optimized(copy, ctx)


# --- module.compile(): ``torch.compile(self._call_impl)`` stored in this instance attribute, a
# wrapper of the original's bound method (a copy must not call it). Under another name (a torch
# that renamed it), fr.apply refuses the module with a clear error instead of dropping it: every
# instance attribute that wraps a method bound to its own module is refused unless it is this one.
COMPILED_CALL = "_compiled_call_impl"
