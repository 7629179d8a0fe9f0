"""Bulk reminders: a Parquet file of users with local send times -> scheduled chronoq messages.

Input (Parquet), one row per reminder:

    user_id        string
    timezone       string     IANA zone of the user, e.g. "Europe/Paris"
    send_at_local  timestamp_ntz (or a "YYYY-MM-DD HH:MM:SS" string): wall-clock time in that zone
    message        string

Each row becomes one delayed message on ``--topic``: body = message, key = user_id, tag
"reminder", properties {timezone, send_at_local}, delivered at ``send_at_local`` in the user's
zone. The conversion is Spark's ``convert_timezone`` (DST included) and does not depend on the
session time zone. The write is one job with ``--job-id``: run it again with the same id after a
failure and only the partitions not yet published are published.

    python examples/bulk_reminders.py --endpoint 127.0.0.1:8081 --input users.parquet \\
        --topic reminders --job-id reminders-2030-01-31
    python examples/bulk_reminders.py --make-sample users.parquet   # 1,000 made-up users
"""

from __future__ import annotations

import argparse
import datetime
import random
import sys
from zoneinfo import ZoneInfo

EPOCH = "TIMESTAMP_NTZ '1970-01-01 00:00:00'"


def reminders(spark, input_path: str):
    """The rows to write: body, key, tag, properties, deliver_at_ms."""
    from pyspark.sql import functions as F

    users = spark.read.parquet(input_path)
    local = F.col("send_at_local").cast("timestamp_ntz")
    utc_wall = "convert_timezone(timezone, 'UTC', cast(send_at_local as timestamp_ntz))"
    return users.select(
        F.col("message").alias("body"),
        F.col("user_id").alias("key"),
        F.lit("reminder").alias("tag"),
        F.create_map(F.lit("timezone"), F.col("timezone"),
                     F.lit("send_at_local"), F.date_format(local, "yyyy-MM-dd HH:mm:ss")).alias("properties"),
        # epoch ms of the UTC wall time: independent of the session time zone
        F.expr(f"timestampdiff(MILLISECOND, {EPOCH}, {utc_wall})").alias("deliver_at_ms"),
    )


def run(spark, input_path: str, endpoint: str, topic: str, job_id: str | None = None) -> int:
    """Schedule every reminder of ``input_path``; returns how many rows the job covers (a re-run
    with a ``job_id`` already published publishes none of them again: the broker answers
    ``already_published`` and drops them)."""
    import chronoq.spark

    chronoq.spark.register(spark)
    df = reminders(spark, input_path).cache()
    try:
        writer = df.write.format("chronoq").option("endpoints", endpoint).option("topic", topic).mode("append")
        if job_id:
            writer = writer.option("jobId", job_id)
        writer.save()
        return df.count()
    finally:
        df.unpersist()


def make_sample(spark, path: str, users: int = 1000, ahead_s: tuple[float, float] = (60.0, 3600.0),
                seed: int = 7) -> None:
    """Write a sample input: ``users`` users spread over a few zones, due ``ahead_s`` from now."""
    rnd = random.Random(seed)
    zones = ["Europe/Paris", "America/New_York", "Asia/Tokyo", "Australia/Sydney", "UTC"]
    now = datetime.datetime.now(datetime.timezone.utc)
    rows = []
    for i in range(users):
        zone = zones[i % len(zones)]
        due = now + datetime.timedelta(seconds=rnd.uniform(*ahead_s))
        local = due.astimezone(ZoneInfo(zone)).replace(tzinfo=None, microsecond=0)
        rows.append((f"user-{i:05d}", zone, local, f"Hello user-{i:05d}, your reminder is due."))
    spark.createDataFrame(rows, "user_id string, timezone string, send_at_local timestamp_ntz, message string") \
        .coalesce(1).write.mode("overwrite").parquet(path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--endpoint", default="127.0.0.1:8081")
    ap.add_argument("--input", help="Parquet file or directory of users")
    ap.add_argument("--topic", default="reminders")
    ap.add_argument("--job-id", default=None, help="makes a re-run after a failure publish only what is missing")
    ap.add_argument("--make-sample", metavar="PATH", help="write a sample input to PATH and exit")
    ap.add_argument("--master", default="local[*]")
    args = ap.parse_args(argv)
    from chronoq.spark.session import local_session

    spark = local_session(args.master, app="chronoq-bulk-reminders")
    try:
        if args.make_sample:
            make_sample(spark, args.make_sample)
            print(f"sample input written to {args.make_sample}")
            return 0
        if not args.input:
            ap.error("--input is required")
        n = run(spark, args.input, args.endpoint, args.topic, args.job_id)
        again = f" (job {args.job_id}: rows a run of it published before are not published again)" if args.job_id else ""
        print(f"{n} reminders handed to {args.topic}{again}")
        return 0
    finally:
        spark.stop()


if __name__ == "__main__":
    sys.exit(main())
