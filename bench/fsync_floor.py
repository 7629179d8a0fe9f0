"""What one fsync adds to a lone request/answer, with no broker at all: the floor under
``bench/send_receive.py --phase e``.

A trivial loopback server (uvloop, one connection, one 1 KiB request at a time, an 8-byte answer)
appends each request to a file and answers it in one of three ways:

  none    answer at once (the ``async`` flush policy's shape: no fsync on the request's path)
  inline  ``os.fsync`` on the event loop thread, then answer
  thread  ring a Python flusher thread (a lock as bell), which fsyncs and reports back with
          ``call_soon_threadsafe``; answer when it has (the committer's design before
          ``chronoq.store.fsyncer``)
  fsyncer ring ``chronoq.store.fsyncer.Fsyncer``, the committer's fsync thread (compiled: it waits,
          fsyncs and reports without the GIL), through its pipes and ``loop.add_reader``
  pause   no fsync: the request waits on a 1 ms timer, then is answered (``--pause-ms``)

For each: the request's round trip (p50, p99, from a client in another process), the rate
(requests a second, all clients) and the server's CPU per request (user + system, all threads).
``--clients 2`` runs two such clients at once, each one request at a time: the shape of
``bench/send_receive.py --phase f``'s producers (issue 24), with no broker at all. ``inline`` is
then a single-threaded server that fsyncs every write before it answers (beanstalkd's way with
``-f 0``): its rate is what such a design gets from this disk and this machine today. The log's
space is fallocated before the run (since 2026-11-28; figures before that grew the file per
write). The difference between ``inline`` and ``none`` is what the fsync itself costs this process in kernel time; ``thread`` adds the hand-off. Issue 21
asks chronoq's ``sync`` send to cost at most 1.2x the CPU of its ``async`` one: this bench shows
how much of that budget the fsync alone takes on a given disk. ``pause`` shows what any wait in the
middle of a request costs this process with no disk at all: the loop thread sleeps and is woken, and
the rest of the request runs after it (on a virtual machine whose wake-ups are dear, most of what
``thread`` adds over ``none`` is there already).

Prints one JSON object per line: {"metric", "value", "unit", ...context}. Bounded in count.

    .venv/bin/python bench/fsync_floor.py                  # 3000 requests per way, 3 rounds
    .venv/bin/python bench/fsync_floor.py --requests 1000 --rounds 1
    .venv/bin/python bench/fsync_floor.py --clients 2 --ways none,inline,fsyncer
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import multiprocessing as mp
import os
import queue
import resource
import shutil
import socket
import tempfile
import threading
import time

import uvloop

from chronoq.store.fsyncer import Fsyncer

WAYS = ("none", "inline", "thread", "fsyncer", "pause")
ANSWER = b"ok......"
REQUEST_BYTES = 1024


def _client(port: int, count: int, go, out) -> None:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    go.wait(30)  # the server starts its CPU count first
    body, times = os.urandom(REQUEST_BYTES), []
    for _ in range(count):
        start = time.perf_counter()
        sock.sendall(body)
        got = 0
        while got < len(ANSWER):
            got += len(sock.recv(64))
        times.append(time.perf_counter() - start)
    sock.close()
    times.sort()
    out.put(times)


async def _serve(way: str, count: int, data_dir: str, pause_s: float, clients: int) -> dict:
    fd = os.open(os.path.join(data_dir, f"log-{way}"), os.O_RDWR | os.O_CREAT | os.O_TRUNC)
    # The whole run's space made first, as the commit log makes its own (fallocate, 32 MiB ahead): a
    # file grown by each write costs each fsync a metadata update too (~300 against ~190 us here).
    os.posix_fallocate(fd, 0, count * clients * REQUEST_BYTES)
    os.fsync(fd)
    loop = asyncio.get_running_loop()
    # One bell ring per waiting request for the Python flusher (a semaphore: several clients may
    # ring before it wakes); reports come back in the order the requests rang.
    bell, waiting, end = threading.Semaphore(0), collections.deque(), [0]
    stop = False

    def flusher() -> None:
        while True:
            bell.acquire()
            if stop:
                return
            os.fsync(fd)
            loop.call_soon_threadsafe(done)

    def done() -> None:
        waiting.popleft().set_result(None)

    thread = threading.Thread(target=flusher, daemon=True)
    thread.start()
    fsyncer = Fsyncer(lambda: None)
    fsyncer.start()

    def reported() -> None:
        for _report in fsyncer.take():
            waiting.popleft().set_result(None)

    loop.add_reader(fsyncer.reports, reported)

    async def handle(reader, writer) -> None:
        try:
            while True:
                data = await reader.readexactly(REQUEST_BYTES)
                os.pwrite(fd, data, end[0])
                end[0] += len(data)
                if way == "thread":
                    fut = loop.create_future()
                    waiting.append(fut)
                    bell.release()
                    await fut
                elif way == "fsyncer":
                    fut = loop.create_future()
                    waiting.append(fut)
                    fsyncer.ring(fd, end[0])
                    await fut
                elif way == "inline":
                    os.fsync(fd)
                elif way == "pause":
                    await asyncio.sleep(pause_s)
                writer.write(ANSWER)
        except asyncio.IncompleteReadError:  # the client is done
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    ctx = mp.get_context("spawn")
    out, go = ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=_client, args=(port, count, go, out)) for _ in range(clients)]
    for proc in procs:
        proc.start()
    await asyncio.sleep(0.5 * clients)  # the clients' interpreter start-up is not timed
    before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    go.set()
    # Each client's times are taken as they come: a client cannot exit before its queue is read.
    runs = []
    while len(runs) < clients:
        try:
            runs.append(out.get_nowait())
        except queue.Empty:
            await asyncio.sleep(0.005)
    elapsed, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF)
    for proc in procs:
        proc.join(10)
    times = sorted(t for run in runs for t in run)
    p50, p99 = times[len(times) // 2] * 1e3, times[int(len(times) * 0.99)] * 1e3
    server.close()
    stop = True
    bell.release()
    thread.join()
    loop.remove_reader(fsyncer.reports)
    fsyncer.close()
    os.close(fd)
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    system, total = after.ru_stime - before.ru_stime, count * clients
    return {"p50_ms": p50, "p99_ms": p99, "rate_per_s": total / elapsed, "cpu_us": cpu / total * 1e6,
            "sys_us": system / total * 1e6}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--clients", type=int, default=1, help="client processes at once, each one request at a time")
    ap.add_argument("--ways", default=",".join(WAYS), help=f"which of {','.join(WAYS)}, comma-separated")
    ap.add_argument("--dir", default=None, help="where the log files go (default: a temp dir here)")
    ap.add_argument("--pause-ms", type=float, default=1.0,
                    help="(pause): the wait, about one fsync here (the loop's timers count whole ms)")
    args = ap.parse_args()
    ways = [w for w in args.ways.split(",") if w]
    unknown = sorted(set(ways) - set(WAYS))
    if unknown or args.clients < 1:
        ap.error(f"unknown ways {unknown}" if unknown else "--clients must be at least 1")
    data_dir = tempfile.mkdtemp(prefix="fsync-floor-", dir=args.dir or os.getcwd())
    try:
        for round_no in range(args.rounds):
            for way in ways:
                f = uvloop.run(_serve(way, args.requests, data_dir, args.pause_ms / 1000, args.clients))
                for key, name, unit in (("p50_ms", "p50", "ms"), ("p99_ms", "p99", "ms"),
                                        ("rate_per_s", "rate", "requests/s"), ("cpu_us", "cpu", "us"),
                                        ("sys_us", "sys", "us")):
                    print(json.dumps({"metric": f"fsync_floor_{way}_{name}",
                                      "value": round(f[key], 3), "unit": unit, "way": way, "round": round_no,
                                      "requests": args.requests, "clients": args.clients, "per": "request"}),
                          flush=True)
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
