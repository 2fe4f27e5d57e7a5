"""parallel_apply: one call per replica, each in a thread of its own, results in order.

``apply_each`` is the same on checked arguments, for the composites.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from .. import _tree
from .._devices import as_devices
from .._torch import transform_level
from .._typing import DeviceSpec

__all__ = ["apply_each", "parallel_apply"]


def parallel_apply(
    fn: Callable[..., Any],
    replicas: Iterable[Any],
    inputs: Iterable[Any],
    *,
    devices: Iterable[DeviceSpec] | None = None,
    kwargs: Iterable[Mapping[str, Any]] | None = None,
) -> list[Any]:
    """Call ``fn(replicas[i], *inputs[i], **kwargs[i])`` for every ``i`` at once; results in order.

    Each call runs in a thread of its own (the first in the caller's thread,
    the others in threads that have ended when this returns), so calls whose
    work releases the GIL (tensor ops) run in parallel. Every call sees the
    caller's grad mode, inference mode, autocast state and intra-op thread
    count (thread-local in PyTorch and OpenMP), and, on a CUDA device, runs
    with that device current and on a stream of its own, ordered after the
    caller's stream (the caller's stream waits for it before this returns). Under a ``torch.func`` transform the
    calls run one after another in the caller's thread: the transform's
    state is thread-local, and another thread would silently compute
    without it.

    Calls that share a generator (the CPU's, or one CUDA device's) draw
    random numbers from it in whatever order their threads reach it, as in
    ``nn.parallel.parallel_apply``: a seed does not fix them. ``fr.data_parallel``
    and ``fr.data_parallel_grad``, whose calls are pure, run such replicas in
    order instead, so that it does.

    Args:
        fn: the function every replica runs.
        replicas: one first argument per call (any iterable: a list, a generator).
        inputs: one entry per call: a tuple (or list) of positional arguments;
            any other object is passed as the only argument, as
            ``nn.parallel.parallel_apply`` does.
        devices: the device each call runs on; by default the device of the
            first tensor found in ``inputs[i]`` or ``replicas[i]``.
        kwargs: one dict of keyword arguments per call.

    Returns:
        The calls' results, in order.

    Raises:
        TypeError: ``fn`` is not callable, or an argument is not iterable.
        ValueError: ``replicas`` is empty, or the arguments have different
            lengths; a bad device.
        Exception: an exception in any call is re-raised here as the same
            exception type, its message naming the replica index and device,
            the original chained (the lowest failing index wins).

    Examples:
        >>> parallel_apply(lambda w, x: w * x, [torch.tensor(2.0), torch.tensor(3.0)],
        ...                [(torch.tensor(1.0),), (torch.tensor(5.0),)])
        [tensor(2.), tensor(15.)]
        >>> parallel_apply(lambda w, x: w[x], [{}, {}], [("a",), ("b",)], devices=["cpu", "cpu"])
        Traceback (most recent call last):
        ...
        KeyError: "fr.parallel_apply: replica 0 on cpu raised KeyError: 'a'"
    """
    caller = "fr.parallel_apply"
    if not callable(fn):
        raise TypeError(f"{caller}: fn must be callable, got {type(fn).__name__}")
    replicas = _as_list(caller, "replicas", replicas)
    inputs = _as_list(caller, "inputs", inputs)
    n = len(replicas)
    if n == 0:
        raise ValueError(f"{caller}: replicas is empty; give at least one replica")
    if len(inputs) != n:
        raise ValueError(
            f"{caller}: replicas has {n} entries but inputs has {len(inputs)}; "
            "give one input tuple per replica"
        )
    kws: list[Mapping[str, Any]] = [{}] * n
    if kwargs is not None:
        kws = _as_list(caller, "kwargs", kwargs)
        if len(kws) != n:
            raise ValueError(
                f"{caller}: replicas has {n} entries but kwargs has {len(kws)}; "
                "give one dict of keyword arguments per replica"
            )
    if devices is not None:
        devs: list[torch.device | None] = list(as_devices(devices, caller=caller))
        if len(devs) != n:
            raise ValueError(
                f"{caller}: replicas has {n} entries but devices has {len(devs)}; "
                "give one device per replica"
            )
    else:
        devs = [_device_of(inputs[i], replicas[i]) for i in range(n)]
    args = [tuple(x) if isinstance(x, (tuple, list)) else (x,) for x in inputs]
    return apply_each(fn, replicas, args, kws, devs, caller=caller)


def _as_list(caller: str, arg: str, values: Any) -> list[Any]:
    if not isinstance(values, Iterable) or isinstance(values, (str, bytes, Mapping)):
        raise TypeError(
            f"{caller}: {arg} must be a list (or any iterable) with one entry per replica, "
            f"got {type(values).__name__}"
        )
    return list(values)


def _device_of(*trees: Any) -> torch.device | None:
    # where nn.parallel.parallel_apply looks: not inside dataclasses
    for leaf in _tree.flatten_containers(trees, dataclasses=False)[0]:
        if isinstance(leaf, torch.Tensor):
            return leaf.device
    return None


class _Modes:
    """The caller's thread-local modes, re-entered in each worker thread.

    The intra-op thread count is one of them: OpenMP keeps it per thread, so
    a new thread would compute with every core (``torch.set_num_threads(1)``
    notwithstanding), and two replicas on a 2-core host would run three
    compute threads at once, each slower than the caller alone.
    """

    def __init__(self) -> None:
        self.threads = torch.get_num_threads()
        self.caller = threading.current_thread()
        self.grad = torch.is_grad_enabled()
        self.inference = torch.is_inference_mode_enabled()
        self.autocast = [
            (kind, torch.get_autocast_dtype(kind))
            for kind in ("cpu", "cuda")
            if torch.is_autocast_enabled(kind)
        ]

    def enter(self, stack: contextlib.ExitStack) -> None:
        if threading.current_thread() is not self.caller:  # a worker: see the docstring
            torch.set_num_threads(self.threads)
        if self.inference:
            stack.enter_context(torch.inference_mode())
        stack.enter_context(torch.set_grad_enabled(self.grad))
        for kind, dtype in self.autocast:
            stack.enter_context(torch.autocast(kind, dtype=dtype))


class Draws:
    """What ``apply_each`` learned of one caller's replicas: do they draw random numbers?

    A caller that runs the same replicas step after step (``data_parallel``
    per module, ``data_parallel_grad`` per step function) keeps one, so that
    replicas found to draw from a generator they share run in order at once,
    without a threaded attempt first.
    """

    __slots__ = ("in_order",)

    def __init__(self) -> None:
        self.in_order = False


def apply_each(
    fn: Callable[..., Any],
    replicas: Sequence[Any],
    args: Sequence[tuple[Any, ...]],
    kwargs: Sequence[Mapping[str, Any]],
    devs: Sequence[torch.device | None],
    *,
    caller: str,
    draws: Draws | None = None,
) -> list[Any]:
    """``parallel_apply`` on checked arguments; errors name ``caller``.

    With ``draws``, the calls are pure functions whose random numbers must
    not depend on thread timing. Replicas that share a generator (the CPU's,
    or one CUDA device's) and draw from it run one after another, in order,
    from the caller's generator state: replica ``i`` draws the numbers that
    follow replica ``i - 1``'s, as the stateful design's copies called in
    order do. Whether they draw is seen from the shared generators' states
    after a threaded run: a change means the threads raced for them, and the
    calls run again, in order, from the states they started from (then
    ``draws`` remembers it; a run in order that draws nothing forgets it).
    """
    n = len(replicas)
    modes = _Modes()
    # Under a torch.func transform, whose state is thread-local, the calls run
    # one after another here, on the caller's streams (another thread would
    # silently compute without the transform).
    threaded = n > 1 and transform_level() is None
    # The caller's stream on each CUDA device: side streams wait for it first
    # (the inputs were made there) and it waits for them at the end.
    callers = {d: torch.cuda.current_stream(d) for d in devs if d is not None and d.type == "cuda"}
    results: list[Any] = [None] * n
    errors: list[BaseException | None] = [None] * n
    streams: list[Any] = [None] * n

    def run(i: int, side: bool) -> None:
        try:
            with contextlib.ExitStack() as stack:
                modes.enter(stack)
                dev = devs[i]
                caller = None
                if dev is not None and dev.type == "cuda":
                    stack.enter_context(torch.cuda.device(dev))
                    if side:
                        caller = callers[dev]
                        stream = streams[i] = torch.cuda.Stream(dev)
                        stream.wait_stream(caller)
                        # The caller's tensors are read on this stream (now, and in
                        # backward, which reuses the forward's streams): the caching
                        # allocator must not hand their memory out before it is done.
                        _record_stream((replicas[i], args[i], kwargs[i]), dev, stream)
                        stack.enter_context(torch.cuda.stream(stream))
                out = fn(replicas[i], *args[i], **kwargs[i])
                if caller is not None and dev is not None:
                    # and the outputs made here are used on the caller's stream
                    _record_stream(out, dev, caller)
                results[i] = out
        except BaseException as err:
            errors[i] = err

    def in_threads() -> None:
        threads = [threading.Thread(target=run, args=(i, True), daemon=True) for i in range(1, n)]
        for t in threads:
            t.start()
        run(0, True)
        for t in threads:
            t.join()
        for i, stream in enumerate(streams):
            if stream is not None:
                callers[devs[i]].wait_stream(stream)  # type: ignore[index]
                streams[i] = None

    if not threaded:
        for i in range(n):
            run(i, False)
    elif draws is None:
        in_threads()
    else:
        gens = _shared_generators(devs)
        before = [g.get_state() for g in gens]
        in_order = draws.in_order
        if not in_order:
            in_threads()
            if not _unchanged(gens, before):
                # the threads raced for a generator they share: again, in order
                for g, state in zip(gens, before):
                    g.set_state(state)
                results[:] = [None] * n
                errors[:] = [None] * n
                in_order = True
        if in_order:
            for i in range(n):
                run(i, False)
        # replicas in order that drew nothing (now in eval mode?) go back to threads next time
        draws.in_order = in_order and not _unchanged(gens, before)
    for i, err in enumerate(errors):
        if err is not None:
            _reraise(err, i, devs[i], caller)
    return results


def _shared_generators(devs: Sequence[torch.device | None]) -> list[torch.Generator]:
    """The default generators replicas on ``devs`` may draw from at once.

    The CPU's (a replica on any device may draw host numbers), and the
    generator of every CUDA device that runs more than one replica (a replica
    alone on its device draws from that device's own, as in ``nn.DataParallel``).
    """
    gens = [torch.default_generator]
    cuda = [d for d in devs if d is not None and d.type == "cuda"]
    for d in dict.fromkeys(d for d in cuda if cuda.count(d) > 1):
        index = d.index if d.index is not None else torch.cuda.current_device()
        gens.append(torch.cuda.default_generators[index])
    return gens


def _unchanged(gens: Sequence[torch.Generator], states: Sequence[torch.Tensor]) -> bool:
    return all(torch.equal(g.get_state(), s) for g, s in zip(gens, states))


def _record_stream(tree: Any, dev: torch.device, stream: Any) -> None:
    for leaf in _tree.flatten_containers(tree)[0]:
        if isinstance(leaf, torch.Tensor) and leaf.device == dev:
            leaf.record_stream(stream)


def _reraise(err: BaseException, i: int, dev: torch.device | None, caller: str) -> None:
    if not isinstance(err, Exception):
        raise err  # KeyboardInterrupt, SystemExit: as they are
    where = f"on {dev}" if dev is not None else "(device unknown)"
    msg = f"{caller}: replica {i} {where} raised {type(err).__name__}: {err}"
    try:
        new = type(err)(msg)
    except Exception:
        # a type that cannot be built from one message: as nn.parallel does
        raise RuntimeError(msg) from err
    raise new from err
