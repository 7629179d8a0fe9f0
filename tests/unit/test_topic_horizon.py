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


def test_topic_counts_follow_sends_recalls_and_flushes(tmp_path):
    """TopicCounts (the files counted on a worker thread by ``refresh``) equals, after each change,
    a count made from nothing, and the messages sent minus those recalled, topic by topic."""
    import asyncio
    import random

    from chronoq.broker.broker import Broker, OutgoingMessage
    from chronoq.core.clock import FakeClock
    from chronoq.core.config import BrokerConfig
    from chronoq.timer.topic_horizon import TopicCounts

    rng, clock = random.Random(20261127), FakeClock(START)
    broker = Broker(BrokerConfig(data_dir=str(tmp_path / "data"), default_queues=1, timer_bucket_ms=10_000,
                                 timer_preload_ms=20_000), clock=clock)
    horizons = (0, 60_000, 600_000, 1 << 62)
    expected, handles = {"orders": 0, "audit": 0}, []
    try:
        counts = TopicCounts(broker.timer)
        for step in range(40):
            action = rng.random()
            if action < 0.5:
                topic = rng.choice(("orders", "audit"))
                results = broker.send_batch([OutgoingMessage(topic, b"x", deliver_at_ms=clock.wall_ms()
                                                             + rng.randrange(30_000, 900_000))
                                             for _ in range(rng.randrange(1, 10))])
                handles += [(r.recall_handle, topic) for r in results]
                expected[topic] += len(results)
            elif action < 0.65 and handles:
                handle, topic = handles.pop(rng.randrange(len(handles)))
                broker.recall(handle)
                expected[topic] -= 1
            else:
                broker.maintenance()  # writes bucket buffers to their files
            asyncio.run(counts.refresh())
            fresh = TopicCounts(broker.timer)
            asyncio.run(fresh.refresh())
            for topic in ("orders", "audit"):
                kept = counts.pending_by_horizon(topic, horizons)
                assert kept == fresh.pending_by_horizon(topic, horizons), step
                assert kept[-1] == expected[topic], (step, topic)  # (the clock stands still: nothing due)
        assert expected["orders"] > 0 and expected["audit"] > 0
    finally:
        broker.close()
