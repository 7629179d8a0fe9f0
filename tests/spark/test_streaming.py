"""Streaming through the data source against a real broker: a read into a Parquet sink stopped
and restarted from its checkpoint mid-stream (and a batch replayed as after a crash) keeps every
message exactly once; a streaming write whose batch fails and is replayed publishes no duplicate."""

from __future__ import annotations

import glob
import os

from tests.spark.conftest import QUERY_TIMEOUT_S, queue_totals, read_topic, wait_until, write_rows


def _source(spark, endpoint: str, topic: str, **options):
    reader = (spark.readStream.format("chronoq").option("endpoints", endpoint).option("topic", topic)
              .option("startingOffsets", "earliest"))
    for key, value in options.items():
        reader = reader.option(key, value)
    return reader.load()


def _bodies(spark, n: int, prefix: str):
    from pyspark.sql import functions as F

    return spark.range(n).select(F.format_string(f"{prefix}-%05d", "id").alias("body"))


def _last_batch(checkpoint: str, what: str) -> int:
    return max(int(os.path.basename(p)) for p in glob.glob(os.path.join(checkpoint, what, "[0-9]*")))


def _forget_commit(checkpoint: str, batch: int) -> None:
    """What a crash between the sink's commit and Spark's ``commits/N`` leaves (its checksum too)."""
    os.remove(os.path.join(checkpoint, "commits", str(batch)))
    crc = os.path.join(checkpoint, "commits", f".{batch}.crc")
    if os.path.exists(crc):
        os.remove(crc)


def test_stream_read_to_parquet_restarts_exactly_once(spark, broker, tmp_path):
    b = broker()
    write_rows(_bodies(spark, 3000, "first"), b.endpoint, "events")
    out, ckpt = str(tmp_path / "sink"), str(tmp_path / "ckpt")

    def start(**trigger):
        return (_source(spark, b.endpoint, "events", maxRecordsPerTrigger="500")
                .select("queue", "offset", "message_id", "body")
                .writeStream.format("parquet").option("path", out).option("checkpointLocation", ckpt)
                .trigger(**trigger).start())

    # Run 1: stopped mid-stream, after two micro-batches of 500 (of 3000 messages).
    q = start(processingTime="1 second")
    try:
        wait_until(lambda: len(glob.glob(os.path.join(ckpt, "commits", "[0-9]*"))) >= 2, QUERY_TIMEOUT_S,
                   interval_s=0.2, what="two committed micro-batches")
    finally:
        q.stop()
    done_before = spark.read.parquet(out).count()
    assert 1000 <= done_before < 3000
    # More messages arrive while the query is down.
    write_rows(_bodies(spark, 1000, "second"), b.endpoint, "events")
    # A crash after the last batch was written but before Spark recorded its commit: the batch is
    # planned again from the logged offsets and replayed with the same batch id. (A stop during a
    # batch leaves such a batch by itself.)
    last = _last_batch(ckpt, "offsets")
    if _last_batch(ckpt, "commits") == last:
        _forget_commit(ckpt, last)
    # Run 2: resume from the checkpoint and drain (availableNow honours maxRecordsPerTrigger).
    q = start(availableNow=True)
    assert q.awaitTermination(QUERY_TIMEOUT_S)
    assert q.exception() is None
    assert all(p["numInputRows"] <= 500 for p in q.recentProgress)
    assert q.recentProgress[0]["batchId"] == last, "the uncommitted batch must be replayed first"

    rows = spark.read.parquet(out).collect()
    bodies = [bytes(r.body).decode() for r in rows]
    assert len(bodies) == 4000, f"{len(bodies)} rows in the sink for 4000 messages"
    assert set(bodies) == {f"first-{i:05d}" for i in range(3000)} | {f"second-{i:05d}" for i in range(1000)}
    assert len({(r.queue, r.offset) for r in rows}) == 4000
    # Offsets in the checkpoint are canonical JSON, one entry per queue of the topic.
    with open(os.path.join(ckpt, "offsets", str(_last_batch(ckpt, "offsets")))) as fh:
        offsets = fh.read().splitlines()[-1]
    assert offsets.startswith('{"events": {"0": ') and '"3": ' in offsets


