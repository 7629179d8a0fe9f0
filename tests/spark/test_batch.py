"""Batch jobs through the data source against a real broker: a failed write re-run with the same
``jobId`` publishes every row exactly once (per partition by default, all or nothing with
``atomic=true``), and a batch read takes explicit per-queue offset ranges."""

from __future__ import annotations

import json
import os

import pytest

from tests.spark.conftest import queue_totals, read_topic, write_rows

ROWS = 300


def _frame(spark, flag_path: str):
    from pyspark.sql import functions as F

    def maybe_fail(body):  # no type hints: Spark would try to infer a pandas UDF from them
        # Injected failure: one row of partition 1 fails its task while the flag file exists.
        if body == "row-0150" and os.path.exists(flag_path):
            raise RuntimeError("injected failure")
        return body

    return spark.range(0, ROWS, 1, 3).select(F.udf(maybe_fail, "string")(F.format_string("row-%04d", "id"))
                                             .alias("body"))


def _bodies(spark, endpoint: str, topic: str) -> list[str]:
    return [bytes(r.body).decode() for r in read_topic(spark, endpoint, topic).select("body").collect()]


@pytest.mark.parametrize("atomic", [False, True])
def test_failed_batch_write_rerun_with_its_job_id_publishes_each_row_once(spark, broker, tmp_path, atomic):
    b = broker()
    flag = tmp_path / "fail"
    flag.write_text("armed")
    df = _frame(spark, str(flag))
    options = {"jobId": "nightly-1", "atomic": str(atomic).lower()}
    with pytest.raises(Exception, match="injected failure"):
        write_rows(df, b.endpoint, "jobs", **options)
    published = queue_totals(b.endpoint, "jobs")
    if atomic:
        assert published == 0, "an atomic job that failed must publish nothing"
    assert published < ROWS and published % 100 == 0  # whole partitions only
    flag.unlink()
    write_rows(df, b.endpoint, "jobs", **options)        # the re-run publishes what is missing
    write_rows(df, b.endpoint, "jobs", **options)        # a third run of a finished job: nothing
    bodies = _bodies(spark, b.endpoint, "jobs")
    assert len(bodies) == ROWS and set(bodies) == {f"row-{i:04d}" for i in range(ROWS)}
    write_rows(df, b.endpoint, "jobs", jobId="nightly-2")  # another job id is another job
    assert queue_totals(b.endpoint, "jobs") == 2 * ROWS


def test_a_misspelt_write_option_is_refused_before_anything_is_staged(spark, broker):
    # A misspelt jobId used to be ignored: the job got a random id, and its re-run published
    # every row again.
    b = broker()
    df = spark.range(0, 10, 1, 2).selectExpr("format_string('t-%02d', id) as body")
    with pytest.raises(Exception) as info:
        write_rows(df, b.endpoint, "typos", jobld="nightly-1")
    assert "does not know the write option(s) jobld" in str(info.value) and "jobId" in str(info.value)
    assert queue_totals(b.endpoint, "typos") == 0


@pytest.mark.parametrize("columns, options, says", [
    ("id as body", {}, "body is bigint, not binary or string"),
    ("'x' as body, current_timestamp() as delay_ms", {}, "delay_ms is timestamp, not bigint"),
    ("'x' as body, 5 as tag", {}, "tag is int, not string"),
    ("'x' as body", {"sinkId": "s1"}, "do not apply to a batch write"),
    ("'x' as body", {"timeoutSeconds": "0"}, "timeoutSeconds must be a number of seconds above 0"),
    ("'x' as body", {"timeoutSeconds": "abc"}, "timeoutSeconds must be a number of seconds above 0"),
])
def test_a_write_planned_with_wrong_types_or_options_is_refused_naming_them(spark, broker, columns, options, says):
    """Refused on the driver, before anything is staged (an int body was an Arrow error on an
    executor; a timestamp as delay_ms a delay of decades; a sinkId on a batch write ignored)."""
    b = broker()
    df = spark.range(0, 4, 1, 2).selectExpr(*[c.strip() for c in columns.split(",")])
    with pytest.raises(Exception) as info:
        write_rows(df, b.endpoint, "typed", **options)
    assert says in str(info.value), str(info.value)[-2000:]
    assert queue_totals(b.endpoint, "typed") == 0


def test_batch_read_takes_per_queue_offset_ranges(spark, broker, tmp_path):
    from chronoq.spark.rpc import AdminRpc

    b = broker()
    write_rows(spark.range(0, ROWS, 1, 3).selectExpr("format_string('m-%04d', id) as body"), b.endpoint, "ranges")
    with AdminRpc(b.endpoint) as client:
        bounds = client.queue_offsets("ranges")
    q, (lo, hi) = max(bounds.items(), key=lambda kv: kv[1][1] - kv[1][0])
    assert hi - lo >= 3
    # One queue from its second message to one before its end; every other queue empty (start == end).
    start = {"ranges": {str(k): (lo + 1 if k == q else h) for k, (_l, h) in sorted(bounds.items())}}
    end = {"ranges": {str(k): (hi - 1 if k == q else h) for k, (_l, h) in sorted(bounds.items())}}
    rows = read_topic(spark, b.endpoint, "ranges", startingOffsets=json.dumps(start),
                      endingOffsets=json.dumps(end)).select("queue", "offset").collect()
    assert sorted((r.queue, r.offset) for r in rows) == [(q, o) for o in range(lo + 1, hi - 1)]
    latest = read_topic(spark, b.endpoint, "ranges", startingOffsets="latest").count()
    assert latest == 0 and read_topic(spark, b.endpoint, "ranges").count() == ROWS
    # Ranges that cannot be read are refused at planning, as Kafka's source does (they read
    # nothing silently, or failed later on an executor naming less).
    for start_at, end_at, words in ((hi - 1, lo + 1, "is after endingOffsets"), (hi + 5, None, "is after endingOffsets"),
                                    (None, hi + 5, "is past it")):
        opts = {}
        if start_at is not None:
            opts["startingOffsets"] = json.dumps({"ranges": {str(q): start_at}})
        if end_at is not None:
            opts["endingOffsets"] = json.dumps({"ranges": {str(q): end_at}})
        with pytest.raises(Exception) as info:
            read_topic(spark, b.endpoint, "ranges", **opts).collect()
        assert words in str(info.value) and f"queue {q} of topic ranges" in str(info.value), opts
