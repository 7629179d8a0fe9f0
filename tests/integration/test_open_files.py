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
import signal
import uuid

from chronoq.client.client import Client, OutgoingMessage

from .conftest import ChronoqProcess
from .nofile_serve import NOFILE_ENV

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
