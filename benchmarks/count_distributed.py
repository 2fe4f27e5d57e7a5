"""Counts, not times: what one warm training step sends and waits on, on 2 gloo ranks, per rank.

Run ``.venv/bin/python -m benchmarks.count_distributed`` (``--json PATH`` to
keep every figure; ``--rows dp all_reduce llama_dp zero3`` for some rows;
``--pkg DIR`` to count another copy of freplicate: DIR is put first on the
ranks' ``sys.path``, e.g. after ``git archive HEAD freplicate | tar -x -C
/tmp/fr_before``, ``--pkg /tmp/fr_before``). Two ranks are spawned on
127.0.0.1 (``_common.on_two_ranks``: gloo, one thread each, rank r pinned
to core r unless ``--no-pin``). Each side runs ``--warmup`` steps (3), then
``--steps`` measured steps (2), whose counts are averaged (a count that
differs between them is marked ``~``). Between steps, outside what is
counted, each side applies an SGD update (new parameter tensors, as a
training loop makes) and sets gradients to ``None``.

The rows, each a freplicate side beside torch's:

- ``dp``: ``fr.distributed.grad_and_value`` of ``F.cross_entropy(fr.apply(model, ...))``
  beside ``DistributedDataParallel`` forward + backward, on small_mlp, mid_mlp, many_small;
- ``all_reduce``: ``fr.distributed.all_reduce`` of the 400-leaf tree of many_small's
  parameters (bench_distributed's case) beside one flat ``dist.all_reduce`` of as many elements;
- ``llama_dp``: the same DP step on a small random ``LlamaForCausalLM`` (no download),
  with all parameters trained, and with the token embedding frozen (``fr.partition``; DDP:
  ``requires_grad_(False)``); DDP with ``broadcast_buffers=False`` (fr syncs no buffer);
- ``zero3``: ``fr.grad_and_value`` of a loss through ``fr.distributed.apply_sharded`` with each
  decoder layer a unit beside FSDP2 (``fully_shard`` on each decoder layer, then the root),
  forward + backward of the causal-LM loss; again with the token embedding frozen.

The Llama rows need ``transformers`` (skipped with a line when it is missing).

What is counted in the measured step (the step's own code and everything it calls):

- collectives: calls of ``torch.distributed``'s collectives (all_reduce,
  all_gather_into_tensor / all_gather_single, reduce_scatter_tensor / reduce_scatter_single,
  broadcast, all_gather, all_to_all, barrier, the object collectives, ``_broadcast_coalesced``,
  ...) and of eager ``torch.ops._c10d_functional`` ones, the outermost call only (an
  ``all_gather_object`` is one, not the all_gathers it makes). DDP's reducer launches its
  bucket all-reduces in C++: its row takes them from the reducer's buckets
  (``reducer._get_zeros_like_grad_buckets()``: one all-reduce a bucket a step); the row
  ``DDP + allreduce_hook`` registers torch's default ``allreduce_hook`` (Python), whose
  ``dist.all_reduce`` calls are counted as any other's, as a check;
- elements: ``in``, the elements of the tensors the rank hands in (``all_reduce``: the
  tensor, an all-gather: its shard, a reduce-scatter: the full input); ``full``, the larger
  of what goes in and what comes out (an all-gather: the gathered tensor);
- waits: calls of ``Work.wait`` (a blocking collective waits inside: one wait),
  ``Future.wait`` and ``_c10d_functional.wait_tensor`` from Python; DDP's reducer waits on its
  buckets in C++, unseen here;
- host reads: ``Tensor.item``, ``tolist``, ``numpy``, ``__bool__``, ``__float__``,
  ``__int__``, ``__index__``, ``__complex__``, ``torch.equal`` / ``allclose`` /
  ``is_nonzero`` called from Python (a read inside an operator's C++ is unseen);
- waits (reads) between launches: those that happen after the step's first collective
  launch and before its last, from the ordered log of launches, waits and reads;
- Python calls: ``sys.setprofile``'s ``call`` events on the rank's main thread (where CPU
  autograd runs the backward and its hooks; a generator's resumption counts as a call),
  less this module's own counting wrappers.
"""

from __future__ import annotations

import argparse
import copy
import inspect
import json
import os
import sys
import threading
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

TITLE = (
    "count_distributed: what one warm step sends, waits on and reads, per rank, on 2 gloo ranks "
    "(counts, not times)"
)
DP_MODELS = ("small_mlp", "mid_mlp", "many_small")
ROWS = ("dp", "all_reduce", "llama_dp", "zero3")
LR = 0.01
# the small Llama: 4 decoder layers, hidden 256, vocabulary 1000 (3.7M parameters, random)
LLAMA: dict[str, Any] = {
    "vocab_size": 1000,
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": 128,
    "tie_word_embeddings": False,
}
LLAMA_BATCH, LLAMA_SEQ = 4, 32
FROZEN = "model.embed_tokens"

