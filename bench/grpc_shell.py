"""Server CPU per message through the gRPC shell: SendMessage, then ReceiveMessage + AckMessage.

Starts ``chronoq serve`` as a subprocess on loopback, drives it with raw async gRPC stubs shaped
like the official clients (one message per SendMessage, one entry per AckMessage, receives of up
to 32; ``--batch N`` sends N messages per SendMessage and acks whole receives at once, as
``chronoq.client.client`` can), and reads the server's CPU time (user + system, from /proc) before and after each phase.
Prints one JSON object per line: {"metric", "value", "unit", ...context}.

    .venv/bin/python bench/grpc_shell.py                       # 20k messages of 1 KiB, 64 in flight
    .venv/bin/python bench/grpc_shell.py --batch 32                            # batched RPCs
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid

import grpc
from rocketmq.grpc_protocol import definition_pb2 as pb
from rocketmq.grpc_protocol import service_pb2 as sv
from rocketmq.grpc_protocol import service_pb2_grpc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
META = (("x-mq-client-id", "bench@1@1@x"),)


def server_cpu_s(pid: int) -> float:
    return sum(server_cpu_split_s(pid))


def _stat_fields(pid: int) -> list[str]:
    """/proc/PID/stat after "(comm)": proc(5)'s field 3 is [0]."""
    with open(f"/proc/{pid}/stat") as fh:
        return fh.read().rsplit(")", 1)[1].split()


