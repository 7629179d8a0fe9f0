"""Copies parked until their release (``chronoq.timer.keyed.parked_copy``): plain tuples the
garbage collector stops tracking, and counted out of the key index as a delivery would be."""

from __future__ import annotations

import gc

from chronoq.store import record
from chronoq.store.writing import Prepared
from chronoq.timer import keyed
from chronoq.timer.keys import KeyIndex
from chronoq.timer.lanes import Delivery


def _delivery(ref, keys: bytes = b"", props: bytes = b"") -> Delivery:
    p = Prepared("orders", 3, record.FLAG_HELD, 1_000, 90_000, b"MID-1", b"tag", keys, props, b"x" * 200)
    d = Delivery(ref, 90_000, p)
    d.queue_offset = 41
    return d


def test_a_parked_copy_is_untracked_by_the_collector_and_keeps_what_counting_reads():
    d = _delivery((60_000, 7), keys=b"k1")
    parked = keyed.parked_copy(d)
    gc.collect()
    # (a Delivery and its Prepared stay tracked: 300,000 of each went through every collection)
    assert gc.is_tracked(d) and gc.is_tracked(d.prepared) and not gc.is_tracked(parked)
    assert (parked[keyed.PARKED_OFFSET], parked[keyed.PARKED_DUE], parked[keyed.PARKED_IDENT]) == (41, 90_000, 7)
    assert (parked[keyed.PARKED_TOPIC], parked[keyed.PARKED_MESSAGE_ID], parked[keyed.PARKED_KEYS]) == \
        ("orders", b"MID-1", b"k1")
    assert parked[keyed.PARKED_PROPS] == b"" and b"x" * 200 not in parked  # (no body, no plain properties)
    assert keyed.parked_copy(_delivery(12))[keyed.PARKED_IDENT] == keyed.NO_IDENT  # a delay level's copy


class _Index(keyed.Keyed):
    def __init__(self) -> None:
        self.keys = KeyIndex(60_000, 0)


def test_released_copies_leave_the_key_index_as_deliveries_do_and_a_level_copy_is_skipped():
    by_delivery, by_parked = _Index(), _Index()
    timer = [_delivery((60_000, ident), keys=b"k%d" % ident) for ident in range(1, 6)]
    level = _delivery(12, keys=b"k9")  # (a delay level's copy with keys: not in the index)
    for index in (by_delivery, by_parked):
        for d in timer:
            index._index_change(index.keys, True, d.ref[1], "orders", d.prepared.keys, b"", 60_000)
    assert by_delivery.keys.live == 5
    by_delivery.unindex_delivered(timer[:3], now=90_000)
    by_parked.unindex_released([keyed.parked_copy(d) for d in timer[:3]] + [keyed.parked_copy(level)], now=90_000)
    assert by_parked.keys.live == by_delivery.keys.live == 2
    by_parked.unindex_released([keyed.parked_copy(d) for d in timer[3:]], now=89_999)  # (not due: kept)
    assert by_parked.keys.live == 2
