"""Timer benchmarks: enqueue rate, lateness through the server, a burst, memory, restart time.

Prints one JSON object per line: {"metric", "value", "unit", ...context}. Every loop is bounded
by a count and by --seconds.

    .venv/bin/python bench/timers.py                       # all parts, 1,000,000 timers in a, d, e
    .venv/bin/python bench/timers.py --parts a --count 200000
    .venv/bin/python bench/timers.py --parts b --rates 2000,5000 --steady-seconds 60
    .venv/bin/python bench/timers.py --parts c --burst 200000
    .venv/bin/python bench/timers.py --parts de --big      # 10,000,000 timers in d and e
    .venv/bin/python bench/timers.py --parts f --count 100000

Parts (letters follow the timer benchmark plan):

a  enqueue: --count timers due over the next 10 minutes, sent through the broker API in batches
   (fsync per batch, flush policy sync); reports timers/s, then what counting them by horizon
   costs (one metrics scrape or history sample, on the event loop) after a batch more.
b  steady lateness through the server: a fresh ``chronoq serve`` (default durable flush) per rate;
   timers fall due evenly at --rates per second for --steady-seconds. --b-mode preload (default)
   sends them all first (one producer process, ``chronoq.client.client`` batches); live sends each
   --lead-s before it is due, beside the deliveries. Two consumer processes receive and ack them
   (a lane that got a partial batch pauses --consumer-pause-ms, so receives carry more messages:
   on a small host consumers and broker share the CPUs). Store-stamp lateness = the delivered
   copy's store timestamp - its due time, per message: p50/p99/p999/max and the early count (a
   copy written ahead and held, ``timer_prewrite_ms`` > 0, the default, is stamped with its due
   time, so this is 0 then; with 0 it is when the copy was written). The headline is the broker's
   own histogram (time the copy became visible to readers - due time; bucket bounds, exact max),
   and end-to-end receive lateness (consumer's clock when the receive returned - due time; same
   machine, so the same clock). broker_nice is the broker's nice value (priority_boost).
   steal_pct is the host's share of the CPUs meanwhile, and
   python_speed_mips how fast this VM ran a plain Python loop when the run began. machine_busy_pct is
   how busy all CPUs were meanwhile, this benchmark's own processes included.
c  burst: --burst timers due in the same second (sent beforehand): the time from that second's
   start until all are visible (the broker's delivered count, polled every 50 ms), the broker's
   exact max lateness, and, consuming them all afterwards, the newest copy's store timestamp and
   the early/duplicate counts.
d  memory: --count far-future timers (due 1 to 8 days ahead) are scheduled in a child process that
   then exits without closing (kill -9); fresh child processes open that directory and an empty one
   and report RSS after start-up; the difference is what pending timers cost in memory.
e  restart: the time to open the broker with those timers pending, after the kill -9 above
   (replays the commit log after the timer's last checkpoint) and after a clean stop.

f  memory per remembered message id and per pending timer: --count messages due 1 to 2 h ahead,
   each with a client-chosen id (as the official clients send them), through the broker API in
   batches, in a fresh child process; VmRSS of that live process before and after the load (each
   after gc.collect()). A second child loads the same messages without ids (nothing for the dedupe
   window to remember): its growth per message is the cost of a pending timer (an upper bound:
   it holds every other per-message cost too), and the difference between the two, divided by the
   entries the window holds at the end, the cost of a remembered id (the heap makes both children
   vary by a few MB: compare runs). released_mb_dropping_window: RSS given back at once when the
   window is dropped after the load (a lower bound). --f-tracemalloc N prints the N top
   allocations by line of each child (slow: use a smaller --count).

g  keys (bench/timerkeys.py): --count timers with a message key each (memory of the key index
   per key, RSS per keyed timer), cancel by key of one of them (latency), replace by key
   (sends/s), the first keyed call after a restart and the index build that follows. Not in the
   default --parts.

--big makes d and e use 10,000,000 timers (a keeps --count, f too).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
import tracemalloc
import uuid

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench import timerkeys  # noqa: E402
from bench.timers_load import (CONSUMERS, MP, SEND_BATCH_MAX, _collect, _producer,  # noqa: E402
                               _start_consumers)
from bench.machine import MachineLoad, python_speed  # noqa: E402
from chronoq.broker.broker import Broker, OutgoingMessage  # noqa: E402
from chronoq.core.config import BrokerConfig  # noqa: E402
from chronoq.core.msgid import new_message_id  # noqa: E402
from chronoq.server.metrics import PENDING_HORIZONS  # noqa: E402

TOPIC = "bench-timers"
DAY_MS = 86_400_000
HOUR_MS = 3_600_000
BIG_COUNT = 10_000_000
DRAIN_GRACE_S = 30.0        # after the last due time, consumers give up after this long
PRELOAD_RATE_GUESS = 8_000  # b, preload: timers/s a send phase surely reaches (sets the lead)


_SPEED: list[float] = []  # bench.machine.python_speed() at start-up


def emit(metric: str, value, unit: str, **ctx) -> None:
    # The host's 1-minute load average when the line is printed, and how fast it ran Python when
    # the run began: figures from a shared host mean little without them (see also
    # machine_busy_pct, steal_pct and server_cpu_s in b and c).
    print(json.dumps({"metric": metric, "value": value, "unit": unit, **ctx,
                      "loadavg_1m": round(os.getloadavg()[0], 2),
                      "python_speed_mips": _SPEED[0] if _SPEED else None}), flush=True)


def rss_kb() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def rss_mb() -> float:
    return rss_kb() / 1024


PENDING_HORIZONS_MS = tuple(1 << 62 if s is None else s * 1000 for _, s in PENDING_HORIZONS)  # as metrics' own


def config(data_dir: str) -> BrokerConfig:
    return BrokerConfig(data_dir=data_dir, flush_policy="sync", default_queues=8)


def schedule(broker: Broker, count: int, batch: int, seconds: float, lo_ms: int, hi_ms: int,
             body: bytes, seed: int, ids: bool = False) -> tuple[int, float, int]:
    """Send up to ``count`` timers due ``lo_ms..hi_ms`` ahead (``ids``: each with a client-chosen
    message id, as the official clients send). Returns (sent, seconds, batches)."""
    rng = random.Random(seed)
    sent = batches = 0
    start = time.perf_counter()
    deadline = start + seconds
    last_maintenance = start
    while sent < count and time.perf_counter() < deadline:
        now_ms = broker.clock.wall_ms()
        n = min(batch, count - sent)
        broker.send_batch([OutgoingMessage(TOPIC, body, deliver_at_ms=now_ms + rng.randrange(lo_ms, hi_ms),
                                           message_id=new_message_id(now_ms) if ids else None)
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
    # What one metrics scrape or history sample costs with them all pending (it runs on the event
    # loop): counting by horizon after a batch more, as traffic goes on between two samples.
    counts_ms = []
    for round_ in range(3):
        schedule(broker, args.batch, args.batch, args.seconds, 1_000, 600_000, body, 2 + round_)
        t0 = time.perf_counter()
        broker.timer.pending_by_horizon(PENDING_HORIZONS_MS)
        counts_ms.append((time.perf_counter() - t0) * 1e3)
    broker.close()
    shutil.rmtree(data_dir, ignore_errors=True)
    ctx = {"part": "a", "timers": sent, "batch": args.batch, "body_bytes": args.body_bytes,
           "spread_s": 600, "seconds": round(elapsed, 3), "fsyncs": batches}
    emit("timer_enqueue_rate", round(sent / elapsed), "timers/s", **ctx)
    emit("timer_pending_count_ms", round(sorted(counts_ms)[1], 3), "ms", part="a", timers=sent,
         rounds_ms=[round(v, 3) for v in counts_ms])


# ----------------------------------------------------------------------------- b, c: through the server
def wait_quiet(busy_pct_max: float, wait_s: float) -> float:
    """Wait (at most ``wait_s``) until all CPUs were less than ``busy_pct_max`` % busy over 2 s;
    returns the last reading. On a shared host this keeps other people's work out of a part."""
    deadline = time.time() + wait_s
    while True:
        load = MachineLoad()
        time.sleep(2)
        busy = load.busy_pct()
        if busy < busy_pct_max or time.time() >= deadline:
            return busy


