"""How the package is put together: what ``import freplicate`` loads, what decides by text, sizes.

These read the package itself (fresh interpreters, its source files):
nothing of the compiler at import, one change to torch's load allowlist,
no exception classified by its message, no import circle inside
``_distributed``, no private name imported from another module, and its
functions kept small.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "freplicate"


def _fresh(code: str) -> dict:
    """Run ``code`` in a new interpreter (it prints one JSON line); its answer."""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_import_loads_nothing_of_the_compiler() -> None:
    got = _fresh(
        "import sys, json, torch, torch.distributed\n"
        "before = set(sys.modules)\n"
        "import freplicate\n"
        "lazy = 'freplicate._distributed' in sys.modules\n"
        "freplicate.distributed.all_reduce  # its first use imports it\n"
        "heavy = ['torch._dynamo', 'torch._inductor', 'torch.distributed.tensor',\n"
        "         'torch.distributed._functional_collectives']\n"
        "print(json.dumps({'loaded': [m for m in heavy if m in sys.modules],\n"
        "                  'before': [m for m in heavy if m in before], 'lazy': lazy}))"
    )
    assert got["before"] == []  # (so the check below means something)
    assert got["loaded"] == [], got
    assert got["lazy"] is False  # fr.distributed waits for its first use


def test_distributed_is_there_however_it_is_reached() -> None:
    got = _fresh(
        "import json\n"
        "from freplicate import distributed as a\n"
        "import freplicate as fr\n"
        "import freplicate.distributed as b\n"
        "from freplicate import *  # noqa: F403\n"
        "print(json.dumps([a is b, fr.distributed is b, distributed is b]))  # noqa: F405"
    )
    assert got == [True, True, True]


def test_the_load_allowlist_grows_by_state_only() -> None:
    got = _fresh(
        "import json, torch, torch.distributed\n"
        "from torch.serialization import get_safe_globals\n"
        "def names():\n"
        "    return {getattr(g, '__qualname__', repr(g)) for g in get_safe_globals()}\n"
        "before = names()\n"
        "import freplicate as fr\n"
        "x = fr.distributed  # and the public face, used\n"
        "print(json.dumps(sorted(names() - before)))"
    )
    assert got == ["State"], got


def _handlers(tree: ast.AST) -> list[tuple[str, ast.ExceptHandler]]:
    return [(n.name, n) for n in ast.walk(tree) if isinstance(n, ast.ExceptHandler) and n.name]


def _reads_text(node: ast.AST, name: str) -> bool:
    """Whether ``node`` looks into the text of exception ``name`` (``"x" in str(e)`` and kin)."""

    def is_text(x: ast.AST) -> bool:
        if isinstance(x, ast.Call) and isinstance(x.func, ast.Name) and x.func.id in ("str", "repr"):
            return any(isinstance(a, ast.Name) and a.id == name for a in x.args)
        if isinstance(x, ast.Attribute) and x.attr == "args":
            return isinstance(x.value, ast.Name) and x.value.id == name
        return False

    for sub in ast.walk(node):
        if isinstance(sub, ast.Compare) and any(map(is_text, [sub.left, *sub.comparators])):
            return True
        if isinstance(sub, ast.Call) and isinstance(sub.func, ast.Attribute):
            if is_text(sub.func.value) and sub.func.attr in (
                "startswith", "endswith", "find", "index", "lower", "upper", "split", "count",
            ):
                return True
    return False


def test_no_exception_is_classified_by_its_text() -> None:
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for name, handler in _handlers(tree):
            for stmt in handler.body:
                if _reads_text(stmt, name):
                    offenders.append(f"{path.relative_to(ROOT)}:{handler.lineno} ({name})")
    assert offenders == [], offenders


def test_the_text_check_finds_what_it_looks_for() -> None:
    # the check above can fail: it sees the patterns the old code used
    code = (
        "try:\n    pass\nexcept RuntimeError as err:\n"
        "    if 'use_reentrant=True' in str(err) or 'sparse' in str(err).lower():\n        pass\n"
    )
    (name, handler), = _handlers(ast.parse(code))
    assert _reads_text(handler.body[0], name)


def _imports(path: Path) -> set[str]:
    """The sibling modules of ``_distributed`` that ``path`` imports (``from ._x import``)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                out.add(node.module.split(".")[0])
            else:
                out.update(a.name for a in node.names)
    return out


