"""Writing the store: encode a batch of records, give each its queue offset, append to the log.

``StoreWriter.write_columns`` appends a batch given as ``Columns`` (page cache only); ``write``
is the same for a list of ``Prepared`` records (the timer's copies, POP, features). Each written
batch waits in ``Store._pending`` (its consume-queue entries, and the FLAG_DELAYED records the
timer absorbs, with their bytes) until ``Store.dispatch`` makes it visible; ``Store.sync`` makes it durable. The
record layout is ``chronoq.store.record``'s: ``write_columns`` encodes each batch with one call of
its ``encode_batch``, the one loop that lays records down (compiled with the codec).
"""

from __future__ import annotations

import itertools
import zlib
from collections import deque
from itertools import repeat
from operator import call, or_
from typing import Callable, Iterable, NamedTuple

from chronoq.core import errors
from chronoq.store import record
from chronoq.store.commitlog import CommitLog
from chronoq.store.consumequeue import ENTRY, ConsumeQueue
from chronoq.store.newqueues import QueueFileMaker

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
    new_files: QueueFileMaker | None
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

        The records' bytes are ``record.encode_batch``'s (one call per batch). What does not depend
        on them (queue offsets, store times, topic bytes, tag hashes) is worked out per column
        before it, in bulk where a batch is all of one kind (the send path's plain and delayed
        batches).
        """
        topics, queue_ids, flags, borns, dues, message_ids, tags, keys, props, bodies = c
        n = len(bodies)
        if not n:
            return [], [], []
        now = self.clock.wall_ms()
        next_qoff = self._next_qoff
        delayed_flag, held_flag = record.FLAG_DELAYED, record.FLAG_HELD
        # The batch's kind (its flags are nearly always alike): plain, delayed, or mixed (held copies).
        kind = flags[0] & (delayed_flag | held_flag) if n == 1 or flags.count(flags[0]) == n else -1
        one_topic = n == 1 or topics.count(topics[0]) == n
        one = topics[0] if one_topic else None  # the topic of every record, or None
        holds = False
        # Per record: its queue (None: a delayed record, in none yet; a one-topic plain batch's
        # named by its id, no tuple per record), queue offset, store time (a held copy: its due
        # time, the time its consume-queue entry carries too).
        if kind == delayed_flag:  # the delayed batch: no queue, no offset
            qkeys, qoffs, stamps = [None] * n, [0] * n, [now] * n
            one = None
        elif kind == 0 and one is not None and n > 1:
            # The plain batch: each queue's offsets run on from its next one, per queue at C level
            # (set-up that pays for many records; a lone record takes the loop below).
            qkeys = queue_ids
            counters = {}
            for queue_id in set(queue_ids):
                qoff = next_qoff.get((one, queue_id))
                counters[queue_id] = itertools.count(self._queue(one, queue_id).next_offset if qoff is None
                                                     else qoff).__next__
            qoffs = list(map(call, map(counters.__getitem__, queue_ids)))  # (C-level: no frame per record)
            for queue_id, following in counters.items():
                next_qoff[(one, queue_id)] = following()
            stamps = [now] * n
        else:
            one = None
            qkeys, qoffs, stamps = [], [], []
            for topic, queue_id, f, due in zip(topics, queue_ids, flags, dues):
                if f & delayed_flag:
                    assert not f & held_flag, "a held copy is a visible copy with a due time"
                    qkeys.append(None)
                    qoffs.append(0)
                    stamps.append(now)
                    continue
                key = (topic, queue_id)
                qoff = next_qoff.get(key)
                if qoff is None:
                    qoff = self._queue(*key).next_offset
                next_qoff[key] = qoff + 1
                qkeys.append(key)
                qoffs.append(qoff)
                if f & held_flag:
                    assert due > 0, "a held copy is a visible copy with a due time"
                    stamps.append(due)
                    holds = True
                else:
                    stamps.append(now)
        new_files = self.new_files
        topic_bytes = self._topic_bytes
        for topic in (topics[0],) if one_topic else set(topics):
            if topic not in topic_bytes:
                topic_bytes[topic] = topic.encode()
        tbs = [topic_bytes[topics[0]]] * n if one_topic else list(map(topic_bytes.__getitem__, topics))
        # One append, one group: every record but the last says another of this append follows
        # (CONTINUES; record.py); the log never splits an append over segments. The last is
        # encoded without it here: clearing it afterwards would compute its CRC twice.
        marked = map(or_, flags, itertools.chain(repeat(record.FLAG_CONTINUES, n - 1), (0,)))
        pieces: list[bytes] = []
        sizes = record.encode_batch(pieces, marked, queue_ids, qoffs, borns, stamps, dues, tbs, message_ids, tags, keys,
                                    props, bodies)
        tag_hashes = self._tag_hashes
        if len(tag_hashes) > 4096:
            tag_hashes.clear()
        for tag in (tags if n == 1 else set(tags)):
            if tag not in tag_hashes:
                tag_hashes[tag] = zlib.crc32(tag)
        # One append, never split over segments (CommitLog.append rolls before it when it does not
        # fit the active one): on disk whole or not at all, as its CONTINUES marks say.
        data = b"".join(pieces)
        try:
            pos = self.log.append(data)
        except errors.StorageError:
            for key, qoff in zip(qkeys, qoffs):  # give back the offsets of what was not written
                if key is not None:  # (delayed records took no queue offset)
                    key = (one, key) if one is not None else key
                    next_qoff[key] = min(next_qoff[key], qoff)
            raise
        if holds:  # before dispatch can put their entries: never visible unreleased
            self._hold_written(list(zip(qkeys, qoffs, sizes, repeat(0), stamps)), 0, n, now)
        # Commit offsets from the sizes (C level); consume-queue entries packed in one C pass, then
        # joined per queue (a queue's records in a batch take consecutive offsets).
        commits = list(itertools.accumulate(sizes, initial=pos))
        pos = commits.pop()  # (the append's end)
        batch: dict[tuple[str, int], tuple[int, bytes]] = {}
        delayed_bytes, delayed_heads = data, None
        if kind == delayed_flag:  # the delayed batch: no consume-queue entry until due
            delayed_records = list(zip(commits, sizes, dues))
            delayed_heads = b"".join(pieces[1::3])
        else:
            delayed_records = []
            entries = list(map(_pack_entry, commits, sizes, map(tag_hashes.__getitem__, tags), stamps))
            runs: dict = {}
            for key, qoff, entry, commit, length, due in zip(qkeys, qoffs, entries, commits, sizes, dues):
                if key is None:
                    delayed_records.append((commit, length, due))
                    continue
                run = runs.get(key)
                if run is None:
                    runs[key] = (qoff, [entry])
                else:
                    run[1].append(entry)
            # (A queue's records in one batch take consecutive offsets: each run is whole, and the
            # batch's entry runs are these, one per queue.)
            for key, (first, parts) in runs.items():
                batch[(one, key) if one is not None else key] = (first, b"".join(parts))
            if delayed_records:  # a mixed batch (rare): its delayed records' bytes, back to back
                delayed = [i for i, key in enumerate(qkeys) if key is None]
                delayed_bytes = b"".join(itertools.chain.from_iterable(pieces[3 * i:3 * i + 3] for i in delayed))
                delayed_heads = b"".join([pieces[3 * i + 1] for i in delayed])
        if new_files is not None and batch:  # new queues' first files, made while the batch is fsynced
            new_files.ask(batch, pos)
        # The timer takes the delayed records with their bytes, and their heads (all but the
        # bodies) apart (``Store.delayed_dispatched``): it never reads back what was just written.
        self._pending.append((pos, batch, (delayed_records, delayed_bytes, delayed_heads) if delayed_records else None))
        return commits, qoffs, sizes
