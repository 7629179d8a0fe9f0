"""The client's own cost per send, in process: the SendMessageRequest encoding alone, and a
whole one-message send through the HTTP/2 transport against canned answers.

1. ``client_encode_*``: CPU per message of ``chronoq.client.client.Client._send_request_bytes`` for
   the shapes producers send. No server, no socket: only the encoder. Shapes: a batch of 100 plain
   one-KiB messages (bench/send_receive.py phase b), the same delayed (phase d: delivery times
   spread over 10 minutes), a lone plain message (phase e), and a batch of 100 with a tag, a key
   and a user property each.
2. ``client_single_send_cpu``: ``Client.send_batch`` of one delayed one-KiB message, one call at a
   time, as bench/send_receive.py phase f's producers call it, on uvloop, over
   ``chronoq.client.h2channel`` wired to a transport that answers every call at once with what
   chronoq's server answers a SendMessage (headers, the response, trailers; in one piece, as the
   server writes it). Everything of the client's call but the socket's system calls: request,
   metadata, HPACK, frames, flow control, futures, the answer's parsing and the receipt.

Prints one JSON object per line: {"metric", "value", "unit", ...context}; the value is the median
of ``--repeats`` timings of ``--messages`` messages each (process CPU time).

``--callgrind`` counts instructions of (2) instead (deterministic on a shared machine): this script
under ``valgrind --tool=callgrind`` with N and 2N calls, the difference / N.

    .venv/bin/python bench/client_encode.py
    .venv/bin/python bench/client_encode.py --repeats 15 --messages 100000
    .venv/bin/python bench/client_encode.py --callgrind --calls 2000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from chronoq.client.client import Client, OutgoingMessage  # noqa: E402
from chronoq.protocol.rocketmq import fields  # noqa: E402

BODY = b"x" * 1024


def _client() -> Client:
    client = Client.__new__(Client)  # no channel: only the encoder is timed
    client.namespace = ""
    client._topic_fields = {}
    client._born_host = fields.string_field(fields.K_SP_BORN_HOST, "bench-host")
    try:  # (the encoder's home since issue 21; the bench also runs against trees before it)
        from chronoq.protocol.rocketmq.outgoing import SendRequestEncoder
        client._encoder = SendRequestEncoder("", "bench-host")
    except ImportError:
        pass
    return client


def _batches(shape: str, batch: int, count: int) -> list[list[OutgoingMessage]]:
    now = int(time.time() * 1000)
    out = []
    for b in range(max(1, count // batch)):
        if shape == "plain":
            out.append([OutgoingMessage("bench", BODY) for _ in range(batch)])
        elif shape == "delayed":
            out.append([OutgoingMessage("bench", BODY, deliver_at_ms=now + 1000 + (b * batch + i) * 600_000 // count)
                        for i in range(batch)])
        else:
            out.append([OutgoingMessage("bench", BODY, tag="TagA", keys=(f"k{i}",), properties={"color": "red"})
                        for i in range(batch)])
    return out


def measure(shape: str, batch: int, messages: int, repeats: int) -> float:
    client = _client()
    encode = client._send_request_bytes
    batches = _batches(shape, batch, messages)
    for m in batches[:10]:
        encode(m)  # warm the caches
    times = []
    for _ in range(repeats):
        t0 = time.process_time()
        for m in batches:
            encode(m)
        times.append((time.process_time() - t0) / (len(batches) * batch) * 1e6)
    return statistics.median(times)


class _Answering:
    """A transport that answers each call it is sent (its HEADERS frame) on the next loop pass
    with a SendMessage answer as chronoq's server writes it: HEADERS, DATA, trailers in one piece."""

    def __init__(self, conn) -> None:
        from chronoq.protocol.h2 import (DATA, END_HEADERS, END_STREAM, HEADERS, MESSAGE_PREFIX, WINDOW_UPDATE,
                                         frame, literal_block, trailers)
        from chronoq.protocol.rocketmq.send import send_response

        self.conn = conn
        self.loop = asyncio.get_running_loop()
        response = send_response(["0A0B0C0D0E0F00000000000000000001"], [-1],
                                 ["recall-v1:bench-single-abcdef:0A0B0C0D0E0F00000000000000000001:1764214800000"])
        answer = (frame(HEADERS, END_HEADERS, 1, literal_block([(":status", "200"), ("content-type", "application/grpc")]))
                  + frame(DATA, 0, 1, MESSAGE_PREFIX.pack(0, len(response)) + response)
                  + frame(HEADERS, END_HEADERS | END_STREAM, 1, trailers(0, None)))
        # The answer with its three stream ids as fields of one struct: made in one C call per call,
        # so the figure is the client's, not this stand-in's.
        cuts, pos = [], 0
        while pos < len(answer):
            cuts.append(pos + 5)
            pos += 9 + int.from_bytes(answer[pos:pos + 3], "big")
        pieces = [answer[a + 4:b] for a, b in zip([-4] + cuts, cuts + [len(answer) + 4])]
        self.parts = tuple(pieces)
        self.pack = struct.Struct(">" + "I".join(f"{len(p)}s" for p in pieces)).pack
        self.sid = struct.Struct(">I").unpack_from
        self.headers = HEADERS
        # The server's connection window, opened wide at once (its SETTINGS are the defaults).
        self.opening = frame(WINDOW_UPDATE, 0, 0, (2 ** 31 - 1 - 65_535).to_bytes(4, "big"))

    def write(self, data) -> None:
        if data[3] == self.headers:  # a call: its HEADERS frame comes first
            sid = self.sid(data, 5)[0]
            a, b, c, d = self.parts
            self.loop.call_soon(self.conn.data_received, self.pack(a, sid, b, sid, c, sid, d))

    def close(self) -> None:
        pass