# torch.distributed's collectives, by the name the package exports (those that exist are counted)
COLLECTIVES = (
    "all_reduce",
    "all_reduce_coalesced",
    "all_gather",
    "all_gather_coalesced",
    "all_gather_into_tensor",
    "all_gather_single",
    "_all_gather_base",
    "all_gather_object",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "_reduce_scatter_base",
    "broadcast",
    "broadcast_object_list",
    "_broadcast_coalesced",
    "all_to_all",
    "all_to_all_single",
    "reduce",
    "gather",
    "gather_object",
    "scatter",
    "scatter_object_list",
    "barrier",
    "monitored_barrier",
    "send",
    "recv",
    "isend",
    "irecv",
    "batch_isend_irecv",
)
FUNCTIONAL = (
    "all_reduce",
    "all_reduce_coalesced",
    "all_gather_into_tensor",
    "all_gather_into_tensor_coalesced",
    "reduce_scatter_tensor",
    "reduce_scatter_tensor_coalesced",
    "all_to_all_single",
    "broadcast",
)
TENSOR_READS = (
    "item",
    "tolist",
    "numpy",
    "__bool__",
    "__float__",
    "__int__",
    "__index__",
    "__complex__",
    "equal",
    "allclose",
)
TORCH_READS = ("equal", "allclose", "is_nonzero")


# --- the counting ------------------------------------------------------------------------------


class Log:
    """One measured step's record: the ordered events and the counters."""

    def __init__(self) -> None:
        self.events: list[str] = []  # "launch", "wait", "read", in order
        self.launches: list[tuple[str, int, int, list[str]]] = []  # kind, in, out, callers
        self.sites: dict[str, int] = {}  # "event kind @ file:line function" -> how many
        self.kinds: dict[str, int] = {}
        self.elements_in = 0
        self.elements_full = 0
        self.elements_wire = 0.0
        self.bytes_full = 0
        self.waits = 0
        self.reads: dict[str, int] = {}
        self.calls: Counter[Any] = Counter()  # code object -> calls

    def launch(self, kind: str, n_in: int, n_out: int, b_in: int, b_out: int) -> None:
        self.events.append("launch")
        self.launches.append((kind, n_in, n_out, self.stack()))
        self.site(f"launch {kind}")
        self.kinds[kind] = self.kinds.get(kind, 0) + 1
        self.elements_in += n_in
        self.elements_full += max(n_in, n_out)
        self.elements_wire += wire(kind, n_in, n_out)
        self.bytes_full += max(b_in, b_out)

    def wait(self) -> None:
        self.events.append("wait")
        self.waits += 1
        self.site("wait")

    def read(self, kind: str) -> None:
        self.events.append("read")
        self.reads[kind] = self.reads.get(kind, 0) + 1
        self.site(f"read {kind}")

    @staticmethod
    def caller() -> Any:
        """The innermost frame outside torch.distributed's c10d layer and the counting: the
        line of freplicate's, FSDP2's or the benchmark's that made the call."""
        frame = sys._getframe(1)
        while frame is not None and (
            frame.f_code in _OWN or frame.f_code.co_filename.replace("\\", "/").endswith(_PLUMBING)
        ):
            frame = frame.f_back  # type: ignore[assignment]
        return frame

    def site(self, what: str) -> None:
        """Count ``what`` at its caller's line."""
        frame = self.caller()
        where = "?" if frame is None else f"{_where(frame.f_code)} (line {frame.f_lineno})"
        key = f"{what} @ {where}"
        self.sites[key] = self.sites.get(key, 0) + 1

    def stack(self, depth: int = 6) -> list[str]:
        """The caller and the frames above it: ``function (file:line)``, innermost first."""
        frame, out = self.caller(), list[str]()
        while frame is not None and len(out) < depth:
            out.append(
                f"{frame.f_code.co_name} ({_where(frame.f_code).split(':')[0]}:{frame.f_lineno})"
            )
            frame = frame.f_back
        return out

    def profile(self, frame: Any, event: str, arg: Any) -> None:
        if event == "call" and not _MUTE:
            code = frame.f_code
            if code not in _OWN:
                self.calls[code] += 1

    def summary(self) -> dict[str, Any]:
        launches = [i for i, e in enumerate(self.events) if e == "launch"]
        first, last = (launches[0], launches[-1]) if launches else (0, -1)

        def where(kind: str) -> tuple[int, int, int]:
            at = [i for i, e in enumerate(self.events) if e == kind]
            return (
                sum(i < first for i in at) if launches else len(at),
                sum(first < i < last for i in at),
                sum(i > last for i in at) if launches else 0,
            )

        wb, wm, wa = where("wait")
        rb, rm, ra = where("read")
        areas: Counter[str] = Counter()
        for code, n in self.calls.items():
            areas[_area(code.co_filename)] += n
        top = sorted(self.calls.items(), key=lambda kv: -kv[1])[:25]
        return {
            "collectives": sum(self.kinds.values()),
            "by_kind": dict(sorted(self.kinds.items())),
            "elements_in": self.elements_in,
            "elements_full": self.elements_full,
            "elements_wire": self.elements_wire,
            "bytes_full": self.bytes_full,
            "waits": self.waits,
            "waits_before_first_launch": wb,
            "waits_between_launches": wm,
            "waits_after_last_launch": wa,
            "reads": sum(self.reads.values()),
            "reads_by_kind": dict(sorted(self.reads.items())),
            "reads_before_first_launch": rb,
            "reads_between_launches": rm,
            "reads_after_last_launch": ra,
            "python_calls": sum(self.calls.values()),
            "calls_by_area": dict(areas.most_common()),
            "top_calls": [[_where(c), n] for c, n in top],
            "order": "".join({"launch": "L", "wait": "w", "read": "r"}[e] for e in self.events),
            "launches": self.launches,
            "sites": dict(sorted(self.sites.items(), key=lambda kv: -kv[1])),
            "_calls": {_where(c): n for c, n in self.calls.items()},
        }


