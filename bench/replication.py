"""Replication's cost and failover time (docs/replication.md; issue 22).

Starts ``chronoq serve`` on loopback three ways, one after the other in the same run: a primary
alone ("none"), a primary with a replica and ``replication = "async"``, and with ``"sync"``. In
each, chronoq.client.client sends 1 KiB messages from ``--concurrency`` tasks of one process,
batched (``--batch`` messages a call) and single (one a call), each for ``--seconds``: msgs/s,
and the ratio to "none" of the same run; batched again at each ``--saturate`` concurrency, and
each mode's throughput (its best batched rate over every concurrency tried) beside no replica's
(``replication_batched_throughput_ratio``: at one fixed concurrency a sync replica's rate is set
by its latency, the senders waiting on the replica's round while CPUs idle); the primary's and the replica's CPU per message (user +
system of all threads, /proc/PID/stat, from the phase's start until the replica has caught up
with it: on a 2-core machine the replica's CPU is taken from the primary's), and the share of
the phase's wall time the primary's loop thread ran (``replication_primary_loop_busy``, with the
whole machine's busy share): near 90% the loop is the limit; lower, with CPUs idle, the sends
wait (under sync, on the replica's reports; docs/replication.md, "What is next"). Under async load
the primary's view of the replica's lag (ClusterStatus, every 100 ms) is sampled: p50 and max
bytes. Last, failover: the async primary is killed with SIGKILL, ``chronoq promote`` is run on
the replica, and the time from the kill to the first acknowledged send and to the first message received there is measured: in
even rounds with chronoq.client.client, in odd rounds with the official Python client
(``failover_to_first_official_send``, ``..._receive``: its clients given the replica's address,
started again until they work); ``--rounds 2`` or more gives both. Then,
when etcd is installed (``/usr/bin/etcd``), automatic failover: an etcd on loopback, two nodes
given ``etcd_endpoints`` (``--lease-ttl-ms``), a batched load, ``kill -9`` of the primary, and the
time to the first send acknowledged through the official RocketMQ Python client by a producer
started at the kill (it retries until the replica promoted itself).

Prints one JSON object per line: {"metric", "value", "unit", ...context}. Every phase is bounded
in count and time. The load runs in one client process: on a 2-core machine shared with others,
compare ratios of alternating runs, not rates.

    .venv/bin/python bench/replication.py
    .venv/bin/python bench/replication.py --seconds 10 --rounds 3
    .venv/bin/python bench/replication.py --etcd-only --rounds 5
    .venv/bin/python bench/replication.py --no-failover --rounds 3   # CPU per message only
    .venv/bin/python bench/replication.py --delayed 300000 --rounds 3   # promotion with pending timers
    .venv/bin/python bench/replication.py --pairs 8   # sync's cost, adjacent phases paired
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.grpc_shell import batch_load, server_cpu_s, start_server, stop_server, thread_run_ns  # noqa: E402
from bench.machine import MachineLoad  # noqa: E402
from chronoq.client.client import Client, OutgoingMessage  # noqa: E402
from chronoq.replication.client import ReplicationClient  # noqa: E402

BODY = b"x" * 1024
MESSAGES_MAX = 2_000_000  # a bound on each phase besides its time


def emit(metric: str, value, unit: str, **ctx) -> None:
    print(json.dumps({"metric": metric, "value": value, "unit": unit, **ctx}), flush=True)


def start(data_dir: str, replication: str, replica_of: str = "", **settings: str) -> tuple[subprocess.Popen, str]:
    """``chronoq serve`` (bench.grpc_shell.start_server), configured through its environment."""
    env = dict(CHRONOQ_REPLICATION=replication, CHRONOQ_REPLICA_OF=replica_of, CHRONOQ_HTTP_PORT="off",
               **{f"CHRONOQ_{k.upper()}": v for k, v in settings.items()})
    os.environ.update(env)
    try:
        return start_server(data_dir, "sync")
    finally:
        for key in env:
            os.environ.pop(key, None)


stop = stop_server


async def load(endpoint: str, topic: str, seconds: float, concurrency: int, batch: int, lag_of: str = "") -> dict:
    lags = []
    deadline = time.monotonic() + seconds

    async def sample() -> None:
        async with ReplicationClient(lag_of) as rc:
            while time.monotonic() < deadline:
                st = await rc.status()
                lags.extend(r.lag_bytes for r in st.replicas)
                await asyncio.sleep(0.1)

    rate = await batch_load(lambda: Client(endpoint, request_timeout_s=30), topic, BODY, seconds, concurrency, batch,
                            MESSAGES_MAX, [sample()] if lag_of else [])
    return {"rate": rate, "lags": lags}


async def pulled(primary: str, timeout_s: float = 60) -> None:
    """Until the primary counts its replica in sync: a pull that reported all it holds (a loaded
    machine starts the replica slowly; under sync a send before that is refused)."""
    async with ReplicationClient(primary) as p:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            st = await p.status()
            if st.replicas and st.replicas[0].position >= st.commit_end:
                return
            await asyncio.sleep(0.05)


async def caught_up(replica: str, primary: str, timeout_s: float = 60) -> None:
    async with ReplicationClient(primary) as p, ReplicationClient(replica) as r:
        end = (await p.status()).commit_end
        deadline = time.monotonic() + timeout_s
        while (await r.status()).commit_end < end and time.monotonic() < deadline:
            await asyncio.sleep(0.05)


def official_failover(replica: str, topic: str, killed: float, out: dict) -> None:
    """The official Python client from the kill on: a producer and a simple consumer given the
    replica's address, started again (0.2 s apart) until they work, as an application restarting
    its clients would; fills ``out`` with the kill to the first acknowledged send and to the first
    message received (the topic's backlog). A client that lived across the failover would wait
    for its route refresh as well (30 s period: docs/replication.md, "Routes and failover")."""
    from rocketmq import ClientConfiguration, Credentials, FilterExpression, Message, Producer, SimpleConsumer

    def attempt(make, use):
        client = None
        try:
            client = make()
            client.startup()
            return use(client)
        except Exception:  # noqa: BLE001 - the primary is dead and the replica not promoted yet
            return None
        finally:
            if client is not None:
                try:
                    client.shutdown()
                except Exception:  # noqa: BLE001
                    pass

    def send(p):
        m = Message()
        m.topic, m.body = topic, b"after-official"
        return p.send(m)

    # The client makes some grpc.aio calls from the calling thread, and grpc asks for its loop.
    asyncio.set_event_loop(asyncio.new_event_loop())
    config = ClientConfiguration(replica, Credentials("", ""), request_timeout=3)
    deadline = killed + 120
    while "official_send" not in out and time.monotonic() < deadline:
        if attempt(lambda: Producer(config, (topic,)), send) is not None:
            out["official_send"] = time.monotonic() - killed
        else:
            time.sleep(0.2)
    while "official_receive" not in out and time.monotonic() < deadline:
        if attempt(lambda: SimpleConsumer(config, "bench-failover-official", {topic: FilterExpression("*")},
                                          await_duration=2), lambda c: c.receive(1, 30)):
            out["official_receive"] = time.monotonic() - killed
        else:
            time.sleep(0.2)


async def failover(primary_proc, replica: str, topic: str, official: bool) -> dict:
    """Kill, promote, and time the first send and receive there: with chronoq.client.client, or
    (``official``) the official Python client, whose clients try from the kill on (on a thread
    of their own). One client kind a round: the two side by side slowed each other."""
    killed = time.monotonic()
    primary_proc.send_signal(signal.SIGKILL)
    primary_proc.wait(10)
    if official:
        out: dict = {}
        watcher = threading.Thread(target=official_failover, args=(replica, topic, killed, out), daemon=True)
        watcher.start()
    promote = subprocess.run([sys.executable, "-m", "chronoq", "promote", "--endpoint", replica], cwd=ROOT,
                             capture_output=True, text=True, timeout=300)
    assert promote.returncode == 0, promote.stderr
    if official:
        await asyncio.to_thread(watcher.join, 130)
        return {"official_send": out.get("official_send"), "official_receive": out.get("official_receive")}
    first_send = first_receive = None
    deadline = time.monotonic() + 120
    while first_send is None and time.monotonic() < deadline:
        try:
            async with Client(replica, request_timeout_s=5) as client:
                await client.send_batch([OutgoingMessage(topic, b"after")])
                first_send = time.monotonic() - killed
                while first_receive is None and time.monotonic() < deadline:
                    if await client.receive("bench-failover", topic, max_messages=1, wait_s=2):
                        first_receive = time.monotonic() - killed
        except Exception:  # noqa: BLE001 - not serving yet
            await asyncio.sleep(0.05)
    return {"send": first_send, "receive": first_receive}


async def run_round(args, root: str, round_no: int) -> dict[str, float]:
    """One round: every mode's phases, then the round's ratios. Returns the throughput ratios
    (``"async"``, ``"sync"``) for the summary over rounds."""
    rates: dict[tuple[str, str], float] = {}
    modes = ("none", "async", "sync")
    for mode in modes[round_no % 3:] + modes[:round_no % 3]:  # each mode first in turn: no order bias
        base = os.path.join(root, f"{mode}-{round_no}")
        replication = "async" if mode == "none" else mode
        primary_proc, primary = start(base + "-p", replication)
        replica_proc = None
        try:
            if mode != "none":
                replica_proc, replica = start(base + "-r", replication, primary)
                await pulled(primary)  # (under sync a send before the first pull is refused: none in sync)
            phases = [("batched", args.batch, args.concurrency), ("single", 1, args.concurrency)]
            phases[1:1] = [("batched", args.batch, c) for c in args.saturate if c != args.concurrency]
            for shape, batch, concurrency in phases:
                procs = {"primary": primary_proc, "replica": replica_proc}
                cpu0 = {role: server_cpu_s(p.pid) for role, p in procs.items() if p is not None}
                loop0, machine = thread_run_ns(primary_proc.pid)[0], MachineLoad()
                began = time.monotonic()
                at_base = concurrency == args.concurrency
                out = await load(primary, f"bench-{shape}", args.seconds, concurrency, batch,
                                 lag_of=primary if mode == "async" and shape == "batched" and at_base else "")
                took = time.monotonic() - began
                sent = out["rate"] * took
                # Whether the primary's loop was the limit (busy throughout) or waited while CPUs idled
                # (on the replica's reports under sync): docs/replication.md, "What is next".
                loop_busy = (thread_run_ns(primary_proc.pid)[0] - loop0) / 1e9 / took
                busy_pct = machine.busy_pct()
                if mode != "none":  # the replica's share ends when it has applied the window's records
                    await caught_up(replica, primary)
                cpu = {role: server_cpu_s(procs[role].pid) - c for role, c in cpu0.items()}
                rates[(mode, shape, concurrency)] = out["rate"]
                ctx = {"mode": mode, "shape": shape, "batch": batch, "concurrency": concurrency,
                       "seconds": args.seconds, "round": round_no}
                emit(f"replication_send_{shape}", round(out["rate"]), "msgs/s", **ctx)
                emit("replication_primary_loop_busy", round(100 * loop_busy, 1), "%", machine_busy_pct=busy_pct, **ctx)
                for role, seconds in cpu.items():  # user + system, all threads (/proc/PID/stat)
                    emit(f"replication_{role}_cpu_per_message", round(seconds / max(sent, 1) * 1e6, 2), "us/msg",
                         messages=round(sent), **ctx)
                if out["lags"]:
                    emit("replication_lag_under_load_p50", statistics.median(out["lags"]), "bytes", **ctx)
                    emit("replication_lag_under_load_max", max(out["lags"]), "bytes", **ctx)
            if mode == "async" and not args.no_failover:
                await caught_up(replica, primary)
                times = await failover(primary_proc, replica, "bench-batched", official=round_no % 2 == 1)
                log_mb = sum(os.path.getsize(os.path.join(base + "-r", "commitlog", n))
                             for n in os.listdir(os.path.join(base + "-r", "commitlog"))) / 1e6
                for what, value in times.items():
                    emit(f"failover_to_first_{what}", None if value is None else round(value, 2), "s",
                         log_mb=round(log_mb, 1), round=round_no)
        finally:
            for proc in (replica_proc, primary_proc):
                if proc is not None:
                    stop(proc)
    c = args.concurrency
    for shape in ("batched", "single"):  # the ratios once the round's three modes ran, at --concurrency
        none = rates[("none", shape, c)]
        for mode in ("async", "sync"):
            emit(f"replication_{shape}_ratio", round(rates[(mode, shape, c)] / none, 3), "x of no replica",
                 mode=mode, shape=shape, concurrency=c, round=round_no)
        emit(f"replication_{shape}_sync_vs_async", round(rates[("sync", shape, c)] / rates[("async", shape, c)], 3),
             "x of async", shape=shape, concurrency=c, round=round_no)
    # Throughput: each mode's best batched rate over the concurrencies tried (--saturate). At a fixed
    # concurrency a replicated mode's rate is its latency's (Little's law: the senders wait on the
    # replica's round trip while CPUs idle); its throughput is what it reaches with enough in flight.
    best = {mode: max((rate, conc) for (m, shape, conc), rate in rates.items() if m == mode and shape == "batched")
            for mode in ("none", "async", "sync")}
    ratios = {}
    for mode in ("async", "sync"):
        ratios[mode] = round(best[mode][0] / best["none"][0], 3)
        emit("replication_batched_throughput_ratio", ratios[mode], "x of no replica",
             mode=mode, best_concurrency=best[mode][1], none_best_concurrency=best["none"][1],
             concurrencies=sorted({c, *args.saturate}), round=round_no)
    return ratios


def summarize(per_round: list[dict[str, float]]) -> None:
    """The throughput ratio's median over the rounds, with its range: one round's ratio swings
    widely on a shared 2-core machine (0.46-0.70 for sync in runs minutes apart), since the load's
    client, the primary and the replica share the CPUs; rounds rotate which mode runs first."""
    for mode in ("async", "sync"):
        values = [r[mode] for r in per_round]
        emit("replication_batched_throughput_ratio_median", round(statistics.median(values), 3), "x of no replica",
             mode=mode, rounds=len(values), low=min(values), high=max(values))


async def paired(args, root: str) -> None:
    """``--pairs K``: a primary alone and a primary with a sync replica, all three processes up
    at once, loaded in turn for ``--seconds`` at each ``--saturate`` concurrency (batched), K
    pairs, the order of the modes swapped every pair. Per pair: the ratio at each concurrency
    (``replication_pair_ratio``), and the throughput ratio, the sync pair's best rate over the
    concurrencies against the lone primary's best (``replication_pair_throughput_ratio``); then
    the median of each over the pairs. Why best rates: a sync send waits for its replica's
    report, so at a fixed number in flight its rate is bound by that latency while CPUs idle
    (docs/replication.md, "What is next"); with more in flight it reaches what the CPUs allow,
    and the lone primary is at its limit already. Why pairs: on a shared 2-core machine the same
    broker's CPU per message swings by half within minutes (a primary alone read 7.3 and 12.2 us
    a message in runs minutes apart), so modes measured a minute apart differ by the machine as
    much as by the mode; adjacent phases share its state. The processes idle while the other is
    loaded (a replica's long poll, timers)."""
    sweep = sorted(set(args.saturate)) or [args.concurrency]
    base = os.path.join(root, "pairs")
    procs = []
    try:
        alone_proc, alone = start(base + "-none", "async")
        procs.append(alone_proc)
        primary_proc, primary = start(base + "-p", "sync")
        procs.append(primary_proc)
        replica_proc, replica = start(base + "-r", "sync", primary)
        procs.insert(0, replica_proc)
        await pulled(primary)
        ratios: dict[int, list[float]] = {c: [] for c in sweep}
        best_ratios = []
        for pair in range(args.pairs):
            rates: dict[str, dict[int, float]] = {"none": {}, "sync": {}}
            for mode in ("none", "sync") if pair % 2 == 0 else ("sync", "none"):
                for concurrency in sweep:
                    out = await load(alone if mode == "none" else primary, "bench-pairs", args.seconds,
                                     concurrency, args.batch)
                    if mode == "sync":  # (the replica's share of the CPU ends when it has applied the phase)
                        await caught_up(replica, primary)
                    rates[mode][concurrency] = out["rate"]
            for c in sweep:
                ratios[c].append(rates["sync"][c] / rates["none"][c])
                emit("replication_pair_ratio", round(ratios[c][-1], 3), "x of no replica", mode="sync",
                     none=round(rates["none"][c]), sync=round(rates["sync"][c]), concurrency=c, batch=args.batch,
                     seconds=args.seconds, pair=pair)
            best = {mode: max(by_c.values()) for mode, by_c in rates.items()}
            best_ratios.append(best["sync"] / best["none"])
            emit("replication_pair_throughput_ratio", round(best_ratios[-1], 3), "x of no replica", mode="sync",
                 none=round(best["none"]), sync=round(best["sync"]),
                 at={mode: max(by_c, key=by_c.get) for mode, by_c in rates.items()}, concurrencies=sweep,
                 batch=args.batch, seconds=args.seconds, pair=pair)
        for c in sweep:
            emit("replication_pair_ratio_median", round(statistics.median(ratios[c]), 3), "x of no replica",
                 mode="sync", pairs=len(ratios[c]), low=round(min(ratios[c]), 3), high=round(max(ratios[c]), 3),
                 concurrency=c)
        emit("replication_pair_throughput_ratio_median", round(statistics.median(best_ratios), 3),
             "x of no replica", mode="sync", pairs=len(best_ratios), low=round(min(best_ratios), 3),
             high=round(max(best_ratios), 3), concurrencies=sweep)
    finally:
        for proc in procs:
            stop(proc)


async def delayed_failover(args, root: str, round_no: int) -> None:
    """Failover with ``--delayed`` pending delayed messages (due hours ahead) in the log: kill -9
    of the primary, ``chronoq promote``, the time to the first acknowledged send, and where the
    promoted node's time went, from its own lines: opening the broker (store recovery and the
    timer's replay from its checkpoint) up to its recovery line, and on to ready."""
    base = os.path.join(root, f"delayed-{round_no}")
    primary_proc, primary = start(base + "-p", "async")
    replica_proc = None
    try:
        replica_proc, replica = start(base + "-r", "async", primary)
        due = int(time.time() * 1000) + 3 * 3600 * 1000
        per_call = max(1, args.batch * 8)
        sent = 0

        async def fill(worker: int) -> None:
            nonlocal sent
            async with Client(primary, request_timeout_s=60) as client:
                while sent < args.delayed:
                    n = min(per_call, args.delayed - sent)
                    sent += n
                    await client.send_batch([OutgoingMessage("bench-delayed", BODY[:200], deliver_at_ms=due + i)
                                             for i in range(n)])

        began = time.monotonic()
        await asyncio.gather(*(fill(w) for w in range(4)))
        filled_s = time.monotonic() - began
        await caught_up(replica, primary, timeout_s=600)
        await asyncio.sleep(3.0)  # (a replica's timer checkpoints every timer_checkpoint_interval_ms)
        lines: list[tuple[float, str]] = []
        reader = threading.Thread(target=lambda: lines.extend((time.monotonic(), line) for line in replica_proc.stdout),
                                  daemon=True)
        reader.start()
        killed = time.monotonic()
        times = await failover(primary_proc, replica, "bench-delayed", official=False)

        def at(text: str) -> float | None:
            return next((t for t, line in lines if text in line), None)

        opening, recovered, ready = at("opening the broker"), at("recovery:"), at("chronoq is ready")
        log_mb = sum(os.path.getsize(os.path.join(base + "-r", "commitlog", n))
                     for n in os.listdir(os.path.join(base + "-r", "commitlog"))) / 1e6
        ctx = {"delayed": args.delayed, "log_mb": round(log_mb, 1), "fill_s": round(filled_s, 1), "round": round_no}
        emit("failover_delayed_to_first_send", None if times["send"] is None else round(times["send"], 2), "s", **ctx)
        if opening is not None and recovered is not None:
            emit("promotion_broker_open", round(recovered - opening, 2), "s", **ctx)
            emit("promotion_kill_to_opening", round(opening - killed, 2), "s", **ctx)
        if recovered is not None and ready is not None:
            emit("promotion_recovered_to_ready", round(ready - recovered, 2), "s", **ctx)
    finally:
        for proc in (replica_proc, primary_proc):
            if proc is not None:
                stop(proc)


ETCD = "/usr/bin/etcd"


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def etcd_failover(args, root: str, round_no: int) -> None:
    """Automatic failover through etcd: kill -9 of the primary to the first send acknowledged
    through the official Python client."""
    from rocketmq import ClientConfiguration, Credentials, Message, Producer

    base = os.path.join(root, f"etcd-{round_no}")
    port = free_port()
    url, peer = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{free_port()}"
    etcd = subprocess.Popen([ETCD, "--name", "b", "--data-dir", base + "-etcd", "--listen-client-urls", url,
                             "--advertise-client-urls", url, "--listen-peer-urls", peer,
                             "--initial-advertise-peer-urls", peer, "--initial-cluster", f"b={peer}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    procs = []
    try:
        time.sleep(1.5)  # (etcd's first election; a node that cannot reach it stops and says so)
        settings = {"etcd_endpoints": f"127.0.0.1:{port}", "lease_ttl_ms": str(args.lease_ttl_ms)}
        primary_proc, primary = start(base + "-a", "async", **settings)
        procs.append(primary_proc)
        replica_proc, replica = start(base + "-b", "async", **settings)
        procs.append(replica_proc)
        asyncio.run(load(primary, "bench-etcd", min(args.seconds, 3.0), args.concurrency, args.batch))
        asyncio.run(caught_up(replica, primary))
        time.sleep(1.5)  # the replica's next pull reports it caught up: in the in-sync set
        killed = time.monotonic()
        primary_proc.send_signal(signal.SIGKILL)
        primary_proc.wait(10)
        took, attempts = None, 0
        while took is None and time.monotonic() - killed < 60:
            attempts += 1
            producer = Producer(ClientConfiguration(replica, Credentials("", ""), request_timeout=3), ("bench-etcd",))
            try:
                producer.startup()
                message = Message()
                message.topic, message.body = "bench-etcd", b"after"
                producer.send(message)
                took = time.monotonic() - killed
            except Exception:  # noqa: BLE001 - not promoted yet
                time.sleep(0.2)
            finally:
                try:
                    producer.shutdown()
                except Exception:  # noqa: BLE001 - a producer that never started
                    pass
        emit("etcd_failover_to_first_official_send", None if took is None else round(took, 2), "s",
             lease_ttl_ms=args.lease_ttl_ms, attempts=attempts, round=round_no)
    finally:
        for proc in procs:
            stop(proc)
        etcd.terminate()
        etcd.wait(10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--saturate", type=lambda v: [int(x) for x in v.split(",") if x], default=[32, 64, 128],
                        help="batched sends again at these concurrencies (comma-separated; '' for none): "
                             "each mode's throughput is its best rate over them and --concurrency")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--lease-ttl-ms", type=int, default=2000, help="etcd failover: the lease's TTL")
    parser.add_argument("--etcd-only", action="store_true", help="only the etcd automatic failover")
    parser.add_argument("--delayed", type=int, default=0,
                        help="only a failover with this many pending delayed messages in the log")
    parser.add_argument("--pairs", type=int, default=0,
                        help="only this many pairs of batched phases, no replica then a sync one, "
                             "all processes up at once: each pair's ratio and the median")
    parser.add_argument("--no-failover", action="store_true",
                        help="only the send phases (rates, ratios, CPU per message): no failover, no etcd")
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="chronoq-bench-repl-")
    try:
        if args.pairs:
            asyncio.run(paired(args, root))
            return
        per_round = []
        for r in range(args.rounds):
            if args.delayed:
                asyncio.run(delayed_failover(args, root, r))
                continue
            if not args.etcd_only:
                per_round.append(asyncio.run(run_round(args, root, r)))
            if os.path.exists(ETCD) and not args.no_failover:
                etcd_failover(args, root, r)
        if len(per_round) > 1:
            summarize(per_round)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
