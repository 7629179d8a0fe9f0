"""Throughput of the ``chronoq`` Spark data source (issue 5's figures), on ``local[2]``.

Starts ``chronoq serve`` (default durable flush) on loopback and a local SparkSession, warms both
up, then:

  write      ``df.write.format("chronoq")`` of N rows, each with a ``deliver_at`` between 1 and 2
             hours ahead (so the timer schedules all of them): rows/s from the start of the write
             to the end of the publish (every message durable and scheduled);
  read       N immediate messages are written first (timed too: ``write_immediate``), then
             ``spark.read.format("chronoq")`` of the topic into the ``noop`` sink: messages/s.

Prints one JSON object per line: {"metric", "value", "unit", ...context}; each line carries the
broker's CPU seconds for the phase and per row (``broker_cpu_us_per_row``; ``..._with_deferred``
adds what the phase left for later: trace records, timer bucket files), and the load average
before and after (the rates depend on what else runs on the machine; the CPU per row does not).
Bounded: one write and one read of N rows each.

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


def spark_cpu_s(broker_pid: int) -> float:
    """CPU seconds of this process and every live descendant but the broker: the JVM and its
    Python workers (a worker that exited is counted in its parent's children times)."""
    ticks = os.sysconf("SC_CLK_TCK")
    parents: dict[int, int] = {}
    times: dict[int, float] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        parents[int(name)] = int(fields[1])
        times[int(name)] = sum(int(f) for f in fields[11:15]) / ticks  # utime stime cutime cstime
    me = os.getpid()
    total = sum(os.times()[:2])
    for pid in times:
        p, seen = parents.get(pid), 0
        while p is not None and p not in (me, broker_pid, 0, 1) and seen < 64:
            p, seen = parents.get(p), seen + 1
        if p == me and pid != broker_pid:
            total += times[pid]
    return total


def phase_ctx(rows: int, seconds: float, cpu_s: float, load_before: float, spark_s: float, **extra) -> dict:
    """What every phase line carries: the broker's and Spark's (JVM, Python workers, driver) CPU
    per row (independent of what else runs on the machine, unlike the rate) and the 1-minute load
    average before and after the phase."""
    return {"seconds": round(seconds, 2), "broker_cpu_s": round(cpu_s, 2),
            "broker_cpu_us_per_row": round(cpu_s / rows * 1e6, 2),
            "spark_cpu_us_per_row": round(spark_s / rows * 1e6, 2),
            "load_before": round(load_before, 2), "load_after": round(os.getloadavg()[0], 2),
            "cores": os.cpu_count(), **extra}


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
            load0, cpu0, spark0 = os.getloadavg()[0], server_cpu_s(proc.pid), spark_cpu_s(proc.pid)
            elapsed = write(spark, endpoint, "bench-delayed", frame(spark, args.rows, args.body_bytes, True,
                                                                      args.partitions))
            during, spark_s = server_cpu_s(proc.pid) - cpu0, spark_cpu_s(proc.pid) - spark0
            settle(proc.pid)  # the trace records and timer bucket files the write left to write later
            deferred = server_cpu_s(proc.pid) - cpu0
            emit("spark_write_rate", round(args.rows / elapsed), "rows/s", deliver_at="1-2 h ahead",
                 **phase_ctx(args.rows, elapsed, during, load0, spark_s, broker_cpu_s_with_deferred=round(deferred, 2),
                             broker_cpu_us_per_row_with_deferred=round(deferred / args.rows * 1e6, 2)), **ctx)
        if args.phase in ("all", "read"):
            settle(proc.pid)
            load0, cpu0, spark0 = os.getloadavg()[0], server_cpu_s(proc.pid), spark_cpu_s(proc.pid)
            elapsed = write(spark, endpoint, "bench-read", frame(spark, args.rows, args.body_bytes, False,
                                                                   args.partitions))
            during, spark_s = server_cpu_s(proc.pid) - cpu0, spark_cpu_s(proc.pid) - spark0
            settle(proc.pid)
            deferred = server_cpu_s(proc.pid) - cpu0
            emit("spark_write_immediate_rate", round(args.rows / elapsed), "rows/s",
                 **phase_ctx(args.rows, elapsed, during, load0, spark_s, broker_cpu_s_with_deferred=round(deferred, 2),
                             broker_cpu_us_per_row_with_deferred=round(deferred / args.rows * 1e6, 2)), **ctx)
            load0, cpu0, spark0 = os.getloadavg()[0], server_cpu_s(proc.pid), spark_cpu_s(proc.pid)
            t0 = time.perf_counter()
            df = spark.read.format("chronoq").option("endpoints", endpoint).option("topic", "bench-read").load()
            df.write.format("noop").mode("overwrite").save()
            elapsed = time.perf_counter() - t0
            during, spark_s = server_cpu_s(proc.pid) - cpu0, spark_cpu_s(proc.pid) - spark0
            count = df.count()
            assert count == args.rows, (count, args.rows)
            emit("spark_read_rate", round(args.rows / elapsed), "msgs/s",
                 **phase_ctx(args.rows, elapsed, during, load0, spark_s), **ctx)
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