async def _single_sends(calls: int) -> float:
    """CPU seconds of ``calls`` one-message delayed sends (module docstring, 2), after a warm-up."""
    from chronoq.client import h2channel

    async with Client("127.0.0.1:1") as client:
        conn = h2channel._Connection(client._h2.authority, "http")
        transport = _Answering(conn)
        conn.connection_made(transport)
        conn.data_received(transport.opening)
        client._h2._conn = conn
        base_ms = 1_764_214_800_000

        async def run(n: int) -> float:
            cpu0 = time.process_time()
            for i in range(n):  # as bench/send_receive.py phase f's producers do, but for the clock
                await client.send_batch([OutgoingMessage("bench-single", BODY, deliver_at_ms=base_ms + i * 20)])
            return time.process_time() - cpu0

        await run(200)  # warm: HPACK's table, caches
        return await run(calls)


def measure_single(calls: int, repeats: int) -> float:
    from chronoq.client.client import run

    return statistics.median(run(_single_sends(calls)) for _ in range(repeats)) / calls * 1e6


def callgrind_single(calls: int, keep: str | None) -> None:
    """Instructions per single send (module docstring, 2): runs of ``calls`` and 2 x ``calls``."""
    from bench.append import _instructions

    if shutil.which("valgrind") is None:
        raise SystemExit("--callgrind needs valgrind (apt-get install valgrind)")
    out_dir = keep or tempfile.mkdtemp(prefix="client-callgrind-")
    os.makedirs(out_dir, exist_ok=True)
    totals = {}
    for n in (calls, 2 * calls):
        out_file = os.path.join(out_dir, f"callgrind.single.{n}")
        subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out_file}", sys.executable,
                        os.path.abspath(__file__), "--only-single", "--calls", str(n), "--repeats", "1"],
                       check=True, env={**os.environ, "PYTHONHASHSEED": "0"},
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        totals[n] = _instructions(out_file)
    import chronoq

    print(json.dumps({"metric": "client_single_send_instructions", "value": round((totals[2 * calls] - totals[calls]) / calls),
                      "unit": "instructions/call", "calls": calls, "build": chronoq.build(),
                      "method": f"callgrind, runs of {calls} and {2 * calls} calls, difference / {calls}"}), flush=True)
    if keep is None:
        shutil.rmtree(out_dir, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--messages", type=int, default=50_000, help="messages per timing (bounded)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--calls", type=int, default=5000, help="(2): single sends per timing (bounded)")
    ap.add_argument("--only-single", action="store_true", help="(2) only")
    ap.add_argument("--callgrind", action="store_true", help="(2) in instructions per call, under callgrind")
    ap.add_argument("--keep", default=None, help="with --callgrind: keep the callgrind files in this directory")
    args = ap.parse_args()
    calls = min(args.calls, 200_000)
    if args.callgrind:
        callgrind_single(calls, args.keep)
        return
    import chronoq

    if args.only_single:
        us = measure_single(calls, args.repeats)
        print(json.dumps({"metric": "client_single_send_cpu", "value": round(us, 2), "unit": "us/call", "calls": calls,
                          "repeats": args.repeats, "body_bytes": len(BODY), "build": chronoq.build()}), flush=True)
        return
    messages = min(args.messages, 1_000_000)
    for shape, batch in (("plain", 100), ("delayed", 100), ("plain", 1), ("tagged", 100)):
        n = messages if batch > 1 else messages // 10
        us = measure(shape, batch, n, args.repeats)
        print(json.dumps({"metric": f"client_encode_{shape}_b{batch}", "value": round(us, 3), "unit": "us/msg",
                          "messages": n, "repeats": args.repeats, "body_bytes": len(BODY)}), flush=True)
    us = measure_single(calls, args.repeats)
    print(json.dumps({"metric": "client_single_send_cpu", "value": round(us, 2), "unit": "us/call", "calls": calls,
                      "repeats": args.repeats, "body_bytes": len(BODY), "build": chronoq.build()}), flush=True)


if __name__ == "__main__":
    main()