_LOG: Log | None = None
_DEPTH = 0  # inside a counted collective: the collectives it makes are not counted again
_OWN: set[Any] = set()  # the code objects of the counting wrappers: not the step's calls
_PATCHED = False
# the files of torch's own layers between a caller and the wire: a site is the frame above them
_PLUMBING = (
    "distributed_c10d.py",
    "c10d_logger.py",
    "_functional_collectives.py",
    "torch/futures/__init__.py",
    "torch/_ops.py",
)
_MUTE = False  # True while a wrapper does its own bookkeeping: its calls are not the step's


def wire(kind: str, n_in: int, n_out: int, world: int = 2) -> float:
    """The elements a rank sends in the bandwidth-optimal (ring) algorithm of ``kind`` on
    ``world`` ranks: an all-reduce 2(W-1)/W of its tensor, an all-gather (W-1)/W of the
    gathered tensor, a reduce-scatter (W-1)/W of its input, a broadcast the tensor, others
    (send, all-to-all, ...) what they hand in."""
    share = (world - 1) / world
    name = kind.removeprefix("functional.")
    if name.startswith("all_reduce"):
        return 2 * share * n_in
    if name.startswith(("all_gather", "_all_gather")) and name != "all_gather_object":
        return share * n_out
    if name.startswith(("reduce_scatter", "_reduce_scatter")):
        return share * n_in
    if name.startswith(("all_to_all",)):
        return share * n_in
    return float(n_in)


def _area(filename: str) -> str:
    path = filename.replace("\\", "/")
    for needle, name in (
        ("/freplicate/", "freplicate"),
        ("/transformers/", "transformers"),
        ("/torch/distributed/", "torch.distributed"),
        ("/torch/nn/parallel/", "torch.nn.parallel"),
        ("/torch/nn/", "torch.nn"),
        ("/torch/autograd/", "torch.autograd"),
        ("/torch/utils/", "torch.utils"),
        ("/torch/_functorch/", "torch._functorch"),
        ("/torch/", "torch (other)"),
        ("/benchmarks/", "benchmarks"),
    ):
        if needle in path:
            return name
    return "other (stdlib, ...)"


def _where(code: Any) -> str:
    path = code.co_filename.replace("\\", "/")
    for root in ("/freplicate/", "/torch/", "/transformers/", "/benchmarks/"):
        if root in path:
            path = root.strip("/") + "/" + path.split(root, 1)[1]
            break
    else:
        path = os.path.basename(path)
    return f"{path}:{code.co_firstlineno} {code.co_name}"


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


def _sizes(sig: inspect.Signature | None, args: Any, kwargs: Any) -> tuple[int, int, int, int]:
    """Elements and bytes handed in and received: arguments named ``output...`` (or
    ``gather_list``) receive, the other tensors are sent; with no receiving argument, in place."""
    named: list[tuple[str, Any]]
    try:
        named = list(sig.bind(*args, **kwargs).arguments.items()) if sig else []
    except TypeError:
        named = []
    if not named:
        named = [("", a) for a in args] + list(kwargs.items())
    n_in = n_out = b_in = b_out = 0
    for name, value in named:
        for t in _tensors(value):
            n, b = t.numel(), t.numel() * t.element_size()
            if "output" in name or name == "gather_list":
                n_out, b_out = n_out + n, b_out + b
            else:
                n_in, b_in = n_in + n, b_in + b
    return n_in, n_out or n_in, b_in, b_out or b_in


def _signature(fn: Any) -> inspect.Signature | None:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):
        return None


