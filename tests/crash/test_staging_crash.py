"""kill -9 test for staged publish (chronoq.features.staging) through a real ``chronoq serve``.

Rows staged through the ``Stage`` RPC survive a SIGKILL and are published after the restart; a
publish is answered only when durable, so after another SIGKILL the messages are all there and
the published mark is too: publishing the batch again (a Spark replay) publishes nothing. A
second batch is SIGKILLed while its publish runs (seeded random moment in the few milliseconds
it takes): after the restart every message of it is there once, whether the publish finished,
was finished by the broker at start-up, or is repeated by the writer. SIGKILL ends the process,
not the machine (page cache survives), as in the other crash tests.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time

from chronoq.proto import chronoq_admin_pb2 as apb
from chronoq.spark.rpc import AdminRpc, BrokerError
from tests.integration.conftest import ChronoqProcess

SEED = int(os.environ.get("CHRONOQ_STAGING_CRASH_SEED", "5"))
CHUNK = 4000


def _rows(prefix: str, n: int) -> apb.RowColumns:
    bodies = [f"{prefix}-{i:05d}".encode() for i in range(n)]
    return apb.RowColumns(count=n, bodies=b"".join(bodies), body_lengths=[len(b) for b in bodies])


def _bodies(endpoint: str, topic: str) -> list[bytes]:
    out = []
    with AdminRpc(endpoint) as rpc:
        try:
            bounds = rpc.queue_offsets(topic)
        except BrokerError:
            return []
        for q, (lo, hi) in bounds.items():
            off = lo
            while off < hi:
                resp = rpc.read(topic, q, off, 10_000)
                m = resp.messages
                pos = 0
                for length in m.body_lengths:
                    out.append(m.bodies[pos:pos + length])
                    pos += length
                off = resp.next_offset
    return out


def _kill(proc: ChronoqProcess) -> None:
    proc.proc.send_signal(signal.SIGKILL)
    proc.proc.wait(10)
    proc.stop(check=False)


def test_kill_9_around_staging_and_publishing_keeps_exactly_once(tmp_path):
    rnd = random.Random(SEED)
    print(f"seed {SEED}")
    data = str(tmp_path / "data")
    proc = ChronoqProcess(data)
    with AdminRpc(proc.endpoint) as rpc:
        for seq in range(3):
            assert rpc.stage("sink", 0, "stage-a", seq, "crashy", _rows(f"a{seq}", CHUNK)) == CHUNK
    _kill(proc)

    proc = ChronoqProcess(data)
    assert _bodies(proc.endpoint, "crashy") == []  # staged rows are invisible
    with AdminRpc(proc.endpoint) as rpc:
        first = rpc.publish("sink", 0, [("stage-a", 3, 3 * CHUNK)])
        assert not first.already_published and first.messages == 3 * CHUNK
        for seq in range(5):
            rpc.stage("sink", 1, "stage-b", seq, "crashy", _rows(f"b{seq}", CHUNK))
    # Kill the broker while it publishes batch 1 (5 chunks, one per event-loop pass).
    result: list = []

    def publish() -> None:
        try:
            with AdminRpc(proc.endpoint, timeout_s=30) as rpc:
                result.append(rpc.publish("sink", 1, [("stage-b", 5, 5 * CHUNK)]))
        except BrokerError as exc:
            result.append(exc)

    worker = threading.Thread(target=publish)
    worker.start()
    time.sleep(rnd.uniform(0.0, 0.05))
    _kill(proc)
    worker.join(30)

    proc = ChronoqProcess(data)  # an interrupted publish is finished at start-up
    with AdminRpc(proc.endpoint) as rpc:
        again = rpc.publish("sink", 0, [("stage-a", 3, 3 * CHUNK)])
        assert again.already_published
        try:
            rpc.publish("sink", 1, [("stage-b", 5, 5 * CHUNK)])  # the writer's retry
        except BrokerError as exc:  # only if the kill came before any chunk was durable ...
            assert "incomplete" not in str(exc), exc  # ... which staged rows survive anyway
    bodies = _bodies(proc.endpoint, "crashy")
    want = [f"a{s}-{i:05d}".encode() for s in range(3) for i in range(CHUNK)] + \
           [f"b{s}-{i:05d}".encode() for s in range(5) for i in range(CHUNK)]
    assert len(bodies) == len(want), f"{len(bodies)} messages for {len(want)} rows (outcome {result})"
    assert sorted(bodies) == sorted(want)
    proc.stop()
