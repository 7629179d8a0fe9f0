"""Running as a systemd service: the unit in deploy/ passes ``systemd-analyze verify``, and
``chronoq serve`` speaks systemd's readiness protocol to a real ``NOTIFY_SOCKET``."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys

import pytest

from .conftest import ROOT, ChronoqProcess

UNIT = os.path.join(ROOT, "deploy", "chronoq.service")


def test_the_unit_file_verifies(tmp_path):
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed")
    # verify checks that ExecStart is executable: point it at this checkout's chronoq.
    chronoq = os.path.join(os.path.dirname(sys.executable), "chronoq")
    assert os.access(chronoq, os.X_OK), chronoq
    text = open(UNIT).read()
    assert "ExecStart=/opt/chronoq/.venv/bin/chronoq serve" in text and "Type=notify" in text
    unit = tmp_path / "chronoq.service"
    unit.write_text(text.replace("/opt/chronoq/.venv/bin/chronoq", chronoq))
    done = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True, timeout=60)
    complaints = [line for line in (done.stdout + done.stderr).splitlines() if "chronoq.service" in line]
    assert done.returncode == 0 and not complaints, done.stdout + done.stderr


def test_serve_notifies_ready_and_stopping(tmp_path):
    path = str(tmp_path / "notify.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as manager:
        manager.bind(path)
        manager.settimeout(30)
        os.environ["NOTIFY_SOCKET"] = path
        try:
            broker = ChronoqProcess(str(tmp_path / "data"))
        finally:
            os.environ.pop("NOTIFY_SOCKET", None)
        try:
            messages = [manager.recv(4096).decode()]
            while "READY=1" not in messages[-1]:
                messages.append(manager.recv(4096).decode())
            assert messages[0].startswith("STATUS=opening ")  # recovery first, then ready
            ready = messages[-1].split("\n")
            assert ready[0] == "READY=1" and ready[1].startswith("STATUS=chronoq is ready")
            broker.proc.send_signal(signal.SIGTERM)
            stopping = manager.recv(4096).decode().split("\n")
            assert stopping[0] == "STOPPING=1"
            assert broker.proc.wait(30) == 0
        finally:
            broker.stop(check=False)