def server_cpu_split_s(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of process ``pid`` so far, all its threads (/proc)."""
    fields = _stat_fields(pid)
    ticks = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / ticks, int(fields[12]) / ticks  # utime, stime


def thread_run_ns(pid: int) -> tuple[int, int]:
    """(the loop thread's, every other thread's) run time so far, ns (/proc/PID/task/*/schedstat):
    a broker's loop thread is its main thread, so its share of a run's wall time says whether the
    loop was the limit (busy throughout) or waited (on fsyncs, on a replica's reports)."""
    loop_ns = other_ns = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as fh:
                ran = int(fh.read().split()[0])
        except (FileNotFoundError, ProcessLookupError):  # a thread that ended meanwhile
            continue
        if int(tid) == pid:
            loop_ns += ran
        else:
            other_ns += ran
    return loop_ns, other_ns


def server_nice(pid: int) -> int:
    """The broker's nice value (its main thread's; ``priority_boost`` lowers it when allowed)."""
    return int(_stat_fields(pid)[16])


async def batch_load(open_sender, topic: str, body: bytes, seconds: float, concurrency: int, batch: int,
                     limit: int, beside=()) -> float:
    """``concurrency`` senders (each ``open_sender()``: an async context manager with ``send_batch``,
    as ``chronoq.client``'s Client and RoutedSender) send batches of ``batch`` messages until
    ``seconds`` pass or ``limit`` messages went, ``beside`` (coroutines) running meanwhile; msgs/s."""
    from chronoq.client.client import OutgoingMessage

    sent = 0
    deadline = time.monotonic() + seconds

    async def worker() -> None:
        nonlocal sent
        async with open_sender() as sender:
            while time.monotonic() < deadline and sent < limit:
                await sender.send_batch([OutgoingMessage(topic, body) for _ in range(batch)])
                sent += batch

    began = time.monotonic()
    await asyncio.gather(*(worker() for _ in range(concurrency)), *beside)
    return sent / (time.monotonic() - began)


def stop_server(proc: subprocess.Popen, wait_s: float = 30.0) -> None:
    """SIGTERM, wait ``wait_s``, then SIGKILL: a broker a bench started stops by itself."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def start_server(data_dir: str, policy: str) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    launcher = os.environ.get("BENCH_SERVER_LAUNCHER")  # e.g. a profiling wrapper script
    command = [launcher] if launcher else ["-m", "chronoq"]
    proc = subprocess.Popen([sys.executable, *command, "serve", "--data-dir", data_dir, "--port", str(port),
                             "--host", "127.0.0.1", "--http-port", "0", "--flush-policy", policy,
                             "--log-level", "warning"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    deadline = time.monotonic() + 30
    for line in proc.stdout:
        if "chronoq is ready" in line:
            break
        if time.monotonic() > deadline:
            raise RuntimeError("server did not start")
    return proc, f"127.0.0.1:{port}"


def send_request(topic: str, body: bytes, batch: int = 1) -> sv.SendMessageRequest:
    messages = []
    for _ in range(batch):
        sp = pb.SystemProperties(message_id="01" + uuid.uuid4().hex[:32].upper(), message_type=pb.NORMAL,
                                 body_encoding=pb.IDENTITY, tag="bench", born_host="127.0.0.1")
        sp.born_timestamp.seconds = int(time.time())
        messages.append(pb.Message(topic=pb.Resource(name=topic), body=body, system_properties=sp))
    return sv.SendMessageRequest(messages=messages)


async def send_phase(stub, topic: str, body: bytes, messages: int, concurrency: int, batch: int = 1) -> int:
    sent = 0

    async def worker(n: int) -> None:
        nonlocal sent
        for _ in range(n):
            res = await stub.SendMessage(send_request(topic, body, batch), metadata=META, timeout=10)
            assert res.status.code == pb.OK, res.status
            sent += batch

    share = max(1, messages // (concurrency * batch))
    await asyncio.gather(*(worker(share) for _ in range(concurrency)))
    return sent


async def receive_phase(stub, topic: str, group: str, messages: int, concurrency: int, ack_batch: bool) -> int:
    done = 0

    async def worker() -> None:
        nonlocal done
        while done < messages:
            req = sv.ReceiveMessageRequest(group=pb.Resource(name=group),
                                           message_queue=pb.MessageQueue(topic=pb.Resource(name=topic)),
                                           filter_expression=pb.FilterExpression(type=pb.TAG, expression="*"),
                                           batch_size=32, auto_renew=False)
            req.invisible_duration.seconds = 60
            req.long_polling_timeout.seconds = 1
            got = []
            async for res in stub.ReceiveMessage(req, metadata=META, timeout=5):
                if res.WhichOneof("content") == "message":
                    got.append(res.message)
            if not got:
                if done >= messages:
                    return
                continue
            entries = [sv.AckMessageEntry(message_id=m.system_properties.message_id,
                                          receipt_handle=m.system_properties.receipt_handle) for m in got]
            for chunk in ([entries] if ack_batch else [[e] for e in entries]):
                res = await stub.AckMessage(sv.AckMessageRequest(
                    group=pb.Resource(name=group), topic=pb.Resource(name=topic), entries=chunk),
                    metadata=META, timeout=10)
                assert res.status.code == pb.OK, res.status
                done += len(chunk)

    await asyncio.gather(*(worker() for _ in range(max(1, concurrency // 8))))
    return done


async def heartbeat_phase(stub, rpcs: int, concurrency: int) -> int:
    """Trivial unary RPCs: the per-call cost of grpcio's asyncio server, for comparison."""
    req = sv.HeartbeatRequest(client_type=pb.PRODUCER)

    async def worker(n: int) -> None:
        for _ in range(n):
            await stub.Heartbeat(req, metadata=META, timeout=10)

    share = max(1, rpcs // concurrency)
    await asyncio.gather(*(worker(share) for _ in range(concurrency)))
    return share * concurrency


async def run(args) -> None:
    data_dir = tempfile.mkdtemp(prefix="grpc-shell-", dir=args.dir)
    proc, endpoint = start_server(data_dir, args.policy)
    try:
        async with grpc.aio.insecure_channel(endpoint) as channel:
            stub = service_pb2_grpc.MessagingServiceStub(channel)
            topic, group = "bench", "bench-group"
            body = os.urandom(args.body_bytes)
            await send_phase(stub, topic, body, 200, 8)  # warm up (routes, caches)
            cpu0, t0 = server_cpu_s(proc.pid), time.perf_counter()
            calls = await heartbeat_phase(stub, min(args.messages, 10_000), args.concurrency)
            cpu1, t1 = server_cpu_s(proc.pid), time.perf_counter()
            emit("heartbeat_server_cpu_per_rpc", (cpu1 - cpu0) / calls * 1e6, "us", args, rpcs=calls,
                 rate_per_s=round(calls / (t1 - t0)))
            cpu0, t0 = server_cpu_s(proc.pid), time.perf_counter()
            sent = await send_phase(stub, topic, body, args.messages, args.concurrency, args.batch)
            cpu1, t1 = server_cpu_s(proc.pid), time.perf_counter()
            emit("send_server_cpu_per_message", (cpu1 - cpu0) / sent * 1e6, "us", args, messages=sent,
                 wall_s=round(t1 - t0, 3), rate_per_s=round(sent / (t1 - t0)))
            got = await receive_phase(stub, topic, group, sent + 200, args.concurrency, args.batch > 1)
            cpu2, t2 = server_cpu_s(proc.pid), time.perf_counter()
            emit("receive_ack_server_cpu_per_message", (cpu2 - cpu1) / got * 1e6, "us", args, messages=got,
                 wall_s=round(t2 - t1, 3), rate_per_s=round(got / (t2 - t1)))
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
        shutil.rmtree(data_dir, ignore_errors=True)


def emit(metric: str, value: float, unit: str, args, **context) -> None:
    print(json.dumps({"metric": metric, "value": round(value, 1), "unit": unit, "policy": args.policy,
                      "body_bytes": args.body_bytes, "concurrency": args.concurrency,
                      "messages_per_rpc": args.batch, **context}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--messages", type=int, default=20_000)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--body-bytes", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=1,
                    help="messages per SendMessage and entries per AckMessage (official clients: 1)")
    ap.add_argument("--policy", choices=("sync", "async"), default="sync")
    ap.add_argument("--dir", default=None, help="where the temporary data directory goes")
    asyncio.run(run(ap.parse_args()))


if __name__ == "__main__":
    main()
