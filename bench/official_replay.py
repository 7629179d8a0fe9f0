"""The official Python client's calls, recorded once and replayed into the broker in process.

Issue 3's figure (a) (server CPU per message through rocketmq-python-client) is read from /proc
while the client talks to a live broker: it counts every wake-up of a mostly idle process, and on
a shared VM it moves by 2x between runs. This benchmark takes the client and the network out:

1. record: starts ``chronoq serve`` behind a loopback proxy (the broker advertises the proxy, so
   every call goes through it), runs the official client (N sends with ``send_async``, then
   ``SimpleConsumer`` receives of 32 with one ack per message, as ``bench/send_receive.py --phase
   a`` does) and keeps the bytes the client sent, connection by connection;
2. replay: opens a broker in this process on a fresh data directory, feeds those bytes to the
   gRPC server's HTTP/2 connections one call at a time, runs the event loop until the answers
   are out, and measures this process's CPU time (getrusage) per call for each phase.

The replay is deterministic: a fresh broker hands out the same queue offsets and receipt handles
as the recording broker did, so every recorded ack settles its message (the run checks it and
says so). What it measures is the broker's own work per call: HTTP/2 and HPACK, the call
machinery, the handler, the store (page cache; fsyncs run in their thread). It does not count
socket reads and writes or the wake-ups between calls (``bench/send_receive.py --phase a`` does).
Each line says how many fsyncs the replay's group commits made (the default ``sync`` policy).

    .venv/bin/python bench/official_replay.py                      # 5,000 messages, 3 replays
    .venv/bin/python bench/official_replay.py --messages 10000 --replays 5
    .venv/bin/python bench/official_replay.py --keep /tmp/calls.pickle     # keep the recording
    .venv/bin/python bench/official_replay.py --recording /tmp/calls.pickle  # replay it again
    CHRONOQ_FLUSH_POLICY=async .venv/bin/python bench/official_replay.py   # the replay's policy (sync)

``--callgrind`` counts instructions instead of CPU time (the machine is shared: CPU time moves by
tens of percent between runs, instruction counts by well under one). It replays the recording
under ``valgrind --tool=callgrind`` cut at each phase's first and last chunk (``--chunks K``
replays the first K chunks, then waits for their calls to end), and prints each phase's
instructions per call: the difference of the runs cut at its two ends over its calls (start-up,
the other phases and the close cancel out). ``--functions K`` adds each phase's K C functions
(Cython-compiled modules by their Python names) with the most inclusive instructions per call.
Group commits are timed (what one fsync covers varies), so counts move by a few percent between
runs (up to 5% in the send phase): quote medians of several runs.
    .venv/bin/python bench/official_replay.py --callgrind --recording /tmp/calls.pickle --functions 40

``--lone`` records issue 24's shape instead (``bench/send_receive.py --phase f``'s producers):
chronoq's own client (``chronoq.client.client``, its HTTP/2 transport) sending one delayed 1 KiB
message per call, one call at a time, due an hour on (spread over 10 minutes: a replay within the
hour takes the timer's path, as the recording did). Its phase is ``lone_send``, and the replay
feeds each of its calls only once the last one's answer is out, so every send has a group commit
(and an fsync) of its own, as a lone producer's does. Then, as (f)'s consumers do, the same number
of plain messages is sent in batches (untimed) and taken one call at a time: a receive of one
message (phase ``lone_receive``, chronoq's ReceiveBatch) and its ack (``lone_ack``).
    .venv/bin/python bench/official_replay.py --lone --messages 2000 --replays 1 --keep /tmp/lone.pickle
    .venv/bin/python bench/official_replay.py --callgrind --recording /tmp/lone.pickle

Prints one JSON object per line: {"metric", "value", "unit", ...context}; each replay's figure
and then the best of them (the least disturbed by the machine) per phase.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import pickle
import resource
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.machine import python_speed  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PREFACE_BYTES = 24                 # "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
FRAME_HEAD = struct.Struct(">BHBBI")  # length (24 bits as 8 + 16), type, flags, stream id
HEADERS = 1
TIME_LIMIT_S = 300                 # recording and each replay stop by themselves after this
TOPIC, GROUP = "replay-t", "replay-g"
LONE_DUE_IN_MS = 3_600_000         # --lone: due an hour on at the earliest (none fires in a replay)
LONE_SPREAD_MS = 600_000           # over 10 minutes, as bench/send_receive.py --phase f spreads them


def emit(metric: str, value, unit: str, **ctx) -> None:
    print(json.dumps({"metric": metric, "value": value, "unit": unit, "cpus": os.cpu_count(), **ctx}), flush=True)


# ---------------------------------------------------------------------------------- recording
class _Proxy:
    """A loopback TCP proxy that keeps what clients send: [(connection index, phase, bytes)]."""

    def __init__(self) -> None:
        self.chunks: list[tuple[int, str, bytes]] = []
        self.phase = "setup"
        self.target_port = 0
        self.port = 0
        self._connections = 0
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        threading.Thread(target=self._serve, daemon=True, name="replay-proxy").start()
        self._ready.wait(10)

    def _serve(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._loop.run_until_complete(self._main())

    async def _main(self) -> None:
        server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        await asyncio.sleep(TIME_LIMIT_S + 60)

    async def _handle(self, client_r, client_w) -> None:
        index = self._connections
        self._connections += 1
        server_r, server_w = await asyncio.open_connection("127.0.0.1", self.target_port)

        async def upstream() -> None:
            while data := await client_r.read(1 << 16):
                self.chunks.append((index, self.phase, data))
                server_w.write(data)
                await server_w.drain()
            server_w.close()

        async def downstream() -> None:
            while data := await server_r.read(1 << 16):
                client_w.write(data)
                await client_w.drain()
            client_w.close()

        await asyncio.gather(upstream(), downstream(), return_exceptions=True)


def record(messages: int, lone: bool = False) -> list[tuple[int, str, bytes]]:
    from rocketmq import ClientConfiguration, Credentials, FilterExpression, Message, Producer, SimpleConsumer

    proxy = _Proxy()
    data_dir = tempfile.mkdtemp(prefix="bench-replay-rec-")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        proxy.target_port = s.getsockname()[1]
    env = dict(os.environ, CHRONOQ_ADVERTISED_ADDRESS=f"127.0.0.1:{proxy.port}")
    proc = subprocess.Popen([sys.executable, "-m", "chronoq", "serve", "--data-dir", data_dir, "--port",
                             str(proxy.target_port), "--host", "127.0.0.1", "--http-port", "0", "--log-level",
                             "warning"], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True)
    producer = consumer = None
    try:
        for line in proc.stdout:
            if "chronoq is ready" in line:
                break
        if lone:
            _run_loop(_lone_sends(f"127.0.0.1:{proxy.port}", proxy, messages))
            time.sleep(0.5)
            proxy.phase = "end"
            return list(proxy.chunks)
        cfg = ClientConfiguration(f"127.0.0.1:{proxy.port}", Credentials("", ""), request_timeout=10)
        producer = Producer(cfg, (TOPIC,))
        producer.startup()
        body = os.urandom(1024)
        started = time.monotonic()
        proxy.phase = "send"
        futures = []
        for _ in range(messages):
            m = Message()
            m.topic, m.body = TOPIC, body
            futures.append(producer.send_async(m))
        for f in futures:
            f.result(timeout=60)
        time.sleep(0.5)
        proxy.phase = "setup"
        consumer = SimpleConsumer(cfg, GROUP, {TOPIC: FilterExpression("*")}, await_duration=2)
        consumer.startup()
        proxy.phase = "receive_ack"
        got = 0
        while got < messages and time.monotonic() - started < TIME_LIMIT_S:
            for m in consumer.receive(32, 30):
                consumer.ack(m)
                got += 1
        time.sleep(0.5)
        proxy.phase = "end"
        if got < messages:
            raise RuntimeError(f"recorded {got} of {messages} receive+acks before the time limit")
    finally:
        for client in (consumer, producer):
            if client is not None:
                client.shutdown()
        proc.terminate()
        proc.wait(30)
        shutil.rmtree(data_dir, ignore_errors=True)
    return list(proxy.chunks)


async def _lone_sends(endpoint: str, proxy: _Proxy, messages: int) -> None:
    """``--lone``'s client: one delayed 1 KiB message per call, one call at a time."""
    from chronoq.client.client import Client, OutgoingMessage

    body = os.urandom(1024)
    async with Client(endpoint) as client:
        await client.route(TOPIC)  # (phase "setup": connected, the topic known)
        proxy.phase = "lone_send"
        base_ms = int(time.time() * 1000) + LONE_DUE_IN_MS
        step = LONE_SPREAD_MS / max(messages, 1)
        for i in range(messages):
            await client.send_batch([OutgoingMessage(TOPIC, body, deliver_at_ms=base_ms + int(i * step))])
        proxy.phase = "setup"  # (f)'s consumers: plain messages sent beforehand, then one per call
        for first in range(0, messages, 100):
            await client.send_batch([OutgoingMessage(TOPIC, body) for _ in range(min(100, messages - first))])
        await asyncio.sleep(0.2)
        for _ in range(messages):
            proxy.phase = "lone_receive"
            msgs = await client.receive(GROUP, TOPIC, max_messages=1, invisible_s=60, wait_s=0)
            if not msgs:
                raise RuntimeError("--lone: the plain messages ran out before the receives")
            proxy.phase = "lone_ack"
            await client.ack(GROUP, TOPIC, msgs)