def _pctl(sorted_values: list[int], q: float):
    if not sorted_values:
        return None
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def _summary(values: list[int]) -> dict:
    values = sorted(values)
    return {"p50_ms": _pctl(values, 0.50), "p99_ms": _pctl(values, 0.99), "p999_ms": _pctl(values, 0.999),
            "max_ms": values[-1] if values else None, "count": len(values)}


def _timer_stats(endpoint: str):
    from chronoq.client.admin import AdminClient
    from chronoq.client.client import run

    async def go():
        async with AdminClient(endpoint) as admin:
            return await admin.timer_stats(1)

    return run(go())


def _server(workdir: str, name: str):
    from bench.grpc_shell import start_server

    # No HTTP listener (metrics, console): its fixed default port would clash between servers.
    os.environ.setdefault("CHRONOQ_HTTP_PORT", "off")

    proc, endpoint = start_server(os.path.join(workdir, name), "sync")
    return proc, endpoint




def _stop_server(proc) -> None:
    from bench.grpc_shell import stop_server
    stop_server(proc, 60)


def _delivery_metrics(rows: list, part: str, **ctx) -> None:
    ids = [r[0] for r in rows]
    dups = len(ids) - len(set(ids))
    early = sum(1 for _mid, due, store, _recv in rows if store < due)
    store_late = _summary([store - due for _mid, due, store, _recv in rows])
    recv_late = _summary([recv - due for _mid, due, _store, recv in rows])
    emit("timer_lateness_store_stamp", store_late["p99_ms"], "ms", part=part, early=early, duplicates=dups,
         **store_late, **ctx)
    emit("timer_receive_lateness", recv_late["p99_ms"], "ms", part=part, **recv_late, **ctx)


