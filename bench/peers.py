"""Issue 24's side-by-side: one message per call against beanstalkd and Redis, on this machine, now.

``bench/send_receive.py --phase f`` measures chronoq's one-message-per-call figures; this script
runs the same shape against other brokers built or installed on the machine, so the figures share
a day (this VM's speed swings 2x and more between days: its fsync of 1 KiB took ~90 us on 11-27
and ~190 us on 11-28). Each peer runs on loopback in its durable mode with a fresh data directory:

  beanstalkd  ``-f 0`` (fsync every write before answering); send = ``put`` with a delay,
              receive + ack = ``reserve-with-timeout 0`` + ``delete`` of ready jobs (two calls)
  redis       ``appendonly yes``, ``appendfsync always`` (every write in the AOF, fsynced, before
              the answer); send = ``ZADD`` of a unique 1 KiB member scored by its due time (the
              usual delayed-queue shape), receive + ack = ``ZRANGEBYSCORE .. LIMIT 0 1`` + ``ZREM``
              (a member another consumer removed first is not counted)

P producer and C consumer processes (default 2 each), each one call at a time over its own
connection with a hand-written protocol client (a few lines of sockets: the clients' cost stays
small beside the brokers'), 1 KiB bodies, delivery times spread evenly over the next 10 minutes.
The consumers drain messages filled beforehand, untimed. Then chronoq's own phase (f) runs on the
same machine in the same invocation (``--rounds`` alternates them all), through ``chronoq.client``.

Prints one JSON object per line: {"metric", "value", "unit", ...context}; per peer and way the
rate, the call's p50, the broker's CPU per message (all its threads, /proc) and the clients'.
Bounded in count and time.

    .venv/bin/python bench/peers.py --beanstalkd /path/to/beanstalkd --redis-server /path/to/redis-server
    .venv/bin/python bench/peers.py --beanstalkd BIN --messages 10000 --rounds 3 --no-chronoq

Neither peer is a dependency of chronoq or installed by ``scripts/setup``: build or install them
yourself (both are a plain ``make``) and name their binaries; a peer not named is skipped.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.grpc_shell import server_cpu_split_s, start_server  # noqa: E402
from bench.machine import python_speed  # noqa: E402

_MP = mp.get_context("spawn")
BODY_BYTES = 1024


def emit(metric: str, value, unit: str, **ctx) -> None:
    ctx.setdefault("load1", round(os.getloadavg()[0], 2))
    print(json.dumps({"metric": metric, "value": value, "unit": unit, **ctx}), flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _connect(port: int) -> socket.socket:
    deadline = time.monotonic() + 10
    while True:
        try:
            sock = socket.create_connection(("127.0.0.1", port), timeout=30)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return sock
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


class _Lines:
    """A socket read as lines and counted bytes (beanstalkd's and Redis's answers)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.buf = sock, b""

    def line(self) -> bytes:
        while (end := self.buf.find(b"\r\n")) < 0:
            self._more()
        line, self.buf = self.buf[:end], self.buf[end + 2:]
        return line

    def exactly(self, n: int) -> bytes:
        while len(self.buf) < n:
            self._more()
        data, self.buf = self.buf[:n], self.buf[n:]
        return data

    def _more(self) -> None:
        chunk = self.sock.recv(65536)
        if not chunk:
            raise ConnectionError("the broker closed the connection")
        self.buf += chunk


def _resp(*args: bytes) -> bytes:
    """A Redis command in RESP: an array of bulk strings."""
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        out.append(b"$%d\r\n%s\r\n" % (len(a), a))
    return b"".join(out)


def _resp_answer(rd: _Lines):
    """One RESP answer: an int, a simple string, a bulk string or an array of bulk strings."""
    head = rd.line()
    kind, rest = head[:1], head[1:]
    if kind == b":":
        return int(rest)
    if kind == b"+":
        return rest
    if kind == b"$":
        n = int(rest)
        return None if n < 0 else rd.exactly(n + 2)[:-2]
    if kind == b"*":
        return [_resp_answer(rd) for _ in range(int(rest))]
    raise RuntimeError(f"redis answered {head!r}")


