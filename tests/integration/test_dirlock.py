"""One process per data directory (chronoq.store.dirlock), with real ``chronoq serve`` processes.

A second ``serve`` or an embedded ``Broker`` on a directory a running broker holds is refused at
once, naming the directory and the holder's PID, and the running broker is unharmed; after
``kill -9`` the lock is gone with the process, and a restart takes it and recovers.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from chronoq.core import errors
from chronoq.broker.broker import Broker
from chronoq.core.config import BrokerConfig

from .conftest import ROOT, free_port
from .test_official_python_client import make_message, producer, receive_all, simple_consumer, unique


def serve_once(data_dir: str) -> subprocess.CompletedProcess:
    """``chronoq serve`` on ``data_dir``, expected to exit by itself (refused)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-m", "chronoq", "serve", "--data-dir", data_dir,
                           "--port", str(free_port()), "--host", "127.0.0.1", "--http-port", "0"],
                          cwd=ROOT, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=30)


def assert_refused(result: subprocess.CompletedProcess, data_dir: str, holder_pid: int) -> None:
    assert result.returncode == 1, result
    assert "chronoq is ready" not in result.stdout, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    line = lines[0]
    assert line.startswith("chronoq: cannot start: data directory "), line
    assert data_dir in line and f"PID {holder_pid}" in line, line


def send_one(endpoint: str, topic: str, body: bytes) -> str:
    with producer(endpoint, topic) as p:
        return p.send(make_message(topic, body)).message_id


def receive_ids(endpoint: str, topic: str, count: int) -> dict[str, bytes]:
    with simple_consumer(endpoint, unique("lockgrp"), topic) as c:
        got = receive_all(c, count)
        for m in got:
            c.ack(m)
    return {m.message_id: m.body for m in got}


def stored_bodies(data_dir: str, topic: str) -> list[bytes]:
    with Broker(BrokerConfig(data_dir=data_dir)) as broker:
        cfg = broker.topics[topic]
        return sorted(m.body for q in range(cfg.queues) for m in broker.read(topic, q, 0, 100).messages)


def test_a_second_serve_on_one_directory_is_refused_and_the_first_goes_on(chronoq_process):
    first = chronoq_process()
    topic = unique("lock")
    before = send_one(first.endpoint, topic, b"before")
    assert_refused(serve_once(first.data_dir), first.data_dir, first.proc.pid)
    after = send_one(first.endpoint, topic, b"after")
    assert receive_ids(first.endpoint, topic, 2) == {before: b"before", after: b"after"}
    first.stop()  # a clean stop (checked)
    assert stored_bodies(first.data_dir, topic) == [b"after", b"before"]


def test_an_embedded_broker_is_refused_while_serve_runs(chronoq_process):
    first = chronoq_process()
    topic = unique("embed")
    before = send_one(first.endpoint, topic, b"before")
    with pytest.raises(errors.DataDirLocked) as info:
        Broker(BrokerConfig(data_dir=first.data_dir))
    assert info.value.holder_pid == first.proc.pid and first.data_dir in info.value.message
    after = send_one(first.endpoint, topic, b"after")
    assert receive_ids(first.endpoint, topic, 2) == {before: b"before", after: b"after"}
    first.stop()
    assert stored_bodies(first.data_dir, topic) == [b"after", b"before"]


def test_after_kill_9_a_restart_takes_the_lock_and_recovers(chronoq_process):
    first = chronoq_process()
    topic = unique("killed")
    acked = send_one(first.endpoint, topic, b"acked before the kill")
    first.proc.send_signal(signal.SIGKILL)
    assert first.proc.wait(20) == -signal.SIGKILL
    first.stop(check=False)  # reap the reader thread and the log file
    # The dead broker's PID is still in the lock file; its flock died with it.
    with open(os.path.join(first.data_dir, "LOCK")) as fh:
        assert fh.read() == f"{first.proc.pid}\n"
    second = chronoq_process()  # same directory
    assert second.data_dir == first.data_dir
    with open(os.path.join(second.data_dir, "LOCK")) as fh:
        assert fh.read() == f"{second.proc.pid}\n"
    assert receive_ids(second.endpoint, topic, 1) == {acked: b"acked before the kill"}
    assert_refused(serve_once(second.data_dir), second.data_dir, second.proc.pid)