def _broker_histogram(endpoint: str, part: str, **ctx) -> dict:
    st = _timer_stats(endpoint)
    h = st.lateness
    emit("timer_lateness_broker_histogram", h.p99_ms, "ms", part=part, count=h.count, p50_ms=h.p50_ms,
         p99_ms=h.p99_ms, p999_ms=h.p999_ms, max_ms=h.max_ms, early=h.early,
         buckets={("inf" if b.le_ms < 0 else str(b.le_ms)): b.count for b in h.buckets if b.count}, **ctx)
    return {"delivered": st.timer_lane.delivered, "max_ms": h.max_ms}


def part_b(args, workdir: str) -> None:
    for rate in [int(r) for r in args.rates.split(",") if r]:
        if args.quiet_pct:
            wait_quiet(args.quiet_pct, args.quiet_wait_s)
        proc, endpoint = _server(workdir, f"b-{rate}")
        try:
            _steady(args, endpoint, proc.pid, rate)
        finally:
            _stop_server(proc)


def _steady(args, endpoint: str, pid: int, rate: int) -> None:
    topic, group = f"bench-steady-{uuid.uuid4().hex[:6]}", f"bench-steady-g-{uuid.uuid4().hex[:6]}"
    total = int(rate * args.steady_seconds)
    preload = args.b_mode == "preload"
    out = MP.Queue()
    t0 = time.time() + 1.0
    # Preload: every timer is sent first (at ~10k+/s), then they fall due; live: each is sent
    # lead_s before it is due, so sends run beside the deliveries.
    lead_s = max(args.lead_s, total / PRELOAD_RATE_GUESS + 10) if preload else args.lead_s
    first_due = t0 + lead_s
    give_up_at = first_due + args.steady_seconds + DRAIN_GRACE_S
    producer = MP.Process(target=_producer, args=(endpoint, topic, rate, args.steady_seconds, lead_s, t0, out,
                                                  preload))
    producer.start()
    prod = {}
    if preload:
        prod = _collect(out, [producer], {"producer": 1}, lead_s + 60).get("producer", [{}])[0]
        time.sleep(max(0.0, first_due - 2 - time.time()))  # consumers start just before the first is due
    consumers = _start_consumers(endpoint, group, topic, total, give_up_at, out, args.consumer_pause_ms)
    cpu0, load = _server_cpu(pid), MachineLoad()
    kinds = {"consumer": CONSUMERS, "receives": CONSUMERS}
    if not preload:
        kinds["producer"] = 1
    got = _collect(out, consumers if preload else [producer, *consumers], kinds, give_up_at - time.time() + 60)
    cpu, busy = _server_cpu(pid) - cpu0, load.busy_pct()
    rows = [r for part in got.get("consumer", []) for r in part]
    if not preload:
        prod = (got.get("producer") or [{}])[0]
    ctx = {"rate_per_s": rate, "seconds": args.steady_seconds, "mode": args.b_mode, "lead_s": round(lead_s, 1),
           "received": len(rows), "receives": sum(got.get("receives", [])),
           "consumer_pause_ms": args.consumer_pause_ms, "server_cpu_s": round(cpu, 1),
           "server_cpu_us_per_msg": round(cpu * 1e6 / max(len(rows), 1)), "flush_policy": "sync",
           "machine_busy_pct": busy, "steal_pct": load.steal_pct(), "cpus": os.cpu_count(),
           "broker_nice": _server_nice(pid), **prod}
    _delivery_metrics(rows, "b", **ctx)
    _broker_histogram(endpoint, "b", rate_per_s=rate, mode=args.b_mode)


