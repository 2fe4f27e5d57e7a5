"""Rank-side code of tests/test_example_llama.py: the Llama example's loop on 2 gloo ranks.

A scenario's name is a command line of ``examples/llama_train.py``, read
after ``TINY`` (a Llama of about 20,000 parameters, a few steps): the run
``train`` makes with it, ZeRO-3 and FSDP2 side by side, is what the scenario
returns. ``main``, the ranks' entry point, registers one scenario per name
it is given, then runs them through ``_dist_workers``' loop (a file store,
gloo on loopback, bounded timeouts, stragglers killed), so no test goes
through ``torchrun``.
"""

from __future__ import annotations

import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _dist_workers import SCENARIOS, _main, spawn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import llama_train  # the example is a script, found on its folder's path

TINY = (
    "--vocab-size 64 --hidden-size 32 --intermediate-size 48 --num-hidden-layers 2"
    " --num-attention-heads 4 --num-key-value-heads 2 --seq-len 16 --batch-size 4 --steps 6"
)


def config(name: str) -> llama_train.Config:
    return llama_train.parse(shlex.split(TINY) + shlex.split(name))


def scenario(name: str) -> Callable[[int], dict[str, Any]]:
    return lambda rank: llama_train.train(config(name), log=None)


def main(*args: Any) -> None:
    for name in args[2]:
        SCENARIOS[name] = scenario(name)
    _main(*args)


def run(names: list[str]) -> dict[str, list[Any]]:
    """``{name: [rank 0's run, rank 1's]}`` for the command lines ``names``, on 2 fresh ranks."""
    return spawn(names, target=main, pg_timeout=30.0, deadline=120.0)
