"""What an fsync costs by how the file's space was made: the commit log's next storage lever.

Each way writes ``--count`` chunks of ``--chunk`` bytes one after another into a fresh file in
``--dir`` (the data directory's file system), and fsyncs (or fdatasyncs) after each, as a log
does after each group commit. The file's space is made before the first write in one of three
ways:

  append    none: every write grows the file
  falloc    ``posix_fallocate`` of the whole run (the commit log's way today, 32 MiB ahead:
            ``chronoq.store.commitlog.PREALLOCATE_BYTES``). ext4 marks such blocks unwritten, so
            the first write into each block changes the extent tree: the fsync commits a journal
            transaction too
  zeroed    zeros written and fsynced beforehand (what RocketMQ's pre-allocated, warmed mapped
            files amount to): a later write overwrites blocks already allocated and written, so
            the fsync flushes data only

``--parallel 2`` runs two such writers at once on the same disk: a primary and its replica on
one machine, as bench/replication.py has them (issue 22).

Measured on this project's 2-core VM (ext4 on virtio, 2026-11-27): 110 KB per fsync (a replica's
pull answer under sync load), falloc 174 us p50, zeroed 100 us; two writers at once, 242 against
146 us. At 1 KiB per fsync (one message per call) the p50 is the same (~90 us) and the p90
lower zeroed (100 against 136-152 us): only the first write into each 4 KiB block converts it.

The zeroed way here zeroes the whole file before the timed writes. Zeroing ahead *while* a
writer goes on (a thread a few MiB ahead of it) was tried too, and kept nothing at a sustained
110 KB per fsync: docs/storage.md, "Write path", has the figures.

Prints one JSON object per line: {"metric", "value", "unit", ...context}. Bounded in count.

    .venv/bin/python bench/fsync_layout.py                     # 110,000-byte chunks, 1000 each way
    .venv/bin/python bench/fsync_layout.py --chunk 1024 --parallel 2
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import tempfile
import time

WAYS = ("append", "falloc", "zeroed")
ZERO_STEP = 1 << 20


def _writer(path: str, way: str, chunk: int, count: int, sync_name: str, go, out) -> None:
    body = os.urandom(chunk)
    size = chunk * count
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        if way == "falloc":
            os.posix_fallocate(fd, 0, size)
        elif way == "zeroed":
            zeros = bytes(ZERO_STEP)
            for off in range(0, size, ZERO_STEP):
                os.pwrite(fd, zeros[:min(ZERO_STEP, size - off)], off)
        os.fsync(fd)
        sync = getattr(os, sync_name)
        go.wait(60)
        times = []
        for i in range(count):
            os.pwrite(fd, body, i * chunk)
            began = time.perf_counter_ns()
            sync(fd)
            times.append(time.perf_counter_ns() - began)
        out.put(times)
    finally:
        os.close(fd)
        os.unlink(path)


def run(way: str, args) -> list[int]:
    ctx = mp.get_context("spawn")
    go, out = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_writer, args=(os.path.join(args.dir, f"{way}-{i}"), way, args.chunk, args.count,
                                               args.sync, go, out)) for i in range(args.parallel)]
    for p in procs:
        p.start()
    time.sleep(0.5)  # each has made its file's space before the timed writes start together
    go.set()
    times = []
    for _ in procs:
        times.extend(out.get(timeout=300))
    for p in procs:
        p.join(60)
    return sorted(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chunk", type=int, default=110_000, help="bytes written before each fsync")
    ap.add_argument("--count", type=int, default=1000, help="writes (and fsyncs) per writer")
    ap.add_argument("--parallel", type=int, default=1, choices=(1, 2, 3, 4), help="writers at once")
    ap.add_argument("--sync", choices=("fsync", "fdatasync"), default="fsync")
    ap.add_argument("--dir", default=None, help="where the files go (default: a temporary directory here)")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir or os.getcwd(), prefix="fsync-layout-") as tmp:
        args.dir = tmp
        for round_no in range(args.rounds):
            for way in WAYS:
                times = run(way, args)
                n = len(times)
                ctx = {"way": way, "chunk": args.chunk, "parallel": args.parallel, "sync": args.sync,
                       "count": n, "round": round_no}
                for name, value in (("p50", times[n // 2]), ("p90", times[n * 9 // 10]), ("mean", sum(times) // n)):
                    print(json.dumps({"metric": f"fsync_{name}", "value": round(value / 1000, 1), "unit": "us",
                                      **ctx}), flush=True)


if __name__ == "__main__":
    main()