def _server_nice(pid: int) -> int:
    from bench.grpc_shell import server_nice

    return server_nice(pid)


def _server_cpu(pid: int) -> float:
    from bench.grpc_shell import server_cpu_s

    return server_cpu_s(pid)


def part_c(args, workdir: str) -> None:
    from chronoq.client.client import Client, OutgoingMessage, run

    proc, endpoint = _server(workdir, "c")
    try:
        topic, group = f"bench-burst-{uuid.uuid4().hex[:6]}", f"bench-burst-g-{uuid.uuid4().hex[:6]}"
        count = args.burst
        second_ms = (int(time.time()) + int(args.burst_lead_s)) * 1000
        body = os.urandom(100)

        async def send_all() -> float:
            started = time.perf_counter()
            async with Client(endpoint, request_timeout_s=60) as client:
                sent = 0

                async def lane(offset: int) -> None:
                    nonlocal sent
                    i = offset * SEND_BATCH_MAX
                    while i < count:
                        n = min(SEND_BATCH_MAX, count - i)
                        await client.send_batch([
                            OutgoingMessage(topic, body, deliver_at_ms=second_ms + (i + k) % 1000)
                            for k in range(n)])
                        sent += n
                        i += 4 * SEND_BATCH_MAX

                await asyncio.gather(*(lane(k) for k in range(4)))
            return time.perf_counter() - started

        send_s = run(send_all())
        sent_ahead_s = second_ms / 1000 - time.time()
        load = MachineLoad()
        cpu0 = _server_cpu(proc.pid)
        # Watch the broker deliver (one Admin connection, polled every 50 ms near the due second).
        async def watch() -> tuple[int, float | None]:
            from chronoq.client.admin import AdminClient

            delivered, done_at = 0, None
            hard = second_ms / 1000 + args.seconds
            async with AdminClient(endpoint) as admin:
                while time.time() < hard:
                    delivered = (await admin.timer_stats(1)).timer_lane.delivered
                    if delivered >= count:
                        done_at = time.time()
                        break
                    await asyncio.sleep(0.05 if time.time() * 1000 >= second_ms - 500 else 0.5)
            return delivered, done_at

        delivered, done_at = run(watch())
        h = _timer_stats(endpoint).lateness
        done_s = None if done_at is None else round(done_at - second_ms / 1000, 2)
        emit("burst_all_visible_after_second_start", done_s, "s", part="c", timers=count, delivered=delivered,
             note="polled every 50 ms: the lane's delivered count reached the burst",
             broker_max_lateness_ms=h.max_ms, broker_p50_ms=h.p50_ms, broker_p99_ms=h.p99_ms, early=h.early,
             machine_busy_pct=load.busy_pct(), steal_pct=load.steal_pct(), server_cpu_s=round(_server_cpu(proc.pid) - cpu0, 1),
             broker_nice=_server_nice(proc.pid),
             send_s=round(send_s, 1), sent_ahead_s=round(sent_ahead_s, 1))
        # Consume everything afterwards (so consumers do not compete with the burst) and check it.
        out = MP.Queue()
        consumers = _start_consumers(endpoint, group, topic, count, time.time() + args.seconds, out)
        got = _collect(out, consumers, {"consumer": CONSUMERS, "receives": CONSUMERS}, args.seconds + 60)
        rows = [r for part in got.get("consumer", []) for r in part]
        last_store = max((r[2] for r in rows), default=0)
        emit("burst_last_copy_store_stamp_after_second_start", last_store - second_ms, "ms", part="c",
             note="store timestamp of the newest copy (stamped by the broker when it wrote it) - the second's start",
             timers=count, received=len(rows), early=sum(1 for r in rows if r[2] < r[1]),
             duplicates=len(rows) - len({r[0] for r in rows}))
    finally:
        _stop_server(proc)


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


