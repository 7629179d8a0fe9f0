"""Throughput of the ``chronoq`` Spark data source (issue 5's figures), on ``local[2]``.

Starts ``chronoq serve`` (default durable flush) on loopback and a local SparkSession, warms both
up, then:

  write      ``df.write.format("chronoq")`` of N rows, each with a ``deliver_at`` between 1 and 2
             hours ahead (so the timer schedules all of them): rows/s from the start of the write
             to the end of the publish (every message durable and scheduled);
  read       N immediate messages are written first (timed too: ``write_immediate``), then
             ``spark.read.format("chronoq")`` of the topic into the ``noop`` sink: messages/s.

Prints one JSON object per line: {"metric", "value", "unit", ...context}; the broker's CPU seconds
per phase come along. Bounded: one write and one read of N rows each.

    .venv/bin/python bench/spark.py                        # N = 1,000,000
    .venv/bin/python bench/spark.py --rows 200000 --body-bytes 100
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.grpc_shell import server_cpu_s, start_server  # noqa: E402


def emit(metric: str, value, unit: str, **ctx) -> None:
    print(json.dumps({"metric": metric, "value": value, "unit": unit, **ctx}), flush=True)


def frame(spark, rows: int, body_bytes: int, delayed: bool, partitions: int):
    from pyspark.sql import functions as F

    pad = "x" * max(0, body_bytes - 12)
    cols = [F.concat(F.lit(pad), F.format_string("%012d", F.col("id"))).alias("body")]
    if delayed:
        now_ms = int(time.time() * 1000)
        # 1..2 hours ahead, spread over the hour: the timer files them into 60 minute buckets.
        cols.append(F.timestamp_millis(F.lit(now_ms + 3_600_000) + (F.col("id") * 7919) % 3_600_000)
                    .alias("deliver_at"))
    df = spark.range(0, rows, 1, partitions).select(*cols)
    return df


def settle(pid: int, timeout_s: float = 120.0) -> None:
    """Wait until the broker is idle (under 5% of a core for a second): work a phase left behind
    (trace records, timer bucket files) must not be counted in the next phase."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        cpu0 = server_cpu_s(pid)
        time.sleep(1.0)
        if server_cpu_s(pid) - cpu0 < 0.05:
            return


def write(spark, endpoint: str, topic: str, df) -> float:
    t0 = time.perf_counter()
    df.write.format("chronoq").option("endpoints", endpoint).option("topic", topic).mode("append").save()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--body-bytes", type=int, default=64)
    ap.add_argument("--master", default="local[2]")
    ap.add_argument("--partitions", type=int, default=8,
                    help="partitions of the written DataFrame (each publishes as it ends: more overlap)")
    ap.add_argument("--phase", choices=["all", "write", "read"], default="all")
    args = ap.parse_args()
    scratch = tempfile.mkdtemp(prefix="chronoq-bench-spark-")
    proc, endpoint = start_server(os.path.join(scratch, "data"), "sync")
    try:
        from chronoq.spark.session import local_session

        spark = local_session(args.master, app="chronoq-bench", scratch=os.path.join(scratch, "spark"),
                              driver_memory="2g")
        ctx = {"rows": args.rows, "master": args.master, "body_bytes": args.body_bytes}
        # Warm-up: JVM, Python workers, first plans (not measured).
        write(spark, endpoint, "bench-warm", frame(spark, 20_000, args.body_bytes, True, args.partitions))
        spark.read.format("chronoq").option("endpoints", endpoint).option("topic", "bench-warm").load() \
            .write.format("noop").mode("overwrite").save()
        if args.phase in ("all", "write"):
            settle(proc.pid)
            cpu0 = server_cpu_s(proc.pid)
            elapsed = write(spark, endpoint, "bench-delayed", frame(spark, args.rows, args.body_bytes, True,
                                                                      args.partitions))
            during = server_cpu_s(proc.pid) - cpu0
            settle(proc.pid)  # the trace records and timer bucket files the write left to write later
            emit("spark_write_rate", round(args.rows / elapsed), "rows/s", seconds=round(elapsed, 2),
                 deliver_at="1-2 h ahead", broker_cpu_s=round(during, 1),
                 broker_cpu_s_with_deferred=round(server_cpu_s(proc.pid) - cpu0, 1), **ctx)
        if args.phase in ("all", "read"):
            settle(proc.pid)
            cpu0 = server_cpu_s(proc.pid)
            elapsed = write(spark, endpoint, "bench-read", frame(spark, args.rows, args.body_bytes, False,
                                                                   args.partitions))
            during = server_cpu_s(proc.pid) - cpu0
            settle(proc.pid)
            emit("spark_write_immediate_rate", round(args.rows / elapsed), "rows/s", seconds=round(elapsed, 2),
                 broker_cpu_s=round(during, 1), broker_cpu_s_with_deferred=round(server_cpu_s(proc.pid) - cpu0, 1),
                 **ctx)
            cpu0 = server_cpu_s(proc.pid)
            t0 = time.perf_counter()
            df = spark.read.format("chronoq").option("endpoints", endpoint).option("topic", "bench-read").load()
            df.write.format("noop").mode("overwrite").save()
            elapsed = time.perf_counter() - t0
            count = df.count()
            assert count == args.rows, (count, args.rows)
            emit("spark_read_rate", round(args.rows / elapsed), "msgs/s", seconds=round(elapsed, 2),
                 broker_cpu_s=round(server_cpu_s(proc.pid) - cpu0, 1), **ctx)
        spark.stop()
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except Exception:  # noqa: BLE001 - a stuck server is killed
            proc.kill()
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
