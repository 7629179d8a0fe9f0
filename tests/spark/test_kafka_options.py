"""The source's Kafka-source aliases against a real broker and a real local SparkSession: several
topics (``subscribe``), a pattern (``subscribePattern``), ``maxOffsetsPerTrigger``, and an unknown
read option refused with the list of the known ones."""

from __future__ import annotations

import json
import os

import pytest

from tests.spark.conftest import QUERY_TIMEOUT_S, write_rows


def _bodies(spark, n: int, prefix: str):
    from pyspark.sql import functions as F

    return spark.range(n).select(F.format_string(f"{prefix}-%03d", "id").alias("body"))


def _reader(spark, endpoint: str, stream: bool = False, **options):
    reader = (spark.readStream if stream else spark.read).format("chronoq").option("endpoints", endpoint)
    for key, value in options.items():
        reader = reader.option(key, value)
    return reader.load()


def _pairs(rows) -> set:
    return {(r.topic, bytes(r.body).decode()) for r in rows}


def test_subscribe_several_topics_a_pattern_and_max_offsets_per_trigger(spark, broker, tmp_path):
    b = broker()
    write_rows(_bodies(spark, 30, "o"), b.endpoint, "k-orders")
    write_rows(_bodies(spark, 20, "b"), b.endpoint, "k-bills")
    write_rows(_bodies(spark, 5, "x"), b.endpoint, "other")
    expected = {("k-orders", f"o-{i:03d}") for i in range(30)} | {("k-bills", f"b-{i:03d}") for i in range(20)}

    listed = _reader(spark, b.endpoint, subscribe="k-orders,k-bills").collect()
    assert len(listed) == 50 and _pairs(listed) == expected
    matched = _reader(spark, b.endpoint, subscribePattern="k-.*").collect()
    assert len(matched) == 50 and _pairs(matched) == expected

    out, ckpt = str(tmp_path / "sink"), str(tmp_path / "ckpt")
    query = (_reader(spark, b.endpoint, stream=True, subscribePattern="k-.*", startingOffsets="earliest",
                     maxOffsetsPerTrigger="20")
             .select("topic", "queue", "offset", "body")
             .writeStream.format("parquet").option("path", out).option("checkpointLocation", ckpt)
             .trigger(availableNow=True).start())
    assert query.awaitTermination(QUERY_TIMEOUT_S)
    assert query.exception() is None
    assert all(p["numInputRows"] <= 20 for p in query.recentProgress)
    streamed = spark.read.parquet(out).collect()
    assert len(streamed) == 50 and _pairs(streamed) == expected
    last = max(int(name) for name in os.listdir(os.path.join(ckpt, "offsets")) if name.isdigit())
    with open(os.path.join(ckpt, "offsets", str(last))) as fh:
        offsets = json.loads(fh.read().splitlines()[-1])
    assert list(offsets) == ["k-bills", "k-orders"]  # one key per topic, sorted


def test_an_unknown_read_option_is_an_error_naming_the_known_ones(spark, broker):
    b = broker()
    write_rows(_bodies(spark, 1, "o"), b.endpoint, "k-typo")
    with pytest.raises(Exception) as info:
        _reader(spark, b.endpoint, topic="k-typo", startingOffset="earliest").collect()  # no s
    text = str(info.value)
    assert "does not know the read option(s) startingoffset" in text
    assert "startingOffsets" in text and "subscribePattern" in text and "maxOffsetsPerTrigger" in text


def test_ending_offsets_in_a_stream_is_refused_not_ignored(spark, broker, tmp_path):
    """A batch read's option given to a stream: it read on past it, all 30 rows (docs: batch only)."""
    b = broker()
    write_rows(_bodies(spark, 3, "e"), b.endpoint, "k-ending")
    reader = (spark.readStream.format("chronoq").option("endpoints", b.endpoint).option("topic", "k-ending")
              .option("endingOffsets", "latest"))
    with pytest.raises(Exception) as info:
        q = reader.load().writeStream.format("noop").option("checkpointLocation", str(tmp_path / "c")) \
            .trigger(availableNow=True).start()
        q.awaitTermination(60)
    assert "endingOffsets do not apply to a stream" in str(info.value), str(info.value)[-2000:]


def test_starting_timestamp_begins_at_the_first_message_at_or_after_it(spark, broker):
    import time

    from tests.spark.conftest import wait_until

    b = broker()
    write_rows(_bodies(spark, 40, "early"), b.endpoint, "k-times")
    between_ms = int(time.time() * 1000) + 1  # every early message entered its queue before this
    wait_until(lambda: time.time() * 1000 > between_ms, 5, 0.001, "the clock to pass the mark")
    write_rows(_bodies(spark, 25, "late"), b.endpoint, "k-times")
    rows = _reader(spark, b.endpoint, topic="k-times", startingTimestamp=str(between_ms)).collect()
    assert sorted(bytes(r.body).decode() for r in rows) == [f"late-{i:03d}" for i in range(25)]
    future = _reader(spark, b.endpoint, topic="k-times", startingTimestamp=str(between_ms + 3_600_000)).collect()
    assert future == []  # nothing at or after it yet: every queue starts at its end
