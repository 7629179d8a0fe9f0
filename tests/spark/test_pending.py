"""``pending=true``: a batch read of what is still scheduled, through a real local SparkSession
and a real broker subprocess. Messages that fired (or were recalled) before the read are absent."""

from __future__ import annotations

import asyncio

import pytest

from tests.spark.conftest import QUERY_TIMEOUT_S, queue_totals, read_topic, wait_until, write_rows

FAR_MS = 3_600_000
SOON_MS = 1_500


def test_pending_messages_as_a_dataframe_fired_and_recalled_ones_absent(spark, broker):
    from pyspark.sql import functions as F

    from chronoq.client.admin import AdminClient

    b = broker()
    far = spark.range(40).select(F.format_string("far-%02d", "id").alias("body"),
                                 F.format_string("user-%d", F.col("id") % 4).alias("key"), F.lit("t1").alias("tag"),
                                 (F.lit(FAR_MS) + F.col("id") * 1000).alias("delay_ms"))
    write_rows(far, b.endpoint, "later", jobId="far")
    soon = spark.range(5).select(F.format_string("soon-%d", "id").alias("body"), F.lit(SOON_MS).cast("bigint")
                                 .alias("delay_ms"))
    write_rows(soon, b.endpoint, "later", jobId="soon")
    other = spark.range(3).select(F.format_string("other-%d", "id").alias("body"), F.lit(FAR_MS).alias("delay_ms"))
    write_rows(other, b.endpoint, "elsewhere", jobId="other")
    wait_until(lambda: queue_totals(b.endpoint, "later") == 5, 60, what="the soon messages delivered")

    df = read_topic(spark, b.endpoint, "later", pending="true", pendingPartitions="3")
    assert df.columns[-1] == "due" and df.columns[:-1] == read_topic(spark, b.endpoint, "later").columns
    assert df.rdd.getNumPartitions() == 3
    rows = df.select("topic", "queue", "offset", "message_id", "keys", "tag", "body",
                     F.expr("unix_millis(due)").alias("due"), F.expr("unix_millis(deliver_at)").alias("deliver_at"),
                     F.expr("unix_millis(stored)").alias("stored"), "visible").collect()
    assert sorted(r.body for r in rows) == [b"far-%02d" % i for i in range(40)]  # fired ones absent
    assert len({r.message_id for r in rows}) == 40  # each once over the partitions
    for r in rows:
        i = int(r.body[4:])
        assert (r.topic, r.tag, r.keys, r.offset, r.visible) == ("later", "t1", [f"user-{i % 4}"], None, None)
        assert r.due == r.deliver_at and r.due - r.stored > FAR_MS // 2  # the delay counts from the write
    assert 0 <= min(r.queue for r in rows)
    # Filters: a message key, a due window.
    keyed = read_topic(spark, b.endpoint, "later", pending="true", messageKey="user-1").collect()
    assert sorted(r.body for r in keyed) == [b"far-%02d" % i for i in range(40) if i % 4 == 1]
    dues = sorted(r.due for r in rows)
    window = read_topic(spark, b.endpoint, "later", pending="true", dueFrom=str(dues[10]), dueTo=str(dues[20]))
    assert window.count() == 10
    assert spark.read.format("chronoq").option("endpoints", b.endpoint).option("subscribe", "later,elsewhere") \
        .option("pending", "true").load().count() == 43

    # Recall some: a new read no longer has them.
    async def recall_user_2():
        async with AdminClient(b.endpoint) as admin:
            page = await admin.list_pending(topic="later", key="user-2", limit=100)
            for m in page.messages:
                assert (await admin.recall(m.recall_handle)).outcome == "cancelled"
            return len(page.messages)

    assert asyncio.run(recall_user_2()) == 10
    again = read_topic(spark, b.endpoint, "later", pending="true").collect()
    assert sorted(r.body for r in again) == [b"far-%02d" % i for i in range(40) if i % 4 != 2]


def test_pending_options_are_checked(spark, broker, tmp_path):
    b = broker()
    with pytest.raises(Exception, match="only apply with pending=true"):
        read_topic(spark, b.endpoint, "x", dueFrom="5").collect()
    with pytest.raises(Exception, match="do not apply to a read of pending"):
        read_topic(spark, b.endpoint, "x", pending="true", startingOffsets="earliest").collect()
    stream = spark.readStream.format("chronoq").option("endpoints", b.endpoint).option("topic", "x") \
        .option("pending", "true").load()
    with pytest.raises(Exception, match="batch read"):
        query = stream.writeStream.format("noop").option("checkpointLocation", str(tmp_path / "ckpt")) \
            .trigger(availableNow=True).start()
        query.awaitTermination(QUERY_TIMEOUT_S)
    assert read_topic(spark, b.endpoint, "x", pending="true").count() == 0  # nothing pending: empty
