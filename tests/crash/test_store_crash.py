"""kill -9 crash test: a writer subprocess appends to a broker and is killed at seeded random moments.

After every kill the broker is reopened in this process (recovery runs) and checked:

1. every acknowledged message is readable at its (topic, queue, offset) with exactly its bytes;
2. every consume queue agrees with the log: each entry names a valid record of that queue at that
   queue offset, the queue is dense (every offset from min to next reads back), and every record
   in the log is indexed exactly once (no stale or missing entries);
3. nothing is half-visible: every visible message, acked or not, decodes whole with a valid CRC
   and carries exactly the body its id determines (an unacked message may be present or absent).

The same data directory is used for every run, so each run continues the log of the previous one
(and recovers what the in-process check left behind). Seed: ``CHRONOQ_CRASH_SEED`` (printed).

Kill moments: a seeded delay after start; or after a seeded number of acknowledgements plus a
seeded short delay; or (a quarter of the runs) the writer's fault hook tears one commit-log write
after a seeded number of batches and the writer SIGKILLs itself. The seed fixes the schedule and
the torn writes exactly; where a time-based kill lands also depends on the machine's speed.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import zlib

import pytest
import writer

from chronoq.broker.broker import Broker
from chronoq.store import record

WRITER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "writer.py")
SEED = int(os.environ.get("CHRONOQ_CRASH_SEED", "20260521"))
KILLS = int(os.environ.get("CHRONOQ_CRASH_KILLS", "36"))


class Run:
    """One writer process, its stdout drained by a thread so the pipe never blocks it."""

    def __init__(self, data_dir: str, run: int, tear_after: int = -1):
        self.proc = subprocess.Popen([sys.executable, WRITER, data_dir, str(SEED), str(run), str(tear_after)],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.raw = bytearray()
        self.lines = 0
        self.cond = threading.Condition()
        self.thread = threading.Thread(target=self._drain, daemon=True)
        self.thread.start()

    def _drain(self) -> None:
        while True:
            chunk = self.proc.stdout.read1(65536)
            with self.cond:
                if not chunk:
                    self.cond.notify_all()
                    return
                self.raw += chunk
                self.lines += chunk.count(b"\n")
                self.cond.notify_all()

    def wait_for_lines(self, count: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        with self.cond:
            while self.lines < count and self.proc.poll() is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self.cond.wait(left)

    def kill(self) -> list[dict]:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        self.thread.join()
        stderr = self.proc.stderr.read().decode(errors="replace")
        self.proc.stderr.close()
        self.proc.stdout.close()
        assert self.proc.returncode == -signal.SIGKILL, f"writer died on its own:\n{stderr}"
        # Only complete lines are acknowledgements; a torn last line is treated as unacked.
        complete = bytes(self.raw[: self.raw.rfind(b"\n") + 1])
        return [json.loads(line) for line in complete.splitlines()]


def check(data_dir: str, acked: dict, ctx: str) -> dict:
    """Reopen the broker in-process, verify the three properties above, close it cleanly."""
    broker = Broker(writer.config(data_dir))
    try:
        rep = broker.recovery
        assert rep.quarantined == [], f"{ctx}: {rep.summary()}"
        store = broker.store
        # 1. Every acknowledged message, exact bytes.
        for (topic, queue, offset), message_id in acked.items():
            res = broker.read(topic, queue, offset, 1)
            assert len(res.messages) == 1, f"{ctx}: acked {message_id} at {topic}/{queue}@{offset} is gone"
            m = res.messages[0]
            assert (m.queue_offset, m.message_id) == (offset, message_id), f"{ctx}: {topic}/{queue}@{offset}"
            assert m.body == writer.body_for(message_id), f"{ctx}: body of {message_id} differs"
        # 2 + 3. Queue -> log: each entry names a whole, valid record of that queue at that offset.
        indexed = 0
        for (topic, queue), cq in sorted(store.queues.items()):
            lo, hi = store.bounds(topic, queue)
            assert lo == 0, f"{ctx}: {topic}/{queue} starts at {lo} without retention"
            offset = lo
            while offset < hi:
                entries = store.entries(topic, queue, offset, 1000)
                assert entries, f"{ctx}: {topic}/{queue} has no entry at {offset} (< {hi})"
                for i, (phys, size, tag_hash, _time_ms) in enumerate(entries):
                    fields = record.decode(store.log.read_record(phys, size))  # validates length + CRC
                    where = f"{ctx}: {topic}/{queue}@{offset + i} -> log {phys}"
                    assert (fields["topic"], fields["queue_id"], fields["queue_offset"]) == (
                        topic, queue, offset + i), where
                    assert fields["body"] == writer.body_for(fields["message_id"]), where
                    assert tag_hash == zlib.crc32(fields["tag"].encode()), where
                offset += len(entries)
            # Dense: reading the whole queue returns every offset once, in order.
            got, offset = [], lo
            while offset < hi:
                res = broker.read(topic, queue, offset, 500)
                got += [m.queue_offset for m in res.messages]
                assert res.next_offset > offset, f"{ctx}: read of {topic}/{queue}@{offset} made no progress"
                offset = res.next_offset
            assert got == list(range(lo, hi)), f"{ctx}: {topic}/{queue} is not dense"
            indexed += hi - lo
        # Log -> queue: the whole log is valid records to the end, each indexed where it says.
        records = 0
        for seg in store.log.segments:
            data = store.log.read(seg.base, seg.size) if seg.size else b""
            pos = 0
            while pos < len(data):
                length = record.check(data, pos, len(data))  # raises on anything half-written
                h = record.RecordHeader(data, pos)
                entry = store.entries(h.topic, h.queue_id, h.queue_offset, 1)
                assert entry and entry[0][:2] == (seg.base + pos, length), (
                    f"{ctx}: record at {seg.base + pos} ({h.topic}/{h.queue_id}@{h.queue_offset}) is not indexed")
                pos += length
                records += 1
        assert records == indexed, f"{ctx}: {records} records in the log, {indexed} queue entries"
        return {"truncated": len(rep.truncated), "replayed": rep.records_replayed, "records": records}
    finally:
        broker.close()


@pytest.mark.slow
def test_kill_9_loses_no_acked_message_and_leaves_nothing_half_visible(tmp_path):
    print(f"\ncrash test seed {SEED} (set CHRONOQ_CRASH_SEED to replay), {KILLS} kills")
    rng = random.Random(SEED)
    data_dir = str(tmp_path / "data")
    acked: dict[tuple[str, int, int], str] = {}
    torn = 0
    stats: dict = {}
    for run in range(KILLS):
        ctx = f"seed {SEED} run {run}"
        mode = rng.random()
        if mode < 0.25:
            # The writer tears one of its own log writes and kills itself (a torn tail).
            w = Run(data_dir, run, tear_after=rng.randint(0, 40))
            w.proc.wait(timeout=60)
        elif mode < 0.5:
            w = Run(data_dir, run)
            # A moment after start: during start-up, recovery, or the first batches.
            time.sleep(rng.uniform(0.02, 0.3))
        else:
            w = Run(data_dir, run)
            # After N acknowledgements, then a little later: mid-batch, mid-roll, mid-checkpoint.
            w.wait_for_lines(rng.randint(1, 200), timeout_s=20)
            time.sleep(rng.choice((0, 0, rng.uniform(0, 0.005), rng.uniform(0, 0.03))))
        for line in w.kill():
            key = (line["topic"], line["queue"], line["offset"])
            assert acked.get(key, line["id"]) == line["id"], f"{ctx}: {key} acked twice for different ids"
            assert line["crc"] == zlib.crc32(writer.body_for(line["id"])), ctx
            acked[key] = line["id"]
        stats = check(data_dir, acked, ctx)
        torn += stats["truncated"]
    print(f"crash test: {KILLS} kills, {len(acked)} acked messages, {stats['records']} records in the log, "
          f"{torn} torn tails truncated")
    assert len(acked) > 100, "the writer hardly ran: the test proved little"
    assert torn > 0, "no torn tail was ever recovered: the test proved less than it claims"
