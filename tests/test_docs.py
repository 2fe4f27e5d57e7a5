"""The code in README.md and on every docs page runs as written, and says what it claims.

Every fenced block names its language. A page's ```python blocks run in order
in one namespace (a page is one story); an assertion in a block that fails
fails the test. A python block that cannot run here says so on the line just
before its fence, with the reason: ``<!-- not run: why -->``. The pages in
``COLLECTIVE`` use ``fr.distributed``: their blocks run on 2 gloo ranks on
this machine (``tests/_docs_ranks.py``), in a group that stands in for the
one ``torchrun`` would give.
"""

from __future__ import annotations

import ast
import inspect
import re
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

import freplicate as fr

sys.path.insert(0, str(Path(__file__).parent))  # the spawned ranks import the helpers by name
from _docs_ranks import ROOT, blocks, run_on_ranks, run_page, runnable

PAGES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md"))]
COLLECTIVE = [
    "docs/distributed.md",
    "docs/frozen_parameters.md",
    "docs/sharding.md",
    "docs/uneven_inputs.md",
    "docs/composing.md",
]


def test_the_pages_are_found() -> None:
    assert {"README.md", "docs/index.md", "docs/api/index.md", *COLLECTIVE} <= set(PAGES)


@pytest.mark.parametrize("page", PAGES)
def test_every_block_names_its_language_and_every_marker_its_reason(page: str) -> None:
    for b in blocks(page):
        assert b.lang, f"{b.where}: a code block without a language (```python, ```text, ```bash)"
        if b.not_run is not None:
            assert b.lang == "python", f"{b.where}: a not-run marker before a {b.lang} block"
            assert b.not_run, f"{b.where}: say why the block is not run: <!-- not run: why -->"
        if b.lang == "python":
            ast.parse(b.code, b.where)  # even a block that is not run is valid python


@pytest.mark.parametrize("page", [p for p in PAGES if p not in COLLECTIVE and runnable(p)])
def test_page_runs(page: str) -> None:
    run_page(page)


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")
def test_collective_pages_run_on_two_ranks() -> None:
    assert all(runnable(page) for page in COLLECTIVE), "a collective page without code to run"
    failed = {
        f"{page} on rank {rank}": result[3]
        for page, results in run_on_ranks(COLLECTIVE).items()
        for rank, result in enumerate(results)
        if result is not None
    }
    assert not failed, "\n".join(f"{k}:\n{tb}" for k, tb in failed.items())


def prose(page: str) -> str:
    """The page without its code blocks and its admonitions (which may name what is being built)."""
    lines = (ROOT / page).read_text().splitlines()
    for b in blocks(page):  # blank out the fenced blocks, fences included
        end = b.line + b.code.count("\n")
        lines[b.line - 1 : end + 1] = [""] * (end + 2 - b.line)
    kept, in_admonition = [], False
    for line in lines:
        if line.startswith("!!!"):
            in_admonition = True
        elif in_admonition and line.strip() and not line.startswith((" ", "\t")):
            in_admonition = False
        kept.append("" if in_admonition else line)
    return "\n".join(kept)


@pytest.mark.parametrize("page", PAGES)
def test_the_prose_names_only_what_exists(page: str) -> None:
    # `fr.name(...)` in the text: the name exists, and every keyword it shows is a parameter
    import freplicate.testing  # noqa: F401  (fr.testing is imported on first use)

    for span in re.findall(r"`([^`\n]+)`", prose(page)):
        for name in re.findall(r"\bfr(?:\.\w+)+", span):
            obj: object = fr
            for part in name.split(".")[1:]:
                assert hasattr(obj, part), f"{page}: `{span}` names {name}, which does not exist"
                obj = getattr(obj, part)
            call = re.match(rf"{re.escape(name)}\((.*)\)", span)
            if not call or not callable(obj):
                continue
            params = inspect.signature(obj).parameters
            if any(p.kind is p.VAR_KEYWORD for p in params.values()):
                continue
            for keyword in re.findall(r"(?<![=\w.])(\w+)=(?!=)", call[1]):
                assert keyword in params, f"{page}: `{span}`: {name} has no parameter {keyword!r}"


def test_api_reference_names_every_public_name() -> None:
    # adding a public name is one `::: freplicate.name` line on a page of docs/api/
    import freplicate.testing

    reference = "\n".join((ROOT / p).read_text() for p in PAGES if p.startswith("docs/api/"))
    shown = set(re.findall(r"^::: (freplicate[\w.]*)\s*$", reference, flags=re.M))
    public = {
        f"{module.__name__}.{name}"
        for module in (fr, fr.distributed, freplicate.testing)
        for name in module.__all__
    }
    assert not public - shown, f"missing from docs/api/: {sorted(public - shown)}"


def test_readme_shows_the_ci_command() -> None:
    ci = [
        line.strip()
        for line in (ROOT / ".ci" / "run").read_text().splitlines()
        if line.strip() and not line.lstrip().startswith(("#", "set "))
    ]
    assert ci == ["./scripts/test"]
    assert "./scripts/test" in (ROOT / "README.md").read_text()
