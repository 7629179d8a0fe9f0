"""Send and receive throughput through the gRPC front end (issue 3's figures).

Starts ``chronoq serve`` (default durable flush) on loopback, then:

  (a) official Python client (rocketmq-python-client): N sends, then N receive+ack; the broker's
      CPU time per message for each way (read from /proc; the client is the bottleneck here);
  (b) chronoq.client.client: P producer processes sending batches of B one-KiB messages: msgs/s;
  (c) chronoq.client.client: C consumer processes receiving batches of R and acking each batch: msgs/s
      (chronoq.client.client receives with chronoq's ReceiveBatch call: one answer per batch, no stream;
      by default each batch is acked with the next receive, ``ack_and_receive``: one call per batch);
  (d) as (b), but every message is delayed: delivery times spread evenly over the next 10 minutes
      (``--delay-spread-s``), the timer's schedule log and wheel take them: msgs/s;
  (e) one client, one 1 KiB message per call, one call at a time, on an idle broker: the call's
      latency (p50, p99) and the broker's CPU per send, under the ``sync`` and the ``async`` flush
      policy (a broker of each, one after the other, in the same run), beside a raw append+fsync of
      1 KiB on the same disk (what ``sync`` adds at the least);
  (f) one message per call, one call at a time in each process: P producer processes sending
      delayed messages (delivery times spread as in (d)), then C consumer processes that receive one
      message and ack it (two calls) from a topic filled beforehand: msgs/s, the call's p50, the
      broker's and the clients' CPU per message (issue 24's figures; ``build`` says compiled or pure).

Prints one JSON object per line: {"metric", "value", "unit", ...context}. Every phase is bounded
in count and time.

    .venv/bin/python bench/send_receive.py                     # all three phases
    .venv/bin/python bench/send_receive.py --phase b --messages 400000
    .venv/bin/python bench/send_receive.py --phase c --rounds 3     # (b) then (c), three times
    .venv/bin/python bench/send_receive.py --phase c --client-transport grpc   # load through grpc.aio
    .venv/bin/python bench/send_receive.py --phase d --rounds 3     # delayed batched enqueue
    .venv/bin/python bench/send_receive.py --phase e                # lone sends: sync vs async
    .venv/bin/python bench/send_receive.py --phase f --rounds 3     # one message per call, issue 24
    CHRONOQ_PURE_PYTHON=1 .venv/bin/python bench/send_receive.py --phase f   # the pure-Python build

The load processes connect first and start together: interpreter start-up is not timed.
Each line carries the broker's CPU time per message (user + system, and system alone) and the
machine's 1-minute load average: on a shared machine compare CPU per message, not rates.
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

import chronoq  # noqa: E402
from bench.grpc_shell import server_cpu_split_s, start_server, thread_run_ns  # noqa: E402
from bench.machine import MachineLoad, python_speed  # noqa: E402


# Fresh interpreters for the load processes: phase (a) leaves the official client's gRPC threads in
# this process, and forking a process with live gRPC threads can crash the child.
_MP = mp.get_context("spawn")


_SPEED: list[float] = []  # bench.machine.python_speed() at start-up


def emit(metric: str, value, unit: str, **ctx) -> None:
    # The machine's load beside every figure: CPU time per message rises on a busy machine too,
    # and on a slow day of a shared VM (python_speed_mips, steal_pct).
    ctx.setdefault("load1", round(os.getloadavg()[0], 2))
    if _SPEED:
        ctx.setdefault("python_speed_mips", _SPEED[0])
    if metric.startswith("batched"):
        ctx.setdefault("client_transport", _transport())
        ctx.setdefault("lanes", _lanes())
    ctx.setdefault("cpus", os.cpu_count())
    ctx.setdefault("build", chronoq.build())  # compiled, or pure (CHRONOQ_PURE_PYTHON=1)
    print(json.dumps({"metric": metric, "value": value, "unit": unit, **ctx}), flush=True)


class ServerCpu:
    """The broker's CPU time over one phase (user + system, from /proc), and the host's steal."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.user0, self.sys0 = server_cpu_split_s(pid)
        self.machine = MachineLoad()

    def per_message(self, messages: int) -> dict:
        user, system = server_cpu_split_s(self.pid)
        n = max(messages, 1)
        return {"server_cpu_us_per_msg": round((user - self.user0 + system - self.sys0) / n * 1e6, 1),
                "server_sys_us_per_msg": round((system - self.sys0) / n * 1e6, 1),
                "steal_pct": self.machine.steal_pct()}


