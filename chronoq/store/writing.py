"""Writing the store: encode a batch of records, give each its queue offset, append to the log.

``StoreWriter.write_columns`` appends a batch given as ``Columns`` (page cache only); ``write``
is the same for a list of ``Prepared`` records (the timer's copies, POP, features). Each written
batch waits in ``Store._pending`` (its consume-queue entries, and the FLAG_DELAYED records the
timer absorbs) until ``Store.dispatch`` makes it visible; ``Store.sync`` makes it durable. The
record layout is ``chronoq.store.record``'s: ``write_columns`` holds the one loop that encodes
records on the write path (``record.encode_parts`` inlined: a call per message costs as much as
its body), and the record-equivalence tests hold it to the codec's bytes.
"""

from __future__ import annotations

import bisect
import itertools
import zlib
from collections import deque
from typing import Callable, Iterable, NamedTuple

from chronoq.core import errors
from chronoq.store import record
from chronoq.store.commitlog import CommitLog
from chronoq.store.consumequeue import ENTRY, ENTRY_SIZE, ConsumeQueue

_pack_entry = ENTRY.pack


class Prepared(NamedTuple):
    """A message validated and encoded by the broker, waiting for its queue offset."""

    topic: str
    queue_id: int
    flags: int
    born_ms: int
    deliver_at_ms: int
    message_id: bytes
    tag: bytes
    keys: bytes
    properties: bytes
    body: bytes


# StoreWriter.write unpacks a Prepared positionally (faster than one named lookup per field).
assert Prepared._fields == ("topic", "queue_id", "flags", "born_ms", "deliver_at_ms", "message_id", "tag", "keys",
                            "properties", "body")


class Written(NamedTuple):
    commit_offset: int
    queue_offset: int
    size: int


class Columns(NamedTuple):
    """A batch of records as columns, one list per ``Prepared`` field, in its order (the send
    path's shape: no tuple per message). A column may repeat one object (``[topic] * n``)."""

    topics: list
    queue_ids: list
    flags: list
    born_ms: list
    deliver_at_ms: list
    message_ids: list
    tags: list
    keys: list
    properties: list
    bodies: list


assert len(Columns._fields) == len(Prepared._fields)


