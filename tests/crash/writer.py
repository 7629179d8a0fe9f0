"""Crash-test writer: appends to a broker until it is killed, printing one line per acked message.

Usage: ``python tests/crash/writer.py DATA_DIR SEED RUN [TEAR_AFTER]``

Each line on stdout is JSON ``{"id", "topic", "queue", "offset", "crc"}``, printed only after
``send_batch`` returned (flush policy ``sync``: the batch is fsynced and dispatched), then flushed.
A body is a pure function of its message id (``body_for``), so the checker can verify exact bytes
of anything it finds in the store, acknowledged or not. Every random choice comes from
``random.Random(f"{SEED}-{RUN}")``.

With ``TEAR_AFTER`` = n, a fault hook tears the commit-log write of batch n+1: only a seeded part
of it reaches the file, then the process SIGKILLs itself. An external kill -9 almost never lands
inside a write system call, so this is how the crash test gets torn tails from a real process.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import zlib

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from chronoq.broker.broker import Broker, OutgoingMessage  # noqa: E402
from chronoq.core.config import BrokerConfig  # noqa: E402

TOPICS = ("orders", "payments", "audit")
QUEUES = 3
SEGMENT_BYTES = 256 * 1024
CQ_ENTRIES_PER_FILE = 64  # small, so consume-queue files roll too


def config(data_dir: str) -> BrokerConfig:
    """The one configuration the writer and the checker both use (file layouts must agree)."""
    return BrokerConfig(data_dir=data_dir, segment_bytes=SEGMENT_BYTES, cq_entries_per_file=CQ_ENTRIES_PER_FILE,
                        flush_policy="sync")


def body_for(message_id: str) -> bytes:
    rng = random.Random(message_id)
    roll = rng.random()
    if roll < 0.05:
        size = rng.randint(40_000, 120_000)  # big records make torn writes and rolls likely
    elif roll < 0.5:
        size = rng.randint(1, 64)
    else:
        size = rng.randint(65, 6_000)
    return rng.randbytes(size)


def tear_next_log_write(broker: Broker, rng: random.Random, which: int = 1) -> None:
    """Fault hook: the ``which``-th commit-log pwrite from now (1: the next) writes a seeded part
    of its bytes, then the process dies (also used by test_torn_append_crash and
    test_retention_crash)."""
    real_pwrite = os.pwrite
    log = broker.store.log
    seen = [0]

    def torn_pwrite(fd, data, offset):
        if fd != log._active_fd or len(data) < 2:
            return real_pwrite(fd, data, offset)
        seen[0] += 1
        if seen[0] < which:
            return real_pwrite(fd, data, offset)
        real_pwrite(fd, bytes(data[: rng.randrange(1, len(data))]), offset)
        os.kill(os.getpid(), signal.SIGKILL)

    os.pwrite = torn_pwrite


def main() -> None:
    data_dir, seed, run = sys.argv[1], sys.argv[2], int(sys.argv[3])
    tear_after = int(sys.argv[4]) if len(sys.argv) > 4 else -1
    rng = random.Random(f"{seed}-{run}")
    broker = Broker(config(data_dir))
    for topic in TOPICS:
        broker.create_topic(topic, QUEUES)
    out = sys.stdout
    seq = 0
    batches = 0
    while True:
        if batches == tear_after:
            tear_next_log_write(broker, rng)
        batches += 1
        batch = []
        for _ in range(rng.choice((1, 1, 2, 5, 10, 25))):
            message_id = f"S{seed}R{run}N{seq}"
            seq += 1
            batch.append(OutgoingMessage(rng.choice(TOPICS), body_for(message_id), message_id=message_id,
                                         queue_id=rng.randrange(QUEUES), tag=rng.choice(("", "a", "b"))))
        results = broker.send_batch(batch)
        lines = [json.dumps({"id": r.message_id, "topic": r.topic, "queue": r.queue_id, "offset": r.queue_offset,
                             "crc": zlib.crc32(m.body)}) for r, m in zip(results, batch)]
        out.write("\n".join(lines) + "\n")
        out.flush()
        if rng.random() < 0.15:
            broker.checkpoint()


if __name__ == "__main__":
    main()
