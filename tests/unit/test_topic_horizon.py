"""Pending timer messages by topic from a bucket's entries (chronoq.timer.topic_horizon)."""

from __future__ import annotations

from chronoq.store import record
from chronoq.timer import schedlog
from chronoq.timer.schedlog import CANCELLED, DISPATCHED, MESSAGE, MOVED
from chronoq.timer.topic_horizon import count_entries

START = 1_800_000_000_000


def _message(ident: int, topic: str) -> bytes:
    rec = record.encode(record.FLAG_DELAYED, 0, ident, 0, START - 1, START + 5, topic.encode(), b"ID%d" % ident,
                        b"", b"", b"", b"body")
    return schedlog.encode_entry(MESSAGE, ident, START + 5, payload=rec)


def test_counts_pending_messages_by_topic_from_file_and_buffer():
    file_data = (schedlog.encode_header(START, 60_000) + _message(1, "orders") + _message(2, "orders")
                 + _message(3, "audit") + _message(4, "orders-x")
                 + schedlog.encode_entry(DISPATCHED, 2, START + 5, 99))
    extra = (_message(5, "audit") + schedlog.encode_entry(CANCELLED, 3, START + 5, 77)
             + schedlog.encode_entry(MOVED, 4, START + 5, 88) + _message(6, "orders") + _message(6, "orders"))
    counts = count_entries("bucket.sch", START, file_data, extra)
    # 1 and 6 (written twice: a replay) pending in orders; 2 delivered; 3 recalled; 4 moved; 5 in audit.
    assert counts == {b"orders": 2, b"audit": 1}


def test_a_file_with_a_bad_header_counts_only_the_buffer():
    file_data = b"XXXX" + schedlog.encode_header(START, 60_000)[4:] + _message(1, "orders")
    assert count_entries("bucket.sch", START, file_data, _message(2, "orders")) == {b"orders": 1}