# ----------------------------------------------------------------------------- (a) official client
def phase_official(endpoint: str, pid: int, messages: int, seconds: float) -> None:
    from rocketmq import ClientConfiguration, Credentials, FilterExpression, Message, Producer, SimpleConsumer

    topic, group = f"bench-official-{uuid.uuid4().hex[:6]}", f"bench-official-g-{uuid.uuid4().hex[:6]}"
    cfg = ClientConfiguration(endpoint, Credentials("", ""), request_timeout=10)
    producer = Producer(cfg, (topic,))
    producer.startup()
    body = os.urandom(1024)
    futures = []
    cpu, t0 = ServerCpu(pid), time.perf_counter()
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
    elapsed, used = time.perf_counter() - t0, cpu.per_message(sent)
    emit("official_send_server_cpu", used.pop("server_cpu_us_per_msg"), "us/msg", messages=sent,
         rate=round(sent / elapsed), **used)
    consumer = SimpleConsumer(cfg, group, {topic: FilterExpression("*")}, await_duration=2)
    consumer.startup()
    got = 0
    cpu, t0 = ServerCpu(pid), time.perf_counter()
    try:
        while got < sent and time.perf_counter() - t0 < seconds:
            for m in consumer.receive(32, 30):
                consumer.ack(m)
                got += 1
    finally:
        consumer.shutdown()
    elapsed, used = time.perf_counter() - t0, cpu.per_message(got)
    emit("official_receive_ack_server_cpu", used.pop("server_cpu_us_per_msg"), "us/msg", messages=got,
         rate=round(got / elapsed), **used)


def _lanes() -> int:
    """Requests each load process keeps in flight (--lanes; spawned children read the environment)."""
    return int(os.environ.get("BENCH_LANES", "4"))


def _transport() -> str:
    """chronoq.client.client's transport for the load processes (--client-transport; spawned children
    inherit it through the environment)."""
    return os.environ.get("BENCH_CLIENT_TRANSPORT", "h2")


def _gather(q, procs, seconds: float) -> tuple[int, float]:
    """The load processes' (messages, CPU seconds), summed: each reports its own after its loop."""
    results = [q.get(timeout=seconds + 60) for _ in procs]
    return sum(r[0] for r in results), sum(r[1] for r in results)


