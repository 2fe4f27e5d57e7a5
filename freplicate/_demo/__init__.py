"""The demo: train a real model with freplicate beside PyTorch's stateful designs, step by step.

scikit-learn's digits, a small MLP (or CNN) trained to about 97% test
accuracy with AdamW, along up to three paths, each the functional way
beside a stateful twin from the same initial weights on the same batches,
compared after every step (loss, gradients, parameters):

(a) one process on ``--devices``: ``fr.data_parallel_grad`` beside
    DataParallel's algorithm (``nn.DataParallel`` on 2+ CUDA devices);
(b) 2 gloo ranks: ``fr.distributed.grad_and_value`` beside
    ``DistributedDataParallel``;
(c) ``torch.compile`` of the functional step (one device) beside the eager one.

Only the public face (``import freplicate as fr``) is used, as a user would.
"""

from __future__ import annotations

import argparse
import time

import torch

from . import _data, _report
from ._options import DemoError, Options, add_arguments, options_from
from ._progress import say
from ._ranks import distributed
from ._record import TOLERANCES
from ._single import compiled, data_parallel

__all__ = ["DemoError", "Options", "add_arguments", "main", "run"]


def run(options: Options) -> bool:
    """Train along every path, print the table, save the plot; whether every path agreed."""
    started = time.perf_counter()
    tol = TOLERANCES[options.dtype]
    data = _data.load(options.torch_dtype)
    if options.batch_size > len(data.y_train):
        raise DemoError(
            f"--batch-size must be at most {len(data.y_train)}, the training set "
            f"(got {options.batch_size})"
        )
    order = _data.batch_order(len(data.y_train), options.batch_size, options.epochs, options.steps)
    steps_per_epoch = len(order[0])
    model = _data.model(options.model)
    size = sum(p.numel() for p in model.parameters())
    print("freplicate demo: each path trains twice from one init, fr beside its stateful twin")
    print(
        f"data: scikit-learn digits, {len(data.y_train)} train / {len(data.y_test)} test; "
        f"model: {options.model} ({size:,} parameters, {options.dtype}); AdamW lr {options.lr:g}; "
        f"batch {options.batch_size}; {options.epochs} epochs x {steps_per_epoch} steps"
    )
    if all(d == "cpu" for d in options.devices) and not torch.cuda.is_available():
        print(f"devices for (a): {', '.join(options.devices)} (CPU replicas: no CUDA here)")
    else:
        print(f"devices for (a): {', '.join(options.devices)}")
    print(f"checked after every step: {tol.describe()}\n")

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # replicas run side by side on the cores, one thread each
    try:
        began = time.perf_counter()
        first = data_parallel(options, data, order, tol)
        first.wall_s = time.perf_counter() - began
        results = [first]
        if options.distributed:
            began = time.perf_counter()
            results.append(distributed(options, data, order, tol))
            results[-1].wall_s = time.perf_counter() - began
        if options.compile:
            began = time.perf_counter()
            results.append(compiled(options, data, order, tol))
            results[-1].wall_s = time.perf_counter() - began
        else:
            say("(c) torch.compile of the fr step: off (--compile runs it)")
    finally:
        torch.set_num_threads(threads)

    say("")
    for line in _report.summary(results, steps_per_epoch):
        say(line)
    png = _report.plot(results, options.out / "curves.png")
    print(f"\nplot: {png}")
    ok = all(r.ok for r in results)
    print(f"wall time: {time.perf_counter() - started:.0f} s")
    failed = [r.title[:3] for r in results if r.failed]
    if ok:
        print("OK: every path agrees with its stateful twin at every step.")
    elif failed and all(r.ok or r.failed for r in results):
        print(f"FAILED: {', '.join(failed)} did not run to the end (see above); nothing disagreed.")
    else:
        print("MISMATCH: a functional path and its stateful twin disagree (see above).")
        if options.dtype == "float32":
            print(
                "(in float32 a rounding difference can break a near tie, in max-pooling or a "
                "ReLU, the other way, and two correct runs then drift apart: --dtype float64 "
                "tells that apart from a real disagreement)"
            )
    return ok


def main(args: argparse.Namespace) -> int:
    """The ``freplicate demo`` command: 0 when every path agrees, 1 when one does not."""
    return 0 if run(options_from(args)) else 1