# ----------------------------------------------------------------------------- f: memory per id and per timer
def child_mem(args) -> None:
    """Load --count messages due 1-2 h ahead into a fresh broker on --dir (--ids: each with a
    client-chosen id) and print this live process's RSS growth, the dedupe window's entries and
    the pending timers as one JSON object (the last line); --f-tracemalloc N: first the N top
    allocations by line that the load left behind."""
    if args.f_tracemalloc:
        tracemalloc.start()
    broker = Broker(config(args.dir))
    body = os.urandom(args.body_bytes)
    gc.collect()
    before_kb = rss_kb()
    snap0 = tracemalloc.take_snapshot() if args.f_tracemalloc else None
    sent, elapsed, _ = schedule(broker, args.count, args.batch, args.seconds, HOUR_MS, 2 * HOUR_MS, body, 3,
                                ids=args.ids)
    gc.collect()
    after_kb = rss_kb()
    if snap0 is not None:
        stats = tracemalloc.take_snapshot().compare_to(snap0, "lineno")
        for st in stats[:args.f_tracemalloc]:
            frame = st.traceback[0]
            print(json.dumps({"where": f"{os.path.relpath(frame.filename, ROOT)}:{frame.lineno}",
                              "bytes": st.size_diff, "blocks": st.count_diff,
                              "bytes_per_message": round(st.size_diff / max(sent, 1), 1)}), flush=True)
    pending = broker.timer.pending_by_horizon((3 * HOUR_MS,))[0]
    entries = len(broker._dedupe)
    # What dropping the window gives back to the system at once (a lower bound: memory the
    # allocator keeps for reuse is not given back, so this misses most of a heap-built window).
    gc.collect()
    held_kb = rss_kb()  # (pending_by_horizon above reads the schedule files: counted apart)
    broker._dedupe = type(broker._dedupe)(0, 0)
    gc.collect()
    released_kb = held_kb - rss_kb()
    print(json.dumps({"sent": sent, "seconds": round(elapsed, 3), "rss_before_kb": before_kb,
                      "rss_after_kb": after_kb, "dedupe_entries": entries, "released_kb": released_kb,
                      "pending_timers": pending}), flush=True)
    os._exit(0)  # no close: only the live figures matter