def _collective(kind: str, orig: Any) -> Any:
    sig = _signature(orig)

    def counted(*args: Any, **kwargs: Any) -> Any:
        global _DEPTH
        global _MUTE
        log = _LOG
        if log is None or _DEPTH:
            return orig(*args, **kwargs)
        _MUTE = True
        try:
            log.launch(kind, *_sizes(sig, args, kwargs))
        finally:
            _MUTE = False
        _DEPTH += 1
        try:
            return orig(*args, **kwargs)
        finally:
            _DEPTH -= 1

    _OWN.add(counted.__code__)
    counted.__wrapped__ = orig  # type: ignore[attr-defined]
    return counted


class _Packet:
    """An eager ``torch.ops._c10d_functional`` op, counted; everything else its own."""

    def __init__(self, kind: str, packet: Any, wait: bool = False) -> None:
        self._kind, self._packet, self._wait = kind, packet, wait
        self._sig = _signature(getattr(packet, "default", packet))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        global _MUTE
        log = _LOG
        if log is not None:
            _MUTE = True
            try:
                if self._wait:
                    log.wait()
                elif not _DEPTH:
                    log.launch(self._kind, *_sizes(None, args, kwargs))
            finally:
                _MUTE = False
        return self._packet(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._packet, name)


def _quiet(record: Callable[..., None], *args: Any) -> None:
    """``record(*args)``, its own calls not counted as the step's."""
    global _MUTE
    _MUTE = True
    try:
        record(*args)
    finally:
        _MUTE = False


def _waiting(orig: Any) -> Any:
    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        log = _LOG
        if log is not None:
            _quiet(log.wait)
        return orig(self, *args, **kwargs)

    _OWN.add(counted.__code__)
    return counted


def _reading(kind: str, orig: Any) -> Any:
    def counted(*args: Any, **kwargs: Any) -> Any:  # a method's self is args[0]
        log = _LOG
        if log is not None:
            _quiet(log.read, kind)
        return orig(*args, **kwargs)

    _OWN.add(counted.__code__)
    return counted


def install() -> None:
    """Wrap the collectives, the waits and the host reads, once per process (they pass
    through untouched while no step is measured)."""
    global _PATCHED
    if _PATCHED:
        return
    _PATCHED = True
    from torch.distributed import distributed_c10d as c10d

    for name in COLLECTIVES:
        for space in (dist, c10d):  # ``dist.x`` and the module's own calls of ``x``
            orig = getattr(space, name, None)
            if orig is not None:
                setattr(space, name, _collective(name, orig))
    try:
        import torch.distributed._functional_collectives  # the ops' Python side

        ops = torch.ops._c10d_functional
        for name in FUNCTIONAL:
            packet = getattr(ops, name, None)
            if packet is not None:
                setattr(ops, name, _Packet(f"functional.{name}", packet))
        name = "wait_tensor"
        packet = getattr(ops, name, None)
        if packet is not None:
            setattr(ops, name, _Packet(f"functional.{name}", packet, wait=True))
    except ImportError:
        pass
    work = torch._C._distributed_c10d.Work
    work.wait = _waiting(work.wait)  # type: ignore[method-assign]
    torch._C.Future.wait = _waiting(torch._C.Future.wait)  # type: ignore[method-assign]
    for name in TENSOR_READS:
        setattr(torch.Tensor, name, _reading(name, getattr(torch.Tensor, name)))
    for name in TORCH_READS:
        setattr(torch, name, _reading(f"torch.{name}", getattr(torch, name)))
    for f in vars(Log).values():
        f = getattr(f, "__func__", f)  # a staticmethod's function
        if inspect.isfunction(f):
            _OWN.add(f.__code__)
    for f in (_Packet.__call__, _Packet.__getattr__, _sizes, _tensors, _signature, _quiet):
        _OWN.add(f.__code__)


def measured(step: Callable[[], Any]) -> tuple[Any, dict[str, Any]]:
    """``step()`` once, counted."""
    global _LOG
    log = Log()
    _LOG = log
    others = [t for t in threading.enumerate() if t is not threading.current_thread()]
    sys.setprofile(log.profile)
    try:
        out = step()
    finally:
        sys.setprofile(None)
        _LOG = None
    summary = log.summary()
    summary["python_threads_besides_main"] = len(others)
    return out, summary


# --- the sides ---------------------------------------------------------------------------------

# a side: make() -> (step, after, static); step() is counted; after(step's result) runs
# uncounted (the update, the gradients dropped); static() -> counts that override the measured
# ones (DDP's buckets), or None
Made = tuple[Callable[[], Any], Callable[[Any], None], Callable[[], dict[str, Any]] | None]


def _sgd_after(module: nn.Module) -> Callable[[Any], None]:
    params = [p for p in module.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=LR)

    def after(_: Any) -> None:
        opt.step()
        opt.zero_grad(set_to_none=True)

    return after


