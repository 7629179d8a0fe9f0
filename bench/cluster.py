"""One broker group vs two (docs/cluster.md; issue 23): what spreading a topic costs or gives here.

Starts a real etcd on loopback (Debian's etcd-server, as the tests do) and, per round, two
clusters one after the other: "one" (a primary of group g1, the topic's 8 queues on it) and
"two" (primaries of g1 and g2, 4 queues on each: the same 8). In each, ``--concurrency`` tasks of
one client process send 1 KiB messages through ``chronoq.client.routed.RoutedSender`` (asks the
route once, then each batch to one group's primary, round robin), batched (``--batch``
messages a call) and single, for ``--seconds`` each: msgs/s and the ratio two/one of the same
round. The order alternates between rounds. On a 2-core machine both primaries share the cores
the client uses, so the ratio shows the cost of routing and of a second process, not the gain a
second machine would bring (docs/cluster.md, "Capacity").

Prints one JSON object per line: {"metric", "value", "unit", ...context}. Every phase is bounded
in count and time.

    .venv/bin/python bench/cluster.py
    .venv/bin/python bench/cluster.py --seconds 8 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.grpc_shell import batch_load, stop_server  # noqa: E402
from chronoq.client.admin import AdminClient  # noqa: E402
from chronoq.client.routed import RoutedSender  # noqa: E402
from tests.integration.conftest import free_port  # noqa: E402
from tests.integration.etcd_fixture import Etcd, etcd_available  # noqa: E402

BODY = b"x" * 1024
MESSAGES_MAX = 2_000_000  # a bound on each phase besides its time
QUEUES = 8


def emit(metric: str, value, unit: str, **ctx) -> None:
    print(json.dumps({"metric": metric, "value": value, "unit": unit, **ctx}), flush=True)


def start(directory: str, etcd: Etcd, cluster: str, group: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    config = os.path.join(directory, f"{group}.toml")
    with open(config, "w") as fh:
        fh.write(etcd.config(cluster) + f'group_name = "{group}"\n')
    proc = subprocess.Popen([sys.executable, "-m", "chronoq", "serve", "--data-dir", os.path.join(directory, group),
                             "--port", str(port), "--host", "127.0.0.1", "--http-port", "off", "--flush-policy",
                             "sync", "--log-level", "warning", "--config", config],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    deadline = time.monotonic() + 60
    for line in proc.stdout:
        if "chronoq is ready" in line:
            return proc, f"127.0.0.1:{port}"
        if time.monotonic() > deadline:
            break
    stop_server(proc)
    raise RuntimeError(f"chronoq ({cluster}/{group}) did not start")


async def create(endpoint: str, topic: str, queues: int) -> None:
    async with AdminClient(endpoint) as admin:
        await admin.create_topic(topic, queues)  # (a clustered node: on every live group)


async def load(endpoint: str, topic: str, seconds: float, concurrency: int, batch: int) -> float:
    return await batch_load(lambda: RoutedSender(endpoint, request_timeout_s=30), topic, BODY, seconds, concurrency,
                            batch, MESSAGES_MAX)


def run_mode(mode: str, etcd: Etcd, args, round_no: int) -> dict:
    directory = tempfile.mkdtemp(prefix=f"chronoq-bench-cluster-{mode}-")
    cluster = f"bench{round_no}{mode}"
    groups = ["g1"] if mode == "one" else ["g1", "g2"]
    procs = []
    try:
        for g in groups:
            procs.append(start(directory, etcd, cluster, g))
        entry = procs[0][1]
        topic = "bench-cluster"
        asyncio.run(create(entry, topic, QUEUES // len(groups)))
        time.sleep(1)  # (every primary's part made: its watch)
        rates = {}
        for kind, batch in (("batched", args.batch), ("single", 1)):
            rates[kind] = asyncio.run(load(entry, topic, args.seconds, args.concurrency, batch))
            emit(f"cluster_send_{kind}", round(rates[kind]), "msgs/s", mode=mode, groups=len(groups), round=round_no,
                 concurrency=args.concurrency, batch=batch, body_bytes=len(BODY), queues=QUEUES)
        return rates
    finally:
        for proc, _ in procs:
            stop_server(proc)
        shutil.rmtree(directory, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--batch", type=int, default=32)
    args = ap.parse_args()
    if not etcd_available():
        sys.exit("etcd is not installed: scripts/setup installs Debian's etcd-server")
    etcd_dir = tempfile.mkdtemp(prefix="chronoq-bench-etcd-")
    etcd = Etcd(etcd_dir)
    results: dict[str, dict[str, list[float]]] = {"one": {}, "two": {}}
    try:
        for r in range(args.rounds):
            for mode in (("one", "two") if r % 2 == 0 else ("two", "one")):
                for kind, rate in run_mode(mode, etcd, args, r).items():
                    results[mode].setdefault(kind, []).append(rate)
    finally:
        etcd.stop()
        shutil.rmtree(etcd_dir, ignore_errors=True)
    for kind in ("batched", "single"):
        ratios = [t / o for t, o in zip(results["two"][kind], results["one"][kind])]
        emit(f"cluster_two_over_one_{kind}", round(statistics.median(ratios), 3), "ratio",
             spread=[round(min(ratios), 3), round(max(ratios), 3)], rounds=args.rounds,
             one_median=round(statistics.median(results["one"][kind])),
             two_median=round(statistics.median(results["two"][kind])))


if __name__ == "__main__":
    main()
