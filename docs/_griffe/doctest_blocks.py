"""A griffe extension for the docs site: freplicate's docstrings show their examples as code.

The docstrings open with ``>>>`` examples (run by pytest's doctest) without a
Google ``Examples:`` heading, and Markdown would read a bare ``>>>`` line as a
nested block quote. This fences every run of doctest lines (a ``>>>`` line, its
``...`` continuations and the expected output up to the next blank line) as a
``pycon`` code block, before mkdocstrings renders the docstring, and drops the
``# doctest: +FLAG`` directives from it (they are for the test runner, not the
reader). Nothing else in the text changes, so the docstrings stay the one
source of the reference.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_DIRECTIVE = re.compile(r"\s*#\s*doctest:.*$")
_EXAMPLES_SECTION = re.compile(r"^\s*Examples?:\s*$", flags=re.M)  # griffe renders those itself


def fence_doctests(text: str) -> str:
    """Wrap every doctest run of ``text`` in a fenced ``pycon`` block, without directives."""
    out: list[str] = []
    in_block = in_fence = False
    for line in text.splitlines():
        stripped = line.lstrip()
        if not in_block and stripped.startswith("```"):
            in_fence = not in_fence  # leave code that is fenced already alone
        if not in_fence and not in_block and stripped.startswith(">>>"):
            indent = line[: len(line) - len(stripped)]
            out.append(f"{indent}```pycon")
            in_block = True
        elif in_block and not stripped:
            out.append(f"{indent}```")
            in_block = False
        if in_block and stripped.startswith((">>>", "...")):
            line = _DIRECTIVE.sub("", line)
        out.append(line)
    if in_block:
        out.append(f"{indent}```")
    return "\n".join(out)


class DoctestBlocks(griffe.Extension):
    """Fence the doctest examples of every docstring griffe loads."""

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        docstring = obj.docstring
        if docstring and ">>>" in docstring.value and not _EXAMPLES_SECTION.search(docstring.value):
            docstring.value = fence_doctests(docstring.value)
