"""Writing the store: encode a batch of records, give each its queue offset, append to the log.

``StoreWriter.write`` appends ``Prepared`` records (page cache only); ``write_plain`` does the
same for plain records of one topic given as columns. Each written batch waits in
``Store._pending`` (its consume-queue entries, and the FLAG_DELAYED records the timer absorbs)
until ``Store.dispatch`` makes it visible; ``Store.sync`` makes it durable. The record layout is
``chronoq.store.record``'s: both loops inline ``record.encode_parts`` (a call per message costs as
much as its body) and the record-equivalence tests hold them to its bytes.
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




class StoreWriter:
    """The write half of ``chronoq.store.store.Store``, a mixin: the two encoder loops are the
    send path's hottest code, moved here unchanged, and they share with recovery, dispatch and
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
        """Append a batch to the log (page cache). Not durable or visible until sync/dispatch."""
        now = self.clock.wall_ms()
        next_qoff = self._next_qoff
        topic_bytes = self._topic_bytes
        tag_hashes = self._tag_hashes
        pack_tail, pack_prefix, crc, extend = record._pack_tail, record._pack_prefix, record._crc, record._extend
        magic, version, size_max, crc_start = record.MAGIC, record.VERSION, record.RECORD_SIZE_MAX, record.CRC_START
        delayed = record.FLAG_DELAYED
        held_flag = record.FLAG_HELD
        cont = record.FLAG_CONTINUES  # on every record; the last one's is cleared below (end_append)
        pieces: list[bytes] = []
        add_piece = pieces.append
        meta = []
        add_meta = meta.append
        sizes: list[int] = []
        add_size = sizes.append
        holds = False
        for m in messages:
            # One unpack instead of a named-field lookup per use: this loop runs per message.
            topic, queue_id, flags, born_ms, deliver_at_ms, message_id, tag, keys, props, body = m
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
            # record.encode_parts, inlined (a call per message costs as much as its body); the
            # record-equivalence tests hold both to the same bytes.
            head = pack_tail(flags | cont, queue_id, qoff, born_ms, stamp, deliver_at_ms, len(tb), len(message_id),
                             len(tag), len(keys), len(props), len(body)) + tb + message_id + tag + keys + props
            size = crc_start + len(head) + len(body)
            if size > size_max:
                raise ValueError(f"record of {size} bytes exceeds {size_max}")
            add_piece(pack_prefix(size, magic, version, extend(crc(head), body)))
            add_piece(head)
            add_piece(body)
            add_meta((key, qoff, size, tag_hash, time_ms))
            add_size(size)
        if not meta:
            return []
        record.end_append(pieces)  # one append, one group: the log never splits it (CommitLog.room)
        ends = list(itertools.accumulate(sizes))  # ends[k]: bytes of records 0..k
        out: list[Written] = []
        add_out, new_tuple = out.append, tuple.__new__
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
                    # tuple.__new__: a NamedTuple's own __new__ is a Python-level call, per message.
                    add_out(new_tuple(Written, (pos, qoff, length)))
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
            if out:
                self._pending.append((pos, batch, delayed_records))
            raise
        self._pending.append((pos, batch, delayed_records))
        return out

    def write_plain(self, topic: str, queue_ids: list[int], born_ms: list[int], message_ids: list[bytes],
                    tags: list[bytes], bodies: list[bytes]) -> tuple[list[int], list[int]]:
        """``write`` for plain records of one topic (flags 0; no keys, properties or delay), from
        columns instead of ``Prepared`` tuples: the same records byte for byte, the same queue
        offsets and pending dispatch, without a tuple per message in or out (the SendMessage
        fast path, chronoq.server.grpc_server). Returns (commit offsets, queue offsets).
        """
        n = len(bodies)
        assert len(queue_ids) == len(born_ms) == len(message_ids) == len(tags) == n
        if not n:
            return [], []
        now = self.clock.wall_ms()
        tb = self._topic_bytes.get(topic)
        if tb is None:
            tb = self._topic_bytes[topic] = topic.encode()
        tlen = len(tb)
        next_qoff = self._next_qoff
        nxt: dict[int, int] = {}
        for qid in set(queue_ids):
            qoff = next_qoff.get((topic, qid))
            nxt[qid] = self._queue(topic, qid).next_offset if qoff is None else qoff
        first = dict(nxt)
        tag_hash = {t: zlib.crc32(t) for t in set(tags)}
        pack_tail, pack_prefix, crc, extend = record._pack_tail, record._pack_prefix, record._crc, record._extend
        magic, version, size_max = record.MAGIC, record.VERSION, record.RECORD_SIZE_MAX
        cont = record.FLAG_CONTINUES  # on every record; the last one's is cleared below (end_append)
        pieces: list[bytes] = []
        add = pieces.append
        sizes: list[int] = []
        add_size = sizes.append
        qoffs: list[int] = []
        add_qoff = qoffs.append
        # The loop of record.encode_parts, inlined: a call per message costs as much as its body.
        for qid, born, mid, tag, body in zip(queue_ids, born_ms, message_ids, tags, bodies):
            qoff = nxt[qid]
            nxt[qid] = qoff + 1
            head = pack_tail(cont, qid, qoff, born, now, 0, tlen, len(mid), len(tag), 0, 0, len(body)) + tb + mid + tag
            total = record.CRC_START + len(head) + len(body)
            if total > size_max:
                raise ValueError(f"record of {total} bytes exceeds {size_max}")
            add(pack_prefix(total, magic, version, extend(crc(head), body)))
            add(head)
            add(body)
            add_size(total)
            add_qoff(qoff)
        record.end_append(pieces)  # one append, one group: the log never splits it (CommitLog.room)
        commits: list[int] = []
        add_commit = commits.append
        runs: dict[int, bytearray] = {qid: bytearray() for qid in nxt}
        pack_entry = _pack_entry
        i = pos = 0
        try:
            while i < n:
                j, room, size = i, self.log.room(), 0
                # Fill what fits in the active segment; a roll happens between chunks only.
                while j < n and (size + sizes[j] <= room or j == i):
                    size += sizes[j]
                    j += 1
                pos = self.log.append(b"".join(pieces[3 * i:3 * j]))
                for k in range(i, j):
                    length = sizes[k]
                    add_commit(pos)
                    runs[queue_ids[k]] += pack_entry(pos, length, tag_hash[tags[k]], now)
                    pos += length
                i = j
        finally:
            # Queue offsets of records not written (a storage error) are given back; what was
            # written waits for dispatch like any batch.
            batch: dict[tuple[str, int], tuple[int, bytearray]] = {}
            for qid, run in runs.items():
                next_qoff[(topic, qid)] = first[qid] + len(run) // ENTRY_SIZE
                if run:
                    self._add_entry(batch, (topic, qid), first[qid], run)
            if commits:
                self._pending.append((pos, batch, []))
        return commits, qoffs
