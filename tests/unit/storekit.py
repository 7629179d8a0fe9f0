"""Helpers shared by the store tests: build messages, open a store, and "crash" it in-process."""

from __future__ import annotations

import os
import random

from chronoq.core.clock import FakeClock
from chronoq.store import record
from chronoq.store.commitlog import CommitLog
from chronoq.store.store import Prepared, Store, StoreOptions

SMALL_SEGMENT = 64 * 1024


def prep(topic: str, queue_id: int, body: bytes, msgid: str, *, tag: str = "", flags: int = 0,
         deliver_at_ms: int = 0, born_ms: int = 1_600_000_000_000) -> Prepared:
    return Prepared(topic, queue_id, flags, born_ms, deliver_at_ms, msgid.encode(), tag.encode(),
                    record.encode_keys(("k-" + msgid,)), record.encode_properties({"p": msgid}), body)


def body_for(msgid: str, size: int | None = None) -> bytes:
    """A body that is a pure function of the message id (so a test can check exact bytes)."""
    rng = random.Random(msgid)
    return rng.randbytes(size if size is not None else rng.randint(1, 3000))


def open_store(path, clock: FakeClock | None = None, **options) -> Store:
    return Store(str(path), StoreOptions(**options), clock=clock or FakeClock())


def crash(store: Store) -> None:
    """Stop using ``store`` as a killed process would: no dispatch, no checkpoint, no sealing.

    Only the file descriptors are closed (``CommitLog.close`` would cut the preallocated tail,
    which a killed process does not do), so the active segment keeps its zero tail; the data
    directory's lock is released, as the kernel drops it when the process dies.
    """
    for fd in store.log._fds.values():
        os.close(fd)
    store.log._fds.clear()
    for cq in store.queues.values():
        cq.close()
    store.dir_lock.release()  # the kernel drops a killed process's flock


def fill(store: Store, count: int, *, topics=("a", "b"), queues: int = 2, seed: int = 0, start: int = 0,
         batch: int = 7, size: int | None = None) -> list[dict]:
    """Append ``count`` messages in batches; return what each was acked as (sync + dispatch)."""
    rng = random.Random(seed)
    sent = []
    pending = []
    for i in range(start, start + count):
        msgid = f"M{seed:04d}-{i:06d}"
        topic, qid = rng.choice(topics), rng.randrange(queues)
        tag = rng.choice(["", "red", "blue"])
        # Delayed records (FLAG_DELAYED) belong to the timer and get no consume-queue entry;
        # the store's queue tests use immediate records only.
        pending.append((prep(topic, qid, body_for(msgid, size), msgid, tag=tag), msgid))
        if len(pending) == batch or i == start + count - 1:
            written = store.append([p for p, _ in pending])
            for (p, mid), w in zip(pending, written):
                sent.append({"id": mid, "topic": p.topic, "queue_id": p.queue_id, "queue_offset": w.queue_offset,
                             "commit_offset": w.commit_offset, "size": w.size, "body": p.body})
            pending = []
    return sent


def read_all(store: Store) -> dict:
    """Every readable message, keyed by (topic, queue, queue offset)."""
    out = {}
    for (topic, qid) in sorted(store.queues):
        lo, hi = store.bounds(topic, qid)
        offset = lo
        while offset < hi:
            msgs, nxt = store.read(topic, qid, offset, 1000)
            for m in msgs:
                out[(topic, qid, m.queue_offset)] = (m.message_id, m.commit_offset, m.body)
            assert nxt > offset
            offset = nxt
    return out


def queue_snapshot(store: Store) -> dict:
    """Raw consume-queue entries of every queue, from min to next offset."""
    snap = {}
    for (topic, qid), cq in sorted(store.queues.items()):
        raw = bytearray()
        offset = cq.min_offset
        while offset < cq.next_offset:
            chunk = cq.get(offset, 100_000)
            assert chunk
            raw += chunk
            offset += len(chunk) // 24
        snap[(topic, qid)] = (cq.min_offset, cq.next_offset, bytes(raw))
    return snap


def segments(path) -> list[str]:
    d = os.path.join(str(path), "commitlog")
    return sorted(os.path.join(d, n) for n in os.listdir(d) if n.endswith(".log"))


def record_positions(seg_path: str) -> list[tuple[int, int]]:
    """(position, length) of every record in a segment file, by walking it with ``record.check``."""
    with open(seg_path, "rb") as fh:
        data = fh.read()
    out, pos = [], 0
    while pos < len(data) and any(data[pos:]):  # an all-zero tail is preallocated space
        length = record.check(data, pos, len(data))
        out.append((pos, length))
        pos += length
    return out


def flip_bit(path: str, byte: int, bit: int = 0) -> None:
    with open(path, "r+b") as fh:
        fh.seek(byte)
        value = fh.read(1)[0]
        fh.seek(byte)
        fh.write(bytes([value ^ (1 << bit)]))


def data_end(seg_path: str) -> int:
    """End of the records in a segment (a crashed active segment has a preallocated zero tail)."""
    recs = record_positions(seg_path)
    return recs[-1][0] + recs[-1][1] if recs else 0


def log_bytes(path) -> bytes:
    """The records of every segment, without preallocated tails (segments must be valid)."""
    return b"".join(open(p, "rb").read()[:data_end(p)] for p in segments(path))


def raw_files(path) -> dict[str, bytes]:
    """Every segment file's exact contents (to prove recovery changed nothing)."""
    return {p: open(p, "rb").read() for p in segments(path)}


__all__ = ["CommitLog", "SMALL_SEGMENT", "prep", "body_for", "open_store", "crash", "fill", "read_all",
           "queue_snapshot", "segments", "record_positions", "flip_bit", "data_end", "log_bytes", "raw_files"]
