"""The compiled hot path (chronoq.COMPILED_MODULES, setup.py) and its pure-Python fallback.

The normal build must run compiled (so a test run cannot silently be a pure-Python one), the
fallback must be what ``CHRONOQ_PURE_PYTHON=1`` gives, the protocol and codec tests must pass on
it too, and a compiled module built from another source than the one beside it must never run.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import warnings
from importlib.machinery import EXTENSION_SUFFIXES

import pytest

import chronoq
from chronoq import PURE_PYTHON_ENV, _SourceFirst

ROOT = pathlib.Path(__file__).resolve().parents[2]
# The unit tests of the compiled modules: run again on the pure-Python build.
CODEC_TESTS = ("test_h2protocol.py", "test_hpackdec.py", "test_h2client.py", "test_h2server.py",
               "test_h2server_calls.py", "test_wire.py",
               "test_send_columns.py", "test_send_one_path.py", "test_batched_encoders.py",
               "test_protocol_layer.py", "test_record.py", "test_timer_schedlog.py", "test_fuzz_decoders.py",
               "test_server_status_convert.py", "test_recall_handle_groups.py", "test_routing.py", "test_fsyncer.py",
               "test_committer.py", "test_callstats.py", "test_broker_api.py", "test_send_round_robin.py",
               "test_public_api.py", "test_client_answer.py", "test_dedupe.py", "test_trace.py")


def _env(pure: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k != PURE_PYTHON_ENV}
    if pure:
        env[PURE_PYTHON_ENV] = "1"
    return env


# A run under CHRONOQ_PURE_PYTHON=1 asked for the pure build: the finder then always loads the source.
pure_run = pytest.mark.skipif(os.environ.get(PURE_PYTHON_ENV, "") not in ("", "0"),
                              reason=f"{PURE_PYTHON_ENV} is set: this run asked for the pure-Python build")


@pure_run
def test_the_installed_build_runs_compiled():
    running = chronoq.compiled_modules()
    pure = sorted(name for name, compiled in running.items() if not compiled)
    assert not pure, (f"running as pure Python: {pure} (stale since an edit: {_SourceFirst.stale}); "
                      "re-run scripts/setup to compile them")
    assert chronoq.compiled() and chronoq.build() == "compiled"


def test_the_variable_forces_the_pure_build():
    probe = ("import chronoq, json; print(json.dumps([chronoq.build(), "
             "[__import__(n, fromlist=['_']).__file__ for n in chronoq.COMPILED_MODULES]]))")
    out = subprocess.run([sys.executable, "-c", probe], env=_env(True), capture_output=True, text=True, timeout=120,
                         check=True).stdout
    build, files = json.loads(out)
    assert build == "pure"
    assert files and all(f.endswith(".py") for f in files)


def test_the_codec_tests_pass_on_the_pure_build(tmp_path):
    script = ("import sys, chronoq, pytest\n"
              "rc = pytest.main(sys.argv[1:])\n"
              "assert chronoq.build() == 'pure', chronoq.compiled_modules()\n"
              "sys.exit(rc)\n")
    files = [str(ROOT / "tests" / "unit" / name) for name in CODEC_TESTS]
    proc = subprocess.run([sys.executable, "-c", script, "-q", "-p", "no:cacheprovider", "-x",
                           f"--basetemp={tmp_path / 'pt'}", *files],
                          env=_env(True), cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout


@pure_run
@pytest.mark.parametrize("case", ["built from this source", "built from another", "not built"])
def test_a_compiled_module_runs_only_if_built_from_its_source(tmp_path, case):
    name = chronoq.COMPILED_MODULES[0]
    leaf = name.rpartition(".")[2]
    source = tmp_path / f"{leaf}.py"
    source.write_text("X = 1\n")
    if case != "not built":
        (tmp_path / f"{leaf}{EXTENSION_SUFFIXES[0]}").write_bytes(b"")
    digest = chronoq.source_digest(str(source))
    built_before, stale_before = _SourceFirst.built, list(_SourceFirst.stale)
    _SourceFirst.built = {name: digest if case == "built from this source" else "0" * 64}
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            spec = _SourceFirst.find_spec(name, [str(tmp_path)])
        if case == "built from another":
            assert spec is not None and spec.origin == str(source)
            assert _SourceFirst.stale[-1] == name
            assert any("scripts/setup" in str(w.message) for w in caught)
        else:
            assert spec is None  # the normal finders pick the extension module, or the source
            assert not caught and _SourceFirst.stale == stale_before
    finally:
        _SourceFirst.built, _SourceFirst.stale[:] = built_before, stale_before


def test_a_module_is_stale_when_one_it_cimports_changed(tmp_path, monkeypatch):
    """h2server.pxd cimports h2streams' C types: an edit of h2streams.py must make h2server's
    compiled build stale too (run from source beside a Python Answers, its import would fail)."""
    (tmp_path / "dependent.py").write_text("X = 1\n")
    (tmp_path / "dependent.pxd").write_text("from chronoq.server.h2streams cimport Stream\n")
    before = chronoq.source_digest(str(tmp_path / "dependent.py"))
    real_open = open

    def edited(name, *args, **kwargs):  # h2streams.py as if edited since the build
        fh = real_open(name, *args, **kwargs)
        if str(name).endswith(os.path.join("server", "h2streams.py")):
            return __import__("io").BytesIO(fh.read() + b"# edited\n")
        return fh

    monkeypatch.setattr("builtins.open", edited)
    assert chronoq.source_digest(str(tmp_path / "dependent.py")) != before


@pure_run
def test_the_install_records_the_sources_it_compiled():
    with open(ROOT / "chronoq" / chronoq.BUILT_SOURCES_FILE) as fh:
        built = json.load(fh)
    assert sorted(built) == sorted(chronoq.COMPILED_MODULES)


def test_other_modules_are_left_to_the_normal_finders(tmp_path):
    (tmp_path / "not_listed.py").write_text("X = 1\n")
    assert _SourceFirst.find_spec("chronoq.protocol.h2.not_listed", [str(tmp_path)]) is None
    assert _SourceFirst.find_spec("json", None) is None
