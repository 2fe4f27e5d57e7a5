"""Path (b): ``fr.distributed`` beside ``DistributedDataParallel`` on 2 gloo ranks of this machine.

Each rank trains both sides from the same initial weights (each rank
builds its own, and both sides take rank 0's: DDP at construction,
``fr.distributed.broadcast`` as a function) on its own shard of every batch
(``torch.chunk``, rank r the r-th), with ``torch.optim.AdamW`` on the DDP
side and the functional AdamW on the other. The ranks meet through a file
store (nothing listens for the rendezvous) and gloo talks over the loopback
interface only; every collective has a timeout, and the parent gives up on
ranks that have not answered in time, asking each for its Python stack
(SIGUSR1, printed on the terminal: where it hung) and then killing it, so
the demo always ends.
"""

from __future__ import annotations

import copy
import faulthandler
import os
import queue
import shutil
import signal
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

import freplicate as fr

from . import _adamw, _data
from ._options import Options
from ._progress import bar, say
from ._record import Agreement, PathResult, Side, Tolerance
from ._single import accuracy

WORLD = 2
TIMEOUT_S = 120.0  # the whole path, from spawning the ranks to their last answer


def _rank(
    rank: int,
    store: str,
    options: Options,
    data: _data.Digits,
    order: list[list[torch.Tensor]],
    tol: Tolerance,
    out: Any,
) -> None:
    """One rank: train DDP and fr.distributed side by side, put its record on ``out``."""
    from torch.nn.parallel import DistributedDataParallel

    if hasattr(signal, "SIGUSR1"):  # the parent asks a rank that is late for its stack
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        torch.set_num_threads(1)
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # gloo's sockets on the loopback interface only
        dist.init_process_group(
            "gloo",
            init_method=f"file://{store}",
            rank=rank,
            world_size=WORLD,
            timeout=timedelta(seconds=60),
        )
    except Exception as exc:
        out.put((rank, f"{type(exc).__name__}: {exc}"))
        return
    try:
        # each rank its own init: both sides must start from rank 0's
        model = _data.model(options.model, seed=rank, dtype=options.torch_dtype)
        ddp = DistributedDataParallel(copy.deepcopy(model))  # broadcasts rank 0's weights
        opt = torch.optim.AdamW(ddp.parameters(), lr=options.lr)
        params = fr.distributed.broadcast(fr.state(model).params)  # the same, as a function
        opt_state = _adamw.init(params)

        def loss_fn(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            out, _ = fr.apply(model, fr.State(p, {}), x)
            return F.cross_entropy(out, y)

        grad_fn = fr.distributed.grad_and_value(loss_fn)
        agreement = Agreement(tol)
        fr_side, twin = Side("fr"), Side("DDP")
        twin_params = dict(ddp.module.named_parameters())
        progress = bar("(b) 2 gloo ranks", sum(map(len, order))) if rank == 0 else None
        n = 0
        for epoch in order:
            for idx in epoch:
                x, y = data.x_train[idx].chunk(WORLD)[rank], data.y_train[idx].chunk(WORLD)[rank]
                start = time.perf_counter()
                grads, loss = grad_fn(params, x, y)
                params, opt_state = _adamw.update(params, grads, opt_state, lr=options.lr)
                mid = time.perf_counter()
                opt.zero_grad(set_to_none=True)
                twin_loss = F.cross_entropy(ddp(x), y)
                twin_loss.backward()
                opt.step()
                fr_side.step_s.append(mid - start)
                twin.step_s.append(time.perf_counter() - mid)
                fr_side.losses.append(float(loss))
                twin.losses.append(float(twin_loss.detach()))
                agreement.check(
                    n,
                    float(loss),
                    float(twin_loss.detach()),
                    grads,
                    {k: p.grad for k, p in twin_params.items()},  # type: ignore[misc]
                    params,
                    twin_params,
                )
                n += 1
                if progress is not None:
                    progress.update()
            if rank == 0:
                fr_side.accuracy.append(accuracy(model, params, data.x_test, data.y_test))
                twin.accuracy.append(accuracy(model, twin_params, data.x_test, data.y_test))
        if progress is not None:
            progress.close()
        out.put((rank, (fr_side, twin, agreement)))
    except Exception:
        out.put((rank, traceback.format_exc(limit=-1).strip().splitlines()[-1]))
    finally:
        out.close()
        out.join_thread()  # the record is in the parent's pipe before any teardown
        dist.destroy_process_group()


def distributed(
    options: Options, data: _data.Digits, order: list[list[torch.Tensor]], tol: Tolerance
) -> PathResult:
    """Path (b): spawn the ranks, wait for both records (or give up), merge them."""
    say(
        "(b) 2 gloo ranks on 127.0.0.1, each on its shard of every batch: "
        "fr.distributed.grad_and_value + AdamW as tree maps, beside "
        "DistributedDataParallel + torch.optim.AdamW"
    )
    result = PathResult(
        title="(b) fr.distributed, 2 gloo ranks",
        twin_title="DistributedDataParallel",
        fr=Side("fr"),
        twin=Side("DDP"),
        agreement=Agreement(tol),
    )
    tmp = tempfile.mkdtemp(prefix="freplicate-demo-")
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    args = (os.path.join(tmp, "store"), options, data, order, tol, out)
    procs = [ctx.Process(target=_rank, args=(r, *args), daemon=True) for r in range(WORLD)]
    records: dict[int, Any] = {}
    deadline = time.monotonic() + TIMEOUT_S
    try:
        for p in procs:
            p.start()
        while len(records) < WORLD and time.monotonic() < deadline:
            try:
                rank, record = out.get(timeout=1.0)
                records[rank] = record
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in procs):
                    break  # a rank died without a word (killed, out of memory)
    finally:
        late = len(records) < WORLD
        for r, p in enumerate(procs):
            if late and r not in records and p.pid and p.is_alive() and hasattr(signal, "SIGUSR1"):
                say(f"(b) rank {r} has not answered: its Python stack follows")
                os.kill(p.pid, signal.SIGUSR1)  # printed by the rank on this terminal
                time.sleep(1.0)
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
        shutil.rmtree(tmp, ignore_errors=True)
    errors = [f"rank {r}: {v}" for r, v in sorted(records.items()) if isinstance(v, str)]
    if errors or len(records) < WORLD:
        missing = [r for r in range(WORLD) if r not in records]
        why = errors or [
            f"rank {r} did not answer within {TIMEOUT_S:.0f} s (exit code {procs[r].exitcode})"
            for r in missing
        ]
        result.failed = "failed: " + "; ".join(why)
        return result
    (fr0, twin0, agree0), (fr1, twin1, agree1) = records[0], records[1]
    # the loss of a step is the mean of the ranks' shard losses; its time the slowest rank's
    for merged, a, b in ((result.fr, fr0, fr1), (result.twin, twin0, twin1)):
        merged.losses = [(u + v) / 2 for u, v in zip(a.losses, b.losses)]
        merged.step_s = [max(u, v) for u, v in zip(a.step_s, b.step_s)]
        merged.accuracy = a.accuracy
    worst = result.agreement
    for part in (agree0, agree1):
        worst.loss = max(worst.loss, part.loss)
        worst.grads = max(worst.grads, part.grads)
        worst.params = max(worst.params, part.params)
    misses = [f"rank {r} at {a.first_miss}" for r, a in enumerate((agree0, agree1)) if a.first_miss]
    worst.first_miss = "; ".join(misses) or None
    return result