class StoreWriter:
    """The write half of ``chronoq.store.store.Store``, a mixin: the encoder loop is the send
    path's hottest code, and they share with recovery, dispatch and
    the holds the store state named below (a class of its own would take all of it: the store)."""

    clock: object
    log: CommitLog
    _next_qoff: dict[tuple[str, int], int]
    _topic_bytes: dict[str, bytes]
    _tag_hashes: dict[bytes, int]
    _pending: deque
    _queue: Callable[[str, int], ConsumeQueue]
    _add_entry: Callable[[dict, tuple[str, int], int, bytes], None]
    _hold_written: Callable[[list, int, int, int], None]

    def write(self, messages: Iterable[Prepared]) -> list[Written]:
        """Append a batch of ``Prepared`` records (page cache): ``write_columns`` of their columns.
        Not durable or visible until sync/dispatch."""
        rows = messages if type(messages) is list else list(messages)
        if not rows:
            return []
        columns = Columns(*map(list, zip(*rows)))
        commits, qoffs, sizes = self.write_columns(columns)
        new_tuple = tuple.__new__  # (a NamedTuple's own __new__ is a Python-level call)
        return [new_tuple(Written, w) for w in zip(commits, qoffs, sizes)]

    def write_columns(self, c: "Columns") -> tuple[list[int], list[int], list[int]]:
        """Append a batch given as columns (the send path's shape: no object per message) to the
        log (page cache). Returns the commit offsets, queue offsets (0 for a FLAG_DELAYED record:
        no consume-queue entry until the timer re-puts it) and record sizes, per record.

        The one record encoder of the write path: ``record.encode_parts``, inlined (a call per
        message costs as much as its body); the record-equivalence tests hold it to the codec.
        """
        now = self.clock.wall_ms()
        next_qoff = self._next_qoff
        topic_bytes = self._topic_bytes
        tag_hashes = self._tag_hashes
        pack_tail, pack_prefix, crc, extend = record._pack_tail, record._pack_prefix, record._crc, record._extend
        magic, version, size_max, crc_start = record.MAGIC, record.VERSION, record.RECORD_SIZE_MAX, record.CRC_START
        delayed = record.FLAG_DELAYED
        held_flag = record.FLAG_HELD
        pieces: list[bytes] = []
        add_piece = pieces.append
        meta = []
        add_meta = meta.append
        sizes: list[int] = []
        add_size = sizes.append
        qoffs: list[int] = []
        add_qoff = qoffs.append
        holds = False
        for topic, queue_id, flags, born_ms, deliver_at_ms, message_id, tag, keys, props, body in zip(*c):
            stamp = now
            if flags & held_flag:
                assert deliver_at_ms > 0 and not flags & delayed, "a held copy is a visible copy with a due time"
                stamp = deliver_at_ms
                holds = True
            if flags & delayed:
                # Not in any consume queue yet: the timer re-puts a copy when it falls due.
                key, qoff, tag_hash, time_ms = None, 0, 0, deliver_at_ms
            else:
                key = (topic, queue_id)
                qoff = next_qoff.get(key)
                if qoff is None:
                    qoff = self._queue(*key).next_offset
                next_qoff[key] = qoff + 1
                tag_hash = tag_hashes.get(tag)
                if tag_hash is None:
                    if len(tag_hashes) > 4096:
                        tag_hashes.clear()
                    tag_hash = tag_hashes[tag] = zlib.crc32(tag)
                time_ms = stamp
            tb = topic_bytes.get(topic)
            if tb is None:
                tb = topic_bytes[topic] = topic.encode()
            head = pack_tail(flags, queue_id, qoff, born_ms, stamp, deliver_at_ms, len(tb), len(message_id),
                             len(tag), len(keys), len(props), len(body)) + tb + message_id + tag + keys + props
            size = crc_start + len(head) + len(body)
            if size > size_max:
                raise ValueError(f"record of {size} bytes exceeds {size_max}")
            add_piece(pack_prefix(size, magic, version, extend(crc(head), body)))
            add_piece(head)
            add_piece(body)
            add_meta((key, qoff, size, tag_hash, time_ms))
            add_size(size)
            add_qoff(qoff)
        if not meta:
            return [], [], []
        ends = list(itertools.accumulate(sizes))  # ends[k]: bytes of records 0..k
        commits: list[int] = []
        add_commit = commits.append
        batch: dict[tuple[str, int], tuple[int, bytearray]] = {}
        delayed_records: list[tuple[int, int, int]] = []
        i = 0
        pos = 0
        try:
            while i < len(meta):
                # Fill what fits in the active segment (at least one record); a roll happens
                # between chunks only.
                j = max(i + 1, bisect.bisect_right(ends, (ends[i - 1] if i else 0) + self.log.room(), i))
                pos = self.log.append(b"".join(pieces[3 * i:3 * j]))
                if holds:  # before dispatch can put their entries: never visible unreleased
                    self._hold_written(meta, i, j, now)
                for k in range(i, j):
                    key, qoff, length, tag_hash, time_ms = meta[k]
                    add_commit(pos)
                    if key is None:
                        delayed_records.append((pos, length, time_ms))
                        pos += length
                        continue
                    run = batch.get(key)
                    entry = _pack_entry(pos, length, tag_hash, time_ms)
                    if run is not None and run[0] + len(run[1]) // ENTRY_SIZE == qoff:
                        run[1].extend(entry)
                    else:
                        self._add_entry(batch, key, qoff, entry)
                    pos += length
                i = j
        except errors.StorageError:
            for key, qoff, *_ in meta[i:]:  # give back the offsets of what was not written
                if key is not None:  # (delayed records took no queue offset)
                    next_qoff[key] = min(next_qoff[key], qoff)
            if commits:
                self._pending.append((pos, batch, delayed_records))
            raise
        self._pending.append((pos, batch, delayed_records))
        return commits, qoffs, sizes
