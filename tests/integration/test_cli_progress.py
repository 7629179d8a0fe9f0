"""Progress bars of the CLI (docs/cli.md): drawn only for a person. The CLI runs as a subprocess
against the shared ``chronoq serve``, once with stdout on a pseudo-terminal (a bar must appear
and end at its total) and once piped or with --json (not a trace of a bar).
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time

from .conftest import ROOT
from .test_cli import make_cli, unique

PTY_TIMEOUT_S = 60


def run_on_terminal(endpoint: str, *args: str, slow_reader: bool = False, **env_extra: str) -> tuple[int, str]:
    """``python -m chronoq ARGS`` with stdout and stderr on a pseudo-terminal: (exit, output).
    ``slow_reader``: nothing is read until the command has begun to write and a second more has
    passed, so a large write fills the terminal and the kernel takes only part of it at first."""
    master, slave = os.openpty()
    env = dict(os.environ, TERM="xterm", COLUMNS="120", CHRONOQ_ENDPOINT=endpoint,
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), **env_extra)
    proc = subprocess.Popen([sys.executable, "-m", "chronoq", *args], cwd=ROOT, env=env,
                            stdin=subprocess.DEVNULL, stdout=slave, stderr=slave)
    os.close(slave)
    out = b""
    deadline = time.monotonic() + PTY_TIMEOUT_S
    exited = False
    if slow_reader:
        select.select([master], [], [], PTY_TIMEOUT_S)
        time.sleep(1.0)
    try:
        while time.monotonic() < deadline:
            # Once the child has exited, drain what it wrote without waiting: its last output may
            # have arrived between a select that timed out and the poll that saw it gone.
            ready, _, _ = select.select([master], [], [], 0 if exited else 0.2)
            if ready:
                try:
                    chunk = os.read(master, 65536)
                except OSError:  # EIO: the child closed the terminal and all was read
                    break
                if not chunk:
                    break
                out += chunk
            elif exited:
                break
            else:
                exited = proc.poll() is not None
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
    return proc.returncode, out.decode(errors="replace")


def test_bulk_send_and_receive_show_a_bar_on_a_terminal_only(chronoq_endpoint):
    topic, group = unique("bar"), unique("bar-g")
    code, out = run_on_terminal(chronoq_endpoint, "send", topic, "x", "--count", "1200", "--batch-size", "100")
    assert code == 0, out
    assert f"sending to {topic}" in out and "1200/1200" in out  # the bar, drawn to its end
    assert f"sent 1,200 messages to {topic}" in out

    code, out = run_on_terminal(chronoq_endpoint, "receive", group, topic, "--count", "1200", "--max", "32")
    assert code == 0, out
    assert f"receiving {topic} for {group}" in out and "1200/1200" in out
    assert "received and acknowledged 1,200 messages" in out

    # Piped, or --json: no bar.
    cli = make_cli(chronoq_endpoint)
    piped = cli("send", topic, "y", "--count", "300", "--batch-size", "100")
    assert "sending to" not in piped.out + piped.err and "\x1b[" not in piped.out
    code, out = run_on_terminal(chronoq_endpoint, "send", topic, "z", "--count", "300", "--batch-size", "100",
                                "--json")
    assert code == 0 and "sending to" not in out
    assert json.loads(out)["sent"] == 300


def test_a_json_answer_reaches_a_slow_terminal_whole(chronoq_endpoint):
    """Under PYTHONUNBUFFERED=1 the text stream wrote straight to the descriptor and dropped what a
    short write left: a terminal read late got ~15-20 KB of a 48 KB answer, and the command exited 0."""
    topic = unique("slowtty")
    code, out = run_on_terminal(chronoq_endpoint, "send", topic, "z", "--count", "300", "--batch-size", "100",
                                "--json", slow_reader=True, PYTHONUNBUFFERED="1")
    assert code == 0, out[-500:]
    answer = json.loads(out)
    assert answer["sent"] == 300 and len(answer["messages"]) == 300
