"""The tree's arrows point down (issue 21 §4): a room imports only rooms below it.

Read from the source (every ``import`` and ``from ... import``, also inside functions), not by
importing, so a lazy import inside a function counts like one at the top. The HTTP listener's
optional console (``chronoq.server.http`` loads it by name, if installed) is composition, not an
import, and is not seen here.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "chronoq"


def imports_of(room: str) -> dict[str, set[str]]:
    """module path -> the chronoq modules it imports."""
    out = {}
    for path in sorted((PACKAGE / room).rglob("*.py")):
        names = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module)
                names.update(f"{node.module}.{a.name}" for a in node.names)
        out[str(path.relative_to(PACKAGE.parent))] = {n for n in names if n.startswith("chronoq.")}
    return out


def test_core_imports_only_core():
    for module, names in imports_of("core").items():
        upward = {n for n in names if not n.startswith("chronoq.core")}
        assert not upward, f"{module} imports {sorted(upward)}"


@pytest.mark.parametrize("room, forbidden", [
    ("server", "chronoq.console"),        # the shells do not call each other ...
    ("console", "chronoq.server.admin"),  # ... they share what they need from below (features.catalog)
    ("console", "chronoq.cli"),
    ("server", "chronoq.cli"),
])
def test_shells_do_not_import_each_other(room, forbidden):
    for module, names in imports_of(room).items():
        bad = {n for n in names if n == forbidden or n.startswith(forbidden + ".")}
        assert not bad, f"{module} imports {sorted(bad)}"