def _ddp(
    model: nn.Module, loss: Callable[[nn.Module], torch.Tensor], hook: bool, **kw: Any
) -> Made:
    from torch.nn.parallel import DistributedDataParallel

    own = copy.deepcopy(model)
    ddp = DistributedDataParallel(own, **kw)
    if hook:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ddp.register_comm_hook(None, default_hooks.allreduce_hook)

    def step() -> None:
        loss(ddp).backward()

    def buckets() -> dict[str, Any]:
        got = [b.buffer() for b in ddp.reducer._get_zeros_like_grad_buckets()]
        n = sum(t.numel() for t in got)
        nbytes = sum(t.numel() * t.element_size() for t in got)
        return {
            "collectives": len(got),
            "by_kind": {"all_reduce (C++ reducer)": len(got)},
            "elements_in": n,
            "elements_full": n,
            "elements_wire": wire("all_reduce", n, n),
            "bytes_full": nbytes,
            "bucket_elements": [t.numel() for t in got],
            "collectives_from": "reducer._get_zeros_like_grad_buckets(): one all-reduce a bucket",
            "waits_between_launches": None,
            "reads_between_launches": None,
        }

    return step, _sgd_after(own), None if hook else buckets


def _fr_dp(
    model: nn.Module,
    loss: Callable[[nn.Module, Any, Any], torch.Tensor],
    *,
    frozen: bool = False,
    **kw: Any,
) -> Made:
    """``fr.distributed.grad_and_value`` of ``loss(model, fr.State, frozen)``; SGD after."""
    import freplicate as fr

    s = fr.state(model)
    params = {k: v.detach().clone() for k, v in s.params.items()}
    buffers = s.buffers
    if frozen:
        trainable, fixed = fr.partition(params, model)
    else:
        trainable, fixed = params, {}

    def loss_fn(p: dict[str, torch.Tensor], fixed: dict[str, torch.Tensor]) -> torch.Tensor:
        return loss(model, fr.State(fr.combine(p, fixed) if fixed else p, buffers), None)

    grad_fn = fr.distributed.grad_and_value(loss_fn, **kw)
    box = {"p": trainable}

    def step() -> Any:
        return grad_fn(box["p"], fixed)

    def after(out: Any) -> None:
        grads, _ = out
        names = list(box["p"])
        new = torch._foreach_add([box["p"][k] for k in names], [grads[k] for k in names], alpha=-LR)
        box["p"] = dict(zip(names, new))

    return step, after, None


def _mlp_loss(x: torch.Tensor, y: torch.Tensor) -> tuple[Any, Any]:
    import freplicate as fr

    def stateful(m: nn.Module) -> torch.Tensor:
        return F.cross_entropy(m(x), y)

    def functional(model: nn.Module, state: Any, _: Any) -> torch.Tensor:
        out, _ = fr.apply(model, state, x)
        return F.cross_entropy(out, y)

    return stateful, functional


def _dp_sides(name: str) -> list[tuple[str, Callable[[], Made]]]:
    from ._common import build

    model, x, y = build(name)
    stateful, functional = _mlp_loss(x, y)
    return [
        ("DDP", lambda: _ddp(model, stateful, hook=False)),
        ("DDP + allreduce_hook (Python)", lambda: _ddp(model, stateful, hook=True)),
        ("fr.distributed.grad_and_value", lambda: _fr_dp(model, functional)),
        (
            "fr.distributed.grad_and_value check=False",
            lambda: _fr_dp(model, functional, check=False),
        ),
    ]


def _all_reduce_sides() -> list[tuple[str, Callable[[], Made]]]:
    import freplicate as fr

    from ._common import build

    model, _, _ = build("many_small")
    tree = {k: v.clone() for k, v in fr.state(model).params.items()}
    flat = torch.cat([t.reshape(-1) for t in tree.values()])

    def flat_side() -> Made:
        return (lambda: dist.all_reduce(flat)), (lambda _: None), None

    def fr_side(**kw: Any) -> Made:
        return (lambda: fr.distributed.all_reduce(tree, **kw)), (lambda _: None), None

    return [
        (f"dist.all_reduce, one flat tensor of {flat.numel()}", flat_side),
        (f"fr.distributed.all_reduce, {len(tree)} leaves", fr_side),
        (
            f"fr.distributed.all_reduce, {len(tree)} leaves, check=False",
            lambda: fr_side(check=False),
        ),
    ]


def transformers_missing() -> str | None:
    try:
        import transformers  # noqa: F401
    except Exception as err:  # ImportError, or a dependency of it that fails to import
        return f"{type(err).__name__}: {err}"
    return None


def _llama(frozen: bool) -> tuple[nn.Module, torch.Tensor]:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)  # the same weights on every rank
    model = LlamaForCausalLM(LlamaConfig(**LLAMA))
    if frozen:
        model.get_submodule(FROZEN).requires_grad_(False)
    g = torch.Generator().manual_seed(100 + dist.get_rank())  # this rank's batch
    ids = torch.randint(0, LLAMA["vocab_size"], (LLAMA_BATCH, LLAMA_SEQ), generator=g)
    return model, ids