def _warn_if_lone_recording_is_due(path: str) -> None:
    """A ``--lone`` recording holds absolute delivery times, the earliest ``LONE_DUE_IN_MS`` after
    it was made: replayed later, its messages are due at once and take the plain path, not the
    timer's (2026-11-28: 520k instructions a send against 487k for a fresh recording). Say so."""
    age_ms = (time.time() - os.path.getmtime(path)) * 1000
    if age_ms < LONE_DUE_IN_MS:
        return
    with open(path, "rb") as fh:
        if any(phase == "lone_send" for _, phase, _ in pickle.load(fh)):
            print(f"official_replay: {path} is {age_ms / 3_600_000:.1f} h old: its delayed messages are "
                  "due now and no longer take the timer's path; record it again (--lone --keep)",
                  file=sys.stderr)


# ---------------------------------------------------------------------------------- replaying
MAX_IN_FLIGHT = 200  # calls in flight per connection: below the server's 250-stream limit


class _Transport:
    """Where the server's answers go in a replay: counted, then dropped."""

    def __init__(self) -> None:
        self.written = 0
        self.waiter: asyncio.Future | None = None  # a lone replay's: done at the next write

    def write(self, data: bytes) -> None:
        self.written += len(data)
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def get_extra_info(self, name: str, default=None):
        return ("127.0.0.1", 40000) if name == "peername" else default

    def close(self) -> None:
        pass

    def is_closing(self) -> bool:
        return False

    def can_write_eof(self) -> bool:
        return False


