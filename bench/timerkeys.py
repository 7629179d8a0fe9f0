"""Part g of bench/timers.py: replace by key and cancel by key (chronoq.timer.keyed) with a big key
index. Run through ``bench/timers.py --parts g`` (it starts ``child`` in a fresh process):

1. ``--count`` timers (default 1,000,000) due 1-2 h ahead, each with a message key of its own, sent
   through the broker API in batches (flush policy sync): the keyed enqueue rate; the key index's
   size (its memory maps: no Python object per key) per key, and the process's RSS growth per
   message (everything a pending keyed timer costs, the index included);
2. cancel by key of one key among them, ``--g-cancels`` times (random keys): the latency of the
   whole call (lookup, the recall record written and fsynced) and of the lookup and write alone;
3. replace by key: ``--g-replaces`` sends over ``--g-replace-keys`` replace keys (after the first
   round each replaces a pending message), in batches of ``--g-replace-batch``: sends/s;
4. the index rebuilt after a restart: the broker reopened (clean stop); the first cancel by key
   (it begins the build and answers from a search of the schedule files for its key), then the
   build itself, driven by maintenance calls back to back: its total and its longest call.
"""

from __future__ import annotations

import gc
import json
import os
import random
import time

from chronoq.broker.broker import Broker, OutgoingMessage
from chronoq.core.config import BrokerConfig

TOPIC = "bench-keys"
HOUR_MS = 3_600_000


def _pctl(values: list[float], q: float) -> float:
    values = sorted(values)
    return round(values[min(len(values) - 1, int(q * len(values)))], 3)


def child(args, emit, rss_kb) -> None:
    cfg = BrokerConfig(data_dir=args.dir, flush_policy="sync", default_queues=8)
    broker = Broker(cfg)
    body = os.urandom(args.body_bytes)
    rng = random.Random(7)
    n = args.count
    ctx = {"part": "g", "keyed_timers": n, "body_bytes": args.body_bytes, "spread": "1-2 h", "batch": args.batch}
    # (a first keyed send builds the index: empty here)
    broker.send(TOPIC, body, deliver_at_ms=broker.clock.wall_ms() + 2 * HOUR_MS, keys=["warm-up"])
    gc.collect()
    before_kb = rss_kb()
    start = time.perf_counter()
    deadline = start + args.seconds
    sent = 0
    last_maintenance = start
    while sent < n and time.perf_counter() < deadline:
        now = broker.clock.wall_ms()
        k = min(args.batch, n - sent)
        broker.send_batch([OutgoingMessage(TOPIC, body, deliver_at_ms=now + rng.randrange(HOUR_MS, 2 * HOUR_MS),
                                           keys=[f"order-{sent + i}"]) for i in range(k)])
        sent += k
        if time.perf_counter() - last_maintenance > 0.2:
            broker.maintenance()
            last_maintenance = time.perf_counter()
    elapsed = time.perf_counter() - start
    gc.collect()
    growth_kb = rss_kb() - before_kb
    index = broker.timer.keys
    ctx["keyed_timers"] = sent
    emit("keyed_enqueue_rate", round(sent / elapsed), "timers/s", seconds=round(elapsed, 3), **ctx)
    emit("key_index_bytes_per_key", round(index.memory_bytes() / len(index), 1), "bytes", keys=len(index),
         capacity=index.capacity, index_mb=round(index.memory_bytes() / (1 << 20), 1), **ctx)
    emit("rss_per_pending_keyed_timer", round(growth_kb * 1024 / max(sent, 1), 1), "bytes",
         rss_growth_mb=round(growth_kb / 1024, 1),
         note="the whole process's RSS growth per keyed timer (buffers, wheel, index...)", **ctx)

    # 2. cancel by key, one key among all of them
    whole, lookup = [], []
    for _ in range(args.g_cancels):
        key = f"order-{rng.randrange(sent)}"
        t0 = time.perf_counter()
        answer = broker.timer_cancel_by_key(TOPIC, key)
        t1 = time.perf_counter()
        broker.durable(answer.ticket)
        result = broker.timer_key_answered(answer)
        t2 = time.perf_counter()
        assert len(result.cancelled) <= 1, result
        lookup.append((t1 - t0) * 1000)
        whole.append((t2 - t0) * 1000)
    emit("cancel_by_key_ms_p50", _pctl(whole, 0.5), "ms", p99=_pctl(whole, 0.99), max=round(max(whole), 3),
         lookup_and_write_p50=_pctl(lookup, 0.5), lookup_and_write_p99=_pctl(lookup, 0.99),
         cancels=len(whole), note="whole call: lookup, recall record written, fsynced, applied", **ctx)

    # 3. replace by key
    keys = args.g_replace_keys
    start = time.perf_counter()
    done = replaced = 0
    while done < args.g_replaces and time.perf_counter() < start + args.seconds:
        now = broker.clock.wall_ms()
        k = min(args.g_replace_batch, args.g_replaces - done)
        results = broker.send_batch([OutgoingMessage(
            TOPIC, body, deliver_at_ms=now + rng.randrange(HOUR_MS, 2 * HOUR_MS),
            properties={"CHRONOQ_REPLACE_KEY": f"debounce-{(done + i) % keys}"}) for i in range(k)])
        replaced += sum(1 for r in results if r.replaced.startswith("replaced:"))
        done += k
    elapsed = time.perf_counter() - start
    emit("replace_by_key_rate", round(done / elapsed), "sends/s", sends=done, replaced=replaced,
         replace_keys=keys, replace_batch=args.g_replace_batch, seconds=round(elapsed, 3), **ctx)

    # 4. the index rebuilt after a restart: the first keyed call answers while the build is
    # partial (it searches the unread buckets for its key), then maintenance reads the rest
    broker.close()
    start = time.perf_counter()
    broker = Broker(cfg)
    opened = time.perf_counter() - start
    start, cpu = time.perf_counter(), time.process_time()
    broker.cancel_by_key(TOPIC, f"order-{rng.randrange(sent)}")
    first, first_cpu = time.perf_counter() - start, time.process_time() - cpu
    emit("first_keyed_call_after_restart", round(first, 3), "s", cpu_s=round(first_cpu, 3), open_s=round(opened, 3),
         keys_indexed_then=len(broker.timer.keys), **ctx)
    steps, longest = 0, 0.0
    start, cpu = time.perf_counter(), time.process_time()
    while broker.timer.keys_building and steps < 100_000:
        t0 = time.perf_counter()
        broker.maintenance()
        longest = max(longest, time.perf_counter() - t0)
        steps += 1
    built, built_cpu = time.perf_counter() - start, time.process_time() - cpu
    emit("key_index_build_after_restart", round(built, 3), "s", cpu_s=round(built_cpu, 3), maintenance_calls=steps,
         longest_maintenance_s=round(longest, 3), keys=len(broker.timer.keys), capacity=broker.timer.keys.capacity,
         note="the build's work spread over maintenance calls (every 200 ms in a broker)", **ctx)
    print(json.dumps({"done": True}), flush=True)
    os._exit(0)
