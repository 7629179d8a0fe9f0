"""pyflakes over the package, the benchmarks and the tests: no undefined name, no unused import or
variable, no import shadowed — the mistakes a tree-wide move leaves behind. Re-exports are allowed
where they are the point: a package's ``__init__`` and a line marked ``# noqa``."""

from __future__ import annotations

import pathlib

from pyflakes import api, messages
from pyflakes.reporter import Reporter

ROOT = pathlib.Path(__file__).resolve().parents[2]
GENERATED = ("_pb2.py", "_pb2_grpc.py")


class _Collect(Reporter):
    def __init__(self) -> None:
        self.found: list[str] = []

    def unexpectedError(self, filename, msg):  # noqa: N802 (pyflakes' names)
        self.found.append(f"{filename}: {msg}")

    def syntaxError(self, filename, msg, lineno, offset, text):  # noqa: N802
        self.found.append(f"{filename}:{lineno}: {msg}")

    def flake(self, message):
        path = pathlib.Path(message.filename)
        line = path.read_text(encoding="utf-8").splitlines()[message.lineno - 1]
        if "noqa" in line:
            return
        if path.name == "__init__.py" and isinstance(message, messages.UnusedImport):
            return
        self.found.append(str(message))


def test_pyflakes_finds_nothing():
    reporter = _Collect()
    for folder in ("chronoq", "bench", "tests"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if not path.name.endswith(GENERATED):
                api.checkPath(str(path), reporter)
    assert reporter.found == []


def test_the_check_sees_an_undefined_name(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import os\n\n\ndef f():\n    return undefined_name\n")
    reporter = _Collect()
    api.checkPath(str(bad), reporter)
    assert any("undefined name 'undefined_name'" in f for f in reporter.found)
    assert any("'os' imported but unused" in f for f in reporter.found)