def test_stream_write_replayed_batch_publishes_no_duplicates(spark, broker, tmp_path):
    from pyspark.sql import functions as F

    b = broker()
    write_rows(_bodies(spark, 2000, "in"), b.endpoint, "incoming")
    ckpt = str(tmp_path / "ckpt")
    fail_flag = tmp_path / "fail-once"
    fail_flag.write_text("armed")
    flag_path = str(fail_flag)

    def maybe_fail(body):
        # Injected failure: one row makes its task fail while the other task may have staged.
        if body.endswith(b"-01500") and os.path.exists(flag_path):
            raise RuntimeError("injected failure")
        return b"out:" + body

    transform = F.udf(maybe_fail, "binary")

    def run():
        return (_source(spark, b.endpoint, "incoming", maxRecordsPerTrigger="800")
                .select(transform("body").alias("body"), F.col("message_id").alias("key"))
                .writeStream.format("chronoq").option("endpoints", b.endpoint).option("topic", "outgoing")
                .option("checkpointLocation", ckpt).trigger(availableNow=True).start())

    q = run()
    try:
        q.awaitTermination(QUERY_TIMEOUT_S)
    except Exception:  # noqa: BLE001 - the injected failure ends the query
        pass
    assert q.exception() is not None and "injected failure" in str(q.exception())
    published_after_failure = queue_totals(b.endpoint, "outgoing")
    assert published_after_failure < 2000

    fail_flag.unlink()
    q = run()  # replays the failed batch (same batch id, same offsets), then goes on
    assert q.awaitTermination(QUERY_TIMEOUT_S) and q.exception() is None
    assert queue_totals(b.endpoint, "outgoing") == 2000

    # Spark loses the record of the last commit (crash between the sink's commit and commits/N):
    # the batch is replayed and committed again; the broker publishes it only once.
    last = _last_batch(ckpt, "commits")
    _forget_commit(ckpt, last)
    q = run()
    assert q.awaitTermination(QUERY_TIMEOUT_S) and q.exception() is None
    assert q.recentProgress and q.recentProgress[0]["batchId"] == last

    rows = read_topic(spark, b.endpoint, "outgoing").select("body", "keys").collect()
    bodies = [bytes(r.body).decode() for r in rows]
    assert len(bodies) == 2000, f"{len(bodies)} messages published for 2000 rows"
    assert set(bodies) == {f"out:in-{i:05d}" for i in range(2000)}


def test_a_topic_deleted_and_created_again_under_a_stream_fails_it_or_is_read_again(spark, broker, tmp_path):
    """The checkpoint holds queue 0 at 10; the topic is deleted and created again with 3 messages
    there: its end went back. With failOnDataLoss (the default) the query fails saying so (it
    went on at 10 and never read the new topic's first messages); without, the queue is read
    again from its start, every new message once."""
    import subprocess
    import sys

    b = broker()

    def topic(*args: str) -> None:
        subprocess.run([sys.executable, "-m", "chronoq", "topic", *args, "--endpoint", b.endpoint],
                       check=True, capture_output=True, timeout=60)

    topic("create", "again", "--queues", "1")
    write_rows(_bodies(spark, 10, "old"), b.endpoint, "again")
    out, ckpt = str(tmp_path / "sink"), str(tmp_path / "ckpt")

    def drain(**options):
        q = (_source(spark, b.endpoint, "again", **options).select("body")
             .writeStream.format("parquet").option("path", out).option("checkpointLocation", ckpt)
             .trigger(availableNow=True).start())
        try:
            q.awaitTermination(QUERY_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - a failed query: its exception() says why
            pass
        return q

    assert drain().exception() is None
    topic("delete", "again", "--force")
    topic("create", "again", "--queues", "1")
    write_rows(_bodies(spark, 3, "new"), b.endpoint, "again")
    failed = drain().exception()
    assert failed is not None and "deleted and created again" in str(failed), failed
    assert drain(failOnDataLoss="false").exception() is None
    bodies = sorted(bytes(r.body).decode() for r in spark.read.parquet(out).collect())
    assert bodies == [f"new-{i:05d}" for i in range(3)] + [f"old-{i:05d}" for i in range(10)]


def test_a_checkpoint_deleted_and_used_again_is_a_new_sink(spark, broker, tmp_path):
    """Deleting a checkpoint to start a stream over is common practice: the new query's batch ids
    restart at 0 at the same path, and a sink id made of the path alone answered them
    ``already_published``: every row dropped, the query green. Spark's query id (in the
    checkpoint's metadata) now names the sink too."""
    import shutil

    b = broker()
    ckpt = str(tmp_path / "ckpt")

    def run(prefix: str) -> None:
        write_rows(_bodies(spark, 10, prefix), b.endpoint, f"in-{prefix}")
        q = (_source(spark, b.endpoint, f"in-{prefix}").select("body")
             .writeStream.format("chronoq").option("endpoints", b.endpoint).option("topic", "wiped-out")
             .option("checkpointLocation", ckpt).trigger(availableNow=True).start())
        assert q.awaitTermination(QUERY_TIMEOUT_S) and q.exception() is None

    run("first")
    shutil.rmtree(ckpt)
    run("second")
    bodies = sorted(bytes(r.body).decode() for r in read_topic(spark, b.endpoint, "wiped-out").collect())
    assert bodies == [f"first-{i:05d}" for i in range(10)] + [f"second-{i:05d}" for i in range(10)]
