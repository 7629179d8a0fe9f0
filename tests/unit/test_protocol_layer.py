"""``chronoq.protocol`` lies below every other room but ``core``: the client and the server share
it, so nothing in it may import the broker, the store, the timer, POP, the server or the client.
(Guards the move of the RocketMQ codec into ``chronoq/protocol/rocketmq``.)"""

from __future__ import annotations

import ast
import pathlib

import chronoq.protocol

ALLOWED = ("chronoq.core", "chronoq.protocol")


def _chronoq_imports(path: pathlib.Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.append(node.module)
    return [name for name in out if name == "chronoq" or name.startswith("chronoq.")]


def test_the_protocol_package_imports_only_core_and_itself():
    root = pathlib.Path(chronoq.protocol.__file__).parent
    modules = sorted(root.rglob("*.py"))
    assert any(p.parent.name == "rocketmq" for p in modules)
    wrong = {f"{p.relative_to(root)}: {name}" for p in modules for name in _chronoq_imports(p)
             if not name.startswith(ALLOWED)}
    assert not wrong, sorted(wrong)
