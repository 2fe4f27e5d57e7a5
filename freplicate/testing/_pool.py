"""``RankPool``: ranks of a loopback gloo group that stay up and run the functions sent to them.

Spawning a rank costs seconds (it imports torch), so a test module, or a
Hypothesis property that runs many examples, starts its ranks once and sends
each example to them. Each rank is a process spawned with this process's
``sys.path``, joined to the others by ``init_loopback_group`` (a file store,
gloo on loopback), with one intra-op thread. A run sends ``fn`` and its
arguments to every rank as ``torch.save`` bytes (so each rank works on
copies, never on the caller's tensors), calls ``fn(*args, **kwargs)`` there,
and brings every rank's result back the same way.

Bounded everywhere: the group's ``timeout`` bounds every collective, and a
run waits at most ``deadline`` seconds. A run in which a rank raised
re-raises that rank's exception, and the ranks join a fresh group before the
next run (one rank may have left a collective the others were still in),
dropping what ``fr.distributed`` remembers of the old one
(``fr.clear_caches``: the new group may reuse the old one's name). A rank
that is still busy a few seconds after another one failed, that died, or
that misses the deadline is killed with all the others (its stack printed
first when it missed the deadline, where the platform can), and the next
run starts new ranks: a failing Hypothesis example never leaves the pool
unusable for the next one.
"""

from __future__ import annotations

import faulthandler
import io
import multiprocessing
import os
import queue
import shutil
import signal
import tempfile
import time
import traceback
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

import freplicate as fr

from ._groups import check_seconds, check_world_size, init_loopback_group

__all__ = ["RankPool"]

T = TypeVar("T")

# how long the other ranks may still run once one has raised, before they are
# stopped (they may be waiting in a collective the failed rank never joins)
_GRACE = 5.0

_IMPORTABLE = (
    "fn, its arguments and every class or function they hold must be importable by the ranks "
    "(fresh processes that start with this process's sys.path): define them at the top level "
    "of a module on sys.path, not in an interactive session or inside a function"
)


class RankPool:
    """``world_size`` processes in a gloo group on loopback that run functions sent to them.

    The ranks start when the pool is made and stay up until ``close()`` (or
    the end of a ``with`` block), so that many runs, e.g. the examples of a
    Hypothesis property, share one start-up. Use one pool from one thread.

    Args:
        world_size: how many ranks, at least 1.
        timeout: seconds that bound every collective on the ranks (the
            group's timeout): a rank that never joins a collective makes the
            others raise instead of hanging.
        deadline: seconds a run may take on every rank, the ranks' start-up
            included when the run is the first after they started. A run
            past it stops the ranks and raises ``TimeoutError``.

    Attributes:
        world_size: how many ranks.
        timeout: the group's timeout, in seconds.
        deadline: the deadline of a run, in seconds; may be changed between
            runs.

    Raises:
        TypeError: ``world_size`` is not an int, or ``timeout`` or
            ``deadline`` not a number.
        ValueError: ``world_size`` below 1, or ``timeout`` or ``deadline``
            not positive.

    The ranks are spawned, so a script that makes a pool needs the
    ``if __name__ == "__main__":`` guard that ``multiprocessing`` asks for.

    >>> with fr.testing.RankPool(2) as pool:  # doctest: +SKIP
    ...     pool.run(torch.distributed.get_rank)
    ...     pool.run(fr.distributed.all_reduce, torch.tensor([1.0, 2.0]), op="sum")
    [0, 1]
    [tensor([2., 4.]), tensor([2., 4.])]
    """

    def __init__(self, world_size: int = 2, *, timeout: float = 30.0, deadline: float = 120.0):
        check_world_size("fr.testing.RankPool", world_size)
        check_seconds("fr.testing.RankPool", "timeout", timeout)
        check_seconds("fr.testing.RankPool", "deadline", deadline)
        self.world_size = world_size
        self.timeout = float(timeout)
        self.deadline = float(deadline)
        self._ranks: _Ranks | None = None
        self._closed = False
        self._start()

    def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> list[T]:
        """Call ``fn(*args, **kwargs)`` on every rank; every rank's result, in rank order.

        ``fn`` runs in the ranks' group, the default group of their process:
        ``torch.distributed.get_rank()`` tells a rank which it is, and every
        collective it makes is bounded by the pool's ``timeout``. ``fn``, the
        arguments and the results travel as ``torch.save`` bytes: ``fn``
        must be importable by the ranks (a function at the top level of a
        module on ``sys.path``, or of a library), and the results come back
        as copies.

        A failed run leaves the pool ready for the next: its ranks join a
        fresh group, or, where one died, hangs or is late, new ranks start.

        Raises:
            TypeError: ``fn`` or an argument cannot be sent to the ranks.
            Exception: the exception a rank raised (the lowest such rank), as
                its own type where it can be rebuilt from a message, else
                ``RuntimeError``; the message names the rank, and the rank's
                traceback is its ``__cause__``.
            RuntimeError: a rank died, or the pool is closed.
            TimeoutError: the run took longer than ``deadline``.
        """
        caller = "fr.testing.RankPool.run"
        if self._closed:
            raise RuntimeError(f"{caller}: the pool is closed")
        try:
            task = _dumps((fn, args, kwargs))
        except Exception as err:
            raise TypeError(
                f"{caller}: cannot send {_name(fn)} to the ranks ({err}); {_IMPORTABLE}"
            ) from err
        ranks = self._ranks if self._ranks is not None else self._start()
        replies = ranks.run(task, time.monotonic() + self.deadline)
        failed = {r: reply for r, reply in replies.items() if reply[0] != "ok"}
        if failed or len(replies) < self.world_size:
            self._after_failure(ranks, replies)
            failure = _error(caller, _name(fn), self.world_size, replies, self.deadline)
            raise failure from failure.__cause__
        return [_loads(replies[r][1]) for r in range(self.world_size)]

    def close(self) -> None:
        """Stop the ranks (they leave their group first when they can); the pool cannot run again.

        Called at the end of a ``with`` block.
        """
        self._closed = True
        if self._ranks is not None:
            self._ranks.stop()
            self._ranks = None

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _start(self) -> _Ranks:
        self._ranks = _Ranks(self.world_size, self.timeout)
        return self._ranks

    def _after_failure(self, ranks: _Ranks, replies: dict[int, tuple[str, bytes]]) -> None:
        if len(replies) == self.world_size and ranks.alive():
            ranks.regroup()  # every rank answered: a fresh group is enough
        else:
            ranks.stop(kill=True)  # a rank is busy, gone or late: new ranks at the next run
            self._ranks = None