def _calls(buf: bytes, first: bool) -> tuple[list[bytes], bytes]:
    """The complete frames of ``buf`` cut into one piece per call (a piece starts at each
    HEADERS frame: a call's headers, its data, the client's window updates after it), and the
    bytes of an incomplete frame left over."""
    pieces, current, pos = [], bytearray(), 0
    if first:
        current += buf[:PREFACE_BYTES]
        pos = PREFACE_BYTES
    while pos + 9 <= len(buf):
        hi, lo, kind, _flags, _sid = FRAME_HEAD.unpack_from(buf, pos)
        end = pos + 9 + (hi << 16 | lo)
        if end > len(buf):
            break
        if kind == HEADERS and current:
            pieces.append(bytes(current))
            current = bytearray()
        current += buf[pos:end]
        pos = end
    if current:
        pieces.append(bytes(current))
    return pieces, buf[pos:]


def _settled(connections) -> bool:
    """No call is running but the clients' Telemetry streams (open for the connection's life)."""
    return all(stream.method.endswith("/Telemetry") for conn in connections.values() for stream in conn.streams.values())


async def _replay(chunks, port: int, limit: int | None = None) -> dict:
    """Replay ``chunks`` (the first ``limit`` of them when given) into a fresh broker."""
    from chronoq.broker.committer import GroupCommitter
    from chronoq.core.config import BrokerConfig
    from chronoq.server import h2server
    from chronoq.server.grpc_server import GrpcFrontEnd
    from chronoq.server.runtime import GC_THRESHOLDS, SWITCH_INTERVAL_S, Runtime

    data_dir = tempfile.mkdtemp(prefix="bench-replay-")
    policy = os.environ.get("CHRONOQ_FLUSH_POLICY", "sync")
    runtime = Runtime(BrokerConfig(data_dir=data_dir, port=port, http_port=-1, flush_policy=policy), say=lambda _: None)
    broker = runtime.open_broker()
    runtime.committer = GroupCommitter(broker)
    runtime.committer.start()
    runtime.open_consumers()
    front_end = GrpcFrontEnd(runtime)
    await front_end.start()
    # As the broker runs once started (runtime.serve): start-up objects frozen, its GC thresholds.
    gc.collect()
    gc.freeze()
    thresholds, switch = gc.get_threshold(), sys.getswitchinterval()
    gc.set_threshold(*GC_THRESHOLDS)
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    spent: dict[str, list[float]] = {}  # phase -> [pieces, user s, system s]
    connections: dict[int, h2server.Connection] = {}
    transports: dict[int, _Transport] = {}
    carry: dict[int, bytes] = {}
    started = time.monotonic()
    try:
        for index, phase, data in chunks[:limit]:
            if time.monotonic() - started > TIME_LIMIT_S:
                raise RuntimeError("the replay ran past its time limit")
            first = index not in connections
            if first:
                connections[index] = h2server.Connection(front_end.server)
                transports[index] = _Transport()
                connections[index].connection_made(transports[index])
                carry[index] = b""
            pieces, carry[index] = _calls(carry[index] + data, first)
            for piece in pieces:
                before = resource.getrusage(resource.RUSAGE_SELF)
                connections[index].data_received(piece)
                # Two loop passes: the call's task runs, then its answer is flushed. A call that
                # waits longer (a group commit) finishes during a later call: still counted.
                if phase.startswith("lone"):  # the next call only once this one's answer is out
                    while not _settled({index: connections[index]}):
                        transports[index].waiter = asyncio.get_running_loop().create_future()
                        await transports[index].waiter
                await asyncio.sleep(0)
                await asyncio.sleep(0)
                after = resource.getrusage(resource.RUSAGE_SELF)
                row = spent.setdefault(phase, [0, 0.0, 0.0])
                row[0] += 1
                row[1] += after.ru_utime - before.ru_utime
                row[2] += after.ru_stime - before.ru_stime
                # The recording came from a client that waited for answers; a replay faster than
                # the group commits would open more streams than the server allows (it refuses
                # them, then ends the connection). Wait, untimed, for the calls in flight.
                while len(connections[index].streams) >= MAX_IN_FLIGHT:
                    await asyncio.sleep(0.0005)
            if phase == "setup":  # (the consumer's start-up: let its settings settle)
                await asyncio.sleep(0.05)
        # The calls still waiting (group commits) end before the close: a replay cut short
        # (--chunks) has all of its calls' work counted, and no cancellation's.
        while not _settled(connections) and time.monotonic() - started < TIME_LIMIT_S:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)
        counters = runtime.pop.counters
        acked = counters.acked.get((GROUP, TOPIC), 0)
        received = counters.received.get((GROUP, TOPIC), 0)
        fsyncs = runtime.committer.fsyncs
    finally:
        gc.set_threshold(*thresholds)
        gc.unfreeze()
        sys.setswitchinterval(switch)
        await front_end.stop()
        runtime.close_consumers()
        await runtime.committer.close()
        broker.close()
        shutil.rmtree(data_dir, ignore_errors=True)
    return {"spent": spent, "acked": acked, "received": received, "fsyncs": fsyncs}


