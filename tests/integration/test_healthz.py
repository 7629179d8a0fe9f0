"""``/healthz`` of a real ``chronoq serve`` says "not ready" while the broker recovers, "ok" after.

The child process is ``chronoq serve`` with one injected hook: opening the broker (recovery) first
waits until the test creates a gate file, so the test sees the recovering state for as long as it
needs, whatever the machine's speed; then the real recovery runs. Nothing of the HTTP listener,
the runtime or the broker is replaced.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request

from .conftest import ROOT, free_port, wait_until

HOOK = """
import os, sys, time
from chronoq.broker import broker as broker_module

gate = os.environ["CHRONOQ_TEST_RECOVERY_GATE"]
original = broker_module.Broker.__init__


def recover_after_the_gate(self, *args, **kwargs):
    deadline = time.monotonic() + 60  # bounded: a test that never opens the gate still ends
    while not os.path.exists(gate) and time.monotonic() < deadline:
        time.sleep(0.01)
    original(self, *args, **kwargs)


broker_module.Broker.__init__ = recover_after_the_gate
from chronoq.cli.main import main

sys.argv = ["chronoq", *sys.argv[1:]]
main()
"""
HTTP_ANNOUNCED = re.compile(r"HTTP on (http://\S+:\d+/)")
TIMEOUT_S = 30


def get(url: str) -> tuple[int, str] | None:
    """(status, body), or None while nothing listens."""
    try:
        with urllib.request.urlopen(url, timeout=5) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except (urllib.error.URLError, ConnectionError):
        return None


def test_healthz_is_not_ready_while_recovering(tmp_path):
    gate = tmp_path / "gate"
    data = tmp_path / "data"
    env = dict(os.environ, PYTHONUNBUFFERED="1", CHRONOQ_TEST_RECOVERY_GATE=str(gate),
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-c", HOOK, "serve", "--data-dir", str(data), "--host", "127.0.0.1",
                             "--port", str(free_port()), "--http-port", "0"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(line.rstrip("\n") for line in proc.stdout), daemon=True)
    reader.start()
    try:
        announced = wait_until(lambda: next((m for line in list(lines) if (m := HTTP_ANNOUNCED.search(line))), None),
                               TIMEOUT_S, 0.02, "the HTTP listener's address")
        url = announced.group(1)
        assert get(url + "healthz") == (503, "not ready: recovering\n")
        assert get(url + "metrics")[0] == 503
        assert not any("chronoq is ready" in line for line in lines)

        gate.touch()
        assert wait_until(lambda: get(url + "healthz") == (200, "ok\n"), TIMEOUT_S, 0.02, "healthz ok")
        # (healthz turns ok just before the line is printed: wait for the reader to see it)
        wait_until(lambda: any("chronoq is ready" in line for line in list(lines)), TIMEOUT_S, 0.02, "the ready line")
        assert get(url + "metrics")[0] == 200
        # The ready line reads as it always has: gRPC first, then HTTP.
        ready = [line for line in lines if line.startswith("chronoq is ready; ")]
        assert len(ready) == 1 and ready[0].startswith("chronoq is ready; RocketMQ gRPC on "), lines
        assert "; HTTP on http://" in ready[0], lines
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, "\n".join(lines)
    reader.join(5)
    assert any("chronoq stopped cleanly" in line for line in lines), "\n".join(lines)
