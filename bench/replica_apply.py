"""A replica's CPU to apply what it is shipped, in one process, without the network (issue 22).

A primary store is filled with ``--messages`` 1 KiB messages (appends of ``--batch``, over 8
queues; ``--delayed`` of them delayed, due hours ahead). Then, for each ``--pull-bytes``, a fresh
replica (a store, its timer following, a ``chronoq.replication.follower.Follower``) applies the
primary's log answer by answer as its follow loop does (``Follower.write``: append, fsync;
``Follower.dispatch``: consume queues, the timer, checkpoints), the answers built from
``Store.read_shipped`` beforehand. Printed: CPU (user + system of this process, the fastest of
``--repeat``; user and system apart in the context) per message and per answer. One thread does the work, so CPU per message moves less with a busy machine than
the served bench's (bench/replication.py); compare alternating runs all the same.

    .venv/bin/python bench/replica_apply.py
    .venv/bin/python bench/replica_apply.py --messages 50000 --pull-bytes 1200 40000 --repeat 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from chronoq.core.clock import SYSTEM_CLOCK  # noqa: E402
from chronoq.core.config import BrokerConfig  # noqa: E402
from chronoq.proto import chronoq_admin_pb2 as apb  # noqa: E402
from chronoq.replication.follower import Follower  # noqa: E402
from chronoq.store import record  # noqa: E402
from chronoq.store.store import Prepared, Store, StoreOptions  # noqa: E402
from chronoq.timer.options import TimerOptions  # noqa: E402
from chronoq.timer.service import TimerService  # noqa: E402

BODY = b"x" * 1024
QUEUES = 8


def emit(metric: str, value, unit: str, **ctx) -> None:
    print(json.dumps({"metric": metric, "value": value, "unit": unit, **ctx}), flush=True)


def fill(store: Store, messages: int, batch: int, delayed: int) -> None:
    due = int(time.time() * 1000) + 3 * 3600 * 1000
    every = messages // delayed if delayed else 0
    for first in range(0, messages, batch):
        out = []
        for i in range(first, min(messages, first + batch)):
            late = bool(every) and i % every == 0
            out.append(Prepared("bench", i % QUEUES, record.FLAG_DELAYED if late else 0, 1, due + i if late else 0,
                                f"m{i:020d}".encode(), b"", b"", b"", BODY))
        store.write(out)
        store.dispatch(store.sync())


def answers(primary: Store, pull_bytes: int) -> list:
    out, at = [], primary.log.min_offset
    while True:
        base, data = primary.read_shipped(at, pull_bytes)
        if not data:
            return out
        out.append(apb.PullResponse(segment_base=base, commit_offset=at, commit_bytes=data,
                                    primary_synced=primary.log.synced))
        at += len(data)


def apply(directory: str, resps: list) -> tuple[float, float]:
    """(user, system) CPU seconds to apply ``resps`` on a fresh replica in ``directory``."""
    store = Store(directory, StoreOptions())
    cfg = BrokerConfig(data_dir=directory)
    timer = TimerService(store, TimerOptions.from_config(cfg), SYSTEM_CLOCK, directory, following=True)
    follower = Follower(store, directory, None, "bench-replica", "127.0.0.1:1", SYSTEM_CLOCK, timer=timer)
    try:
        began, times = time.process_time(), os.times()
        for resp in resps:
            follower.write(resp)
            follower.dispatch(resp)
        cpu, ended = time.process_time() - began, os.times()
        system = ended.system - times.system  # (in clock ticks: the split is coarse, the sum is not)
        return cpu - system, system
    finally:
        timer.close()
        store.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=100_000)
    parser.add_argument("--batch", type=int, default=32, help="messages an append on the primary")
    parser.add_argument("--delayed", type=int, default=0, help="how many of the messages are delayed")
    parser.add_argument("--pull-bytes", type=int, nargs="+", default=[1200, 40_000, 1 << 20],
                        help="an answer's max_bytes (1200: one message; 40000: a batch of 32)")
    parser.add_argument("--repeat", type=int, default=3, help="replicas applied per size (the least CPU is kept)")
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="chronoq-bench-apply-")
    try:
        primary = Store(os.path.join(root, "p"), StoreOptions())
        fill(primary, args.messages, args.batch, args.delayed)
        for pull_bytes in args.pull_bytes:
            resps = answers(primary, pull_bytes)
            cpu = []
            for n in range(args.repeat):
                directory = os.path.join(root, f"r-{pull_bytes}-{n}")
                cpu.append(apply(directory, resps))
                shutil.rmtree(directory)
            user, system = min(cpu, key=sum)
            ctx = {"messages": args.messages, "delayed": args.delayed, "pull_bytes": pull_bytes,
                   "answers": len(resps), "cpu_s": [round(sum(c), 3) for c in cpu],
                   "user_s": round(user, 3), "system_s": round(system, 3)}
            emit("replica_apply_cpu_per_message", round((user + system) / args.messages * 1e6, 2), "us/msg", **ctx)
            emit("replica_apply_cpu_per_answer", round((user + system) / len(resps) * 1e6, 1), "us/answer", **ctx)
        primary.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