def _llama_losses(ids: torch.Tensor) -> tuple[Any, Any]:
    import freplicate as fr

    def stateful(m: nn.Module) -> torch.Tensor:
        return m(ids, labels=ids).loss  # type: ignore[no-any-return]

    def functional(model: nn.Module, state: Any, _: Any) -> torch.Tensor:
        out, _ = fr.apply(model, state, ids, labels=ids)
        return out.loss  # type: ignore[no-any-return]

    return stateful, functional


def _llama_dp_sides(frozen: bool) -> list[tuple[str, Callable[[], Made]]]:
    model, ids = _llama(frozen)
    stateful, functional = _llama_losses(ids)
    return [
        (
            "DDP broadcast_buffers=False",
            lambda: _ddp(model, stateful, False, broadcast_buffers=False),
        ),
        (
            "DDP + allreduce_hook (Python)",
            lambda: _ddp(model, stateful, True, broadcast_buffers=False),
        ),
        ("fr.distributed.grad_and_value", lambda: _fr_dp(model, functional, frozen=frozen)),
    ]


_MESH: list[Any] = []


def _fsdp2(model: nn.Module, ids: torch.Tensor) -> Made:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if not _MESH:  # on the CPU over gloo: a 1-D mesh of device type "cpu" over the default group
        _MESH.append(init_device_mesh("cpu", (dist.get_world_size(),)))
    own = copy.deepcopy(model)
    for layer in own.model.layers:  # type: ignore[union-attr]
        fully_shard(layer, mesh=_MESH[0])
    fully_shard(own, mesh=_MESH[0])

    def step() -> None:
        own(ids, labels=ids).loss.backward()

    return step, _sgd_after(own), None


def _zero3(model: nn.Module, ids: torch.Tensor, frozen: bool) -> Made:
    """docs/sharding.md's ZeRO-3 step: ``fr.grad_and_value`` of a loss through
    ``apply_sharded`` on a meta twin, each decoder layer a unit; SGD on the rows after."""
    import freplicate as fr

    s = fr.state(model)
    shards = fr.distributed.shard({k: v.detach().clone() for k, v in s.params.items()})
    shards = {k: v.clone() for k, v in shards.items()}  # rows of their own
    buffers = {k: v.clone() for k, v in s.buffers.items()}
    meta = copy.deepcopy(model).to("meta")
    units = [f"model.layers.{i}" for i in range(LLAMA["num_hidden_layers"])]
    if frozen:
        trainable, fixed = fr.partition(shards, model)
    else:
        trainable, fixed = shards, {}

    def loss_fn(p: dict[str, torch.Tensor], fixed: dict[str, torch.Tensor]) -> torch.Tensor:
        state = fr.State(fr.combine(p, fixed) if fixed else p, buffers)
        out, _ = fr.distributed.apply_sharded(meta, state, ids, labels=ids, units=units)
        return out.loss  # type: ignore[no-any-return]

    grad_fn = fr.grad_and_value(loss_fn)
    box = {"p": trainable}

    def step() -> Any:
        return grad_fn(box["p"], fixed)

    def after(out: Any) -> None:
        grads, _ = out
        box["p"] = {k: v - LR * grads[k] for k, v in box["p"].items()}

    return step, after, None


def _zero3_sides(frozen: bool) -> list[tuple[str, Callable[[], Made]]]:
    model, ids = _llama(frozen)
    return [
        ("FSDP2 fully_shard (each layer, then root)", lambda: _fsdp2(model, ids)),
        ("fr.distributed.apply_sharded (each layer a unit)", lambda: _zero3(model, ids, frozen)),
    ]


# --- one rank ----------------------------------------------------------------------------------


def _count(make: Callable[[], Made], warmup: int, steps: int) -> dict[str, Any]:
    step, after, static = make()
    for _ in range(warmup):
        after(step())
    per_step = []
    for _ in range(steps):
        out, summary = measured(step)
        after(out)
        per_step.append(summary)
    result = _mean(per_step)
    if static is not None:
        result.update(static())
    return result


NUMBERS = (
    "collectives",
    "elements_in",
    "elements_full",
    "elements_wire",
    "bytes_full",
    "waits",
    "waits_before_first_launch",
    "waits_between_launches",
    "waits_after_last_launch",
    "reads",
    "reads_before_first_launch",
    "reads_between_launches",
    "reads_after_last_launch",
    "python_calls",
)


def _mean(per_step: list[dict[str, Any]]) -> dict[str, Any]:
    calls = [s.pop("_calls") for s in per_step]
    out = dict(per_step[-1])  # the kinds, areas and top calls: the last measured step's
    # the functions called a different number of times in the measured steps
    out["calls_differ"] = {
        f: [c.get(f, 0) for c in calls]
        for f in sorted(set().union(*calls))
        if len({c.get(f, 0) for c in calls}) > 1
    }
    out["varies"] = []
    for key in NUMBERS:
        values = [s[key] for s in per_step]
        out[key] = sum(values) / len(values)
        if len(set(values)) > 1:
            out["varies"].append(key)
    out["per_step"] = {key: [s[key] for s in per_step] for key in NUMBERS}
    return out