class _Ranks:
    """One generation of rank processes, their queues and their store's directory."""

    def __init__(self, world_size: int, timeout: float) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.world_size = world_size
        self.dir = tempfile.mkdtemp(prefix="freplicate-ranks-")
        self.stores = 0
        self.tasks = [ctx.SimpleQueue() for _ in range(world_size)]
        self.replies = ctx.Queue()
        store = self._store()
        self.procs = [
            ctx.Process(
                target=_serve,
                args=(rank, world_size, store, timeout, self.tasks[rank], self.replies),
                daemon=True,
                name=f"freplicate-rank-{rank}",
            )
            for rank in range(world_size)
        ]
        for p in self.procs:
            p.start()
        self.ready = False
        self.seq = 0
        self.fresh: str | None = None  # the store of the group to join before the next task
        # the processes are stopped even if the pool is dropped without close()
        self._finalizer = weakref.finalize(self, _stop, self.procs, self.tasks, self.dir)

    def _store(self) -> str:
        self.stores += 1
        return os.path.join(self.dir, f"store-{self.stores}")

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def regroup(self) -> None:
        self.fresh = self._store()

    def run(self, task: bytes, end: float) -> dict[int, tuple[str, bytes]]:
        """Every rank's ``(status, bytes)`` that came back by ``end``; fewer when one is late."""
        if not self.ready:
            started = self._wait(0, end)
            if (
                any(status != "ok" for status, _ in started.values())
                or len(started) < self.world_size
            ):
                return started
            self.ready = True
        self.seq += 1
        for q in self.tasks:
            q.put((self.seq, self.fresh, task))
        self.fresh = None
        return self._wait(self.seq, end)

    def _wait(self, seq: int, deadline: float) -> dict[int, tuple[str, bytes]]:
        got: dict[int, tuple[str, bytes]] = {}
        end = deadline
        while len(got) < self.world_size:
            now = time.monotonic()
            if now > end:
                break
            try:
                s, rank, status, data = self.replies.get(timeout=min(0.5, end - now))
            except queue.Empty:
                for r, p in enumerate(self.procs):
                    if r not in got and not p.is_alive():
                        got[r] = ("died", str(p.exitcode).encode())
                continue
            if s == seq:  # a reply to an abandoned task never counts
                got[rank] = (status, data)
                if status != "ok":  # the others may wait for it in a collective: a short grace
                    end = min(end, time.monotonic() + _GRACE)
        late = [r for r in range(self.world_size) if r not in got]
        if late and time.monotonic() > deadline and hasattr(signal, "SIGUSR1"):
            for r in late:  # a hang: its stack on stderr, to see where it waits
                pid = self.procs[r].pid
                if pid is not None and self.procs[r].is_alive():
                    os.kill(pid, signal.SIGUSR1)
            time.sleep(0.5)
        return got

    def stop(self, *, kill: bool = False) -> None:
        """Stop the processes: told to leave (``close``), or killed at once (a failed run)."""
        if kill:
            for p in self.procs:
                if p.is_alive():
                    p.kill()
        self._finalizer()


