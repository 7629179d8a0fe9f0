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

--callgrind counts instructions instead of timing (the machine is shared: wall and CPU time are
noise, instruction counts are not). It runs this script under ``valgrind --tool=callgrind``
(``--policy sync --mode inline`` on a ``FakeClock``: no clock read decides anything, so the work is
the same every run) with --messages N and 2N, plain and --delayed, and prints the instructions per
message of each (the difference of the two runs over N: start-up and close cancel out) and the
delayed extra over plain; with --ids every message has a client id (the dedupe window's work).
``--functions K`` adds the K C functions (Cython-compiled codecs by their Python names) with the
most delayed extra per message, from ``callgrind_annotate`` (``--inclusive``: with their callees).
    .venv/bin/python bench/append.py --callgrind --messages 10000 --functions 30
    .venv/bin/python bench/append.py --callgrind --ids --batch 32 --messages 4000
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from chronoq.broker.broker import Broker, OutgoingMessage  # noqa: E402
from chronoq.core.clock import FakeClock  # noqa: E402
from chronoq.core.config import BrokerConfig  # noqa: E402
from chronoq.core.msgid import new_message_id  # noqa: E402


def batches(body: bytes, batch: int, ids: bool, spread_ms: int = 0, clock=None):
    """What each send sends: the same messages, or (``ids``) fresh ones with new client ids, or
    (``spread_ms``) delayed ones, due a minute on and spread over the next ``spread_ms``."""
    same = [OutgoingMessage("bench", body, tag="t") for _ in range(batch)]
    sent = 0
    while True:
        now = clock.wall_ms() if clock is not None else int(time.time() * 1000)
        if spread_ms:  # due times scattered over the window (a multiplicative walk, not in order)
            first, sent = sent, sent + batch
            yield [OutgoingMessage("bench-delayed", body, tag="t", deliver_at_ms=now + 60_000 + (k * 7919) % spread_ms,
                                   message_id=new_message_id(now) if ids else None)
                   for k in range(first, first + batch)]
        elif ids:
            yield [OutgoingMessage("bench", body, tag="t", message_id=new_message_id(now)) for _ in range(batch)]
        elif clock is not None:  # built anew as the delayed ones are: the delayed extra is the broker's alone
            yield [OutgoingMessage("bench", body, tag="t") for _ in range(batch)]
        else:
            yield same


def run(policy: str, batch: int, messages: int, seconds: float, body_bytes: int, queues: int, directory: str,
        ids: bool = False, spread_ms: int = 0, fake_clock: bool = False) -> None:
    data_dir = tempfile.mkdtemp(prefix=f"append-{policy}-", dir=directory)
    cfg = BrokerConfig(data_dir=data_dir, flush_policy=policy, default_queues=queues)
    clock = FakeClock() if fake_clock else None
    broker = Broker(cfg, clock=clock)
    body = bytes(range(256)) * (body_bytes // 256) + bytes(body_bytes % 256) if fake_clock else os.urandom(body_bytes)
    source = batches(body, batch, ids, spread_ms, clock)
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


def _instructions(out_file: str) -> int:
    """The total instruction count of a callgrind output file."""
    with open(out_file, encoding="utf-8", errors="replace") as fh:
        for line in fh:
            if line.startswith(("summary:", "totals:")):
                return int(line.split()[1])
    raise ValueError(f"{out_file}: no totals line")


_ANNOTATE_LINE = re.compile(r"^\s*([\d,]+)\s+(?:\([^)]*\)\s+)?(.+?)\s*$")


def _functions(out_file: str, inclusive: bool) -> dict[str, int]:
    """{function: self (or inclusive) instructions} of a callgrind output file (``callgrind_annotate``)."""
    text = subprocess.run(["callgrind_annotate", "--threshold=100", f"--inclusive={'yes' if inclusive else 'no'}",
                           "--auto=no", out_file],
                          check=True, capture_output=True, text=True).stdout
    out: dict[str, int] = {}
    body = False
    for line in text.splitlines():
        if "file:function" in line:
            body = True
            continue
        m = _ANNOTATE_LINE.match(line) if body else None
        if m:
            name = m.group(2).split(":", 1)[-1] if ":" in m.group(2) else m.group(2)
            name = re.sub(r" \[[^\]]*\]$", "", name)
            cost = int(m.group(1).replace(",", ""))
            out[name] = max(out.get(name, 0), cost) if inclusive else out.get(name, 0) + cost
    return out


def run_callgrind(batch: int, messages: int, body_bytes: int, queues: int, directory: str, functions: int,
                  inclusive: bool, keep: str | None, ids: bool = False) -> None:
    """The --callgrind driver (module docstring): 4 runs of this script under callgrind."""
    if shutil.which("valgrind") is None:
        raise SystemExit("--callgrind needs valgrind (apt-get install valgrind)")
    out_dir = keep or tempfile.mkdtemp(prefix="append-callgrind-", dir=directory)
    os.makedirs(out_dir, exist_ok=True)
    totals: dict[tuple[bool, int], int] = {}
    files: dict[tuple[bool, int], str] = {}
    for delayed in (False, True):
        for n in (messages, 2 * messages):
            out_file = os.path.join(out_dir, f"callgrind.{'delayed' if delayed else 'plain'}.{n}")
            cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out_file}", sys.executable,
                   os.path.abspath(__file__), "--fake-clock", "--policy", "sync", "--mode", "inline", "--batch",
                   str(batch), "--messages", str(n), "--seconds", "3600", "--body-bytes", str(body_bytes),
                   "--queues", str(queues), "--dir", directory] + (["--delayed"] if delayed else []) \
                + (["--ids"] if ids else [])
            subprocess.run(cmd, check=True, env={**os.environ, "PYTHONHASHSEED": "0"},
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            totals[delayed, n], files[delayed, n] = _instructions(out_file), out_file
    per = {d: (totals[d, 2 * messages] - totals[d, messages]) / messages for d in (False, True)}
    ctx = {"policy": "sync", "mode": "inline", "batch": batch, "body_bytes": body_bytes, "messages": messages,
           "ids": ids, "method": f"callgrind, runs of {messages} and {2 * messages} messages, difference / {messages}"}
    for d in (False, True):
        print(json.dumps({"metric": "append_instructions_per_msg", "value": round(per[d]), "unit": "instructions",
                          "delayed": d, **ctx}), flush=True)
    print(json.dumps({"metric": "delayed_extra_instructions_per_msg", "value": round(per[True] - per[False]),
                      "unit": "instructions", **ctx}), flush=True)
    if functions:
        costs = {k: _functions(f, inclusive) for k, f in files.items()}
        names = set().union(*costs.values())

        def extra(name: str) -> float:
            def grow(d: bool) -> int:
                return costs[d, 2 * messages].get(name, 0) - costs[d, messages].get(name, 0)
            return (grow(True) - grow(False)) / messages

        ranked = sorted(names, key=lambda name: -abs(extra(name)))[:functions]
        for name in ranked:
            print(json.dumps({"metric": "delayed_extra_instructions_per_msg_by_function", "function": name,
                              "inclusive": inclusive, "value": round(extra(name), 1), "unit": "instructions", **ctx}),
                  flush=True)
    if keep is None:
        shutil.rmtree(out_dir, ignore_errors=True)


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
    ap.add_argument("--mode", choices=["inline", "group_commit", "both"], default="both",
                    help="under --policy sync: one batch at a time, the committer's group commit, or both")
    ap.add_argument("--fake-clock", action="store_true",
                    help="a FakeClock and a fixed body: the same work every run (what --callgrind runs)")
    ap.add_argument("--callgrind", action="store_true",
                    help="instructions per message under callgrind, plain and delayed (module docstring)")
    ap.add_argument("--functions", type=int, default=0, help="with --callgrind: the top K functions of the extra")
    ap.add_argument("--inclusive", action="store_true",
                    help="with --functions: costs including callees (meaningful for C and Cython functions, "
                         "not for the interpreter's recursive frames)")
    ap.add_argument("--keep", default=None, help="with --callgrind: keep the callgrind files in this directory")
    args = ap.parse_args()
    if args.callgrind:
        run_callgrind((args.batch or [100])[0], args.messages, args.body_bytes, args.queues,
                      args.dir or tempfile.gettempdir(), args.functions, args.inclusive, args.keep, args.ids)
        return
    policies = ["sync", "async"] if args.policy == "both" else [args.policy]
    spread_ms = 600_000 if args.delayed else 0
    for policy in policies:
        for batch in args.batch or [100, 1000]:
            if policy == "async" or args.mode != "group_commit":
                run(policy, batch, args.messages, args.seconds, args.body_bytes, args.queues,
                    args.dir or tempfile.gettempdir(), args.ids, spread_ms, args.fake_clock)
            if policy == "sync" and args.mode != "inline":
                run_group_commit(batch, args.messages, args.seconds, args.body_bytes, args.queues,
                                 args.dir or tempfile.gettempdir(), args.senders, args.ids, spread_ms)


if __name__ == "__main__":
    main()
