"""Batch write of 10,000 rows with ``deliver_at`` through the data source: every message is
delivered at its time, none early, each exactly once (a real broker subprocess, POP consumers)."""

from __future__ import annotations

import asyncio
import time

from tests.spark.conftest import queue_totals, read_topic, write_rows

ROWS = 10_000
LEAD_S = 12.0      # the first message is due this long after the write starts
SPREAD_S = 4.0     # due times spread over this window
LATE_MAX_S = 5.0   # visible no later than this after its due time (when published before it)


async def consume(endpoint: str, group: str, topic: str, want: int, deadline_s: float) -> dict[str, tuple]:
    """POP-receive and ack until ``want`` messages arrived: {body: (receive ms, deliver_at ms)}."""
    from chronoq.client.client import Client

    got: dict[str, tuple] = {}
    async with Client(endpoint) as client:
        end = time.monotonic() + deadline_s
        while len(got) < want and time.monotonic() < end:
            batch = await client.receive(group, topic, max_messages=32, invisible_s=60, wait_s=2)
            now_ms = int(time.time() * 1000)
            for m in batch:
                assert m.body.decode() not in got, f"delivered twice: {m.body!r}"
                got[m.body.decode()] = (now_ms, m.deliver_at_ms)
            await client.ack(group, topic, batch)
    return got


def test_batch_write_10k_delayed_rows_delivered_on_time(spark, broker):
    from pyspark.sql import functions as F

    b = broker()
    start_ms = int(time.time() * 1000)
    first_due = start_ms + int(LEAD_S * 1000)
    df = spark.range(ROWS).select(
        F.format_string("reminder-%05d", "id").alias("body"),
        F.format_string("user-%d", F.col("id") % 97).alias("key"),
        F.lit("reminder").alias("tag"),
        # deliver_at as a timestamp column: spread over SPREAD_S, 400 rows per distinct millisecond
        F.timestamp_millis(F.lit(first_due) + (F.col("id") % 25) * int(SPREAD_S * 1000 / 25)).alias("deliver_at"))
    write_rows(df, b.endpoint, "reminders", jobId="test-10k")
    published_ms = int(time.time() * 1000)
    assert queue_totals(b.endpoint, "reminders") == 0, "delayed messages must not be visible before their time"

    got = asyncio.run(consume(b.endpoint, "reminder-workers", "reminders", ROWS, LEAD_S + SPREAD_S + 60))
    assert len(got) == ROWS
    assert set(got) == {f"reminder-{i:05d}" for i in range(ROWS)}
    early = [body for body, (received, due) in got.items() if received < due]
    assert not early, f"{len(early)} received before their deliver_at, e.g. {early[:3]}"

    rows = read_topic(spark, b.endpoint, "reminders").select(
        "body", "keys", "tag", F.expr("unix_millis(deliver_at)").alias("due"),
        F.expr("unix_millis(visible)").alias("visible"), F.expr("unix_millis(stored)").alias("stored")).collect()
    assert len(rows) == ROWS
    for r in rows:
        assert r.visible >= r.due, f"{r.body} visible {r.due - r.visible} ms early"
        assert r.stored is not None and r.stored <= r.due
        assert r.tag == "reminder" and len(r.keys) == 1
        if r.due > published_ms:  # published before it was due: made visible on time
            assert r.visible - r.due <= LATE_MAX_S * 1000, f"{r.body} visible {r.visible - r.due} ms late"
    assert sum(1 for r in rows if r.due > published_ms) > ROWS // 2, "the write took too long to judge lateness"
