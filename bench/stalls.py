"""Call latency while the broker holds much state and is watched: event-loop stalls.

A broker's periodic work (metrics scrapes, the console's history sample every 5 s, maintenance)
runs on the same event loop as every call; work that grows with what the broker holds shows up
as latency spikes for everybody, delayed deliveries included. This starts ``chronoq serve``
(default durable flush), loads it (``--timers`` far-future delayed messages, due in 10 minutes
to a day; ``--inflight`` messages received by a group and left in flight for an hour), then for
``--seconds`` sends one delayed message at a time (a 2 ms pause between) while ``/metrics`` is
scraped every ``--scrape-s`` seconds, and reports the sends' latency: p50, p99, max, and how many
took longer than ``--spike-ms``, with when the first ones happened (seconds into the probe); and
the broker's own view (``chronoq_event_loop_lag_seconds``): its loop's wake-ups later than 25 ms
during the probe, and the largest lag since its start (the loading included).

    .venv/bin/python bench/stalls.py                              # 200,000 timers, 20,000 in flight
    .venv/bin/python bench/stalls.py --timers 1000000 --seconds 60
    .venv/bin/python bench/stalls.py --keyed --timers 300000 --inflight 0 --seconds 15   # key index build after a restart
    .venv/bin/python bench/stalls.py --keyed --replace --timers 300000 --inflight 0 --seconds 15   # ... with replacing sends
    .venv/bin/python bench/stalls.py --due-burst 100000 --due-in-s 30   # a burst falls due, consumed and acked
    .venv/bin/python bench/stalls.py --topics 2000 --groups 200          # many topics and groups in flight
    .venv/bin/python bench/stalls.py --retention                         # segments roll and are deleted
    .venv/bin/python bench/stalls.py --retention --one-bucket --inflight 0   # ... all timers in one bucket
    .venv/bin/python bench/stalls.py --timers 0 --inflight 0 --seconds 12 --new-topics 2500   # 500 new topics a batch
    .venv/bin/python bench/stalls.py --expire 50000                      # invisible times end: retries, DLQ

The scenarios' loading and consumers are in ``bench/stalls_load.py`` (their options are described there).

Prints one JSON object per line: {"metric", "value", "unit", ...context}. Loopback only; every
loop is bounded by a count and by time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.grpc_shell import stop_server  # noqa: E402
from bench import stalls_load as scen  # noqa: E402
from bench.machine import MachineLoad, python_speed  # noqa: E402
from chronoq.client.client import Client, OutgoingMessage, run  # noqa: E402

LOAD_BATCH = 500
DAY_MS = 86_400_000
BUCKET_MS = 60_000  # the default timer_bucket_ms


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(data_dir: str, env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str, str]:
    port, http_port = _free_port(), _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "chronoq", "serve", "--data-dir", data_dir, "--port", str(port),
                             "--host", "127.0.0.1", "--http-port", str(http_port), "--log-level", "warning"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env={**os.environ, **(env or {})})
    deadline = time.monotonic() + 60
    for line in proc.stdout:
        if "chronoq is ready" in line:
            return proc, f"127.0.0.1:{port}", f"http://127.0.0.1:{http_port}/metrics"
        if time.monotonic() > deadline:
            break
    stop_server(proc)
    raise RuntimeError("the broker did not start")


def _keys(keyed: bool, i: int) -> tuple[str, ...]:
    return (f"order-{i}",) if keyed else ()


async def load(client: Client, timers: int, inflight: int, rng: random.Random, seconds: float,
               keyed: bool = False, one_bucket: bool = False) -> tuple[int, int]:
    deadline = time.monotonic() + seconds
    now = int(time.time() * 1000)
    # Due 10 minutes to a day ahead; ``one_bucket``: all inside one schedule bucket (the default
    # 60 s width) 11-12 minutes ahead, so one bucket's work is all of it (retention's roll of it).
    lo, hi = (600_000, DAY_MS)
    if one_bucket:
        first = (now + 660_000) // BUCKET_MS * BUCKET_MS - now
        lo, hi = first, first + BUCKET_MS
    sent = 0
    while sent < timers and time.monotonic() < deadline:
        n = min(LOAD_BATCH, timers - sent)
        await client.send_batch([OutgoingMessage("bench-far", b"x" * 200, keys=_keys(keyed, sent + i),
                                                 deliver_at_ms=now + rng.randrange(lo, hi))
                                 for i in range(n)])
        sent += n
    for first in range(0, inflight, LOAD_BATCH):
        await client.send_batch([OutgoingMessage("bench-work", b"y" * 200) for _ in range(min(LOAD_BATCH, inflight - first))])
    held = 0
    while held < inflight and time.monotonic() < deadline:
        got = await client.receive("bench-g", "bench-work", max_messages=32, invisible_s=3600)
        if not got:
            break
        held += len(got)
    return sent, held


async def probe(client: Client, metrics_url: str, args, rng: random.Random,
                seconds: float) -> tuple[list[float], list, int]:
    stop = time.monotonic() + seconds
    scrapes = 0

    async def scraper() -> None:
        nonlocal scrapes
        while time.monotonic() < stop:
            await asyncio.to_thread(lambda: urllib.request.urlopen(metrics_url, timeout=30).read())
            scrapes += 1
            await asyncio.sleep(args.scrape_s)

    watcher = asyncio.ensure_future(scraper())
    latencies, spikes, began = [], [], time.monotonic()
    try:
        while time.monotonic() < stop and len(latencies) < args.max_sends:
            t0 = time.perf_counter()
            await client.send("bench-far", b"z" * 200, keys=_keys(args.keyed, -len(latencies) - 1),
                              replace_key=f"r{len(latencies) % 100}" if args.replace else None,
                              deliver_at_ms=int(time.time() * 1000) + rng.randrange(600_000, DAY_MS))
            took = (time.perf_counter() - t0) * 1e3
            latencies.append(took)
            if took > args.spike_ms:
                spikes.append([round(time.monotonic() - began, 2), round(took, 1)])
            await asyncio.sleep(0.002)
    finally:
        await watcher
    return latencies, spikes, scrapes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--timers", type=int, default=200_000, help="far-future delayed messages loaded first")
    ap.add_argument("--inflight", type=int, default=20_000, help="messages received and left in flight")
    ap.add_argument("--seconds", type=float, default=25.0, help="how long the probe sends")
    ap.add_argument("--max-sends", type=int, default=100_000, help="the probe's bound in sends")
    ap.add_argument("--scrape-s", type=float, default=1.0, help="pause between two /metrics scrapes")
    ap.add_argument("--spike-ms", type=float, default=20.0, help="a send slower than this counts as a spike")
    ap.add_argument("--one-bucket", action="store_true",
                    help="the loaded timers all fall due inside one schedule bucket (11-12 minutes ahead)")
    ap.add_argument("--load-seconds", type=float, default=600.0, help="time bound of the loading")
    ap.add_argument("--keyed", action="store_true",
                    help="every timer carries a message key, and the broker is restarted after the loading: the "
                         "probe's keyed sends begin the key index's build over every pending timer")
    ap.add_argument("--replace", action="store_true",
                    help="with --keyed: the probe's sends replace by key (100 keys in turn): each looks its key up "
                         "while the index is being built")
    scen.add_arguments(ap)
    args = ap.parse_args()

    data_dir = tempfile.mkdtemp(prefix="bench-stalls-")
    env = scen.server_env(args)
    proc, endpoint, metrics_url = start(os.path.join(data_dir, "data"), env)
    rng = random.Random(1)
    try:
        async def loaded():
            async with Client(endpoint) as client:
                return await load(client, args.timers, args.inflight, rng, args.load_seconds, args.keyed)

        async def go(timers, held):
            extra, consumers, due_at_s = {}, [], None
            async with Client(endpoint) as client:
                if not args.keyed:
                    timers, held = await load(client, args.timers, args.inflight, rng, args.load_seconds,
                                               one_bucket=args.one_bucket)
                deadline = time.monotonic() + args.load_seconds
                if args.topics:
                    extra["topics"], extra["topics_inflight"], extra["topics_load_send_ms"] = await scen.load_topics(
                        client, args.topics, args.groups, args.topics_per_group, deadline)
                    extra["groups"] = args.groups
                if args.expire:
                    extra["expire_sent"] = await scen.load_expire(endpoint, client, args.expire)
                if args.due_burst:
                    began = time.time()
                    due_at_ms = int(began * 1000 + args.due_in_s * 1000)
                    extra["due_sent"] = await scen.load_due(client, args.due_burst, due_at_ms,
                                                            int(args.due_spread_s * 1000), deadline)
                    due_at_s = due_at_ms / 1000 - time.time()  # into the probe
                    extra["due_at_probe_s"], extra["due_spread_s"] = round(due_at_s, 1), args.due_spread_s
                seconds = scen.probe_seconds(args, due_at_s)
                if args.due_burst:
                    consumers.append(scen.start_consumer(endpoint, "due", extra["due_sent"], seconds + 30))
                if args.new_topics:
                    consumers.append(scen.start_new_topics(endpoint, args, seconds))
                if args.expire:
                    consumers.append(scen.start_consumer(endpoint, "expire", args.expire, seconds,
                                                         args.expire_invisible_s))
                machine = MachineLoad()
                before = scen.scrape(metrics_url)
                latencies, spikes, scrapes = await probe(client, metrics_url, args, rng, seconds)
                after = scen.scrape(metrics_url)
            for proc_ in consumers:  # (off the loop: the client is closed by now)
                extra.update(scen.consumer_result(proc_, 60))
            if args.due_burst:
                extra["broker_lateness"] = scen.broker_lateness(before, scen.scrape(metrics_url))
            if args.expire:
                extra["dlq_messages"] = int(after["dlq"])
            if args.retention:  # (retention deleted segments: the log stays small)
                extra["commitlog_segments_before_after"] = [before.get("commitlog_segments"), after.get("commitlog_segments")]
                extra["commitlog_mib_before_after"] = [round(x.get("commitlog_bytes", 0) / 2**20, 1) for x in (before, after)]
            return timers, held, latencies, spikes, scrapes, machine.busy_pct(), scen.loop_stalls(before, after), extra

        timers = held = 0
        if args.keyed:  # loaded, then started again: the key index is built anew from the files
            timers, held = run(loaded())
            stop_server(proc)
            proc, endpoint, metrics_url = start(os.path.join(data_dir, "data"), env)
        timers, held, latencies, spikes, scrapes, busy, stalls, extra = run(go(timers, held))
    finally:
        stop_server(proc)
        shutil.rmtree(data_dir, ignore_errors=True)
    latencies.sort()
    n = len(latencies)
    print(json.dumps({"metric": "stall_send_latency_max", "value": round(latencies[-1], 1), "unit": "ms",
                      "p50_ms": round(latencies[n // 2], 2), "p99_ms": round(latencies[int(n * 0.99)], 2),
                      "sends": n, "spikes": len(spikes), "spike_ms": args.spike_ms, "first_spikes_s_ms": spikes[:10],
                      **stalls, "timers_pending": timers, "keyed": args.keyed, "replace": args.replace, "inflight": held,
                      "retention": args.retention, "one_bucket": args.one_bucket, **extra,
                      "scrapes": scrapes, "scrape_s": args.scrape_s,
                      "machine_busy_pct": busy, "python_speed_mips": python_speed()}), flush=True)


if __name__ == "__main__":
    main()
