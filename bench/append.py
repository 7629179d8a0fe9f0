"""Append throughput of the embedded broker: 1 KiB messages in batches, sync and async flush.

Prints one JSON object per line: {"metric", "value", "unit", ...context}. Bounded: each run
stops after --messages messages or --seconds seconds, whichever comes first.

    .venv/bin/python bench/append.py                 # defaults: 200k messages, batches of 100 and 1000

Under ``sync`` two modes run: ``inline`` (write, fsync, dispatch, one batch at a time) and
``group_commit`` (several asyncio senders through chronoq.broker.committer.GroupCommitter, as the server
runs: encoding overlaps the fsync in a worker thread, one fsync acknowledges many batches).
    .venv/bin/python bench/append.py --batch 500 --messages 500000 --policy sync
    .venv/bin/python bench/append.py --policy sync --batch 100 --delayed   # delayed messages (the timer's path)
    .venv/bin/python -m cProfile -s tottime bench/append.py --policy sync --batch 100 --delayed --messages 50000

--ids gives every message a client-chosen id, as the official clients send (the broker then keeps
each in its dedupe window); the batch is built anew for each send then, in both runs alike.
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

from chronoq.broker.broker import Broker, OutgoingMessage  # noqa: E402
from chronoq.core.config import BrokerConfig  # noqa: E402
from chronoq.core.msgid import new_message_id  # noqa: E402


def batches(body: bytes, batch: int, ids: bool, spread_ms: int = 0):
    """What each send sends: the same messages, or (``ids``) fresh ones with new client ids, or
    (``spread_ms``) delayed ones, due a minute on and spread over the next ``spread_ms``."""
    same = [OutgoingMessage("bench", body, tag="t") for _ in range(batch)]
    sent = 0
    while True:
        now = int(time.time() * 1000)
        if spread_ms:  # due times scattered over the window (a multiplicative walk, not in order)
            first, sent = sent, sent + batch
            yield [OutgoingMessage("bench-delayed", body, tag="t", deliver_at_ms=now + 60_000 + (k * 7919) % spread_ms,
                                   message_id=new_message_id(now) if ids else None)
                   for k in range(first, first + batch)]
        elif ids:
            yield [OutgoingMessage("bench", body, tag="t", message_id=new_message_id(now)) for _ in range(batch)]
        else:
            yield same


def run(policy: str, batch: int, messages: int, seconds: float, body_bytes: int, queues: int, directory: str,
        ids: bool = False, spread_ms: int = 0) -> None:
    data_dir = tempfile.mkdtemp(prefix=f"append-{policy}-", dir=directory)
    cfg = BrokerConfig(data_dir=data_dir, flush_policy=policy, default_queues=queues)
    broker = Broker(cfg)
    body = os.urandom(body_bytes)
    source = batches(body, batch, ids, spread_ms)
    sent = fsyncs = 0
    start = time.perf_counter()
    cpu0 = time.process_time()
    deadline = start + seconds
    while sent < messages and time.perf_counter() < deadline:
        broker.write(next(source))
        if policy == "sync":
            broker.flush()  # group commit: one fsync for the whole batch, then visible
            fsyncs += 1
        else:
            broker.store.dispatch()
            if broker.store.log.written - broker.store.log.synced > 0 and time.perf_counter() - start > fsyncs * cfg.flush_interval_ms / 1000:
                broker.store.sync()  # the async flusher's periodic fsync, inline for the bench
                fsyncs += 1
        sent += batch
    broker.flush()
    elapsed = time.perf_counter() - start
    cpu = time.process_time() - cpu0
    broker.close()
    shutil.rmtree(data_dir, ignore_errors=True)
    ctx = {"policy": policy, "mode": "inline", "batch": batch, "body_bytes": body_bytes, "ids": ids,
           "delay_spread_ms": spread_ms, "messages": sent,
           "seconds": round(elapsed, 3), "cpu_seconds": round(cpu, 3)}
    print(json.dumps({"metric": "append_rate", "value": round(sent / elapsed), "unit": "msgs/s", **ctx}), flush=True)
    print(json.dumps({"metric": "append_bandwidth", "value": round(sent * body_bytes / elapsed / 1e6, 1),
                      "unit": "MB/s", **ctx}), flush=True)
    print(json.dumps({"metric": "fsync_rate", "value": round(fsyncs / elapsed, 1), "unit": "fsyncs/s", **ctx}),
          flush=True)


def run_group_commit(batch: int, messages: int, seconds: float, body_bytes: int, queues: int, directory: str,
                     senders: int, ids: bool = False, spread_ms: int = 0) -> None:
    """``senders`` concurrent asyncio producers through the GroupCommitter (as the server runs):
    encoding of new batches overlaps the fsync of earlier ones, and one fsync acks many batches."""
    import asyncio

    from chronoq.broker.committer import GroupCommitter

    data_dir = tempfile.mkdtemp(prefix="append-group-", dir=directory)
    broker = Broker(BrokerConfig(data_dir=data_dir, flush_policy="sync", default_queues=queues))
    body = os.urandom(body_bytes)
    source = batches(body, batch, ids, spread_ms)

    async def go() -> tuple[int, float, int]:
        committer = GroupCommitter(broker)
        committer.start()
        sent = 0
        start = time.perf_counter()
        deadline = start + seconds

        async def sender() -> None:
            nonlocal sent
            while sent < messages and time.perf_counter() < deadline:
                sent += batch  # counted before the await so senders stop at the bound
                await committer.send(next(source))

        await asyncio.gather(*(sender() for _ in range(senders)))
        elapsed = time.perf_counter() - start
        fsyncs = committer.fsyncs
        await committer.close()
        return sent, elapsed, fsyncs

    cpu0 = time.process_time()
    sent, elapsed, fsyncs = asyncio.run(go())
    cpu = time.process_time() - cpu0
    broker.close()
    shutil.rmtree(data_dir, ignore_errors=True)
    ctx = {"policy": "sync", "mode": "group_commit", "senders": senders, "batch": batch, "body_bytes": body_bytes,
           "ids": ids, "delay_spread_ms": spread_ms,
           "messages": sent, "seconds": round(elapsed, 3), "cpu_seconds": round(cpu, 3)}
    print(json.dumps({"metric": "append_rate", "value": round(sent / elapsed), "unit": "msgs/s", **ctx}), flush=True)
    print(json.dumps({"metric": "append_bandwidth", "value": round(sent * body_bytes / elapsed / 1e6, 1),
                      "unit": "MB/s", **ctx}), flush=True)
    print(json.dumps({"metric": "fsync_rate", "value": round(fsyncs / elapsed, 1), "unit": "fsyncs/s", **ctx}),
          flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policy", choices=["sync", "async", "both"], default="both")
    ap.add_argument("--batch", type=int, action="append")
    ap.add_argument("--messages", type=int, default=200_000)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--body-bytes", type=int, default=1024)
    ap.add_argument("--queues", type=int, default=4)
    ap.add_argument("--dir", default=None, help="where to put the temporary data directory")
    ap.add_argument("--senders", type=int, default=4, help="concurrent senders in group-commit mode")
    ap.add_argument("--ids", action="store_true", help="every message with a client-chosen id")
    ap.add_argument("--delayed", action="store_true",
                    help="every message delayed: due a minute on, spread over the next 10 minutes (the timer's path)")
    args = ap.parse_args()
    policies = ["sync", "async"] if args.policy == "both" else [args.policy]
    spread_ms = 600_000 if args.delayed else 0
    for policy in policies:
        for batch in args.batch or [100, 1000]:
            run(policy, batch, args.messages, args.seconds, args.body_bytes, args.queues, args.dir or tempfile.gettempdir(),
                args.ids, spread_ms)
            if policy == "sync":
                run_group_commit(batch, args.messages, args.seconds, args.body_bytes, args.queues,
                                 args.dir or tempfile.gettempdir(), args.senders, args.ids, spread_ms)


if __name__ == "__main__":
    main()
