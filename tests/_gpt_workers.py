"""Rank-side code of tests/test_example_gpt.py: the GPT example's loop on 2 gloo ranks.

A scenario's name is a command line of ``examples/gpt_train.py``, read
after ``TINY`` (a model of about 1,200 parameters, a handful of steps): the
run ``train`` makes with it is what the scenario returns: the example's loop
as a user runs it (``--zero 3`` included: nothing is kept alive or watched
for the test). ``main``, the ranks' entry point, registers one scenario per
name it is given, then runs them through ``_dist_workers``' loop (a file
store, gloo on loopback, bounded timeouts, stragglers killed), so no test
goes through ``torchrun``.
"""

from __future__ import annotations

import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _dist_workers import SCENARIOS, _main, spawn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import gpt_train  # the example is a script, found on its folder's path

TINY = (
    "--n-layer 1 --n-head 2 --n-embd 8 --block-size 8 --sentences 300 --batch-size 4"
    " --accumulate 3 --steps 5 --warmup 2 --eval-every 2 --eval-batches 2 --sample-chars 12"
)


def config(name: str) -> gpt_train.Config:
    return gpt_train.parse(shlex.split(TINY) + shlex.split(name))


def scenario(name: str) -> Callable[[int], dict[str, Any]]:
    return lambda rank: gpt_train.train(config(name), log=None)


def main(*args: Any) -> None:
    for name in args[2]:
        SCENARIOS[name] = scenario(name)
    _main(*args)


def run(names: list[str]) -> dict[str, list[Any]]:
    """``{name: [rank 0's run, rank 1's]}`` for the command lines ``names``, on 2 fresh ranks."""
    return spawn(names, target=main, pg_timeout=30.0, deadline=180.0)
