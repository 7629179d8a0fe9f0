"""The dispatch walk: checked records in, consume-queue entries out (recovery's replay, a
replica's dispatch of what it was shipped: ``Store._replay``).

One call per chunk of whole records (``chronoq.store.recovery.iter_chunks``), compiled
(``chronoq.COMPILED_MODULES``): the loop over records runs without a Python frame, a header
object or a generator step per record, which were most of a replica's CPU for each record it
applies (bench/replica_apply.py).

Each record not DELAYED becomes its consume-queue entry (``ConsumeQueue``'s layout: the
record's commit offset, its length, the CRC-32 of its tag, its stored time), added to ``batch``
({(topic, queue id): (first queue offset, bytearray of entries)}) as the run it continues, or
through ``add_entry`` (``Store._add_entry``: a new run, a gap, a queue's first). Records a timer
follows (DELAYED, or with a delivery time) are listed in ``taps`` by their position in the
chunk, in log order, for the caller to hand over (``Store._replay``'s ``tap``).
"""

from __future__ import annotations

import zlib

from chronoq.store.consumequeue import ENTRY, ENTRY_SIZE
from chronoq.store.record import FLAG_DELAYED, HEADER_SIZE, ROUTE, topic_name

def route(chunk: bytes, p: int, stop: int, at: int, batch: dict, taps: list | None, add_entry) -> int:
    """Route the records of ``chunk[p:stop]`` (``chunk[0]`` at commit offset ``at``) into
    ``batch``; returns how many entries were made. ``taps`` None: nobody follows (recovery)."""
    unpack, pack, crc32 = ROUTE.unpack_from, ENTRY.pack, zlib.crc32
    header, delayed, entry_size = HEADER_SIZE, FLAG_DELAYED, ENTRY_SIZE
    made = 0
    while p < stop:
        total, flags, qid, qoff, stored, deliver, tlen, mlen, taglen = unpack(chunk, p)
        if flags & delayed:  # the timer absorbs these itself: no entry (Store.scan, the tap)
            if taps is not None:
                taps.append(p)
            p += total
            continue
        if deliver and taps is not None:
            taps.append(p)
        t = p + header
        topic = topic_name(chunk[t:t + tlen])
        t += tlen + mlen
        entry = pack(at + p, total, crc32(chunk[t:t + taglen]) if taglen else 0, stored)
        key = (topic, qid)
        run = batch.get(key)
        if run is not None and run[0] + len(run[1]) // entry_size == qoff:  # (add_entry's common case)
            run[1].extend(entry)
        else:
            add_entry(batch, key, qoff, entry)
        made += 1
        p += total
    assert p == stop, (p, stop)  # whole records: a walk that overran misread a length
    return made
