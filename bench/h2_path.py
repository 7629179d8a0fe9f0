"""The HTTP/2 hot path alone, in process: no broker, no sockets, a handler that does nothing.

Two figures, each the CPU time (``time.process_time``) per call:

1. ``h2_replay_server_cpu_per_call``: the official client's calls, recorded by
   ``bench/official_replay.py --keep FILE``, fed piece by piece (a call's frames) to the server's
   connections (``chronoq.server.h2server.Connection``), every method answered by one unary
   handler that returns a constant: frames, HPACK, the call machinery, answer frames;
2. ``h2_roundtrip_cpu_per_call``: chronoq's client transport (``chronoq.client.h2channel``) and
   the server wired back to back in memory, one unary call of 1 KiB at a time: both ends.

The work is deterministic (no clock, no threads, no I/O), so under callgrind the instruction count
per call is exact and comparable across commits, which the wall-clock figures on a shared machine
are not: run it with ``--pieces 0 --roundtrips 0`` too and subtract, so start-up is not counted.

    .venv/bin/python bench/official_replay.py --messages 1000 --replays 1 --keep /tmp/calls.pickle
    .venv/bin/python bench/h2_path.py --recording /tmp/calls.pickle
    PYTHONHASHSEED=0 valgrind --tool=callgrind --callgrind-out-file=/dev/null \\
        .venv/bin/python bench/h2_path.py --recording /tmp/calls.pickle --roundtrips 0

Prints one JSON object per line: {"metric", "value", "unit", ...context}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pickle
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import grpc  # noqa: E402

from bench.official_replay import _calls, _Transport  # noqa: E402
from chronoq.client import h2channel  # noqa: E402
from chronoq.server.h2grpc import Server  # noqa: E402
from chronoq.server.h2server import Connection  # noqa: E402

ANSWER = b"\x0a\x04\x08\x00\x12\x00" + b"x" * 100   # what every call answers (bytes: no serializer)
BODY = b"y" * 1024                                   # each round trip's request
PATH = "/apache.rocketmq.v2.MessagingService/SendMessage"


async def _answer(_request, _context):
    return ANSWER


class _EveryMethod(grpc.GenericRpcHandler):
    def service(self, _details):
        return grpc.unary_unary_rpc_method_handler(_answer)


class _Pipe(_Transport):
    """The replay's transport (it counts what is written); given a peer, it also hands that over
    on the next loop pass."""

    def __init__(self, deliver=None) -> None:
        super().__init__()
        self.deliver = deliver

    def write(self, data: bytes) -> None:
        super().write(data)
        if self.deliver is not None:
            asyncio.get_running_loop().call_soon(self.deliver, data)


def _server() -> Server:
    server = Server()
    server.add_generic_rpc_handlers((_EveryMethod(),))
    return server


async def replay(chunks, limit: int) -> tuple[int, float]:
    """Feed at most ``limit`` recorded calls to the server's connections: (calls, CPU seconds)."""
    server, connections, carry, calls = _server(), {}, {}, 0
    started = time.process_time()
    for index, _phase, data in chunks:
        first = index not in connections
        if first:
            connections[index] = Connection(server)
            connections[index].connection_made(_Pipe())
            carry[index] = b""
        pieces, carry[index] = _calls(carry[index] + data, first)
        for piece in pieces:
            if calls >= limit:
                return calls, time.process_time() - started
            connections[index].data_received(piece)
            await asyncio.sleep(0)  # a call that waits (a streaming request's) goes on in its task
            calls += 1
    return calls, time.process_time() - started


async def roundtrips(count: int) -> tuple[int, float]:
    """``count`` unary calls from chronoq's client transport to the server, in memory: (calls, CPU seconds)."""
    server = Connection(_server())
    client = h2channel._Connection("127.0.0.1:1", "http")
    server.connection_made(_Pipe(client.data_received))
    client.connection_made(_Pipe(server.data_received))
    await asyncio.sleep(0)
    metadata = [("x-mq-client-id", "host@1234@0@abc"), ("x-mq-language", "PYTHON"), ("x-mq-protocol", "v2"),
                ("x-mq-request-id", "")]
    started = time.process_time()
    for i in range(count):
        metadata[-1] = ("x-mq-request-id", f"req-{i:08d}")  # (a literal on every call, as in real ones)
        answer = await client.send(PATH, (), metadata, 10.0, BODY).future
        assert answer == ANSWER
    return count, time.process_time() - started


def emit(metric: str, calls: int, seconds: float) -> None:
    print(json.dumps({"metric": metric, "value": round(seconds / calls * 1e6, 2) if calls else 0.0, "unit": "us",
                      "calls": calls, "cpus": os.cpu_count()}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recording", required=True, help="a recording of bench/official_replay.py --keep")
    ap.add_argument("--pieces", type=int, default=1_000_000, help="recorded calls to replay (at most)")
    ap.add_argument("--roundtrips", type=int, default=2000)
    args = ap.parse_args()
    with open(args.recording, "rb") as fh:
        chunks = pickle.load(fh)
    emit("h2_replay_server_cpu_per_call", *asyncio.run(replay(chunks, args.pieces)))
    emit("h2_roundtrip_cpu_per_call", *asyncio.run(roundtrips(args.roundtrips)))


if __name__ == "__main__":
    main()
