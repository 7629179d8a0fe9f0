"""The broker's receive path in one process, no network: what (c) costs the broker per message
before HTTP/2 and gRPC are counted.

Writes N one-KiB messages (bulk path, as chronoq.client.client's batches arrive), then POP-receives
them 16 at a time, encodes each batch as chronoq's receive calls answer it
(``chronoq.protocol.rocketmq.receive.messages_bytes``), acks each batch (``PopService.ack_many``) and finally encodes the
trace events the run recorded (``trace.bodies``). Prints one JSON line per stage (µs per
message, best of ``--repeat`` runs, each on a fresh data directory) and their sum:

    .venv/bin/python bench/receive_path.py
    .venv/bin/python bench/receive_path.py --messages 50000 --repeat 5
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

from bench.machine import python_speed  # noqa: E402
from chronoq.broker import trace  # noqa: E402
from chronoq.broker.broker import Broker, OutgoingBatch, OutgoingMessage  # noqa: E402
from chronoq.core.clock import SystemClock  # noqa: E402
from chronoq.core.config import BrokerConfig  # noqa: E402
from chronoq.pop.service import PopService  # noqa: E402
from chronoq.protocol.rocketmq import receive  # noqa: E402

TOPIC, GROUP, BATCH, SEND_BATCH = "bench", "bench-g", 16, 100
TIME_LIMIT_S = 120  # per run: the loop stops by itself


def one_run(messages: int) -> dict[str, float]:
    data_dir = tempfile.mkdtemp(prefix="bench-rp-")
    clock = SystemClock()
    broker = Broker(BrokerConfig(data_dir=data_dir, flush_policy="async", trace_enabled=True), clock=clock)
    pop = PopService(broker, clock)
    try:
        body = os.urandom(1024)
        broker.create_topic(TOPIC, broker.config.default_queues)
        # One send the usual way: it validates the topic once, as the server's first send does.
        broker.write([OutgoingMessage(topic=TOPIC, body=body, message_id="FIRST")])
        for i in range(0, messages, SEND_BATCH):
            n = min(SEND_BATCH, messages - i)
            ids = [f"ID{i + j:020d}" for j in range(n)]
            broker.write_batch(OutgoingBatch([TOPIC] * n, [body] * n, message_ids=ids))
        broker.store.dispatch()
        pop.group(GROUP)
        host = receive.store_host_field("127.0.0.1:8081")
        spent = {"receive": 0.0, "encode": 0.0, "ack": 0.0}
        got = 0
        started = time.monotonic()
        while time.monotonic() - started < TIME_LIMIT_S:
            t0 = time.perf_counter()
            popped = pop.receive(GROUP, TOPIC, max_messages=BATCH, invisible_ms=60_000)
            t1 = time.perf_counter()
            if not popped:
                break
            receive.messages_bytes(popped, TOPIC, "", host)
            t2 = time.perf_counter()
            failures = pop.ack_many(GROUP, TOPIC, [p.receipt_handle for p in popped])
            t3 = time.perf_counter()
            assert not any(failures), failures
            spent["receive"] += t1 - t0
            spent["encode"] += t2 - t1
            spent["ack"] += t3 - t2
            got += len(popped)
        assert got == messages + 1, got
        events = broker.trace.take_events()
        t0 = time.perf_counter()
        trace.bodies(events)
        spent["trace_encode"] = time.perf_counter() - t0
        return {stage: s / got * 1e6 for stage, s in spent.items()}
    finally:
        pop.close()
        broker.close()
        shutil.rmtree(data_dir, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--messages", type=int, default=20_000)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    speed = python_speed()
    runs = [one_run(args.messages) for _ in range(max(1, args.repeat))]
    best = {stage: min(r[stage] for r in runs) for stage in runs[0]}
    ctx = {"messages": args.messages, "batch": BATCH, "runs": len(runs), "python_speed_mips": speed}
    for stage, value in best.items():
        print(json.dumps({"metric": f"receive_path_{stage}", "value": round(value, 2), "unit": "us/msg", **ctx}))
    print(json.dumps({"metric": "receive_path_total", "value": round(sum(best.values()), 2), "unit": "us/msg",
                      **ctx}), flush=True)


if __name__ == "__main__":
    main()