def _stop(procs: list[Any], tasks: list[Any], directory: str) -> None:
    for p, q in zip(procs, tasks):
        if p.is_alive():
            try:
                q.put(None)
            except (OSError, ValueError):
                pass
    end = time.monotonic() + 5.0
    for p in procs:
        p.join(timeout=max(0.0, end - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(timeout=10.0)
    shutil.rmtree(directory, ignore_errors=True)


def _serve(
    rank: int, world_size: int, store: str, timeout: float, tasks: Any, replies: Any
) -> None:
    """A rank: join the group, then run tasks until told to stop (``None``)."""
    torch.set_num_threads(1)
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        init_loopback_group(store, rank, world_size, timeout=timeout)
    except Exception as err:
        replies.put((0, rank, "raised", _dumps_error(err)))
        return
    replies.put((0, rank, "ok", b""))
    try:
        while (task := tasks.get()) is not None:
            seq, fresh, data = task
            try:
                if fresh is not None:  # a run failed: leave the old group, whatever it holds
                    dist.destroy_process_group()
                    init_loopback_group(fresh, rank, world_size, timeout=timeout)
                    fr.clear_caches()  # what fr.distributed learnt of the old group's ranks
            except Exception as err:
                replies.put((seq, rank, "raised", _dumps_error(err)))
                return  # out of any group: the pool starts new ranks
            try:
                fn, args, kwargs = _loads(data)
            except Exception as err:  # a class or function the rank cannot import
                replies.put((seq, rank, "raised", _dumps_error(err, f" ({_IMPORTABLE})")))
                continue
            try:
                reply = (seq, rank, "ok", _dumps(fn(*args, **kwargs)))
            except Exception as err:
                reply = (seq, rank, "raised", _dumps_error(err))
            replies.put(reply)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        replies.close()
        replies.join_thread()  # the last reply is sent; then skip torch's slow interpreter teardown
        os._exit(0)


def _dumps(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _loads(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=False)


def _dumps_error(err: Exception, hint: str = "") -> bytes:
    """The exception's type (``None`` where it cannot travel), message and traceback text."""
    text = "".join(traceback.format_exception(err))
    try:
        return _dumps((type(err), str(err) + hint, text))
    except Exception:
        return _dumps((None, f"{type(err).__name__}: {err}{hint}", text))


def _name(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)


def _error(
    caller: str, what: str, world_size: int, replies: dict[int, tuple[str, bytes]], deadline: float
) -> Exception:
    """The exception a failed run raises: a death first (the others' errors follow from it),
    else the lowest failing rank's, else the lateness."""
    died = [r for r in range(world_size) if r in replies and replies[r][0] == "died"]
    if died:
        codes = ", ".join(f"rank {r} (exit code {replies[r][1].decode()})" for r in died)
        return RuntimeError(f"{caller}: {codes} died running {what}; the next run starts new ranks")
    for rank in range(world_size):
        if rank in replies and replies[rank][0] == "raised":
            kind, message, text = _loads(replies[rank][1])
            name = getattr(kind, "__name__", "an exception")
            full = f"{caller}: rank {rank} raised {name} running {what}: {message}"
            try:
                err = kind(full) if isinstance(kind, type) and issubclass(kind, Exception) else None
            except Exception:  # a type that is not made from a message
                err = None
            if not isinstance(err, Exception):
                err = RuntimeError(full)
            # the rank's traceback, shown as the cause (as concurrent.futures shows a worker's)
            err.__cause__ = _RankTraceback(f"the traceback on rank {rank}:\n{text}")
            return err
    late = [r for r in range(world_size) if r not in replies]
    return TimeoutError(
        f"{caller}: rank(s) {late} did not answer within {deadline} s running {what}; the ranks "
        "were stopped (a late rank's stack is on stderr) and the next run starts new ones"
    )


class _RankTraceback(Exception):
    """A rank's traceback as text: the cause of the exception a failed run raises."""
