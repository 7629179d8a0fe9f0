"""The examples run against a real broker: bulk reminders from Parquet, and a topic into Parquet."""

from __future__ import annotations

import datetime
import os
import sys
import time
from zoneinfo import ZoneInfo

from tests.spark.conftest import QUERY_TIMEOUT_S, queue_totals, read_topic, wait_until, write_rows

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "examples"))

import bulk_reminders  # noqa: E402
import stream_to_parquet  # noqa: E402

ZONES = ["Europe/Paris", "America/New_York", "Asia/Tokyo", "Australia/Lord_Howe", "UTC"]


def test_bulk_reminders_from_parquet(spark, broker, tmp_path):
    b = broker()
    now = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0)
    expected, rows = {}, []
    for i in range(200):
        zone = ZONES[i % len(ZONES)]
        due = now + datetime.timedelta(seconds=8 + i % 4)
        local = due.astimezone(ZoneInfo(zone)).replace(tzinfo=None)
        rows.append((f"user-{i:03d}", zone, local, f"hello {i}"))
        expected[f"user-{i:03d}"] = int(due.timestamp() * 1000)
    users = str(tmp_path / "users.parquet")
    spark.createDataFrame(rows, "user_id string, timezone string, send_at_local timestamp_ntz, message string") \
        .write.parquet(users)

    assert bulk_reminders.run(spark, users, b.endpoint, "reminders", job_id="daily-1") == 200
    # Run again with the same job id (a re-run after a failure): nothing is published twice.
    assert bulk_reminders.run(spark, users, b.endpoint, "reminders", job_id="daily-1") == 200
    wait_until(lambda: queue_totals(b.endpoint, "reminders") == 200, 60, interval_s=0.2, what="200 reminders due")
    time.sleep(0.5)
    assert queue_totals(b.endpoint, "reminders") == 200
    got = read_topic(spark, b.endpoint, "reminders").selectExpr(
        "keys[0] as user", "unix_millis(deliver_at) as due", "unix_millis(visible) as visible",
        "properties['timezone'] as zone", "cast(body as string) as body").collect()
    assert len(got) == 200
    for r in got:
        assert r.due == expected[r.user], (r.user, r.zone, r.due - expected[r.user])
        assert r.visible >= r.due
        assert r.body == f"hello {int(r.user[5:])}"


def test_stream_to_parquet_example_exactly_once(spark, broker, tmp_path):
    b = broker()
    write_rows(spark.range(1500).selectExpr("concat('m-', id) as body"), b.endpoint, "orders")
    out, ckpt = str(tmp_path / "out"), str(tmp_path / "ckpt")
    q = stream_to_parquet.start(spark, b.endpoint, "orders", out, ckpt, available_now=True, max_per_trigger=400)
    assert q.awaitTermination(QUERY_TIMEOUT_S) and q.exception() is None
    write_rows(spark.range(1500, 2000).selectExpr("concat('m-', id) as body"), b.endpoint, "orders")
    q = stream_to_parquet.start(spark, b.endpoint, "orders", out, ckpt, available_now=True, max_per_trigger=400)
    assert q.awaitTermination(QUERY_TIMEOUT_S) and q.exception() is None
    bodies = [bytes(r.body).decode() for r in spark.read.parquet(out).select("body").collect()]
    assert sorted(bodies) == sorted(f"m-{i}" for i in range(2000))
