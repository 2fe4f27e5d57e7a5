"""Every private PyTorch API freplicate uses, each behind a fallback.

PyTorch may move or change these between releases. Each is looked up once,
here; where it is missing or its signature changed, freplicate takes a
slower public path instead of failing at import or on every call, or,
where no public path gives the same answer, raises an error that names what
is missing at the point of use (never a silently different result).
``FAST_PATHS`` says which are on, and a test asserts that all of them are on
the pinned torch (so a fast path never goes silently off); another takes
each away in turn and checks its fallback.

Nothing of the compiler is imported here: the traced collectives and
Dynamo's helpers are looked up on first use, while ``torch.compile`` traces.
"""

from __future__ import annotations

import operator
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = [
    "any_requires_grad",
    "COMPILED_CALL",
    "FAST_PATHS",
    "assume_constant_result",
    "aten_op",
    "chunk_cat",
    "compiled_module",
    "engine_grad",
    "foreach_add",
    "foreach_add_",
    "foreach_div_",
    "foreach_mul",
    "foreach_norm",
    "foreach_supported",
    "functional_collectives",
    "graph_break",
    "group_store",
    "groups_by_device_and_dtype",
    "is_compiling",
    "holds_reentrant_checkpoint",
    "is_reentrant_checkpoint",
    "leaves_outside",
    "optimized_module_class",
    "resolve_group",
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


def _any_level() -> int | None:  # pragma: no cover - only on a torch that moved the accessor
    return -1


#: The innermost ``torch.func`` transform's level, or ``None`` outside every transform: torch's
#: own accessor (a C function: no Python frame on the hot path). Without it, assume a transform
#: may be active (``-1``): every caller then takes its transform-safe path, slower but right.
transform_level: Callable[[], int | None] = (
    _any_level if _maybe_current_level is None else _maybe_current_level
)


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


# --- the foreach kernels (one fused pass over a list of tensors) ---
_any_requires_grad = getattr(torch._C, "_any_requires_grad", None)
_REQUIRES_GRAD = operator.attrgetter("requires_grad")


def any_requires_grad(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether any of ``tensors`` requires grad (in C where torch has it: a collective's check).

    >>> any_requires_grad([torch.zeros(1), torch.zeros(1, requires_grad=True)])
    True
    """
    if _any_requires_grad is not None and type(tensors) is list:
        return bool(_any_requires_grad(tensors))
    return any(map(_REQUIRES_GRAD, tensors))


_foreach_add = getattr(torch, "_foreach_add", None)
_foreach_add_ = getattr(torch, "_foreach_add_", None)
_foreach_mul = getattr(torch, "_foreach_mul", None)
_foreach_div_ = getattr(torch, "_foreach_div_", None)
FAST_PATHS["foreach"] = None not in (_foreach_add, _foreach_add_, _foreach_mul, _foreach_div_)


def foreach_add(
    a: Sequence[torch.Tensor], b: Sequence[torch.Tensor], *, alpha: float = 1
) -> list[torch.Tensor]:
    """``[x + alpha * y for x, y in zip(a, b)]``, in one fused pass where torch has it.

    ``alpha=1`` is not passed on: integer tensors refuse a float one.
    """
    kw: dict[str, Any] = {} if alpha == 1 else {"alpha": alpha}
    if _foreach_add is not None:
        return list(_foreach_add(list(a), list(b), **kw))
    return [torch.add(x, y, **kw) for x, y in zip(a, b)]


def foreach_add_(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor], *, alpha: float = 1) -> None:
    """``x.add_(y, alpha=alpha)`` for each pair (``a`` holds the caller's own tensors)."""
    kw: dict[str, Any] = {} if alpha == 1 else {"alpha": alpha}
    if _foreach_add_ is not None:
        _foreach_add_(list(a), list(b), **kw)
        return
    for x, y in zip(a, b):
        x.add_(y, **kw)


def foreach_div_(a: Sequence[torch.Tensor], scalar: float) -> None:
    """``x.div_(scalar)`` for each (``a`` holds the caller's own tensors)."""
    if _foreach_div_ is not None:
        _foreach_div_(list(a), scalar)
        return
    for x in a:
        x.div_(scalar)


def foreach_mul(a: Sequence[torch.Tensor], scalar: Any) -> list[torch.Tensor]:
    """``[x * scalar for x in a]``, in one fused pass where torch has it."""
    if _foreach_mul is not None:
        return list(_foreach_mul(list(a), scalar))
    return [x * scalar for x in a]


# --- clip_grad_norm_'s groups and norms, in torch's own order ---
try:
    from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype as _group
    from torch.utils._foreach_utils import _has_foreach_support as _foreach_ok
except ImportError:  # pragma: no cover - only on a torch that moved them
    _group = _foreach_ok = None  # type: ignore[assignment]
_foreach_norm = getattr(torch, "_foreach_norm", None)
FAST_PATHS["clip_groups"] = _group is not None and _foreach_ok is not None
FAST_PATHS["foreach_norm"] = _foreach_norm is not None


def groups_by_device_and_dtype(
    tensors: Sequence[torch.Tensor],
) -> list[tuple[list[torch.Tensor], list[int]]]:
    """``tensors`` split by (device, dtype), with their positions, in torch's order of groups.

    ``clip_grad_norm_`` sums the groups' norms in that order (a C++ hash
    map's). The fallback takes them in order of first appearance: the same
    norms, and with a single (device, dtype), the same total; with several,
    its last bit may differ from torch's.
    """
    if _group is not None:
        found = _group([list(tensors)], True).values()
        return [(list(lists[0]), list(idx)) for lists, idx in found]  # type: ignore[misc, arg-type]
    by: dict[tuple[torch.device, torch.dtype], tuple[list[torch.Tensor], list[int]]] = {}
    for k, t in enumerate(tensors):
        group = by.setdefault((t.device, t.dtype), ([], []))
        group[0].append(t)
        group[1].append(k)
    return list(by.values())


def foreach_supported(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether torch's foreach kernels take ``tensors`` (``clip_grad_norm_``'s own test)."""
    return _foreach_ok is not None and bool(_foreach_ok(list(tensors), tensors[0].device))


def foreach_norm(tensors: Sequence[torch.Tensor], p: float) -> list[torch.Tensor]:
    """The ``p``-norm of each tensor (``torch._foreach_norm``; ``vector_norm`` one by one else)."""
    if _foreach_norm is not None:
        return list(_foreach_norm(list(tensors), p))
    return [torch.linalg.vector_norm(t, p) for t in tensors]


def aten_op(name: str, caller: str) -> Any:
    """``torch.ops.aten.<name>`` (GradScaler's kernels), or an error naming it and ``caller``."""
    op = getattr(torch.ops.aten, name, None)
    if op is None:
        raise RuntimeError(f"{caller}: this torch has no torch.ops.aten.{name}, which GradScaler uses")
    return op


# --- FSDP2's copy-in: tensors cut into row chunks, one per rank, laid out rank-major ---
_chunk_cat = getattr(torch, "_chunk_cat", None)
FAST_PATHS["chunk_cat"] = _chunk_cat is not None


def chunk_cat(tensors: Sequence[torch.Tensor], num_chunks: int, out: torch.Tensor) -> None:
    """Write ``tensors`` into ``out`` (``num_chunks`` rows) as ``torch._chunk_cat(dim=0)`` does.

    Each tensor is padded with zero rows to a multiple of ``num_chunks``, cut
    into ``num_chunks`` equal chunks of rows, and row ``r`` of ``out`` is the
    concatenation of every tensor's chunk ``r``, flattened (FSDP2's copy-in
    of a reduce-scatter), cast to ``out``'s dtype. The fallback does the same
    with ``pad`` and ``copy_``.

    >>> out = torch.empty(2, 3)
    >>> chunk_cat([torch.arange(3.0), torch.tensor([[7.0], [8.0]])], 2, out)
    >>> out
    tensor([[0., 1., 7.],
            [2., 0., 8.]])
    """
    tensors = [t for t in tensors if t.numel()]  # an empty tensor has no rows in any chunk
    if not tensors:
        return
    if _chunk_cat is not None and all(t.dtype == out.dtype for t in tensors):
        _chunk_cat(tensors, 0, num_chunks, out=out)
        return
    start = 0  # the fallback, which also casts (booleans travel as uint8)
    for t in tensors:
        rows = t.shape[0]
        c = -(-rows // num_chunks)
        flat = t.reshape(rows, -1)
        padded = torch.nn.functional.pad(flat, (0, 0, 0, c * num_chunks - rows))
        width = c * flat.shape[1]
        out[:, start : start + width].copy_(padded.reshape(num_chunks, width))
        start += width


# --- activation checkpointing: does a graph hold a reentrant checkpoint's node? ---
try:
    from torch.autograd.function import BackwardCFunction as _PythonNode
except ImportError:  # pragma: no cover - only on a torch that moved it
    _PythonNode = None  # type: ignore[assignment, misc]
try:
    from torch.utils.checkpoint import CheckpointFunction as _CheckpointFunction
except ImportError:  # pragma: no cover - only on a torch that moved it
    _CheckpointFunction = None  # type: ignore[assignment, misc]
FAST_PATHS["reentrant_checkpoint"] = _CheckpointFunction is not None and _PythonNode is not None


def _python_node(node: Any) -> bool:
    """Whether ``node`` is a custom ``autograd.Function``'s (a Python-defined node)."""
    if _PythonNode is not None:
        return isinstance(node, _PythonNode)
    return getattr(node, "_forward_cls", None) is not None  # pragma: no cover


def is_reentrant_checkpoint(node: Any) -> bool:
    """Whether ``node`` is the backward node of a ``use_reentrant=True`` checkpoint.

    Raises ``RuntimeError`` at the point of use where this torch has no
    ``CheckpointFunction`` to compare with: a reentrant checkpoint that fr
    could not see would leave its parameters without their gradients.
    """
    if not _python_node(node):
        return False
    cls = getattr(node, "_forward_cls", None)
    if _CheckpointFunction is None:
        raise RuntimeError(
            "freplicate cannot tell whether the custom autograd Function in fn's graph "
            f"({getattr(cls, '__name__', node)}) is a reentrant activation checkpoint: this "
            "torch has no torch.utils.checkpoint.CheckpointFunction; use "
            "torch.func.grad_and_value, or a torch freplicate supports"
        )
    return isinstance(cls, type) and issubclass(cls, _CheckpointFunction)


def holds_reentrant_checkpoint(value: torch.Tensor) -> bool:
    """Whether ``value``'s autograd graph holds a reentrant checkpoint's node, by type.

    One walk of the graph (about 0.13 us a node). Every call decides on its
    own graph: a function whose forward checkpoints differently from call
    to call is seen as it is each time.
    """
    root = value.grad_fn
    if root is None:
        return False
    seen: set[Any] = {None, root}  # None: an input that needs no gradient
    todo: list[Any] = [root]
    add, push = seen.add, todo.append
    kind = _PythonNode
    for node in todo:  # (it grows as it goes: each node once, without pops: see docs/benchmarks.md)
        python = isinstance(node, kind) if kind is not None else _python_node(node)
        if python and is_reentrant_checkpoint(node):
            return True
        for nxt, _ in node.next_functions:
            if nxt not in seen:
                add(nxt)
                push(nxt)
    return False


def leaves_outside(value: torch.Tensor, ours: Sequence[torch.Tensor]) -> int:
    """How many leaves of ``value``'s graph that require grad are not among ``ours``.

    Read from each ``AccumulateGrad`` node's ``variable``: the tensors whose
    ``.grad`` a full backward would write. (Tensors used only inside a
    reentrant checkpoint are not in this graph: it recomputes its own.)
    """
    mine = {id(t) for t in ours}
    root = value.grad_fn
    seen = {root}
    stack = [root]
    others = 0
    while stack:
        node = stack.pop()
        if node is None:
            continue
        variable = getattr(node, "variable", None)
        if isinstance(variable, torch.Tensor) and id(variable) not in mine:
            others += 1
        for nxt, _ in node.next_functions:
            if nxt is not None and nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    return others


# --- what the traced path of fr.distributed needs, loaded while Dynamo traces ---


def functional_collectives() -> Any:
    """``torch.ops._c10d_functional``, the traceable collectives, with their Python side loaded.

    Imported on first use (it pulls in DTensor): never at ``import freplicate``.
    """
    try:
        import torch.distributed._functional_collectives
    except ImportError as err:  # pragma: no cover - only on a torch without them
        raise RuntimeError(
            "fr.distributed under torch.compile needs torch's functional collectives "
            "(torch.distributed._functional_collectives), which this torch build lacks; "
            "run the step eagerly"
        ) from err
    return torch.ops._c10d_functional


def resolve_group(name: str) -> Any:
    """The process group named ``name`` (the traced layout check runs on names, not objects)."""
    import torch.distributed as dist

    world = dist.group.WORLD
    if world is not None and name == world.group_name:
        return world
    from torch.distributed import distributed_c10d

    resolve = getattr(distributed_c10d, "_resolve_process_group", None)
    if resolve is None:  # pragma: no cover - only on a torch that moved it
        raise RuntimeError(
            f"fr.distributed under torch.compile: cannot find process group {name!r} "
            "(torch.distributed's _resolve_process_group is missing); compile with the "
            "default group or run the step eagerly"
        )
    return resolve(name)


def group_store(group: Any) -> Any | None:
    """The store of ``group``, or ``None`` where torch cannot tell (a collective is used then)."""
    from torch.distributed import distributed_c10d

    get = getattr(distributed_c10d, "_get_process_group_store", None)
    return None if get is None else get(group)


def assume_constant_result(fn: Any) -> Any:
    """``torch.compiler.assume_constant_result(fn)``, without importing Dynamo.

    Dynamo then runs ``fn`` for real on the constants it traced and bakes
    its answer into the graph. The public decorator imports Dynamo (seconds,
    at ``import freplicate``), and, called while tracing, would be a side
    effect Dynamo defers past the call; it only sets this attribute, which a
    test checks it still does.
    """
    fn._dynamo_marked_constant = True
    return fn


def graph_break(message: str) -> None:
    """End the traced graph here with ``message`` (Dynamo's error under ``fullgraph=True``)."""
    import torch._dynamo

    brk = getattr(torch._dynamo, "graph_break", None)
    if brk is not None:
        brk(msg=message)


def is_compiling() -> bool:
    """True while Dynamo traces: public functions then take their traceable twins.

    A function of ours, not an alias of torch's: called from inside a
    ``torch.func`` transform that Dynamo traces, torch's own answers False
    where this one answers True (measured on torch 2.13; the refusal of
    collectives inside compiled transforms depends on it).
    """
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