Sides = list[tuple[str, Callable[[], Made]]]


def _plan(args: argparse.Namespace) -> list[tuple[str, Callable[[], Sides] | str]]:
    """The rows: their sides, or why the row is skipped."""
    rows: list[tuple[str, Any]] = []
    if "dp" in args.rows:
        for name in args.models:
            rows.append((f"dp {name}", lambda name=name: _dp_sides(name)))
    if "all_reduce" in args.rows:
        rows.append(("all_reduce 400 leaves (many_small)", _all_reduce_sides))
    missing = transformers_missing()
    for row, title, sides in (
        ("llama_dp", "dp llama", _llama_dp_sides),
        ("zero3", "zero3 llama", _zero3_sides),
    ):
        if row not in args.rows:
            continue
        for frozen in (False, True):
            label = f"{title}{' frozen ' + FROZEN if frozen else ''}"
            if missing:
                rows.append((label, f"skipped: transformers is not importable ({missing})"))
            else:
                rows.append((label, lambda sides=sides, frozen=frozen: sides(frozen)))
    return rows


def _rank_body(args: argparse.Namespace) -> dict[str, Any]:
    """Every row's sides counted on this rank; rank 0 returns both ranks' counts."""
    import freplicate as fr

    # DDP(broadcast_buffers=False) is what the fr sides do (no buffer synced); say it once
    warnings.filterwarnings("ignore", message=".*broadcast_buffers.* is deprecated")
    install()
    mine: dict[str, Any] = {}
    for row, sides in _plan(args):
        if isinstance(sides, str):
            mine[row] = sides
            continue
        mine[row] = {}
        for side, make in sides():
            try:
                mine[row][side] = _count(make, args.warmup, args.steps)
            except Exception as err:  # a side that fails here is a line, not the end of the run
                mine[row][side] = f"failed: {type(err).__name__}: {str(err).splitlines()[0][:300]}"
            dist.barrier()
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    try:
        import transformers

        hf = transformers.__version__
    except Exception:
        hf = None
    return {
        "freplicate": os.path.dirname(fr.__file__),
        "torch": torch.__version__,
        "transformers": hf,
        "ranks": everyone,
    }


# --- the report --------------------------------------------------------------------------------


def _num(value: Any, varies: bool = False) -> str:
    if value is None:
        return "n/a"
    text = f"{value:.1f}" if value != int(value) else f"{int(value)}"
    return ("~" if varies else "") + text


def _kinds(by_kind: dict[str, int]) -> str:
    short = {
        "all_reduce": "ar",
        "all_gather_into_tensor": "agt",
        "all_gather_single": "ags",
        "reduce_scatter_tensor": "rst",
        "reduce_scatter_single": "rss",
        "broadcast": "bc",
        "all_gather": "ag",
        "all_gather_object": "ago",
        "_broadcast_coalesced": "bcc",
        "barrier": "bar",
        "all_reduce (C++ reducer)": "ar(C++)",
    }
    return " ".join(f"{short.get(k, k)}:{n}" for k, n in by_kind.items()) or "-"


def _paths(launches: list[Any]) -> list[str]:
    """One line per (kind, call path): how many launches, their full and wire elements."""
    groups: dict[tuple[str, str], list[float]] = {}
    for kind, n_in, n_out, stack in launches:
        key = (kind, " < ".join(f.split(" (")[0] for f in stack[:3]))
        g = groups.setdefault(key, [0, 0, 0.0])
        g[0] += 1
        g[1] += max(n_in, n_out)
        g[2] += wire(kind, n_in, n_out)
    return [
        f"    {int(n):4d}  {kind}: {int(full)} full, {_num(w)} wire  [{path}]"
        for (kind, path), (n, full, w) in groups.items()
    ]