def part_f(args, workdir: str) -> None:
    common = ["--count", str(args.count), "--batch", str(args.batch), "--seconds", str(args.seconds),
              "--body-bytes", str(args.body_bytes), "--f-tracemalloc", str(args.f_tracemalloc)]
    runs = {}
    for ids in (True, False):
        data_dir = tempfile.mkdtemp(prefix="timers-f-", dir=workdir)
        runs[ids] = run_child("--child", "mem", "--dir", data_dir, *(["--ids"] if ids else []), *common)
        runs[ids]["growth_kb"] = runs[ids]["rss_after_kb"] - runs[ids]["rss_before_kb"]
        shutil.rmtree(data_dir, ignore_errors=True)
    with_ids, without = runs[True], runs[False]
    ctx = {"part": "f", "messages": with_ids["sent"], "body_bytes": args.body_bytes, "spread": "1-2 h",
           "batch": args.batch, "dedupe_entries": with_ids["dedupe_entries"],
           "pending_timers": with_ids["pending_timers"], "load_s_with_ids": with_ids["seconds"],
           "rss_growth_mb_with_ids": round(with_ids["growth_kb"] / 1024, 1),
           "rss_growth_mb_without_ids": round(without["growth_kb"] / 1024, 1),
           "released_mb_dropping_window": round(with_ids["released_kb"] / 1024, 1)}
    emit("rss_per_message_with_ids", round(with_ids["growth_kb"] * 1024 / max(with_ids["sent"], 1), 1),
         "bytes", **ctx)
    emit("rss_per_pending_timer", round(without["growth_kb"] * 1024 / max(without["pending_timers"], 1), 1),
         "bytes", **ctx)
    emit("rss_per_remembered_id",
         round((with_ids["growth_kb"] - without["growth_kb"]) * 1024 / max(with_ids["dedupe_entries"], 1), 1),
         "bytes", **ctx)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="abcdef", help="which parts to run (letters a to g)")
    ap.add_argument("--count", type=int, default=1_000_000, help="timers in a, d, e and f")
    ap.add_argument("--big", action="store_true", help="10,000,000 timers in d and e")
    ap.add_argument("--rates", default="2000,5000", help="b: due timers per second, comma-separated")
    ap.add_argument("--steady-seconds", type=float, default=60.0, help="b: how long each rate runs")
    ap.add_argument("--lead-s", type=float, default=5.0, help="b live: how long before its due time a timer is sent")
    ap.add_argument("--consumer-pause-ms", type=int, default=20,
                    help="b: after a receive that was not full, a consumer lane waits this long (bigger batches, "
                         "fewer RPCs: on a small host the consumers share the broker's CPUs)")
    ap.add_argument("--b-mode", choices=("preload", "live"), default="preload",
                    help="b: send every timer before the first is due (preload), or each --lead-s before it "
                         "is due while the others are delivered (live: sends compete for the same CPU)")
    ap.add_argument("--burst", type=int, default=200_000, help="c: timers due in the same second")
    ap.add_argument("--burst-lead-s", type=float, default=40.0, help="c: the due second starts this far ahead")
    ap.add_argument("--quiet-pct", type=float, default=0.0,
                    help="b, c: first wait until the host's CPUs are less busy than this (%%; 0: do not wait)")
    ap.add_argument("--quiet-wait-s", type=float, default=600.0, help="longest wait for --quiet-pct")
    ap.add_argument("--batch", type=int, default=1000)
    ap.add_argument("--seconds", type=float, default=600.0, help="time bound of each enqueue loop")
    ap.add_argument("--body-bytes", type=int, default=100)
    ap.add_argument("--dir", default=None, help="work directory (default: a temp dir)")
    ap.add_argument("--f-tracemalloc", type=int, default=0, metavar="N",
                    help="f: print the N top allocations by line in each child (slow)")
    ap.add_argument("--g-cancels", type=int, default=200, help="g: cancel-by-key calls timed")
    ap.add_argument("--g-replaces", type=int, default=50_000, help="g: replacing sends")
    ap.add_argument("--g-replace-keys", type=int, default=5_000, help="g: distinct replace keys")
    ap.add_argument("--g-replace-batch", type=int, default=100, help="g: replacing sends per batch")
    ap.add_argument("--child", choices=["fill", "open", "mem", "keys"], help=argparse.SUPPRESS)
    ap.add_argument("--ids", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--close", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    _SPEED.append(python_speed())
    if args.child == "fill":
        return child_fill(args)
    if args.child == "open":
        return child_open(args)
    if args.child == "mem":
        return child_mem(args)
    if args.child == "keys":
        return timerkeys.child(args, emit, rss_kb)
    workdir = tempfile.mkdtemp(prefix="chronoq-bench-timers-", dir=args.dir)
    count = args.count
    try:
        if "a" in args.parts:
            part_a(args, workdir)
        if "b" in args.parts:
            part_b(args, workdir)
        if "c" in args.parts:
            if args.quiet_pct:
                wait_quiet(args.quiet_pct, args.quiet_wait_s)
            part_c(args, workdir)
        if "d" in args.parts or "e" in args.parts:
            if args.big:
                args.count = BIG_COUNT
            part_d_e(args, workdir, args.parts)
        if "f" in args.parts:
            args.count = count  # (--big is for d and e only)
            part_f(args, workdir)
        if "g" in args.parts:
            args.count = count
            g_dir = tempfile.mkdtemp(prefix="timers-g-", dir=workdir)
            run_child("--child", "keys", "--dir", g_dir, *(f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
                      if k in ("count", "batch", "seconds", "body_bytes") or k.startswith("g_")))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