def test_distributed_has_no_import_circle() -> None:
    folder = PACKAGE / "_distributed"
    graph = {p.stem: _imports(p) for p in folder.glob("*.py") if p.stem != "__init__"}
    seen: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        if seen.get(node) == 1:
            raise AssertionError(f"import circle: {' -> '.join([*path, node])}")
        if seen.get(node) == 2:
            return
        seen[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if nxt in graph:
                visit(nxt, [*path, node])
        seen[node] = 2

    for node in sorted(graph):
        visit(node, [])


def test_no_private_name_is_imported_from_another_module() -> None:
    # a module's underscored names are its own: what another module needs is named without one
    # (private modules themselves, ``from . import _flags``, are the package's to share)
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.ImportFrom) and node.level):
                continue
            base = path.parent
            for _ in range(node.level - 1):
                base = base.parent
            target = base.joinpath(*node.module.split(".")) if node.module else base
            for alias in node.names:
                name = alias.name
                if not name.startswith("_") or name.startswith("__"):
                    continue
                if not ((target / f"{name}.py").exists() or (target / name).is_dir()):
                    found.append(f"{path.relative_to(ROOT)}: {name} from {node.module}")
    assert found == [], found


@pytest.mark.parametrize("path", sorted((PACKAGE / "_distributed").glob("*.py")), ids=lambda p: p.name)
def test_distributed_functions_are_small(path: Path) -> None:
    # ~60 lines of code (docstrings aside) and ~8 parameters at most
    big = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                body = body[1:]  # the docstring
            lines = (body[-1].end_lineno - body[0].lineno + 1) if body else 0
            args = node.args
            count = len(args.posonlyargs + args.args + args.kwonlyargs)
            count -= 1 if args.args and args.args[0].arg in ("self", "cls") else 0
            # the public functions' keywords are fixed by the API (and Step takes them)
            public = not node.name.startswith("_") or node.name == "__init__"
            public = public and path.stem in ("_collectives", "_step")
            if lines > 60 or (count > 8 and not public):
                big.append(f"{node.name}: {lines} lines, {count} parameters")
    assert big == [], big


_KIND_NAMES = ("reduce", "scatter", "gather", "all_reduce", "broadcast", "reduce_scatter", "all_gather")


def _compares_a_kind_name(node: ast.AST) -> bool:
    """``options.kind == "scatter"`` and kin: a kind tested by its name."""
    if not isinstance(node, ast.Compare):
        return False
    sides = [node.left, *node.comparators]
    named = any(isinstance(x, ast.Constant) and x.value in _KIND_NAMES for x in sides)
    kinds = [
        x for x in sides if "kind" in ast.unparse(x) and not isinstance(x, ast.Constant)
    ]
    return named and bool(kinds)


def test_no_kind_is_tested_by_its_name_outside_the_wire_format() -> None:
    # issue 23: the kind is an object (_wire) whose attributes and methods say what differs
    offenders = []
    for path in sorted((PACKAGE / "_distributed").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if _compares_a_kind_name(node):
                offenders.append(f"{path.name}:{node.lineno}")
    assert offenders == [], offenders
    assert _compares_a_kind_name(ast.parse('options.kind == "scatter"').body[0].value)  # type: ignore[attr-defined]
    assert not _compares_a_kind_name(ast.parse('mode == "broadcast"').body[0].value)  # type: ignore[attr-defined]


def test_the_call_driver_issues_no_collective_itself() -> None:
    # issue 23: _call drives a call; the kinds (_wire) and the transports start collectives
    source = (PACKAGE / "_distributed" / "_call.py").read_text()
    calls = [
        node
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "dist"
        and node.attr not in ("get_rank", "get_world_size")
    ]
    assert calls == [], [f"dist.{c.attr} at line {c.lineno}" for c in calls]


def test_the_distributed_package_draws_its_call_paths() -> None:
    import freplicate._distributed as package

    doc = package.__doc__ or ""
    for part in ("_wire", "_rules", "Eager.start", "start_traced", "kind.transpose", "kind.joined"):
        assert part in doc, part