# ----------------------------------------------------------------------------- (b) batched producers
def _producer_proc(endpoint: str, topic: str, count: int, batch: int, seconds: float, out: mp.Queue,
                   start, spread_ms: int = 0, lanes: int = 0) -> None:
    from chronoq.client.client import Client, OutgoingMessage, run

    async def go() -> tuple:
        body, times = os.urandom(1024), []
        sent = 0
        async with Client(endpoint, transport=_transport()) as client:
            await client.route(topic)  # connected (and the topic known) before the clock starts
            start.wait(seconds + 60)
            cpu0 = time.process_time()
            deadline = time.perf_counter() + seconds
            base_ms = int(time.time() * 1000) + 60_000  # due a minute on at the earliest: none fires here
            step = spread_ms / max(count, 1)
            async def lane() -> None:
                nonlocal sent
                while sent < count and time.perf_counter() < deadline:
                    first = sent
                    sent += batch
                    if spread_ms:  # delayed: due times spread evenly over the window, in send order
                        msgs = [OutgoingMessage(topic, body, deliver_at_ms=base_ms + int((first + i) * step))
                                for i in range(batch)]
                    else:
                        msgs = [OutgoingMessage(topic, body) for _ in range(batch)]
                    t0 = time.perf_counter()
                    await client.send_batch(msgs)
                    times.append(time.perf_counter() - t0)
            await asyncio.gather(*(lane() for _ in range(lanes or _lanes())))  # a few requests in flight
        return sent, time.process_time() - cpu0, sorted(times)[len(times) // 2] if times else 0.0

    out.put(run(go()))


def phase_send(endpoint: str, pid: int, messages: int, producers: int, batch: int, seconds: float, topic: str,
               spread_s: float = 0) -> None:
    q, start = _MP.Queue(), _MP.Barrier(producers + 1)
    procs = [_MP.Process(target=_producer_proc,
                         args=(endpoint, topic, messages // producers, batch, seconds, q, start, int(spread_s * 1000)))
             for _ in range(producers)]
    for p in procs:
        p.start()
    start.wait(seconds + 60)  # every producer connected: interpreter start-up is not timed
    cpu, t0 = ServerCpu(pid), time.perf_counter()
    sent, client_cpu = _gather(q, procs, seconds)
    elapsed = time.perf_counter() - t0
    for p in procs:
        p.join()
    emit("batched_delayed_send_rate" if spread_s else "batched_send_rate", round(sent / elapsed), "msgs/s",
         producers=producers, batch=batch, messages=sent, **({"delay_spread_s": spread_s} if spread_s else {}), seconds=round(elapsed, 2), **cpu.per_message(sent),
         client_cpu_us_per_msg=round(client_cpu / max(sent, 1) * 1e6, 1))


# ----------------------------------------------------------------------------- (c) batched consumers
def _consumer_proc(endpoint: str, group: str, topic: str, count: int, batch: int, seconds: float, out: mp.Queue,
                   combined: bool, stream: bool, start) -> None:
    from chronoq.client.client import Client, run

    async def go() -> int:
        got = 0
        async with Client(endpoint, extensions=not stream, transport=_transport()) as client:
            await client.route(topic)  # connected before the clock starts
            start.wait(seconds + 60)
            cpu0 = time.process_time()
            deadline = time.perf_counter() + seconds
            async def lane() -> None:
                nonlocal got
                msgs: list = []
                # Everything was sent (and is visible) before this phase: an empty answer without
                # waiting means the topic is drained, whichever consumer took more than its share.
                while got < count and time.perf_counter() < deadline:
                    if combined:  # ack the last batch and receive the next in one call
                        msgs = await client.ack_and_receive(group, topic, msgs, max_messages=batch, invisible_s=60,
                                                            wait_s=0)
                    else:
                        msgs = await client.receive(group, topic, max_messages=batch, invisible_s=60, wait_s=0)
                        await client.ack(group, topic, msgs)
                    if not msgs:
                        return
                    got += len(msgs)
                if combined:
                    await client.ack(group, topic, msgs)
            await asyncio.gather(*(lane() for _ in range(_lanes())))
        return got, time.process_time() - cpu0

    out.put(run(go()))


def phase_receive(endpoint: str, pid: int, messages: int, consumers: int, batch: int, seconds: float, topic: str,
                  combined: bool = True, stream: bool = False) -> None:
    group = f"bench-g-{uuid.uuid4().hex[:6]}"
    q, start = _MP.Queue(), _MP.Barrier(consumers + 1)
    procs = [_MP.Process(target=_consumer_proc,
                        args=(endpoint, group, topic, messages, batch, seconds, q, combined, stream, start))
             for _ in range(consumers)]
    for p in procs:
        p.start()
    start.wait(seconds + 60)  # every consumer connected: interpreter start-up is not timed
    cpu, t0 = ServerCpu(pid), time.perf_counter()
    got, client_cpu = _gather(q, procs, seconds)
    elapsed = time.perf_counter() - t0
    for p in procs:
        p.join()
    emit("batched_receive_ack_rate", round(got / elapsed), "msgs/s", consumers=consumers, batch=batch,
         ack="ack then receive" if stream or not combined else "ack_and_receive",
         receive="ReceiveMessage stream" if stream else "ReceiveBatch", messages=got, seconds=round(elapsed, 2),
         **cpu.per_message(got), client_cpu_us_per_msg=round(client_cpu / max(got, 1) * 1e6, 1))


# ----------------------------------------------------------------------------- (f) one message per call
def _single_consumer_proc(endpoint: str, group: str, topic: str, count: int, seconds: float, out: mp.Queue,
                          start) -> None:
    from chronoq.client.client import Client, run

    async def go() -> tuple:
        times = []
        async with Client(endpoint, transport=_transport()) as client:
            await client.route(topic)
            start.wait(seconds + 60)
            cpu0 = time.process_time()
            deadline = time.perf_counter() + seconds
            while len(times) < count and time.perf_counter() < deadline:  # receive one, ack it: two calls
                t0 = time.perf_counter()
                msgs = await client.receive(group, topic, max_messages=1, invisible_s=60, wait_s=0)
                if not msgs:  # everything was sent (and is visible) before: the topic is drained
                    break
                await client.ack(group, topic, msgs)
                times.append(time.perf_counter() - t0)
            cpu = time.process_time() - cpu0
        return len(times), cpu, sorted(times)[len(times) // 2] if times else 0.0

    out.put(run(go()))


def _fill(endpoint: str, topic: str, count: int) -> None:
    """``count`` plain one-KiB messages on ``topic``, in batches, untimed: what (f)'s consumers take."""
    from chronoq.client.client import Client, OutgoingMessage, run

    async def go() -> None:
        body = os.urandom(1024)
        async with Client(endpoint, transport=_transport()) as client:
            for first in range(0, count, 100):
                await client.send_batch([OutgoingMessage(topic, body) for _ in range(min(100, count - first))])

    run(go())


def phase_single(endpoint: str, pid: int, messages: int, producers: int, consumers: int, seconds: float,
                 topic: str, spread_s: float) -> None:
    """One message per call, one call at a time per process: delayed sends, then receive+ack of
    plain messages (issue 24's must-show, the way the official clients and most applications work)."""
    for kind, n in (("send", producers), ("receive_ack", consumers)):
        q, start = _MP.Queue(), _MP.Barrier(n + 1)
        if kind == "send":
            # one message per call, one call at a time (a lane)
            args = [(endpoint, f"{topic}-delayed", messages // n, 1, seconds, q, start, int(spread_s * 1000), 1)
                    for _ in range(n)]
            target = _producer_proc
        else:
            _fill(endpoint, topic, messages)
            group = f"bench-g-{uuid.uuid4().hex[:6]}"
            args = [(endpoint, group, topic, messages // n, seconds, q, start) for _ in range(n)]
            target = _single_consumer_proc
        procs = [_MP.Process(target=target, args=a) for a in args]
        for p in procs:
            p.start()
        start.wait(seconds + 60)  # every process connected: interpreter start-up is not timed
        cpu, threads0, t0 = ServerCpu(pid), thread_run_ns(pid), time.perf_counter()
        results = [q.get(timeout=seconds + 60) for _ in procs]
        elapsed = time.perf_counter() - t0
        threads1 = thread_run_ns(pid)
        for p in procs:
            p.join()
        done, client_cpu = sum(r[0] for r in results), sum(r[1] for r in results)
        # The broker's CPU split: its event loop thread, and the rest (the fsync thread, mostly).
        split = {"loop_thread_us_per_msg": round((threads1[0] - threads0[0]) / max(done, 1) / 1e3, 1),
                 "other_threads_us_per_msg": round((threads1[1] - threads0[1]) / max(done, 1) / 1e3, 1)}
        p50_ms = round(sum(r[2] for r in results) / len(results) * 1e3, 3)
        if kind == "send":
            emit("single_delayed_send_rate", round(done / elapsed), "msgs/s", target=6200, producers=n,
                 delay_spread_s=spread_s, call_p50_ms=p50_ms, messages=done, seconds=round(elapsed, 2),
                 **cpu.per_message(done), **split,
                 client_cpu_us_per_msg=round(client_cpu / max(done, 1) * 1e6, 1))
        else:
            emit("single_receive_ack_rate", round(done / elapsed), "msgs/s", target=4900, consumers=n,
                 receive_ack_p50_ms=p50_ms, messages=done, seconds=round(elapsed, 2),
                 **cpu.per_message(done), **split, client_cpu_us_per_msg=round(client_cpu / max(done, 1) * 1e6, 1))


# ----------------------------------------------------------------------------- (e) lone sends
def _raw_append_fsync_us(directory: str, count: int) -> float:
    """p50 of writing 1 KiB at the end of a file and fsyncing it: the disk's floor for a durable send."""
    path = os.path.join(directory, "raw-append")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    body, times = os.urandom(1024), []
    try:
        for _ in range(count):
            t0 = time.perf_counter()
            os.write(fd, body)
            os.fsync(fd)
            times.append(time.perf_counter() - t0)
    finally:
        os.close(fd)
        os.unlink(path)
    times.sort()
    return times[len(times) // 2] * 1e6


def _lone_sends(endpoint: str, pid: int, count: int, seconds: float) -> dict:
    from chronoq.client.client import Client, run

    async def go() -> list[float]:
        topic, body, times = f"bench-lone-{uuid.uuid4().hex[:6]}", os.urandom(1024), []
        async with Client(endpoint, transport=_transport()) as client:
            await client.route(topic)
            for _ in range(50):  # warm up: connection, topic, caches
                await client.send(topic, body)
            cpu, threads0 = ServerCpu(pid), thread_run_ns(pid)
            deadline = time.perf_counter() + seconds
            while len(times) < count and time.perf_counter() < deadline:
                t0 = time.perf_counter()
                await client.send(topic, body)
                times.append(time.perf_counter() - t0)
            threads1, n = thread_run_ns(pid), max(len(times), 1)
            return times, {**cpu.per_message(len(times)),
                           "loop_thread_us_per_msg": round((threads1[0] - threads0[0]) / n / 1e3, 1),
                           "other_threads_us_per_msg": round((threads1[1] - threads0[1]) / n / 1e3, 1)}

    times, used = run(go())
    times.sort()
    return {"p50_ms": round(times[len(times) // 2] * 1e3, 3), "p99_ms": round(times[int(len(times) * 0.99)] * 1e3, 3),
            "messages": len(times), **used}


def phase_lone(data_dir: str, count: int, seconds: float) -> None:
    figures, raws = {}, []
    for policy in ("sync", "async"):
        # The disk's own figure beside each policy's run: on a shared machine it drifts with the
        # neighbours' I/O, and the target is against the disk as it was.
        raws.append(_raw_append_fsync_us(data_dir, 300))
        proc, endpoint = start_server(os.path.join(data_dir, f"lone-{policy}"), policy)
        try:
            figures[policy] = _lone_sends(endpoint, proc.pid, count, seconds)
        finally:
            proc.terminate()
            proc.wait(30)
    raw_us = sum(raws) / len(raws)
    for policy, f in figures.items():
        emit(f"lone_send_{policy}_p50", f["p50_ms"], "ms", policy=policy, raw_append_fsync_p50_ms=round(raw_us / 1e3, 3),
             **{k: v for k, v in f.items() if k != "p50_ms"})
    sync, asyn = figures["sync"], figures["async"]
    # The targets: a lone durable send costs at most the disk's fsync and 0.1 ms more than an
    # async one, and at most 1.2x its broker CPU (chronoq/broker/committer.py).
    emit("lone_send_sync_p50_over_target", round(sync["p50_ms"] - (asyn["p50_ms"] + raw_us / 1e3 + 0.1), 3), "ms",
         target_ms=round(asyn["p50_ms"] + raw_us / 1e3 + 0.1, 3))
    emit("lone_send_sync_cpu_ratio", round(sync["server_cpu_us_per_msg"] / max(asyn["server_cpu_us_per_msg"], 1e-9), 2),
         "x", target=1.2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--phase", choices=["a", "b", "c", "d", "e", "f", "all"], default="all")
    ap.add_argument("--delay-spread-s", type=float, default=600.0, help="(d): delivery times spread over this window")
    ap.add_argument("--lone-messages", type=int, default=3000, help="(e): sends per flush policy")
    ap.add_argument("--official-messages", type=int, default=3000)
    ap.add_argument("--messages", type=int, default=200_000)
    ap.add_argument("--single-messages", type=int, default=30_000, help="(f): messages each way")
    ap.add_argument("--producers", type=int, default=2)
    ap.add_argument("--send-batch", type=int, default=100)
    ap.add_argument("--consumers", type=int, default=2)
    ap.add_argument("--receive-batch", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=60.0, help="time bound of each phase")
    ap.add_argument("--policy", choices=["sync", "async"], default="sync")
    ap.add_argument("--rounds", type=int, default=1, help="repeat (b) and (c) this often (noisy machines)")
    ap.add_argument("--ack", choices=["combined", "separate"], default="combined",
                    help="(c): ack each batch with the next receive (ack_and_receive), or in a call of its own")
    ap.add_argument("--client-transport", choices=["h2", "grpc"], default="h2",
                    help="chronoq.client.client's transport in (b) and (c): its own HTTP/2 (default) or grpc.aio")
    ap.add_argument("--lanes", type=int, default=4,
                    help="(b), (c): requests each load process keeps in flight")
    ap.add_argument("--stream", action="store_true",
                    help="(c): RocketMQ's calls only (ReceiveMessage stream, then AckMessage), for comparison")
    args = ap.parse_args()
    _SPEED.append(python_speed())
    os.environ["BENCH_CLIENT_TRANSPORT"] = args.client_transport
    os.environ["BENCH_LANES"] = str(max(1, args.lanes))
    data_dir = tempfile.mkdtemp(prefix="bench-sr-")
    try:
        if args.phase in ("e", "all"):  # brokers of their own, idle
            phase_lone(data_dir, args.lone_messages, args.seconds)
        if args.phase == "e":
            return
        proc, endpoint = start_server(os.path.join(data_dir, "data"), args.policy)
        try:
            if args.phase in ("a", "all"):
                phase_official(endpoint, proc.pid, args.official_messages, args.seconds)
            if args.phase in ("f", "all"):
                for _ in range(args.rounds):  # a fresh topic each round
                    phase_single(endpoint, proc.pid, args.single_messages, args.producers, args.consumers,
                                 args.seconds, f"bench-single-{uuid.uuid4().hex[:6]}", args.delay_spread_s)
                if args.phase == "f":
                    return
            for _ in range(args.rounds if args.phase != "a" else 0):  # a fresh topic each round
                topic = f"bench-{uuid.uuid4().hex[:6]}"
                if args.phase in ("d", "all"):
                    phase_send(endpoint, proc.pid, args.messages, args.producers, args.send_batch, args.seconds,
                               f"{topic}-delayed", args.delay_spread_s)
                if args.phase == "d":
                    continue
                phase_send(endpoint, proc.pid, args.messages, args.producers, args.send_batch, args.seconds, topic)
                if args.phase in ("c", "all"):
                    phase_receive(endpoint, proc.pid, args.messages, args.consumers, args.receive_batch,
                                  args.seconds, topic, args.ack == "combined", args.stream)
        finally:
            proc.terminate()
            proc.wait(30)
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