def table(results: dict[str, Any]) -> str:
    """The plain table of rank 0's counts, and the notes under it."""
    ranks = results["ranks"]
    header = (
        "row",
        "side",
        "collectives",
        "by kind",
        "elements in",
        "elements full",
        "elements wire",
        "waits",
        "waits between launches",
        "host reads",
        "reads between launches",
        "python calls",
    )
    lines: list[tuple[str, ...]] = []
    notes: list[str] = []
    areas: list[str] = []
    orders: list[str] = []
    sites: list[str] = []
    paths: list[str] = []
    for row, sides in ranks[0].items():
        if isinstance(sides, str):
            notes.append(f"{row}: {sides}")
            continue
        for side, c in sides.items():
            if isinstance(c, str):
                lines.append((row, side, "failed", *[""] * (len(header) - 3)))
                notes.append(f"{row} | {side}: {c}")
                continue
            v = set(c["varies"])
            lines.append(
                (
                    row,
                    side,
                    _num(c["collectives"], "collectives" in v),
                    _kinds(c["by_kind"]),
                    _num(c["elements_in"], "elements_in" in v),
                    _num(c["elements_full"], "elements_full" in v),
                    _num(c["elements_wire"], "elements_wire" in v),
                    _num(c["waits"], "waits" in v),
                    _num(c["waits_between_launches"], "waits_between_launches" in v),
                    _num(c["reads"], "reads" in v),
                    _num(c["reads_between_launches"], "reads_between_launches" in v),
                    _num(c["python_calls"], "python_calls" in v),
                )
            )
            areas.append(
                f"  {row} | {side}: " + ", ".join(f"{a} {n}" for a, n in c["calls_by_area"].items())
            )
            orders.append(f"  {row} | {side}: {c['order'] or '-'}")
            sites.append(f"  {row} | {side}:")
            sites += [f"    {n:4d}  {where}" for where, n in c["sites"].items()]
            paths.append(f"  {row} | {side}:")
            paths += _paths(c["launches"])
            other = ranks[1].get(row, {}).get(side) if isinstance(ranks[1].get(row), dict) else None
            if isinstance(other, dict):
                differs = [k for k in NUMBERS if other[k] != c[k]]
                if differs:
                    notes.append(
                        f"{row} | {side}: rank 1 differs: "
                        + ", ".join(f"{k} {_num(other[k])} (rank 0 {_num(c[k])})" for k in differs)
                    )
    widths = [max(len(r[i]) for r in [header, *lines]) for i in range(len(header))]
    out = [
        TITLE,
        f"freplicate: {results['freplicate']}; torch {results['torch']}; "
        f"transformers {results['transformers']}",
    ]
    out.append("  ".join(h.ljust(w) for h, w in zip(header, widths)))
    out.append("  ".join("-" * w for w in widths))
    out += ["  ".join(x.ljust(w) for x, w in zip(r, widths)).rstrip() for r in lines]
    out.append("")
    out.append(
        "Rank 0, per measured step (mean of the measured steps; ~: they differed). Elements: in, "
        "what the rank hands in; full, the larger of in and out (a gather's result); wire, what "
        "the rank sends in a ring algorithm on 2 ranks (an all-reduce its tensor, an all-gather "
        "or a reduce-scatter half the full tensor). DDP's row takes "
        "its collectives from the reducer's buckets (launched and waited in C++: its waits and "
        "between-launch counts are Python's only, n/a); 'DDP + allreduce_hook' counts them through "
        "dist.all_reduce. Kinds: ar all_reduce, agt all_gather_into_tensor, ags all_gather_single, "
        "rst reduce_scatter_tensor, rss reduce_scatter_single, bc broadcast, bcc "
        "_broadcast_coalesced."
    )
    out += notes
    out.append("")
    out.append("Python calls by where the called function lives:")
    out += areas
    out.append("")
    out.append("The order of a step's collective launches (L), waits (w) and host reads (r):")
    out += orders
    out.append("")
    out.append("Where (the innermost caller above torch's c10d layer), per step:")
    out += sites
    out.append("")
    out.append("Launches by kind and call path (3 innermost callers), per step:")
    out += paths
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=TITLE)
    parser.add_argument("--rows", nargs="*", default=list(ROWS), choices=ROWS)
    parser.add_argument("--models", nargs="*", default=list(DP_MODELS), choices=DP_MODELS)
    parser.add_argument("--warmup", type=int, default=3, help="uncounted steps first (default 3)")
    parser.add_argument("--steps", type=int, default=2, help="measured steps (default 2)")
    parser.add_argument("--json", type=str, default=None, help="write every count here")
    parser.add_argument(
        "--pkg",
        type=str,
        default=None,
        help="a directory holding another copy of freplicate, put first on the ranks' sys.path",
    )
    parser.add_argument(
        "--no-pin",
        dest="pin",
        action="store_false",
        help="let the OS place the ranks (default: rank r pinned to core r)",
    )
    args = parser.parse_args(argv)
    if args.pkg:
        pkg = os.path.abspath(args.pkg)
        if not os.path.isdir(os.path.join(pkg, "freplicate")):
            parser.error(f"--pkg {pkg}: no freplicate package there")
        # spawned ranks start from this process's sys.path (multiprocessing's preparation
        # data), so freplicate, imported there first by _common, comes from DIR
        sys.path.insert(0, pkg)
    from ._common import on_two_ranks  # imports freplicate: after --pkg

    results = on_two_ranks(_rank_body, args, pin=args.pin, group_timeout=120, limit=1800)
    if args.pkg and not results["freplicate"].startswith(os.path.abspath(args.pkg)):
        raise RuntimeError(f"the ranks imported freplicate from {results['freplicate']}")
    text = table(results)
    print(text)
    if args.json:
        results["argv"] = sys.argv if argv is None else argv
        results["warmup"], results["steps"] = args.warmup, args.steps
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
