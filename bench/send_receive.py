"""Send and receive throughput through the gRPC front end (issue 3's figures).

Starts ``chronoq serve`` (default durable flush) on loopback, then:

  (a) official Python client (rocketmq-python-client): N sends, then N receive+ack; the broker's
      CPU time per message for each way (read from /proc; the client is the bottleneck here);
  (b) chronoq.client: P producer processes sending batches of B one-KiB messages: msgs/s;
  (c) chronoq.client: C consumer processes receiving batches of R and acking each batch: msgs/s.

Prints one JSON object per line: {"metric", "value", "unit", ...context}. Every phase is bounded
in count and time.

    .venv/bin/python bench/send_receive.py                     # all three phases
    .venv/bin/python bench/send_receive.py --phase b --messages 400000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
import uuid

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.grpc_shell import server_cpu_s, start_server  # noqa: E402


def emit(metric: str, value, unit: str, **ctx) -> None:
    print(json.dumps({"metric": metric, "value": value, "unit": unit, **ctx}), flush=True)


# ----------------------------------------------------------------------------- (a) official client
def phase_official(endpoint: str, pid: int, messages: int, seconds: float) -> None:
    from rocketmq import ClientConfiguration, Credentials, FilterExpression, Message, Producer, SimpleConsumer

    topic, group = f"bench-official-{uuid.uuid4().hex[:6]}", f"bench-official-g-{uuid.uuid4().hex[:6]}"
    cfg = ClientConfiguration(endpoint, Credentials("", ""), request_timeout=10)
    producer = Producer(cfg, (topic,))
    producer.startup()
    body = os.urandom(1024)
    futures = []
    cpu0, t0 = server_cpu_s(pid), time.perf_counter()
    try:
        for _ in range(messages):
            if time.perf_counter() - t0 > seconds:
                break
            m = Message()
            m.topic, m.body = topic, body
            futures.append(producer.send_async(m))
        for f in futures:
            f.result(timeout=30)
    finally:
        producer.shutdown()
    sent = len(futures)
    cpu, elapsed = server_cpu_s(pid) - cpu0, time.perf_counter() - t0
    emit("official_send_server_cpu", round(cpu / sent * 1e6, 1), "us/msg", messages=sent, rate=round(sent / elapsed))
    consumer = SimpleConsumer(cfg, group, {topic: FilterExpression("*")}, await_duration=2)
    consumer.startup()
    got = 0
    cpu0, t0 = server_cpu_s(pid), time.perf_counter()
    try:
        while got < sent and time.perf_counter() - t0 < seconds:
            for m in consumer.receive(32, 30):
                consumer.ack(m)
                got += 1
    finally:
        consumer.shutdown()
    cpu, elapsed = server_cpu_s(pid) - cpu0, time.perf_counter() - t0
    emit("official_receive_ack_server_cpu", round(cpu / max(got, 1) * 1e6, 1), "us/msg", messages=got,
         rate=round(got / elapsed))


# ----------------------------------------------------------------------------- (b) batched producers
def _producer_proc(endpoint: str, topic: str, count: int, batch: int, seconds: float, out: mp.Queue) -> None:
    from chronoq.client import Client, OutgoingMessage, run

    async def go() -> int:
        body = os.urandom(1024)
        sent = 0
        deadline = time.perf_counter() + seconds
        async with Client(endpoint) as client:
            async def lane() -> None:
                nonlocal sent
                while sent < count and time.perf_counter() < deadline:
                    sent += batch
                    await client.send_batch([OutgoingMessage(topic, body) for _ in range(batch)])
            await asyncio.gather(*(lane() for _ in range(4)))  # a few requests in flight
        return sent

    out.put(run(go()))


def phase_send(endpoint: str, pid: int, messages: int, producers: int, batch: int, seconds: float, topic: str) -> None:
    q: mp.Queue = mp.Queue()
    procs = [mp.Process(target=_producer_proc, args=(endpoint, topic, messages // producers, batch, seconds, q))
             for _ in range(producers)]
    cpu0, t0 = server_cpu_s(pid), time.perf_counter()
    for p in procs:
        p.start()
    sent = sum(q.get(timeout=seconds + 60) for _ in procs)
    for p in procs:
        p.join()
    elapsed, cpu = time.perf_counter() - t0, server_cpu_s(pid) - cpu0
    emit("batched_send_rate", round(sent / elapsed), "msgs/s", producers=producers, batch=batch,
         messages=sent, seconds=round(elapsed, 2), server_cpu_us_per_msg=round(cpu / sent * 1e6, 1))


# ----------------------------------------------------------------------------- (c) batched consumers
def _consumer_proc(endpoint: str, group: str, topic: str, count: int, batch: int, seconds: float, out: mp.Queue) -> None:
    from chronoq.client import Client, run

    async def go() -> int:
        got = 0
        deadline = time.perf_counter() + seconds
        async with Client(endpoint) as client:
            async def lane() -> None:
                nonlocal got
                while got < count and time.perf_counter() < deadline:
                    msgs = await client.receive(group, topic, max_messages=batch, invisible_s=60, wait_s=1)
                    if not msgs and got >= count:
                        return
                    await client.ack(group, topic, msgs)
                    got += len(msgs)
            await asyncio.gather(*(lane() for _ in range(4)))
        return got

    out.put(run(go()))


def phase_receive(endpoint: str, pid: int, messages: int, consumers: int, batch: int, seconds: float, topic: str) -> None:
    group = f"bench-g-{uuid.uuid4().hex[:6]}"
    q: mp.Queue = mp.Queue()
    procs = [mp.Process(target=_consumer_proc, args=(endpoint, group, topic, messages // consumers, batch, seconds, q))
             for _ in range(consumers)]
    cpu0, t0 = server_cpu_s(pid), time.perf_counter()
    for p in procs:
        p.start()
    got = sum(q.get(timeout=seconds + 60) for _ in procs)
    for p in procs:
        p.join()
    elapsed, cpu = time.perf_counter() - t0, server_cpu_s(pid) - cpu0
    emit("batched_receive_ack_rate", round(got / elapsed), "msgs/s", consumers=consumers, batch=batch,
         messages=got, seconds=round(elapsed, 2), server_cpu_us_per_msg=round(cpu / max(got, 1) * 1e6, 1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--phase", choices=["a", "b", "c", "all"], default="all")
    ap.add_argument("--official-messages", type=int, default=3000)
    ap.add_argument("--messages", type=int, default=200_000)
    ap.add_argument("--producers", type=int, default=2)
    ap.add_argument("--send-batch", type=int, default=100)
    ap.add_argument("--consumers", type=int, default=2)
    ap.add_argument("--receive-batch", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=60.0, help="time bound of each phase")
    ap.add_argument("--policy", choices=["sync", "async"], default="sync")
    args = ap.parse_args()
    data_dir = tempfile.mkdtemp(prefix="bench-sr-")
    proc, endpoint = start_server(os.path.join(data_dir, "data"), args.policy)
    try:
        if args.phase in ("a", "all"):
            phase_official(endpoint, proc.pid, args.official_messages, args.seconds)
        topic = f"bench-{uuid.uuid4().hex[:6]}"
        if args.phase in ("b", "c", "all"):
            phase_send(endpoint, proc.pid, args.messages, args.producers, args.send_batch, args.seconds, topic)
        if args.phase in ("c", "all"):
            phase_receive(endpoint, proc.pid, args.messages, args.consumers, args.receive_batch, args.seconds, topic)
    finally:
        proc.terminate()
        proc.wait(30)
        shutil.rmtree(data_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
