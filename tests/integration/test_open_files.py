"""A broker whose clients write to thousands of queues stays within its open-files limit.

Topics are created by clients (auto-create is on by default) and every queue written keeps a
consume-queue file open. Before ``chronoq/store/fdbudget.py`` a soft limit of 1,024 ran out at
about the 1,000th topic: that send failed, and from then on the broker could not save its topic
table, write a checkpoint or accept a connection; with more queues than the limit it could not
start again. Here a real broker runs under a hard limit of 200 (it cannot raise it) and takes
2,000 queues, a second connection, a kill -9 and a restart."""

from __future__ import annotations

import asyncio
import os
import resource
import signal
import socket
import uuid
from contextlib import contextmanager

from chronoq.client.client import Client, OutgoingMessage

from .conftest import ChronoqProcess, wait_until
from .nofile_serve import NOFILE_ENV
from .test_metrics import scrape, value

LIMIT = 200
TOPICS = 500


def _open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_thousands_of_queues_under_a_low_open_files_limit(tmp_path, monkeypatch):
    monkeypatch.setenv(NOFILE_ENV, str(LIMIT))
    data = str(tmp_path / "data")
    prefix = f"nf{uuid.uuid4().hex[:6]}"
    topics = [f"{prefix}-{i}" for i in range(TOPICS)]
    broker = ChronoqProcess(data, module="tests.integration.nofile_serve")

    async def fill(endpoint):
        async with Client(endpoint) as client:
            for start in range(0, TOPICS, 50):  # 4 messages a topic: every one of its 4 queues
                await client.send_batch([OutgoingMessage(t, b"%s/%d" % (t.encode(), k))
                                         for t in topics[start:start + 50] for k in range(4)])

    async def drain(endpoint, some):
        async with Client(endpoint) as client:  # a new connection once the queues are open
            out = {}
            for topic in some:
                got = []
                for _ in range(20):
                    got += await client.receive("nf-group", topic, max_messages=32, wait_s=0)
                    if len(got) >= 4:
                        break
                await client.ack("nf-group", topic, got)
                out[topic] = sorted(m.body for m in got)
            return out

    def expected(topic):
        return sorted(b"%s/%d" % (topic.encode(), k) for k in range(4))

    try:
        asyncio.run(fill(broker.endpoint))
        assert _open_fds(broker.proc.pid) < LIMIT
        some = topics[:3] + topics[-3:]
        assert asyncio.run(drain(broker.endpoint, some)) == {t: expected(t) for t in some}
        broker.proc.send_signal(signal.SIGKILL)
        broker.proc.wait(10)
        broker = ChronoqProcess(data, module="tests.integration.nofile_serve")  # loads 2,000 queues
        rest = topics[200:203]
        assert asyncio.run(drain(broker.endpoint, rest)) == {t: expected(t) for t in rest}
        assert _open_fds(broker.proc.pid) < LIMIT
        assert "Too many open files" not in broker.output()
    finally:
        broker.stop(check=False)


def test_serve_raises_its_soft_open_files_limit_to_the_hard_one():
    import subprocess
    import sys
    probe = ("import resource\n"
             "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
             "resource.setrlimit(resource.RLIMIT_NOFILE, (128, hard))\n"
             "from chronoq.server import process\n"
             "print(process.raise_open_files_limit())\n"
             "print(resource.getrlimit(resource.RLIMIT_NOFILE) == (hard, hard) or hard == resource.RLIM_INFINITY)\n"
             "print(process.raise_open_files_limit())\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True).stdout
    said, raised, again = out.splitlines()
    assert said.startswith("open files: limit raised 128 -> ") and raised == "True"
    assert again.startswith("open files: limit ") and "raised" not in again  # at the hard limit already


# An HTTP/2 client's first bytes: the preface and an empty SETTINGS frame.
H2_HELLO = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"


@contextmanager
def _idle_connections(endpoint: str, count: int):
    """``count`` raw connections that say hello and then nothing (kept until the block ends)."""
    host, port = endpoint.rsplit(":", 1)
    socks = []
    try:
        for _ in range(count):
            sock = socket.create_connection((host, int(port)), timeout=10)
            socks.append(sock)
            sock.sendall(H2_HELLO)
        yield socks
    finally:
        for sock in socks:
            sock.close()


async def _round_trip(endpoint: str, topic: str) -> list[bytes]:
    async with Client(endpoint) as client:
        await client.send(topic, b"still serving")
        got = await client.receive("nf-conn-group", topic, max_messages=4, wait_s=5)
        await client.ack("nf-conn-group", topic, got)
        return [m.body for m in got]


def _checkpoint_written_after(data: str, mtime_ns: int) -> bool:
    return os.stat(os.path.join(data, "checkpoint.json")).st_mtime_ns > mtime_ns


def test_connections_are_capped_to_fit_a_low_hard_open_files_limit(tmp_path, monkeypatch):
    """Under a hard limit of 512, h2_max_connections (1,000) does not fit beside the consume-queue
    files (128) and the broker's other files: before, 488 idle connections took every descriptor
    left and every checkpoint failed with EMFILE until they closed. Now the broker takes 192 (one
    WARNING line says so: 512 - 128 - 64 kept for the HTTP listener - 128 kept) and keeps writing its files."""
    monkeypatch.setenv(NOFILE_ENV, "512")
    data = str(tmp_path / "data")
    broker = ChronoqProcess(data, module="tests.integration.nofile_serve")
    try:
        assert "leaves room for 192 connections, not h2_max_connections (1000)" in broker.output()
        with _idle_connections(broker.endpoint, 400):  # more than fit: the extra ones get GOAWAY
            wait_until(lambda: value(scrape(broker.http_url), "chronoq_grpc_connections") == 192, 30,
                       what="192 connections held")
            assert _open_fds(broker.proc.pid) < 512
            since = os.stat(os.path.join(data, "checkpoint.json")).st_mtime_ns
            wait_until(lambda: _checkpoint_written_after(data, since), 30, what="a checkpoint under the flood")
            assert value(scrape(broker.http_url), "chronoq_grpc_connections") == 192
        assert asyncio.run(_round_trip(broker.endpoint, "nf-conn")) == [b"still serving"]
        assert "Too many open files" not in broker.output()
    finally:
        broker.stop(check=False)


def test_accept_past_the_open_files_limit_neither_crashes_nor_stops_the_broker(tmp_path):
    """When descriptors run out anyway (here the limit is lowered under a running broker, past what
    it sized its connections for), each accept fails with EMFILE: the connection is dropped, the
    loop goes on, and once descriptors are free again the broker serves as before."""
    broker = ChronoqProcess(str(tmp_path / "data"))
    try:
        resource.prlimit(broker.proc.pid, resource.RLIMIT_NOFILE, (LIMIT, LIMIT))
        with _idle_connections(broker.endpoint, 2 * LIMIT) as socks:
            wait_until(lambda: _open_fds(broker.proc.pid) >= LIMIT - 1, 30, what="descriptors exhausted")
            assert len(socks) == 2 * LIMIT  # the kernel completed every handshake; the broker kept few
        wait_until(lambda: _open_fds(broker.proc.pid) < LIMIT // 2, 30, what="the connections closed")
        assert broker.proc.poll() is None
        assert asyncio.run(_round_trip(broker.endpoint, "nf-emfile")) == [b"still serving"]
        assert "Traceback" not in broker.output()
    finally:
        broker.stop(check=False)