def _run_loop(coro):
    """On uvloop when it is installed, as ``chronoq serve`` runs."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


# ---------------------------------------------------------------------------------- callgrind
PHASES = ("send", "receive_ack", "lone_send", "lone_receive", "lone_ack")
CUT_PHASES = ("send", "receive_ack", "lone_send", "lone_receive_ack")  # --callgrind's (_phase_cuts)


def _phase_cuts(chunks) -> dict[str, tuple[int, int]]:
    """{phase: (index of its first chunk, index after its last)}: the recording's phases are runs,
    but for ``lone_receive`` and ``lone_ack``, which alternate call by call: they are cut as one,
    ``lone_receive_ack`` (a callgrind figure per receive + ack pair)."""
    cuts: dict[str, tuple[int, int]] = {}
    for i, (_index, phase, _data) in enumerate(chunks):
        phase = _CUT_AS.get(phase, phase)
        first, _end = cuts.get(phase, (i, i))
        cuts[phase] = (first, i + 1)
    return cuts


_CUT_AS = {"lone_receive": "lone_receive_ack", "lone_ack": "lone_receive_ack"}


def _pieces_per_phase(chunks) -> dict[str, int]:
    """The calls (pieces, as ``_replay`` feeds them) of each phase."""
    seen: set[int] = set()
    carry: dict[int, bytes] = {}
    counts: dict[str, int] = {}
    for index, phase, data in chunks:
        pieces, carry[index] = _calls(carry.get(index, b"") + data, index not in seen)
        seen.add(index)
        counts[phase] = counts.get(phase, 0) + len(pieces)
        if phase == "lone_receive":  # one receive + ack pair each
            counts["lone_receive_ack"] = counts.get("lone_receive_ack", 0) + len(pieces)
    return counts


def run_callgrind(recording: str, functions: int, keep: str | None) -> None:
    """The --callgrind driver (module docstring): the replay under callgrind, cut at each phase's ends."""
    from bench.append import _functions, _instructions

    if shutil.which("valgrind") is None:
        raise SystemExit("--callgrind needs valgrind (apt-get install valgrind)")
    with open(recording, "rb") as fh:
        chunks = pickle.load(fh)
    cuts, calls = _phase_cuts(chunks), _pieces_per_phase(chunks)
    out_dir = keep or tempfile.mkdtemp(prefix="replay-callgrind-")
    os.makedirs(out_dir, exist_ok=True)
    files: dict[int, str] = {}
    for limit in sorted({k for phase in CUT_PHASES if phase in cuts for k in cuts[phase]}):
        files[limit] = os.path.join(out_dir, f"callgrind.chunks.{limit}")
        subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={files[limit]}", sys.executable,
                        os.path.abspath(__file__), "--recording", recording, "--replays", "1", "--chunks", str(limit)],
                       check=True, env={**os.environ, "PYTHONHASHSEED": "0"},
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    import chronoq

    ctx = {"build": chronoq.build(), "policy": os.environ.get("CHRONOQ_FLUSH_POLICY", "sync"),
           "recording": os.path.basename(recording)}
    for phase in CUT_PHASES:
        if phase not in cuts:
            continue
        first, end = cuts[phase]
        n = calls[phase]
        value = (_instructions(files[end]) - _instructions(files[first])) / n
        emit(f"replay_{phase}_instructions_per_call", round(value), "instructions", calls=n,
             method=f"callgrind, replays cut before and after the phase's chunks ({first}, {end}), difference / calls",
             **ctx)
        if functions:
            before, after = _functions(files[first], True), _functions(files[end], True)
            grown = {name: (after.get(name, 0) - before.get(name, 0)) / n for name in after}
            for name in sorted(grown, key=lambda k: -grown[k])[:functions]:
                emit(f"replay_{phase}_instructions_per_call_by_function", round(grown[name], 1), "instructions",
                     function=name, inclusive=True, calls=n, **ctx)
    if keep is None:
        shutil.rmtree(out_dir, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--messages", type=int, default=5000)
    ap.add_argument("--replays", type=int, default=3)
    ap.add_argument("--keep", help="write the recording to this file")
    ap.add_argument("--recording", help="replay this recording instead of making one")
    ap.add_argument("--chunks", type=int, default=None, help="replay only the recording's first CHUNKS chunks")
    ap.add_argument("--callgrind", action="store_true",
                    help="instructions per call of each phase, under callgrind (module docstring)")
    ap.add_argument("--functions", type=int, default=0, help="with --callgrind: each phase's top K functions")
    ap.add_argument("--callgrind-dir", default=None, help="with --callgrind: keep the callgrind files here")
    ap.add_argument("--lone", action="store_true",
                    help="record chronoq's client sending one delayed message per call instead (module docstring)")
    args = ap.parse_args()
    if args.recording:
        _warn_if_lone_recording_is_due(args.recording)
    if args.callgrind:
        recording = args.recording
        if recording is None:  # record once, into the kept file or a temporary one
            recording = args.keep or os.path.join(tempfile.mkdtemp(prefix="replay-rec-"), "calls.pickle")
            with open(recording, "wb") as fh:
                pickle.dump(record(args.messages, args.lone), fh)
        run_callgrind(recording, args.functions, args.callgrind_dir)
        return
    speed = python_speed()
    if args.recording:
        with open(args.recording, "rb") as fh:
            chunks = pickle.load(fh)
    else:
        chunks = record(args.messages, args.lone)
        if args.keep:
            with open(args.keep, "wb") as fh:
                pickle.dump(chunks, fh)
    sends = sum(1 for _, phase, _ in chunks if phase in ("send", "lone_send"))  # (chunks, not calls: context only)
    best: dict[str, float] = {}
    for run in range(args.replays):
        with socket.socket() as s:  # the front end binds a port even though nothing connects to it
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        result = _run_loop(_replay(chunks, port, args.chunks))
        for phase in PHASES:
            pieces, user, system = result["spent"].get(phase, (0, 0.0, 0.0))
            if not pieces:
                continue
            per_call = round((user + system) / pieces * 1e6, 1)
            best[phase] = min(best.get(phase, per_call), per_call)
            emit(f"replay_{phase}_cpu_per_call", per_call, "us", calls=pieces,
                 user_us=round(user / pieces * 1e6, 1), sys_us=round(system / pieces * 1e6, 1),
                 acked=result["acked"], received=result["received"], replay=run + 1,
                 fsyncs=result["fsyncs"], python_speed_mips=speed, recorded_chunks=sends)
        if args.chunks is None and ("receive_ack" in result["spent"] or "lone_ack" in result["spent"]) and (result["acked"] != result["received"] or not result["acked"]):
            emit("replay_acks_settled", result["acked"], "messages", received=result["received"],
                 note="the recorded acks did not all settle: the replay diverged from the recording")
    for phase, value in best.items():
        emit(f"replay_{phase}_cpu_per_call_best", value, "us", replays=args.replays, python_speed_mips=speed)


if __name__ == "__main__":
    main()
