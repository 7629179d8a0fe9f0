"""Timer benchmarks that need no gRPC: enqueue rate, memory of pending timers, restart time.

Prints one JSON object per line: {"metric", "value", "unit", ...context}. Every loop is bounded
by a count and by --seconds.

    .venv/bin/python bench/timers.py                       # all parts, 1,000,000 timers
    .venv/bin/python bench/timers.py --parts a --count 200000
    .venv/bin/python bench/timers.py --big                 # 10,000,000 timers (needs disk and time)

Parts (letters follow the timer benchmark plan; b and c need the gRPC shell and live elsewhere):

a  enqueue: --count timers due over the next 10 minutes, sent through the broker API in batches
   (fsync per batch, flush policy sync); reports timers/s.
d  memory: --count far-future timers (due 1 to 8 days ahead) are scheduled in a child process that
   then exits without closing (kill -9); fresh child processes open that directory and an empty one
   and report RSS after start-up; the difference is what pending timers cost in memory.
e  restart: the time to open the broker with those timers pending, after the kill -9 above
   (replays the commit log after the timer's last checkpoint) and after a clean stop.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from chronoq.broker import Broker, OutgoingMessage  # noqa: E402
from chronoq.config import BrokerConfig  # noqa: E402

TOPIC = "bench-timers"
DAY_MS = 86_400_000


def emit(metric: str, value, unit: str, **ctx) -> None:
    print(json.dumps({"metric": metric, "value": value, "unit": unit, **ctx}), flush=True)


def rss_mb() -> float:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def config(data_dir: str) -> BrokerConfig:
    return BrokerConfig(data_dir=data_dir, flush_policy="sync", default_queues=8)


def schedule(broker: Broker, count: int, batch: int, seconds: float, lo_ms: int, hi_ms: int,
             body: bytes, seed: int) -> tuple[int, float, int]:
    """Send up to ``count`` timers due ``lo_ms..hi_ms`` ahead. Returns (sent, seconds, batches)."""
    rng = random.Random(seed)
    sent = batches = 0
    start = time.perf_counter()
    deadline = start + seconds
    last_maintenance = start
    while sent < count and time.perf_counter() < deadline:
        now_ms = broker.clock.wall_ms()
        n = min(batch, count - sent)
        broker.send_batch([OutgoingMessage(TOPIC, body, deliver_at_ms=now_ms + rng.randrange(lo_ms, hi_ms))
                           for _ in range(n)])
        sent += n
        batches += 1
        if time.perf_counter() - last_maintenance > 0.2:  # what the runtime's periodic task does
            broker.maintenance()
            last_maintenance = time.perf_counter()
    return sent, time.perf_counter() - start, batches


def part_a(args, workdir: str) -> None:
    data_dir = tempfile.mkdtemp(prefix="timers-a-", dir=workdir)
    broker = Broker(config(data_dir))
    body = os.urandom(args.body_bytes)
    sent, elapsed, batches = schedule(broker, args.count, args.batch, args.seconds, 1_000, 600_000, body, 1)
    broker.close()
    shutil.rmtree(data_dir, ignore_errors=True)
    ctx = {"part": "a", "timers": sent, "batch": args.batch, "body_bytes": args.body_bytes,
           "spread_s": 600, "seconds": round(elapsed, 3), "fsyncs": batches}
    emit("timer_enqueue_rate", round(sent / elapsed), "timers/s", **ctx)


def child_fill(args) -> None:
    """Schedule far-future timers into --dir, then die like kill -9 (no close, no checkpoint)."""
    broker = Broker(config(args.dir))
    body = os.urandom(args.body_bytes)
    sent, elapsed, _ = schedule(broker, args.count, args.batch, args.seconds, DAY_MS, 8 * DAY_MS, body, 2)
    emit("far_future_enqueue_rate", round(sent / elapsed), "timers/s", part="d", timers=sent,
         rss_mb_after_enqueue=round(rss_mb(), 1), seconds=round(elapsed, 3))
    sys.stdout.flush()
    os._exit(0)


def child_open(args) -> None:
    """Open the broker on --dir, run one tick (loads the near window), report time and RSS."""
    start = time.perf_counter()
    broker = Broker(config(args.dir))
    opened = time.perf_counter() - start
    broker.timer_tick()
    print(json.dumps({"open_s": round(opened, 3), "rss_mb": round(rss_mb(), 1),
                      "replayed": broker.timer.caught_up,
                      "waiting_buckets": broker.timer_stats(horizon_ms=0)["buckets"]["waiting_on_disk"]}),
          flush=True)
    if args.close:
        broker.close()
    os._exit(0)


def run_child(*argv: str) -> dict:
    out = subprocess.run([sys.executable, os.path.abspath(__file__), *argv], capture_output=True, text=True,
                         check=True, timeout=3_600)
    lines = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    for line in lines[:-1]:
        print(json.dumps(line), flush=True)
    return lines[-1]


def part_d_e(args, workdir: str, parts: str) -> None:
    empty = tempfile.mkdtemp(prefix="timers-empty-", dir=workdir)
    full = tempfile.mkdtemp(prefix="timers-full-", dir=workdir)
    common = ["--count", str(args.count), "--batch", str(args.batch), "--seconds", str(args.seconds),
              "--body-bytes", str(args.body_bytes)]
    fill = run_child("--child", "fill", "--dir", full, *common)
    timers = fill.get("timers", args.count)
    print(json.dumps(fill), flush=True)
    after_crash = run_child("--child", "open", "--dir", full, "--close")  # opens after kill -9, then stops cleanly
    after_clean = run_child("--child", "open", "--dir", full)
    baseline = run_child("--child", "open", "--dir", empty)
    disk = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(os.path.join(full, "timer")) for f in fs)
    ctx = {"timers": timers, "body_bytes": args.body_bytes, "spread": "1-8 days",
           "waiting_buckets": after_clean["waiting_buckets"]}
    if "d" in parts:
        emit("far_future_extra_rss", round(after_clean["rss_mb"] - baseline["rss_mb"], 1), "MB", part="d",
             rss_mb=after_clean["rss_mb"], baseline_rss_mb=baseline["rss_mb"], **ctx)
        emit("schedule_log_bytes_per_timer", round(disk / max(timers, 1), 1), "bytes", part="d", **ctx)
    if "e" in parts:
        emit("restart_after_kill", after_crash["open_s"], "s", part="e", replayed=after_crash["replayed"], **ctx)
        emit("restart_after_clean_stop", after_clean["open_s"], "s", part="e", **ctx)
    shutil.rmtree(empty, ignore_errors=True)
    shutil.rmtree(full, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="ade", help="which parts to run (letters a, d, e)")
    ap.add_argument("--count", type=int, default=1_000_000)
    ap.add_argument("--big", action="store_true", help="10,000,000 timers")
    ap.add_argument("--batch", type=int, default=1000)
    ap.add_argument("--seconds", type=float, default=600.0, help="time bound of each enqueue loop")
    ap.add_argument("--body-bytes", type=int, default=100)
    ap.add_argument("--dir", default=None, help="work directory (default: a temp dir)")
    ap.add_argument("--child", choices=["fill", "open"], help=argparse.SUPPRESS)
    ap.add_argument("--close", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.big:
        args.count = 10_000_000
    if args.child == "fill":
        return child_fill(args)
    if args.child == "open":
        return child_open(args)
    workdir = tempfile.mkdtemp(prefix="chronoq-bench-timers-", dir=args.dir)
    try:
        if "a" in args.parts:
            part_a(args, workdir)
        if "d" in args.parts or "e" in args.parts:
            part_d_e(args, workdir, args.parts)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
