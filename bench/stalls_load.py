"""The loading and the consumers of ``bench/stalls.py``'s scenarios beyond far-future timers and
messages in flight (read that module first):

- ``--due-burst N``: N delayed messages to ``bench-due`` falling due ``--due-in-s`` after their
  loading began, all at one instant (``--due-spread-s 0``) or spread over that many seconds; a
  consumer process receives and acks them and reports how late each was against its due time
  (receive time minus deliver-at, both on this machine's clock; negative: early), beside the
  broker's own lateness histogram (visible time minus due time).
- ``--topics N --groups M``: N topics with a message each and M consumer groups, group g receiving
  (and holding in flight for an hour) from ``--topics-per-group`` topics: the POP state and the
  per-topic/per-group walks of periodic work grow with them.
- ``--retention``: small commit-log segments (``CHRONOQ_SEGMENT_BYTES``), a short retention age
  and interval (``CHRONOQ_RETENTION_MAX_AGE_HOURS``, ``CHRONOQ_RETENTION_INTERVAL_S``): segments
  roll and are deleted while the broker holds the far-future timers (their records are rolled
  forward first).
- ``--new-topics N``: during the probe, a process of its own sends N messages to N topics that do
  not exist yet (auto-created), ``--new-topics-batch`` topics (one message each) per send, a send
  every ``--new-topics-every-s`` seconds: each batch makes that many topics (``topics.json``
  rewritten once) and their consume queues' directories and files. Its sends' latency is
  reported (``new_topics``).
- ``--expire N``: N messages to ``bench-exp`` received by a group with ``max_attempts`` 2 and a
  short invisible time (``--expire-invisible-s``) and never acked, from the probe's start: every
  one is revived into the retry topic (back-off: the first delay level, 1 s), received again, and
  dead-lettered when it expires a second time.

The consumers run in a process of their own (``python -m bench.stalls_load consume ...``), so
their decoding does not slow the probe's sends; each prints one JSON object. Loopback only; each
loop is bounded by a count and by time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from chronoq.client.admin import AdminClient  # noqa: E402
from chronoq.client.client import Client, OutgoingMessage, run  # noqa: E402

LOAD_BATCH = 500
DUE_TOPIC, DUE_GROUP = "bench-due", "bench-due-g"
EXP_TOPIC, EXP_GROUP = "bench-exp", "bench-exp-g"
EXP_MAX_ATTEMPTS = 2
MANY_TOPIC, MANY_GROUP = "bench-t{}", "bench-g{}"
NEW_TOPIC = "bench-n{}"
RETENTION_ENV = {"CHRONOQ_SEGMENT_BYTES": str(1 << 20), "CHRONOQ_RETENTION_MAX_AGE_HOURS": "0.005",
                 "CHRONOQ_RETENTION_INTERVAL_S": "5"}


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--due-burst", type=int, default=0, help="delayed messages falling due during the probe")
    ap.add_argument("--due-in-s", type=float, default=30.0, help="... this long after their loading began")
    ap.add_argument("--due-spread-s", type=float, default=0.0, help="... spread over this long (0: one instant)")
    ap.add_argument("--topics", type=int, default=0, help="topics with a message each")
    ap.add_argument("--groups", type=int, default=0, help="consumer groups receiving from them")
    ap.add_argument("--topics-per-group", type=int, default=10, help="topics each group receives from")
    ap.add_argument("--retention", action="store_true", help="1 MiB segments, 18 s retention, looked at every 5 s")
    ap.add_argument("--new-topics", type=int, default=0, help="new topics made by batches sent during the probe")
    ap.add_argument("--new-topics-batch", type=int, default=500, help="... topics (a message each) per batch")
    ap.add_argument("--new-topics-every-s", type=float, default=2.0, help="... a batch this often")
    ap.add_argument("--expire", type=int, default=0, help="messages received, never acked, expiring in the probe")
    ap.add_argument("--expire-invisible-s", type=float, default=5.0, help="their invisible time")


def server_env(args) -> dict[str, str]:
    return dict(RETENTION_ENV) if args.retention else {}


def probe_seconds(args, due_at_s: float | None) -> float:
    """The probe's length: at least ``--seconds``, and past the burst's due time by 10 s."""
    if due_at_s is None:
        return args.seconds
    return max(args.seconds, due_at_s + args.due_spread_s + 10)


async def load_due(client: Client, n: int, due_at_ms: int, spread_ms: int, deadline: float) -> int:
    sent = 0
    while sent < n and time.monotonic() < deadline:
        k = min(LOAD_BATCH, n - sent)
        await client.send_batch([OutgoingMessage(DUE_TOPIC, b"d" * 200, deliver_at_ms=due_at_ms
                                                 + (spread_ms * (sent + i) // n if spread_ms else 0))
                                 for i in range(k)])
        sent += k
    return sent


async def load_topics(client: Client, topics: int, groups: int, per_group: int,
                      deadline: float) -> tuple[int, int, list[float]]:
    """(topics made, messages held in flight, each loading send's latency in ms): a message in
    each topic (a send of LOAD_BATCH new topics at a time, auto-created), and each group receives
    from ``per_group`` topics (group g from topics g*per_group..., wrapping)."""
    took = []
    for first in range(0, topics, LOAD_BATCH):
        t0 = time.perf_counter()
        await client.send_batch([OutgoingMessage(MANY_TOPIC.format(i), b"t" * 100)
                                 for i in range(first, min(topics, first + LOAD_BATCH))])
        took.append(round((time.perf_counter() - t0) * 1e3, 1))
    held = 0
    for g in range(groups):
        for j in range(per_group):
            if time.monotonic() > deadline:
                return topics, held, took
            topic = MANY_TOPIC.format((g * per_group + j) % topics)
            held += len(await client.receive(MANY_GROUP.format(g), topic, max_messages=4, invisible_s=3600,
                                             wait_s=0))
    return topics, held, took


async def load_expire(endpoint: str, client: Client, n: int) -> int:
    async with AdminClient(endpoint) as admin:
        await admin.create_group(EXP_GROUP, max_attempts=EXP_MAX_ATTEMPTS)
    for first in range(0, n, LOAD_BATCH):
        await client.send_batch([OutgoingMessage(EXP_TOPIC, b"e" * 200) for _ in range(min(LOAD_BATCH, n - first))])
    return n


def start_new_topics(endpoint: str, args, seconds: float) -> subprocess.Popen:
    """The ``--new-topics`` sender, in a process of its own (its encoding must not slow the probe)."""
    return subprocess.Popen([sys.executable, "-m", "bench.stalls_load", "new-topics", endpoint, str(args.new_topics),
                             str(args.new_topics_batch), str(args.new_topics_every_s), str(seconds)],
                            cwd=ROOT, stdout=subprocess.PIPE, text=True)


async def _send_new_topics(endpoint: str, count: int, per_batch: int, every_s: float, seconds: float) -> dict:
    """Batches of ``per_batch`` new topics (a message each), one every ``every_s``, the first after
    one pause (the probe is sending by then), until ``count`` topics or ``seconds``."""
    took: list[float] = []
    stop = time.monotonic() + seconds
    made = 0
    async with Client(endpoint) as client:
        await asyncio.sleep(every_s)
        while made < count and time.monotonic() < stop:
            began = time.monotonic()
            n = min(per_batch, count - made)
            await client.send_batch([OutgoingMessage(NEW_TOPIC.format(made + i), b"n" * 100) for i in range(n)])
            took.append(round((time.monotonic() - began) * 1e3, 1))
            made += n
            await asyncio.sleep(max(0.0, every_s - (time.monotonic() - began)))
    return {"new_topics": made, "new_topics_batch": per_batch, "new_topics_send_ms": took}


def start_consumer(endpoint: str, mode: str, count: int, seconds: float, invisible_s: float = 30.0) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "bench.stalls_load", "consume", endpoint, mode, str(count),
                             str(seconds), str(invisible_s)], cwd=ROOT, stdout=subprocess.PIPE, text=True)


def consumer_result(proc: subprocess.Popen, timeout_s: float) -> dict:
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    lines = [line for line in out.splitlines() if line.startswith("{")]
    return json.loads(lines[-1]) if lines else {"error": f"consumer exited {proc.returncode} without a result"}


def _quantiles(values: list[int]) -> dict:
    if not values:
        return {"n": 0}
    values.sort()
    n = len(values)
    return {"n": n, "p50_ms": values[n // 2], "p99_ms": values[int(n * 0.99)], "max_ms": values[-1],
            "min_ms": values[0], "early": sum(1 for v in values if v < 0)}


async def _consume_due(endpoint: str, count: int, seconds: float) -> dict:
    """Receive and ack ``count`` messages of ``bench-due``: their lateness at the consumer."""
    late: list[int] = []
    stop = time.monotonic() + seconds
    async with Client(endpoint) as client:
        got: list = []
        while len(late) < count and time.monotonic() < stop:
            got = await client.ack_and_receive(DUE_GROUP, DUE_TOPIC, got, max_messages=64, invisible_s=60, wait_s=2)
            now = int(time.time() * 1000)
            late.extend(now - m.deliver_at_ms for m in got)
        await client.ack(DUE_GROUP, DUE_TOPIC, got)
    return {"lateness_at_consumer": _quantiles(late)}


async def _consume_expire(endpoint: str, count: int, seconds: float, invisible_s: float) -> dict:
    """Receive ``bench-exp`` and never ack, for ``seconds``: deliveries counted by attempt."""
    by_attempt: dict[int, int] = {}
    stop = time.monotonic() + seconds
    async with Client(endpoint) as client:
        while time.monotonic() < stop and sum(by_attempt.values()) < count * EXP_MAX_ATTEMPTS:
            got = await client.receive(EXP_GROUP, EXP_TOPIC, max_messages=64, invisible_s=invisible_s, wait_s=1)
            for m in got:
                by_attempt[m.delivery_attempt] = by_attempt.get(m.delivery_attempt, 0) + 1
    return {"received_by_attempt": {str(k): v for k, v in sorted(by_attempt.items())}}


def _new_topics_main(argv: list[str]) -> None:
    endpoint, count, per_batch, every_s, seconds = argv[0], int(argv[1]), int(argv[2]), float(argv[3]), float(argv[4])
    print(json.dumps(run(_send_new_topics(endpoint, count, per_batch, every_s, seconds))), flush=True)


def _consume_main(argv: list[str]) -> None:
    endpoint, mode, count, seconds, invisible_s = argv[0], argv[1], int(argv[2]), float(argv[3]), float(argv[4])
    if mode == "due":
        result = run(_consume_due(endpoint, count, seconds))
    else:
        result = run(_consume_expire(endpoint, count, seconds, invisible_s))
    print(json.dumps(result), flush=True)


def scrape(metrics_url: str) -> dict:
    """What the probe reads of the broker's /metrics: loop lag (wake-ups over 25 ms, the max),
    the timer's lateness histogram (cumulative bucket counts by bound), early deliveries, DLQ,
    the commit log's size and segments."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(metrics_url, timeout=30).read().decode()
    out = {"lag_count": 0.0, "lag": {}, "lag_max": 0.0, "late": {}, "early": 0.0, "dlq": 0.0}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "chronoq_event_loop_lag_seconds_count":
                out["lag_count"] = s.value
            elif s.name == "chronoq_event_loop_lag_seconds_bucket":
                out["lag"][s.labels["le"]] = s.value
            elif s.name == "chronoq_event_loop_lag_max_seconds":
                out["lag_max"] = s.value
            elif s.name == "chronoq_timer_lateness_seconds_bucket":
                out["late"][s.labels["le"]] = s.value
            elif s.name.startswith("chronoq_timer_early_deliveries"):
                out["early"] = s.value
            elif s.name == "chronoq_dlq_messages":
                out["dlq"] += s.value
            elif s.name in ("chronoq_commitlog_bytes", "chronoq_commitlog_segments"):
                out[s.name[len("chronoq_"):]] = int(s.value)
    return out


def loop_stalls(before: dict, after: dict) -> dict:
    """The probe's loop wake-ups later than 25/100/250 ms (the broker's lag histogram between two
    scrapes), and the largest lag since the broker started (the loading included)."""
    def over(le: str) -> int:
        return int((after["lag_count"] - after["lag"].get(le, 0.0)) - (before["lag_count"] - before["lag"].get(le, 0.0)))

    return {"broker_loop_stalls_over_25ms": over("0.025"), "broker_loop_stalls_over_100ms": over("0.1"),
            "broker_loop_stalls_over_250ms": over("0.25"), "broker_loop_lag_max_ms": round(after["lag_max"] * 1e3, 1)}


def broker_lateness(before: dict, after: dict) -> dict:
    """The broker's lateness histogram between two scrapes: count, p50/p99/max as bucket bounds (ms)."""
    bounds = sorted(after["late"], key=lambda b: float("inf") if b == "+Inf" else float(b))
    cum = [after["late"][b] - before["late"].get(b, 0.0) for b in bounds]
    total = cum[-1] if cum else 0

    def upper(q: float):
        for b, c in zip(bounds, cum):
            if c >= q * total:
                return b if b == "+Inf" else round(float(b) * 1e3, 1)
        return None

    top = next((b for b, c in zip(bounds, cum) if c >= total), None)
    # How many were later than each bound from 5 ms up (the tail the quantiles' buckets hide).
    over = {f"{float(b) * 1e3:g}": int(total - c) for b, c in zip(bounds, cum) if b != "+Inf" and float(b) >= 0.005}
    return {"count": int(total), "p50_le_ms": upper(0.5) if total else None, "p99_le_ms": upper(0.99) if total else None,
            "max_le_ms": (top if top == "+Inf" else round(float(top) * 1e3, 1)) if total else None,
            "over_ms": over, "early": int(after["early"] - before["early"])}


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "consume":
    _consume_main(sys.argv[2:])
elif __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "new-topics":
    _new_topics_main(sys.argv[2:])
