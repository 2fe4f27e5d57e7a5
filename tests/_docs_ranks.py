"""The code blocks of the docs pages, and the rank side of their runs on 2 gloo ranks.

``blocks(page)`` reads a page's fenced blocks (and the ``<!-- not run: why -->``
marker before one); ``run_page(page)`` runs its python blocks in order, as a
module of its own. A page whose code is collective (``fr.distributed``) runs
as written on every rank of a group joined with
``fr.testing.init_loopback_group``, through ``_dist_workers``' spawner (a
file store, gloo on loopback, every collective bounded by the group's
timeout, stragglers killed): the group stands in for the one ``torchrun``
would give. ``main`` is the ranks' entry point; each page is a scenario
named by its path.
"""

from __future__ import annotations

import re
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _dist_workers import SCENARIOS, _main, spawn

ROOT = Path(__file__).resolve().parent.parent

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
_NOT_RUN = re.compile(r"^\s*<!--\s*not run:(?P<why>.*?)-->\s*$")


@dataclass
class Block:
    page: str
    line: int  # of the opening fence, from 1
    lang: str
    code: str
    not_run: str | None  # the marker's reason, "" for a marker without one

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def blocks(page: str) -> list[Block]:
    lines = (ROOT / page).read_text().splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence = m["indent"], m["fence"]
        end = i + 1
        while end < len(lines) and not re.match(rf"^\s*{re.escape(fence)}\s*$", lines[end]):
            end += 1
        body = [
            line[len(indent) :] if line.startswith(indent) else line for line in lines[i + 1 : end]
        ]
        before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        marker = _NOT_RUN.match(before)
        found.append(
            Block(
                page=page,
                line=i + 1,
                lang=m["info"].strip().split(" ")[0],
                code="\n".join(body) + "\n",
                not_run=marker["why"].strip() if marker else None,
            )
        )
        i = end + 1
    return found


def runnable(page: str) -> list[Block]:
    return [b for b in blocks(page) if b.lang == "python" and b.not_run is None]


def run_page(page: str) -> None:
    """Run the page's python blocks in order, in a module of its own, as a script would run.

    The module is in ``sys.modules`` while it runs: torch.compile looks its
    functions' module up there.
    """
    module = types.ModuleType("docs_page_" + re.sub(r"\W", "_", page))
    sys.modules[module.__name__] = module
    try:
        for b in runnable(page):
            exec(compile(b.code, b.where, "exec"), module.__dict__)
    finally:
        del sys.modules[module.__name__]


def main(*args: Any) -> None:
    """The ranks' entry point: every name given is a page, run as a scenario."""
    for page in args[2]:
        SCENARIOS[page] = lambda rank, page=page: run_page(page)
    _main(*args)


def run_on_ranks(pages: list[str]) -> dict[str, list[Any]]:
    """``{page: [rank 0's result, rank 1's]}``: ``None``, or ``("raised", ..., traceback)``."""
    return spawn(pages, target=main, pg_timeout=30.0, deadline=300.0)
