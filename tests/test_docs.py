"""The code in README.md and the tutorial runs as written, and says what it claims.

Each page's ```python blocks are executed in order in one namespace (a page is
one story); an assertion in a block that fails fails the test.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = ["README.md", "docs/tutorial.md"]


def blocks(page: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / page).read_text(), flags=re.S)


@pytest.mark.parametrize("page", PAGES)
def test_page_runs(page: str) -> None:
    code = blocks(page)
    assert code, f"{page} has no python blocks"
    namespace: dict[str, object] = {"__name__": f"docs:{page}"}
    for i, block in enumerate(code):
        exec(compile(block, f"{page} block {i}", "exec"), namespace)


def test_readme_shows_the_ci_command() -> None:
    ci = [
        line.strip()
        for line in (ROOT / ".ci" / "run").read_text().splitlines()
        if line.strip() and not line.lstrip().startswith(("#", "set "))
    ]
    assert ci == ["./scripts/test"]
    assert "./scripts/test" in (ROOT / "README.md").read_text()
