"""The dispatch walk: checked records in, consume-queue entries out (recovery's replay, a
replica's dispatch of what it was shipped: ``Store._replay``).

One call per chunk of whole records (``chronoq.store.recovery.iter_chunks``), compiled
(``chronoq.COMPILED_MODULES``). Compiled, the walk is routing.pxd's ``_route_in_c``: each
record's routing fields are C integers read from the chunk's bytes, its entry is written into its
run's bytearray through a pointer, and Python objects are made per run or per new name, not per
record (a topic whose bytes equal the last one's keeps its name, a tag equal to the last one's its
CRC, and a queue's run is found in a slot by queue id). The loop below is the pure build's and the
reference (tests/unit/test_routing.py holds the C walk to it). Typed, a replica's apply of what it
is shipped took 9.1 k instructions a message instead of 16.0 k (the walk's own share from 7.6 k to
0.7 k), a recovery replay 4.5 k a record instead of 11.6 k (callgrind, 50,000 1 KiB messages over
8 queues; bench/replica_apply.py, alternating runs: 2.3-2.7 -> 1.8-2.0 us a message).

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

# The compiled build walks in C (routing.pxd's ``_route_in_c``); this source's loop is the pure
# build's, and the reference the C walk is held to (tests/unit/test_routing.py).
_COMPILED = not __file__.endswith(".py")


def route(chunk: bytes, p: int, stop: int, at: int, batch: dict, taps: list | None, add_entry) -> int:
    """Route the records of ``chunk[p:stop]`` (``chunk[0]`` at commit offset ``at``) into
    ``batch``; returns how many entries were made. ``taps`` None: nobody follows (recovery).
    ``add_entry(batch, key, qoff, entry)`` may change ``batch[key]`` only, and leaves it the run
    that ``key``'s next entry continues (the compiled walk remembers each queue's run by it)."""
    if _COMPILED and type(chunk) is bytes:
        return _route_in_c(chunk, p, stop, at, batch, taps, add_entry,  # noqa: F821 - in routing.pxd
                           topic_name, zlib.crc32)
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
