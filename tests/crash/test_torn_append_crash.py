"""kill -9 in the middle of a large append: no record of it survives, so a staged publish is exactly-once.

``kill -9`` during a large ``pwrite`` (measured: 4-42 MiB of a 256 MiB write reached the file)
leaves a prefix of the append; a fault hook in the child process reproduces exactly that
(``writer.tear_next_log_write``: a seeded prefix of one commit-log ``pwrite`` is written, then
the process SIGKILLs itself: an external kill almost never lands inside the system call). Recovery (R11) must drop the whole
unfinished append:

* ``raw``: batches of 1,500 messages (about 6 MiB each); the torn one is never acknowledged and
  none of its messages may be read back, every acknowledged one must;
* ``staging``: a staged batch of 8 chunks of 4,000 rows is published (one append per chunk: its
  messages and its marker) and torn at a seeded chunk; the broker finishes the publish at start-up
  and the writer retries it (as Spark would): every row is then there exactly once. Before R11 a
  torn chunk's whole records were published again by the resume (34,640 messages for 32,000 rows
  was seen through ``chronoq serve``).
"""

from __future__ import annotations

import collections
import os
import random
import signal
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from chronoq.broker.broker import Broker, OutgoingMessage  # noqa: E402
from chronoq.core.config import BrokerConfig  # noqa: E402
from chronoq.features.staging import Rows, Staging  # noqa: E402
from writer import tear_next_log_write  # noqa: E402

BATCH = 1_500
BODY = 4_000
CHUNKS, ROWS = 8, 4_000
RUNS = int(os.environ.get("CHRONOQ_TORN_RUNS", "4"))


def _config(data_dir: str) -> BrokerConfig:
    return BrokerConfig(data_dir=data_dir, segment_bytes=64 << 20, flush_policy="sync")


def _body(mid: str) -> bytes:
    return (mid.encode() * (BODY // len(mid) + 1))[:BODY]


def _raw_child(data_dir: str, seed: int) -> None:
    rng = random.Random(seed)
    broker = Broker(_config(data_dir))
    broker.create_topic("big", 4)
    for b in range(rng.randint(1, 3)):
        ids = [f"A{seed}-{b}-{i}" for i in range(BATCH)]
        broker.send_batch([OutgoingMessage("big", _body(m), message_id=m) for m in ids])
        print(f"acked {b}", flush=True)  # only after send_batch returned: durable
    tear_next_log_write(broker, rng)
    ids = [f"T{seed}-{i}" for i in range(BATCH)]
    broker.send_batch([OutgoingMessage("big", _body(m), message_id=m) for m in ids])
    print("done", flush=True)  # not reached: the hook kills the process


def _staging_child(data_dir: str, seed: int) -> None:
    rng = random.Random(seed)
    broker = Broker(_config(data_dir))
    staging = Staging(broker)
    for seq in range(CHUNKS):
        staging.stage("sink", 0, "stage-a", seq, "rows", Rows([f"r{seq}-{i:05d}".encode() for i in range(ROWS)]))
    broker.flush()
    print("staged", flush=True)
    tear_next_log_write(broker, rng, rng.randint(1, CHUNKS))
    for _ in staging.publish("sink", 0, [("stage-a", CHUNKS, CHUNKS * ROWS)]).steps(staging):
        pass
    print("done", flush=True)


def _bodies(broker: Broker, topic: str) -> list[bytes]:
    out = []
    for q in range(broker.topic(topic).queues):
        lo, hi = broker.queue_bounds(topic, q)
        off = lo
        while off < hi:
            res = broker.read(topic, q, off, 1000)
            out += [m.body for m in res.messages]
            off = res.next_offset
    return out


def _run_child(mode: str, data: str, seed: int) -> list[str]:
    child = subprocess.run([sys.executable, os.path.abspath(__file__), mode, data, str(seed)], capture_output=True,
                           text=True, timeout=300, cwd=ROOT)
    lines = child.stdout.splitlines()
    assert child.returncode == -signal.SIGKILL and "done" not in lines, \
        f"{child.returncode}: {child.stdout}\n{child.stderr[-3000:]}"
    return lines


@pytest.mark.parametrize("run", range(RUNS))
def test_kill_9_inside_a_large_batch_append_leaves_none_of_it(tmp_path, run):
    seed = 100 + run
    data = str(tmp_path / "data")
    acked = len([line for line in _run_child("raw", data, seed) if line.startswith("acked")])
    with Broker(_config(data)) as broker:
        bodies = collections.Counter(_bodies(broker, "big"))
        torn = sum(bodies[_body(f"T{seed}-{i}")] for i in range(BATCH))
        assert torn == 0, f"{torn} messages of the torn, unacknowledged append survived"
        assert all(bodies[_body(f"A{seed}-{b}-{i}")] == 1 for b in range(acked) for i in range(BATCH))
        assert sum(bodies.values()) == acked * BATCH
        assert broker.recovery.truncated, "the torn append is reported"


@pytest.mark.parametrize("run", range(RUNS))
def test_kill_9_inside_a_staged_publish_then_resume_and_retry_publish_each_row_once(tmp_path, run):
    seed = 200 + run
    data = str(tmp_path / "data")
    assert _run_child("staging", data, seed)[0] == "staged"
    with Broker(_config(data)) as broker:
        staging = Staging(broker)  # finishes the interrupted publish, if its "begin" is durable
        for _ in staging.publish("sink", 0, [("stage-a", CHUNKS, CHUNKS * ROWS)]).steps(staging):
            pass  # the writer's retry (a Spark replay of the commit)
        broker.flush()
        bodies = collections.Counter(_bodies(broker, "rows"))
        staging.checkpoint(force=True)
    want = {f"r{seq}-{i:05d}".encode() for seq in range(CHUNKS) for i in range(ROWS)}
    extra = {b: n for b, n in bodies.items() if n != 1}
    assert set(bodies) == want and not extra, \
        f"{sum(bodies.values())} messages for {len(want)} rows; {len(extra)} rows more than once"


if __name__ == "__main__":
    {"raw": _raw_child, "staging": _staging_child}[sys.argv[1]](sys.argv[2], int(sys.argv[3]))