# ----------------------------------------------------------------------------- the load processes
def _producer(peer: str, port: int, count: int, spread_ms: int, seconds: float, start, out) -> None:
    sock = _connect(port)
    rd, body, tag = _Lines(sock), os.urandom(BODY_BYTES), uuid.uuid4().hex[:8].encode()
    start.wait(seconds + 60)
    cpu0, times = time.process_time(), []
    deadline = time.perf_counter() + seconds
    base_ms = int(time.time() * 1000) + 60_000
    step = spread_ms / max(count, 1)
    for i in range(count):
        if time.perf_counter() > deadline:
            break
        due_ms = base_ms + int(i * step)
        t0 = time.perf_counter()
        if peer == "beanstalkd":
            delay_s = max(1, (due_ms - int(time.time() * 1000)) // 1000)
            sock.sendall(b"put 0 %d 120 %d\r\n%s\r\n" % (delay_s, BODY_BYTES, body))
            answer = rd.line()
            if not answer.startswith(b"INSERTED"):
                raise RuntimeError(f"beanstalkd answered {answer!r}")
        else:
            member = b"%s-%d-%s" % (tag, i, body[: BODY_BYTES - 20])
            sock.sendall(_resp(b"ZADD", b"delayed", b"%d" % due_ms, member))
            if _resp_answer(rd) != 1:
                raise RuntimeError("redis did not add the member")
        times.append(time.perf_counter() - t0)
    cpu = time.process_time() - cpu0
    sock.close()
    times.sort()
    out.put((len(times), cpu, times[len(times) // 2] if times else 0.0))


def _consumer(peer: str, port: int, count: int, seconds: float, start, out) -> None:
    sock = _connect(port)
    rd = _Lines(sock)
    start.wait(seconds + 60)
    cpu0, times = time.process_time(), []
    deadline = time.perf_counter() + seconds
    while len(times) < count and time.perf_counter() < deadline:
        t0 = time.perf_counter()
        if peer == "beanstalkd":
            sock.sendall(b"reserve-with-timeout 0\r\n")
            head = rd.line()
            if head.startswith(b"TIMED_OUT"):
                break  # drained
            _, job, size = head.split()
            rd.exactly(int(size) + 2)
            sock.sendall(b"delete %s\r\n" % job)
            if rd.line() != b"DELETED":
                raise RuntimeError("beanstalkd did not delete the job")
        else:
            sock.sendall(_resp(b"ZRANGEBYSCORE", b"ready", b"-inf", b"%d" % int(time.time() * 1000),
                               b"LIMIT", b"0", b"1"))
            got = _resp_answer(rd)
            if not got:
                break  # drained
            sock.sendall(_resp(b"ZREM", b"ready", got[0]))
            if _resp_answer(rd) != 1:
                continue  # the other consumer took it first: not counted
        times.append(time.perf_counter() - t0)
    cpu = time.process_time() - cpu0
    sock.close()
    times.sort()
    out.put((len(times), cpu, times[len(times) // 2] if times else 0.0))


def _fill(peer: str, port: int, count: int) -> None:
    """``count`` ready 1 KiB messages for the consumers, pipelined, untimed."""
    sock = _connect(port)
    rd, body = _Lines(sock), os.urandom(BODY_BYTES)
    for first in range(0, count, 100):
        n = min(100, count - first)
        if peer == "beanstalkd":
            sock.sendall(b"".join(b"put 0 0 120 %d\r\n%s\r\n" % (BODY_BYTES, body) for _ in range(n)))
            for _ in range(n):
                rd.line()
        else:
            sock.sendall(b"".join(_resp(b"ZADD", b"ready", b"0", b"%d-%s" % (first + i, body[: BODY_BYTES - 8]))
                                  for i in range(n)))
            for _ in range(n):
                _resp_answer(rd)
    sock.close()


# ----------------------------------------------------------------------------- the peers
def _start_peer(peer: str, binary: str, data_dir: str) -> tuple[subprocess.Popen, int]:
    port = _free_port()
    os.makedirs(data_dir, exist_ok=True)
    if peer == "beanstalkd":
        cmd = [binary, "-l", "127.0.0.1", "-p", str(port), "-b", data_dir, "-f", "0"]
    else:
        cmd = [binary, "--bind", "127.0.0.1", "--port", str(port), "--dir", data_dir, "--appendonly", "yes",
               "--appendfsync", "always", "--save", "", "--daemonize", "no", "--protected-mode", "yes"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _connect(port).close()  # ready
    return proc, port


def _run_load(target, args_of, n: int, seconds: float, pid: int) -> tuple[int, float, float, float, float]:
    """(messages, seconds, broker CPU s, clients' CPU s, mean of their call p50s) of n load
    processes started together."""
    q, start = _MP.Queue(), _MP.Barrier(n + 1)
    procs = [_MP.Process(target=target, args=(*args_of(i), seconds, start, q)) for i in range(n)]
    for p in procs:
        p.start()
    start.wait(seconds + 60)
    u0, s0 = server_cpu_split_s(pid)
    t0 = time.perf_counter()
    results = [q.get(timeout=seconds + 60) for _ in procs]
    elapsed = time.perf_counter() - t0
    u1, s1 = server_cpu_split_s(pid)
    for p in procs:
        p.join()
    done = sum(r[0] for r in results)
    p50 = sum(r[2] for r in results) / len(results)
    return done, elapsed, (u1 - u0) + (s1 - s0), sum(r[1] for r in results), p50


def run_peer(peer: str, binary: str, data_dir: str, messages: int, producers: int, consumers: int,
             seconds: float, spread_s: float, round_no: int) -> None:
    proc, port = _start_peer(peer, binary, data_dir)
    try:
        for way, n in (("send", producers), ("receive_ack", consumers)):
            if way == "send":
                target, args_of = _producer, lambda i: (peer, port, messages // n, int(spread_s * 1000))
            else:
                _fill(peer, port, messages)
                target, args_of = _consumer, lambda i: (peer, port, messages // n)
            done, elapsed, broker_cpu, client_cpu, p50 = _run_load(target, args_of, n, seconds, proc.pid)
            metric = "single_delayed_send_rate" if way == "send" else "single_receive_ack_rate"
            emit(metric, round(done / elapsed), "msgs/s", broker=peer, round=round_no,
                 processes=n, call_p50_ms=round(p50 * 1e3, 3), messages=done, seconds=round(elapsed, 2),
                 server_cpu_us_per_msg=round(broker_cpu / max(done, 1) * 1e6, 1),
                 client_cpu_us_per_msg=round(client_cpu / max(done, 1) * 1e6, 1),
                 mode="fsync every write" if peer == "beanstalkd" else "AOF appendfsync always")
    finally:
        proc.terminate()
        proc.wait(10)


def run_chronoq(data_dir: str, messages: int, producers: int, consumers: int, seconds: float,
                spread_s: float) -> None:
    """chronoq's phase (f), as ``bench/send_receive.py --phase f`` runs it (its own JSON lines)."""
    from bench import send_receive

    proc, endpoint = start_server(data_dir, "sync")
    try:
        send_receive.phase_single(endpoint, proc.pid, messages, producers, consumers, seconds,
                                  f"bench-single-{uuid.uuid4().hex[:6]}", spread_s)
    finally:
        proc.terminate()
        proc.wait(10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--beanstalkd", help="a beanstalkd binary (skipped if not given)")
    ap.add_argument("--redis-server", help="a redis-server binary (skipped if not given)")
    ap.add_argument("--no-chronoq", action="store_true", help="the peers only")
    ap.add_argument("--messages", type=int, default=20_000, help="messages each way")
    ap.add_argument("--producers", type=int, default=2)
    ap.add_argument("--consumers", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=60.0, help="time bound of each way")
    ap.add_argument("--delay-spread-s", type=float, default=600.0)
    ap.add_argument("--rounds", type=int, default=1, help="run them all this often, in turn")
    args = ap.parse_args()
    peers = [(name, binary) for name, binary in (("beanstalkd", args.beanstalkd), ("redis", args.redis_server))
             if binary]
    emit("python_speed", python_speed(), "mips")
    root = tempfile.mkdtemp(prefix="bench-peers-", dir=os.getcwd())  # the disk the broker would use
    try:
        for round_no in range(args.rounds):
            for peer, binary in peers:
                run_peer(peer, binary, os.path.join(root, f"{peer}-{round_no}"), args.messages, args.producers,
                         args.consumers, args.seconds, args.delay_spread_s, round_no)
            if not args.no_chronoq:
                run_chronoq(os.path.join(root, f"chronoq-{round_no}"), args.messages, args.producers,
                            args.consumers, args.seconds, args.delay_spread_s)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
