"""A gRPC server on the asyncio event loop: HTTP/2 (RFC 9113) and gRPC framing, one thread.

Why chronoq has its own: grpcio's server hands every call between its poller thread, its
event-engine threads and the loop thread (GIL hand-offs included). On small VMs, where a thread
wake-up costs tens of microseconds, that measured ~340 us of server CPU for a call that does
nothing (``bench/grpc_floor.py``: ~14 context switches per call). This server parses frames in
the loop's ``data_received`` and runs each call there, once the read's frames are parsed, up to
its first wait; only a call that waits gets a task (``Server._launch``). A call costs a few dozen us.

It is a drop-in for the part of ``grpc.aio.server`` chronoq uses: generic and registered method
handlers (``grpc.*_rpc_method_handler``), ``grpc.aio.ServerInterceptor``s, handler contexts with
``invocation_metadata``, ``time_remaining``, ``peer``, ``write``, ``read``, ``abort``,
``set_code``/``set_details``, ``cancelled``; plaintext (prior knowledge, as gRPC clients speak
it) and TLS with ALPN ``h2``. Every client that speaks gRPC over HTTP/2 works with it (grpcio,
grpc-js, grpc-java).

What HTTP/2 it implements: SETTINGS (both ways, acknowledged), PING, WINDOW_UPDATE and flow
control both ways (answers wait for the peer's windows; we grant windows as we read, and stop
granting the connection more while unary requests not yet taken by their handlers hold
``BUFFERED_MAX``: many open streams cannot make a connection hold unbounded memory),
HEADERS/CONTINUATION with padding and priority fields, DATA with padding, RST_STREAM (the call's
task, if it waits, is cancelled), GOAWAY (both ways; ``stop`` sends it and lets running calls finish within the
grace). Not implemented: priorities (ignored, as RFC 9113 allows), server push (never used by gRPC),
the HTTP/1.1 upgrade to h2c. Requests compressed with ``gzip`` or ``deflate`` are accepted;
answers are never compressed. Protocol errors close the connection with GOAWAY and the RFC's
error code; a bad call is answered with a gRPC status and harms no other call.

Limits (``chronoq.server.h2limits``, ``Server(limits=...)``; docs/security.md "HTTP/2 limits"):
open connections per server, concurrent streams per connection (advertised in SETTINGS, enforced
with REFUSED_STREAM, handlers of reset streams still finishing included), a deadline for the
client preface and first SETTINGS, an idle timeout (one timer handle per connection, re-armed once
per interval, none per call), and the defences against the published attacks: a reset budget
spent by the client's resets and ours (rapid reset, MadeYouReset), CONTINUATION frames per header
block, the decoded header list (HPACK bomb, capped inside ``hpackdec``), PING/SETTINGS acks queued
while the peer does not read, entries per SETTINGS frame, a budget of frames that carry nothing,
and a gRPC length prefix checked before its bytes are held. Beyond a limit: GOAWAY
(ENHANCE_YOUR_CALM unless the RFC names a code) whose debug data names it, or REFUSED_STREAM;
each refusal is counted in ``Server(refusals=...)`` (``chronoq.core.refusals``). The checks run only on
the frames an attack is made of; a DATA frame or a call pays an integer compare or two.
"""

from __future__ import annotations

import asyncio
import base64
import collections.abc
import logging
import os
import socket
import ssl
import struct
import tempfile
import zlib
from urllib.parse import quote

import grpc

from chronoq.core import refusals as R
from chronoq.server.h2limits import IdleWatch, Limits, TokenBucket
from chronoq.protocol.h2.hpackdec import Decoder, HeaderListTooLarge, HpackError, literal, literal_block

log = logging.getLogger("chronoq.h2")

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

# Frame types (RFC 9113 §6)
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)
# Flags
END_STREAM, ACK, END_HEADERS, PADDED, PRIORITY_FLAG = 0x1, 0x1, 0x4, 0x8, 0x20
# Settings
S_HEADER_TABLE_SIZE, S_ENABLE_PUSH, S_MAX_CONCURRENT_STREAMS = 1, 2, 3
S_INITIAL_WINDOW_SIZE, S_MAX_FRAME_SIZE, S_MAX_HEADER_LIST_SIZE = 4, 5, 6
# Error codes
NO_ERROR, PROTOCOL_ERROR, INTERNAL_ERROR, FLOW_CONTROL_ERROR = 0, 1, 2, 3
FRAME_SIZE_ERROR, REFUSED_STREAM, CANCEL, COMPRESSION_ERROR = 6, 7, 8, 9
ENHANCE_YOUR_CALM = 11

_HEAD = struct.Struct(">HBBBI")   # length hi 16, length lo 8, type, flags, stream id
_U32 = struct.Struct(">I")
_SETTING = struct.Struct(">HI")
_MSG = struct.Struct(">BI")       # gRPC message prefix: compressed flag, length

DEFAULT_WINDOW = 65_535
MAX_WINDOW = (1 << 31) - 1
OUR_STREAM_WINDOW = 4 << 20       # what each stream may send us before we grant more
OUR_CONN_WINDOW = 16 << 20        # and the whole connection
OUR_MAX_FRAME = 1 << 20           # clients may send DATA frames this big (fewer frames per big send)
# Concurrent streams, connections, timeouts and the attack budgets: chronoq.server.h2limits
# (Server(limits=...)). The decoded header list's cap is advertised in SETTINGS_MAX_HEADER_LIST_SIZE.
MAX_HEADER_BLOCK = 256 << 10      # HEADERS + CONTINUATION bytes, before decoding
LINGER_S = 1.0                    # a failed connection drains the peer's frames this long (``_fail``)
FLUSH_BYTES = 64 << 10            # buffered output beyond this is written at once
READ_AHEAD_MESSAGES = 64          # a streaming call's unread requests before its window stops growing
BUFFERED_MAX = 64 << 20           # unary request bytes a connection may hold before its window stops growing

_ANSWER_HEADERS = literal_block([(":status", "200"), ("content-type", "application/grpc")])


def _frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    n = len(payload)
    return _HEAD.pack(n >> 8, n & 0xFF, kind, flags, stream_id) + payload


def _goaway_frame(last_stream: int, code: int, debug: str) -> bytes:
    """GOAWAY; its debug data (at most 256 bytes) says why, naming the limit."""
    return _frame(GOAWAY, 0, 0, _U32.pack(last_stream) + _U32.pack(code) + debug.encode("utf-8", "replace")[:256])


def _headers_frame(stream_id: int, block: bytes, end_stream: bool) -> bytes:
    # Our blocks are small (a few hundred bytes at most): one HEADERS frame, no CONTINUATION.
    return _frame(HEADERS, END_HEADERS | (END_STREAM if end_stream else 0), stream_id, block)


def _status_code(code) -> int:
    if isinstance(code, grpc.StatusCode):
        return code.value[0]
    return int(code)


def _trailers(code: int, details: str | None, metadata=()) -> bytes:
    fields = [literal("grpc-status", str(code))]
    if details:
        # gRPC's percent-encoding: printable ASCII but '%' stays, everything else %XX of UTF-8.
        fields.append(literal("grpc-message", quote(details, safe=" !\"#$&'()*+,-./:;<=>?@[\\]^_`{|}~")))
    for key, value in metadata:
        fields.append(literal(key, base64.b64encode(value).rstrip(b"=") if key.endswith("-bin") else value))
    return b"".join(fields)


_OK_TRAILERS = _trailers(0, None)


_TIMEOUT_UNITS = {"H": 3600.0, "M": 60.0, "S": 1.0, "m": 1e-3, "u": 1e-6, "n": 1e-9}

# Request header fields _start_call treats itself; every other name is the handler's metadata.
_F_PATH, _F_METHOD, _F_CONTENT_TYPE, _F_TIMEOUT, _F_ENCODING, _F_SKIP = range(6)
_FIELD_KINDS = {":path": _F_PATH, ":method": _F_METHOD, ":authority": _F_SKIP, ":scheme": _F_SKIP,
                "content-type": _F_CONTENT_TYPE, "grpc-timeout": _F_TIMEOUT, "grpc-encoding": _F_ENCODING,
                "te": _F_SKIP, "user-agent": _F_SKIP, "grpc-accept-encoding": _F_SKIP,
                "accept-encoding": _F_SKIP}


def _timeout_s(text: str) -> float | None:
    """``grpc-timeout`` (at most 8 digits and a unit) in seconds; None when absent or malformed."""
    if not text or len(text) < 2:
        return None
    unit = _TIMEOUT_UNITS.get(text[-1])
    digits = text[:-1]
    if unit is None or not digits.isdigit() or len(digits) > 8:
        return None
    return int(digits) * unit


class CallDetails:
    """What ``ServerInterceptor.intercept_service`` and generic handlers are given."""

    __slots__ = ("method", "invocation_metadata")

    def __init__(self, method: str, invocation_metadata: tuple) -> None:
        self.method = method
        self.invocation_metadata = invocation_metadata


class Abort(Exception):
    """Raised by ``Context.abort``: the call ends with the status set."""


class _Closed(Exception):
    """The stream or connection went away while a handler wrote."""


class Context:
    """The handler's view of one call (the subset of ``grpc.aio.ServicerContext`` in use)."""

    __slots__ = ("_stream", "_metadata", "_deadline", "code", "details", "trailing_metadata", "_loop")

    def __init__(self, stream: "_Stream", metadata: tuple, deadline: float | None, loop) -> None:
        self._stream = stream
        self._metadata = metadata
        self._deadline = deadline
        self._loop = loop
        self.code: int | None = None
        self.details: str | None = None
        self.trailing_metadata = ()

    def invocation_metadata(self):
        return self._metadata

    def time_remaining(self) -> float | None:
        if self._deadline is None:
            return None
        return max(0.0, self._deadline - self._loop.time())

    def peer(self) -> str:
        return self._stream.conn.peer

    def set_code(self, code) -> None:
        self.code = _status_code(code)

    def set_details(self, details: str) -> None:
        self.details = details

    def set_trailing_metadata(self, metadata) -> None:
        self.trailing_metadata = tuple(metadata)

    def cancelled(self) -> bool:
        return self._stream.cancelled

    def done(self) -> bool:
        return self._stream.ended

    async def abort(self, code, details: str = "", trailing_metadata=()) -> None:
        self.code = _status_code(code)
        self.details = details
        if trailing_metadata:
            self.trailing_metadata = tuple(trailing_metadata)
        raise Abort(details)

    async def write(self, message) -> None:
        stream = self._stream
        serialize = stream.serializer
        data = serialize(message) if serialize is not None else message
        await stream.send_message(data)

    async def read(self):
        """The next request message of a streaming call, or ``grpc.aio.EOF`` after the last."""
        return await self._stream.read_message()

    def reset(self, code: int = CANCEL) -> None:
        """End the call from outside its handler (chronoq's own, not grpc.aio's): RST_STREAM drops
        the answer frames still waiting for the peer's window at once and cancels the handler.
        (Cancelling the handler alone would queue the trailers behind the blocked bytes.)"""
        stream = self._stream
        conn = stream.conn
        if not (stream.ended and not stream.blocked) and not stream.cancelled and not conn.closed:
            try:
                conn._reset(stream, code)
            except _ConnError as exc:  # our resets spend the connection's budget too: over it, the
                conn._conn_error(exc)  # connection ends here (outside a read: nothing else catches it)


class _Stream:
    """One call: request bytes in, answer frames out, and the task running the handler."""

    __slots__ = ("conn", "id", "buf", "queue", "half_closed", "cancelled", "ended", "headers_sent",
                 "send_window", "blocked", "window_open", "task", "deserializer", "serializer", "recv_unacked",
                 "encoding", "ready", "counted")

    def __init__(self, conn: "_Connection", stream_id: int, send_window: int) -> None:
        self.conn = conn
        self.id = stream_id
        self.buf = bytearray()          # request bytes not yet cut into messages
        self.queue: asyncio.Queue | None = None  # parsed request messages for streaming handlers
        self.half_closed = False        # the client sent END_STREAM
        self.cancelled = False
        self.ended = False              # we sent END_STREAM (or RST_STREAM)
        self.headers_sent = False
        self.send_window = send_window
        self.blocked: list[bytes] = []  # answer bytes waiting for flow-control window
        self.window_open: asyncio.Event | None = None
        self.task: asyncio.Task | None = None
        self.deserializer = None
        self.serializer = None
        self.recv_unacked = 0           # request bytes read since our last WINDOW_UPDATE for the stream
        self.encoding = "identity"
        self.ready: asyncio.Future | None = None  # a unary call's task waits here for END_STREAM
        self.counted = 0                # request bytes held for a unary call (the connection's cap)

    # ------------------------------------------------------------------ requests
    def messages(self) -> list[bytes]:
        """Cut complete gRPC messages off the buffer (decompressed)."""
        out = []
        buf = self.buf
        pos, n = 0, len(buf)
        limit = self.conn.server.max_receive
        while n - pos >= 5:
            flag, length = _MSG.unpack_from(buf, pos)
            if length > limit:  # refused on its length prefix, before its bytes are held
                self.conn.refuse(R.MESSAGE_TOO_LARGE, f"a message of {length} bytes")
                raise _CallError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                 f"Received message larger than max ({length} vs. {limit})")
            if n - pos - 5 < length:
                break
            data = bytes(buf[pos + 5:pos + 5 + length])
            pos += 5 + length
            if flag:
                data = self._decompress(data)
            out.append(data)
        if pos:
            del buf[:pos]
        return out

    def _decompress(self, data: bytes) -> bytes:
        try:
            if self.encoding == "gzip":
                return zlib.decompress(data, 16 + zlib.MAX_WBITS)
            if self.encoding == "deflate":
                return zlib.decompress(data)
        except zlib.error as exc:
            raise _CallError(grpc.StatusCode.INTERNAL, f"cannot decompress the request: {exc}") from None
        raise _CallError(grpc.StatusCode.UNIMPLEMENTED, f"message compressed with unsupported encoding "
                                                        f"{self.encoding!r}")

    async def read_message(self):
        item = await self.queue.get()
        if self.recv_unacked:
            self.conn.credit(self)
        if item is None:
            return grpc.aio.EOF
        if isinstance(item, BaseException):
            raise item
        return self.deserializer(item) if self.deserializer is not None else item

    async def request_iterator(self):
        while True:
            item = await self.read_message()
            if item is grpc.aio.EOF:
                return
            yield item

    # ------------------------------------------------------------------ answers
    def _head(self) -> bytes:
        if self.headers_sent:
            return b""
        self.headers_sent = True
        return _headers_frame(self.id, _ANSWER_HEADERS, False)

    async def send_message(self, data: bytes) -> None:
        if self.ended or self.cancelled:
            raise _Closed("the call has ended")
        self.conn.send_data(self, self._head(), _MSG.pack(0, len(data)) + data)
        if self.blocked:
            await self._drain()
        elif self.conn.paused:
            await self.conn.drain()

    async def _drain(self) -> None:
        while self.blocked and not (self.cancelled or self.conn.closed):
            if self.window_open is None:
                self.window_open = asyncio.Event()
            self.window_open.clear()
            await self.window_open.wait()
        if self.cancelled or self.conn.closed:
            raise _Closed("the call has ended")

    def finish(self, code: int, details: str | None, metadata=()) -> None:
        """Trailers: the call's last frame."""
        self.conn.release(self)
        if self.ended or self.cancelled:
            return
        block = _OK_TRAILERS if code == 0 and not details and not metadata else _trailers(code, details, metadata)
        self.conn.send_trailers(self, self._head(), _headers_frame(self.id, block, True))


class _CallError(Exception):
    def __init__(self, code, details: str) -> None:
        super().__init__(details)
        self.code = _status_code(code)
        self.details = details


class _Connection(asyncio.Protocol):
    """One HTTP/2 connection: frame parsing, streams, flow control."""

    def __init__(self, server: "Server") -> None:
        self.server = server
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.peer = ""
        self.buf = bytearray()
        self.preface_seen = False
        limits = self.limits = server.limits
        self.decoder = Decoder(max_list=limits.max_header_list)
        # Defences (chronoq.server.h2limits): resets both ways share one budget (rapid reset and
        # MadeYouReset), frames that carry nothing another; acks queued while the peer does not read.
        self.resets = TokenBucket(limits.reset_burst, limits.reset_rate, self.loop.time)
        self.empties = TokenBucket(limits.empty_burst, limits.empty_rate, self.loop.time)
        self.controls = TokenBucket(limits.control_burst, limits.control_rate, self.loop.time)
        self.unread_acks = 0
        self.lingering = 0                       # handlers of reset streams not yet finished
        self.settings_seen = False               # the client's first SETTINGS (ends the preface deadline)
        self._timer: asyncio.TimerHandle | None = None  # the preface deadline, then the idle check
        self._idle = IdleWatch()
        self.streams: dict[int, _Stream] = {}
        # Streams with answer bytes waiting for window, oldest first: a connection WINDOW_UPDATE
        # (clients send one every few KiB) looks at these, not at every open stream.
        self.waiting: dict[int, _Stream] = {}
        self.last_stream = 0
        self.closed = False
        self.goaway_sent = False
        self.paused = False
        self._resumed: asyncio.Event | None = None
        self.peer_window = DEFAULT_WINDOW        # connection send window
        self.peer_initial_window = DEFAULT_WINDOW
        self.peer_max_frame = 16_384
        self.recv_unacked = 0
        self.buffered = 0                        # unary request bytes held until their calls read them
        self._header_stream = 0                  # stream whose header block continues (CONTINUATION)
        self._header_flags = 0
        self._header_parts: list[bytes] = []
        self._header_size = 0
        self._continuations = 0                  # CONTINUATION frames of the header block under way
        self._out: list[bytes] = []              # frames to send at the end of this loop pass
        self._out_bytes = 0
        self._starting: list = []                # calls whose HEADERS came in this read: (stream, path, context)
        self._reading = False                    # in data_received: it sends what is written when done

    # ------------------------------------------------------------------ output
    def _write(self, data: bytes) -> None:
        """Frames leave once per event-loop pass: the answers of every call that finished in this
        pass (headers, data, trailers) go out in one send, not three sends per call."""
        out = self._out
        out.append(data)
        self._out_bytes += len(data)
        if self._out_bytes >= FLUSH_BYTES:  # big answers go out now: the transport's buffer
            self._flush_out()                # limits (pause_writing) must see them
        elif len(out) == 1 and not self._reading:  # (data_received flushes when it is done)
            self.loop.call_soon(self._flush_out)

    def _flush_out(self) -> None:
        out = self._out
        if out and not self.closed:
            data = b"".join(out) if len(out) > 1 else out[0]
            out.clear()
            self._out_bytes = 0
            self.transport.write(data)

    # ------------------------------------------------------------------ asyncio.Protocol
    def connection_made(self, transport) -> None:
        self.transport = transport
        peer = transport.get_extra_info("peername")
        if isinstance(peer, tuple) and len(peer) >= 2:
            host = peer[0]
            self.peer = f"ipv6:[{host}]:{peer[1]}" if ":" in host else f"ipv4:{host}:{peer[1]}"
        else:
            self.peer = "unix:" + str(peer or "")
        limits = self.limits
        if len(self.server._connections) >= limits.max_connections:
            # Over the broker-wide cap: this connection alone is turned away, at once.
            self.refuse(R.CONNECTIONS, f"{limits.max_connections} connections open")
            transport.write(_frame(SETTINGS, 0, 0) + _goaway_frame(
                0, ENHANCE_YOUR_CALM, f"connection limit {limits.max_connections} (h2_max_connections)"))
            transport.close()
            self.closed = True
            return
        settings = b"".join(_SETTING.pack(k, v) for k, v in (
            (S_MAX_CONCURRENT_STREAMS, limits.max_concurrent_streams), (S_INITIAL_WINDOW_SIZE, OUR_STREAM_WINDOW),
            (S_MAX_FRAME_SIZE, OUR_MAX_FRAME), (S_MAX_HEADER_LIST_SIZE, limits.max_header_list),
            (S_ENABLE_PUSH, 0)))
        transport.write(_frame(SETTINGS, 0, 0, settings)
                        + _frame(WINDOW_UPDATE, 0, 0, _U32.pack(OUR_CONN_WINDOW - DEFAULT_WINDOW)))
        self.server._connections.add(self)
        self._timer = self.loop.call_later(limits.preface_timeout_s, self._preface_expired)

    # ------------------------------------------------------------------ timers (one handle at a time)
    def _preface_expired(self) -> None:
        self._timer = None
        if not self.settings_seen and not self.closed:
            seconds = self.limits.preface_timeout_s
            self.refuse(R.PREFACE_TIMEOUT, f"no preface and SETTINGS in {seconds:g} s")
            self._fail(PROTOCOL_ERROR, f"no HTTP/2 preface and SETTINGS within {seconds:g} s (h2_preface_timeout_ms)")

    def _idle_check(self) -> None:
        """Once per idle timeout: close the connection if it had no stream since the last check."""
        self._timer = None
        if self.closed:
            return
        if self._idle.check(len(self.streams), self.last_stream):
            seconds = self.limits.idle_timeout_s
            self.refuse(R.IDLE_TIMEOUT, f"no call for {seconds:g} s")
            self._fail(NO_ERROR, f"idle for {seconds:g} s (h2_idle_timeout_ms)")  # clients reconnect
        else:
            self._timer = self.loop.call_later(self.limits.idle_timeout_s, self._idle_check)

    def refuse(self, reason: str, detail: str) -> None:
        """Count a refusal (chronoq.core.refusals) when the server was given a Refusals."""
        refusals = self.server.refusals
        if refusals is not None:
            refusals.refuse(reason, self.peer, detail)

    def connection_lost(self, exc) -> None:
        self.closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.server._connections.discard(self)
        for stream in list(self.streams.values()):
            self._cancel(stream)
        self.streams.clear()
        if self._resumed is not None:
            self._resumed.set()

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        self.unread_acks = 0  # the peer reads again: what it was sent has left
        if self._resumed is not None:
            self._resumed.set()

    async def drain(self) -> None:
        while self.paused and not self.closed:
            if self._resumed is None:
                self._resumed = asyncio.Event()
            self._resumed.clear()
            await self._resumed.wait()

    def data_received(self, data: bytes) -> None:
        # What this read's calls answer (most answer within it, ``_launch_calls``), its SETTINGS
        # and PING acks and window updates leave in one send at the end: no loop pass to wait for.
        if self.closed:  # failed, lingering until its close (``_fail``): what comes is dropped
            return
        self._reading = True
        try:
            self._read(data)
            if self._starting:
                self._launch_calls()
        finally:
            self._reading = False
            if self._out:
                self._flush_out()

    def _read(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        try:
            if not self.preface_seen:
                if len(buf) < len(PREFACE):
                    if not PREFACE.startswith(bytes(buf)):
                        raise _ConnError(PROTOCOL_ERROR, "not an HTTP/2 connection preface")
                    return
                if buf[:len(PREFACE)] != PREFACE:
                    raise _ConnError(PROTOCOL_ERROR, "not an HTTP/2 connection preface")
                del buf[:len(PREFACE)]
                self.preface_seen = True
            pos, n = 0, len(buf)
            unpack = _HEAD.unpack_from
            while n - pos >= 9 and not self.closed:
                hi, lo, kind, flags, stream_id = unpack(buf, pos)
                length = hi << 8 | lo
                if length > OUR_MAX_FRAME:
                    raise _ConnError(FRAME_SIZE_ERROR, f"frame of {length} bytes")
                if n - pos - 9 < length:
                    break
                payload = bytes(buf[pos + 9:pos + 9 + length])
                pos += 9 + length
                self._frame(kind, flags, stream_id & 0x7FFFFFFF, payload)
            if pos:
                del buf[:pos]
        except _ConnError as exc:
            self._conn_error(exc)
        except HeaderListTooLarge as exc:  # an HPACK bomb, or far too much metadata
            self.refuse(R.HEADER_LIST, str(exc))
            self._fail(ENHANCE_YOUR_CALM, str(exc))
        except HpackError as exc:
            self.refuse(R.PROTOCOL, str(exc))
            self._fail(COMPRESSION_ERROR, str(exc))
        except Exception:  # noqa: BLE001 - a bug here must cost one connection, not the server
            log.exception("HTTP/2 connection from %s failed", self.peer)
            self._fail(INTERNAL_ERROR, "internal error")

    def _launch_calls(self) -> None:
        """Run the calls that began in this read, now that all of its frames are in: a unary
        call's request (HEADERS and DATA usually come in one read) is complete, so the call can
        run to its end at once (``Server._launch``)."""
        starting, self._starting = self._starting, []
        if self.closed:
            return
        launch = self.server._launch
        for stream, path, context in starting:
            if not (stream.cancelled or stream.ended):  # not reset or failed meanwhile
                launch(stream, path, context)

    # ------------------------------------------------------------------ frames
    def _frame(self, kind: int, flags: int, sid: int, payload: bytes) -> None:
        if self._header_stream and kind != CONTINUATION:
            raise _ConnError(PROTOCOL_ERROR, "a header block was interrupted")
        if kind == DATA:
            self._data(flags, sid, payload)
        elif kind == HEADERS:
            self._headers(flags, sid, payload)
        elif kind == CONTINUATION:
            if sid != self._header_stream or not sid:
                raise _ConnError(PROTOCOL_ERROR, "CONTINUATION without a header block")
            self._continuations += 1  # frames, not bytes: zero-length ones count too
            if self._continuations > self.limits.max_continuations:
                raise _ConnError(ENHANCE_YOUR_CALM, f"more than {self.limits.max_continuations} CONTINUATION "
                                 "frames in one header block", R.CONTINUATION_FLOOD)
            if not payload and not flags & END_HEADERS:
                self._empty("an empty CONTINUATION")
            self._header_part(payload, flags)
        elif kind == WINDOW_UPDATE:
            self._window_update(sid, payload)
        elif kind == SETTINGS:
            self._settings(flags, sid, payload)
        elif kind == PING:
            if sid or len(payload) != 8:
                raise _ConnError(PROTOCOL_ERROR if sid else FRAME_SIZE_ERROR, "bad PING")
            if not flags & ACK:
                self._control("PING")
                if self.paused:  # the peer does not read what we send: count the acks piling up
                    self._unread_ack()
                self._write(_frame(PING, ACK, 0, payload))
            else:  # we send no PINGs: an ack answers nothing
                self._empty("an unsolicited PING ack")
        elif kind == RST_STREAM:
            if not sid or len(payload) != 4:
                raise _ConnError(PROTOCOL_ERROR, "bad RST_STREAM")
            if not self.resets.take():  # rapid reset (CVE-2023-44487)
                raise _ConnError(ENHANCE_YOUR_CALM, f"stream resets over the budget ({self.limits.reset_burst}, "
                                 f"then {self.limits.reset_rate:g}/s)", R.RAPID_RESET)
            stream = self.streams.pop(sid, None)
            if stream is not None:
                self._cancel(stream)
        elif kind == GOAWAY:
            # The client stops opening calls; those running finish. It closes when it is done.
            pass
        elif kind == PRIORITY:
            if not sid:
                raise _ConnError(PROTOCOL_ERROR, "PRIORITY on stream 0")
            self._empty("PRIORITY")  # priorities are ignored here: the frame carries nothing
        elif kind == PUSH_PROMISE:
            raise _ConnError(PROTOCOL_ERROR, "clients may not push")
        else:  # unknown frame types are ignored (RFC 9113 §4.1), within the empty-frame budget
            self._empty(f"frame type {kind}")

    def _conn_error(self, exc: "_ConnError") -> None:
        """A connection error: counted, then GOAWAY with its code and the connection closed."""
        self.refuse(exc.reason, str(exc))
        self._fail(exc.code, str(exc))

    def _empty(self, what: str) -> None:
        """A frame that carries nothing (CVE-2019-9518): within a budget."""
        if not self.empties.take():
            raise _ConnError(ENHANCE_YOUR_CALM, f"frames carrying nothing over the budget ({self.limits.empty_burst}, "
                             f"then {self.limits.empty_rate:g}/s; last: {what})", R.EMPTY_FRAMES)

    def _control(self, what: str) -> None:
        """A PING or SETTINGS frame, which we must acknowledge: within a budget."""
        if not self.controls.take():
            raise _ConnError(ENHANCE_YOUR_CALM, f"PING/SETTINGS frames over the budget ({self.limits.control_burst}, "
                             f"then {self.limits.control_rate:g}/s; last: {what})", R.CONTROL_FLOOD)

    def _unread_ack(self) -> None:
        """One more PING or SETTINGS ack queued while the transport is paused (CVE-2019-9512/9515)."""
        self.unread_acks += 1
        if self.unread_acks > self.limits.max_unread_acks:
            raise _ConnError(ENHANCE_YOUR_CALM, f"more than {self.limits.max_unread_acks} PING/SETTINGS acks "
                             "queued unread", R.CONTROL_FLOOD)

    def _server_reset(self, sid: int, code: int) -> None:
        """RST_STREAM from us: it spends the same budget as the client's (MadeYouReset, CVE-2025-8671)."""
        if not self.resets.take():
            raise _ConnError(ENHANCE_YOUR_CALM, f"streams reset by the server over the budget "
                             f"({self.limits.reset_burst}, then {self.limits.reset_rate:g}/s)", R.SERVER_RESETS)
        self._write(_frame(RST_STREAM, 0, sid, _U32.pack(code)))

    def _settings(self, flags: int, sid: int, payload: bytes) -> None:
        if sid:
            raise _ConnError(PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & ACK:
            self._empty("a SETTINGS ack")  # one per SETTINGS we send (once): more carry nothing
            return
        if len(payload) % 6:
            raise _ConnError(FRAME_SIZE_ERROR, "SETTINGS length")
        if len(payload) > 6 * self.limits.max_settings_entries:
            raise _ConnError(ENHANCE_YOUR_CALM, f"more than {self.limits.max_settings_entries} entries in "
                             "one SETTINGS frame", R.CONTROL_FLOOD)
        self._control("SETTINGS")
        if not self.settings_seen:  # the preface is complete: from now on only idleness is timed
            self.settings_seen = True
            if self._timer is not None:
                self._timer.cancel()
            self._timer = self.loop.call_later(self.limits.idle_timeout_s, self._idle_check)
        if self.paused:
            self._unread_ack()
        grown = False
        for i in range(0, len(payload), 6):
            key, value = _SETTING.unpack_from(payload, i)
            if key == S_INITIAL_WINDOW_SIZE:
                if value > MAX_WINDOW:
                    raise _ConnError(FLOW_CONTROL_ERROR, "initial window over 2^31-1")
                delta = value - self.peer_initial_window
                self.peer_initial_window = value
                for stream in self.streams.values():
                    stream.send_window += delta
                grown = grown or delta > 0
            elif key == S_MAX_FRAME_SIZE:
                if not 16_384 <= value <= 16_777_215:
                    raise _ConnError(PROTOCOL_ERROR, "MAX_FRAME_SIZE out of range")
                self.peer_max_frame = value
            elif key == S_ENABLE_PUSH and value > 1:
                raise _ConnError(PROTOCOL_ERROR, "ENABLE_PUSH out of range")
            # HEADER_TABLE_SIZE: our answers never use the table. Others need nothing from us.
        self._write(_frame(SETTINGS, ACK, 0))
        if grown:  # only after the ACK: a client checks our data against the windows it knows we have
            self._unblock_all()

    def _window_update(self, sid: int, payload: bytes) -> None:
        if len(payload) != 4:
            raise _ConnError(FRAME_SIZE_ERROR, "WINDOW_UPDATE length")
        increment = _U32.unpack(payload)[0] & 0x7FFFFFFF
        if not sid:
            if not increment:
                raise _ConnError(PROTOCOL_ERROR, "WINDOW_UPDATE of 0")
            self.peer_window += increment
            if self.peer_window > MAX_WINDOW:
                raise _ConnError(FLOW_CONTROL_ERROR, "connection window over 2^31-1")
            self._unblock_all()
            return
        stream = self.streams.get(sid)
        if stream is None:
            return  # a stream that has ended: allowed
        if not increment:
            self._reset(stream, PROTOCOL_ERROR)
            return
        stream.send_window += increment
        if stream.send_window > MAX_WINDOW:
            self._reset(stream, FLOW_CONTROL_ERROR)
            return
        if stream.blocked:
            self._flush_stream(stream)

    def _headers(self, flags: int, sid: int, payload: bytes) -> None:
        if not sid or not sid & 1:
            raise _ConnError(PROTOCOL_ERROR, f"HEADERS on stream {sid}")
        pos, end = 0, len(payload)
        if flags & PADDED:
            if not payload:
                raise _ConnError(PROTOCOL_ERROR, "padding length missing")
            end -= payload[0]
            pos = 1
        if flags & PRIORITY_FLAG:
            pos += 5
        if pos > end:
            raise _ConnError(PROTOCOL_ERROR, "padding longer than the frame")
        self._header_stream = sid
        self._header_flags = flags
        self._header_parts = []
        self._header_size = 0
        self._continuations = 0
        if pos == end and not flags & END_HEADERS:
            self._empty("an empty HEADERS")
        self._header_part(payload[pos:end], flags)

    def _header_part(self, part: bytes, flags: int) -> None:
        self._header_size += len(part)
        if self._header_size > MAX_HEADER_BLOCK:
            raise _ConnError(ENHANCE_YOUR_CALM, f"header block over {MAX_HEADER_BLOCK} bytes", R.HEADER_LIST)
        self._header_parts.append(part)
        if not flags & END_HEADERS:
            return
        sid, first_flags = self._header_stream, self._header_flags
        block = b"".join(self._header_parts) if len(self._header_parts) > 1 else self._header_parts[0]
        self._header_stream, self._header_parts = 0, []
        fields = self.decoder.decode(block)  # always: the table must follow every block
        stream = self.streams.get(sid)
        if stream is not None:  # trailers of a streaming request: only END_STREAM matters
            if first_flags & END_STREAM:
                self._half_close(stream)
            return
        if sid <= self.last_stream:
            raise _ConnError(PROTOCOL_ERROR, f"stream {sid} reused or out of order")
        self.last_stream = sid
        if self.goaway_sent or self.server._stopping:
            self._server_reset(sid, REFUSED_STREAM)
            return
        # Open streams, and handlers of reset streams still finishing: never more running at once
        # than the advertised cap, however fast a client opens and resets them.
        if len(self.streams) + self.lingering >= self.limits.max_concurrent_streams:
            self.refuse(R.STREAMS, f"stream {sid} over {self.limits.max_concurrent_streams} concurrent")
            self._server_reset(sid, REFUSED_STREAM)
            return
        stream = _Stream(self, sid, self.peer_initial_window)
        self.streams[sid] = stream
        self.server._start_call(stream, fields, bool(first_flags & END_STREAM))

    def _data(self, flags: int, sid: int, payload: bytes) -> None:
        if not sid:
            raise _ConnError(PROTOCOL_ERROR, "DATA on stream 0")
        if not payload and not flags & END_STREAM:
            self._empty("an empty DATA")
        self.recv_unacked += len(payload)
        try:
            self._stream_data(flags, sid, payload)
        finally:  # after the frame's bytes are counted as held (or not)
            self._credit_connection()

    def _stream_data(self, flags: int, sid: int, payload: bytes) -> None:
        length = len(payload)
        if flags & PADDED:
            if not payload or payload[0] >= length:
                raise _ConnError(PROTOCOL_ERROR, "bad DATA padding")
            payload = payload[1:length - payload[0]]
        stream = self.streams.get(sid)
        if stream is None or stream.half_closed:
            if sid > self.last_stream:
                raise _ConnError(PROTOCOL_ERROR, f"DATA on idle stream {sid}")
            return  # a stream we reset or finished: the data is dropped (window already counted)
        stream.buf += payload
        if stream.queue is None:  # unary: held until END_STREAM and the handler takes it
            stream.counted += len(payload)
            self.buffered += len(payload)
        if not flags & END_STREAM:
            stream.recv_unacked += length
            self.credit(stream)
        try:
            if stream.queue is not None:  # streaming request: hand messages over as they complete
                for message in stream.messages():
                    stream.queue.put_nowait(message)
            else:
                held, limit = len(stream.buf), self.server.max_receive
                if held > limit + 5:
                    self.refuse(R.MESSAGE_TOO_LARGE, f"a request of more than {held - 5} bytes")
                    raise _CallError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                     f"Received message larger than max ({held - 5} vs. {limit})")
                if held - len(payload) < 5 <= held:  # this frame completed the length prefix:
                    announced = _MSG.unpack_from(stream.buf)[1]  # refused before its bytes come
                    if announced > limit:
                        self.refuse(R.MESSAGE_TOO_LARGE, f"a message of {announced} bytes announced")
                        raise _CallError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                         f"Received message larger than max ({announced} vs. {limit})")
        except _CallError as exc:
            self._fail_call(stream, exc.code, exc.details)
            return
        if flags & END_STREAM:
            self._half_close(stream)

    def _credit_connection(self) -> None:
        """Grant the connection more window once half is used, unless unary requests not yet
        taken by their handlers hold BUFFERED_MAX: a client cannot make us hold more than that
        plus one window, however many streams it opens."""
        if self.recv_unacked >= OUR_CONN_WINDOW // 2 and self.buffered < BUFFERED_MAX and not self.closed:
            self._write(_frame(WINDOW_UPDATE, 0, 0, _U32.pack(self.recv_unacked)))
            self.recv_unacked = 0

    def release(self, stream: _Stream) -> None:
        """The stream's held request bytes are taken (or dropped): count them off the cap."""
        if stream.counted:
            self.buffered -= stream.counted
            stream.counted = 0
            self._credit_connection()

    def credit(self, stream: _Stream) -> None:
        """Grant the stream more window once half of it is used, unless its handler is behind:
        a streaming call whose handler does not read stops its client after one window."""
        if (stream.recv_unacked >= OUR_STREAM_WINDOW // 2 and not stream.half_closed and not self.closed
                and (stream.queue is None or stream.queue.qsize() < READ_AHEAD_MESSAGES)):
            self._write(_frame(WINDOW_UPDATE, 0, stream.id, _U32.pack(stream.recv_unacked)))
            stream.recv_unacked = 0

    def _half_close(self, stream: _Stream) -> None:
        stream.half_closed = True
        if stream.queue is not None:
            if stream.buf:
                self._fail_call(stream, _status_code(grpc.StatusCode.INTERNAL), "the request ends inside a message")
                return
            stream.queue.put_nowait(None)
        else:
            self.server._unary_ready(stream)

    def _fail_call(self, stream: _Stream, code: int, details: str) -> None:
        """End one call with a status (the client gets it; its task, if any, is cancelled)."""
        stream.finish(code, details)
        if stream.task is not None and not stream.task.done():
            stream.cancelled = True
            stream.task.cancel()
        self.streams.pop(stream.id, None)
        if not stream.half_closed:  # we want no more of its request
            self._server_reset(stream.id, NO_ERROR)

    # ------------------------------------------------------------------ sending
    def send_data(self, stream: _Stream, head: bytes, message: bytes) -> None:
        """Queue one framed gRPC message for ``stream``; sends as much as the windows allow."""
        if head:
            self._write(head)
        if not stream.blocked and len(message) <= min(stream.send_window, self.peer_window, self.peer_max_frame):
            stream.send_window -= len(message)
            self.peer_window -= len(message)
            self._write(_frame(DATA, 0, stream.id, message))
            return
        stream.blocked.append(message)
        self.waiting[stream.id] = stream
        self._flush_stream(stream)

    def send_trailers(self, stream: _Stream, head: bytes, trailers: bytes) -> None:
        if stream.blocked:  # trailers wait behind the data
            if head:
                self._write(head)
            stream.blocked.append(trailers)
            stream.ended = True  # no more writes; the frames leave when the windows open
            self._flush_stream(stream)
            return
        stream.ended = True
        self._write(head + trailers if head else trailers)
        self.streams.pop(stream.id, None)

    def _flush_stream(self, stream: _Stream) -> None:
        write, max_frame = self._write, self.peer_max_frame
        blocked = stream.blocked
        while blocked:
            item = blocked[0]
            if stream.ended and len(blocked) == 1:  # only the trailers (a HEADERS frame) remain
                write(item)
                blocked.clear()
                self.streams.pop(stream.id, None)
                break
            room = min(stream.send_window, self.peer_window, max_frame)
            if room <= 0:  # a WINDOW_UPDATE (stream or connection) or SETTINGS resumes it
                break
            chunk, rest = item[:room], item[room:]
            stream.send_window -= len(chunk)
            self.peer_window -= len(chunk)
            write(_frame(DATA, 0, stream.id, chunk))
            if rest:
                blocked[0] = rest
            else:
                blocked.pop(0)
        if not blocked:
            self.waiting.pop(stream.id, None)
            if stream.window_open is not None:
                stream.window_open.set()

    def _unblock_all(self) -> None:
        """More connection window (or a larger initial window): oldest waiting streams first."""
        waiting, streams = self.waiting, self.streams
        for sid, stream in list(waiting.items()):
            if stream.blocked and streams.get(sid) is stream:
                self._flush_stream(stream)
            else:  # reset or cancelled meanwhile: its bytes will never leave
                waiting.pop(sid, None)

    # ------------------------------------------------------------------ ending
    def _reset(self, stream: _Stream, code: int) -> None:
        self.streams.pop(stream.id, None)
        self._cancel(stream)
        self._server_reset(stream.id, code)

    def _cancel(self, stream: _Stream) -> None:
        self.release(stream)
        self.waiting.pop(stream.id, None)
        stream.cancelled = True
        if stream.task is not None and not stream.task.done():
            stream.task.cancel()
            # Its clean-up still runs: it counts against the stream cap until it is done.
            self.lingering += 1
            stream.task.add_done_callback(self._handler_done)
        if stream.queue is not None:
            stream.queue.put_nowait(_Closed("the call was cancelled"))
        if stream.window_open is not None:
            stream.window_open.set()

    def _handler_done(self, _task) -> None:
        self.lingering -= 1

    def _fail(self, code: int, reason: str) -> None:
        log.debug("closing connection from %s: %s", self.peer, reason)
        transport = self.transport
        if transport is not None and not self.closed:
            self._write(_goaway_frame(self.last_stream, code, reason))
            self._flush_out()
            if self.paused:
                # The peer does not read: the GOAWAY will not reach it, and a close() would wait for
                # the unread output forever, holding the connection (and a slot of the cap).
                transport.abort()
            elif transport.can_write_eof():
                # A lingering close: the GOAWAY leaves with our FIN, and what the peer still sends is
                # read and dropped (data_received) for LINGER_S. Closing at once with its frames
                # unread makes the kernel answer with a reset, which can destroy the GOAWAY (and
                # its reason) before the peer reads it.
                transport.write_eof()
                self.loop.call_later(LINGER_S, transport.abort)
            else:  # TLS: no half-close
                transport.close()
        self.closed = True

    def goaway(self) -> None:
        if not self.goaway_sent and not self.closed:
            self.goaway_sent = True
            self._write(_frame(GOAWAY, 0, 0, _U32.pack(self.last_stream) + _U32.pack(NO_ERROR)))

    def close(self) -> None:
        if self.transport is not None and not self.closed:
            self._flush_out()
            self.transport.close()


class _ConnError(Exception):
    """A connection error: GOAWAY with ``code``, the message as its debug data, ``reason`` counted."""

    def __init__(self, code: int, message: str, reason: str = R.PROTOCOL) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason


class Server:
    """The subset of ``grpc.aio.Server`` chronoq uses, served on this event loop."""

    def __init__(self, *, interceptors=(), max_receive_message_length: int = 4 << 20,
                 limits: Limits | None = None, refusals=None) -> None:
        """``limits``: connections, streams, timeouts and attack budgets (``h2limits.Limits``, its
        defaults if None). ``refusals``: a ``chronoq.core.refusals.Refusals`` that counts what the
        limits turn away (the broker's); None counts nothing."""
        self.limits = limits if limits is not None else Limits()
        self.refusals = refusals
        self._interceptors = list(interceptors)
        self._generic: list = []
        self._registered: dict[str, object] = {}  # full method path -> RpcMethodHandler
        self._binds: list[tuple] = []  # (address, port, ssl context or None, listening socket)
        self._servers: list[asyncio.AbstractServer] = []
        self._connections: set[_Connection] = set()
        self._calls: set[asyncio.Task] = set()
        self._stopping = False
        self._stopped: asyncio.Event | None = None
        self.max_receive = max_receive_message_length

    # ------------------------------------------------------------------ grpc.aio.Server's API
    def add_generic_rpc_handlers(self, handlers) -> None:
        self._generic.extend(handlers)

    def add_registered_method_handlers(self, service_name: str, method_handlers: dict) -> None:
        for name, handler in method_handlers.items():
            self._registered[f"/{service_name}/{name}"] = handler

    def add_insecure_port(self, address: str) -> int:
        return self._bind(address, None)

    def add_secure_port(self, address: str, context: ssl.SSLContext) -> int:
        if not isinstance(context, ssl.SSLContext):
            raise TypeError("add_secure_port takes an ssl.SSLContext (see server_ssl_context)")
        return self._bind(address, context)

    def _bind(self, address: str, context) -> int:
        host, _, port = address.rpartition(":")
        host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
        port_n = int(port)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host or "0.0.0.0", port_n))
            sock.listen(1024)
        except OSError as exc:
            sock.close()
            raise RuntimeError(f"cannot bind {address}: {exc.strerror or exc}") from None
        sock.setblocking(False)
        bound = sock.getsockname()[1]
        self._binds.append((address, bound, context, sock))
        return bound

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._stopped = asyncio.Event()
        for _address, _port, context, sock in self._binds:
            server = await loop.create_server(lambda: _Connection(self), sock=sock, ssl=context,
                                              backlog=1024)
            self._servers.append(server)

    async def stop(self, grace: float | None) -> None:
        self._stopping = True
        for server in self._servers:
            server.close()
        for conn in list(self._connections):
            conn.goaway()
        if grace and self._calls:
            await asyncio.wait(list(self._calls), timeout=grace)
        for task in list(self._calls):
            task.cancel()
        if self._calls:
            await asyncio.wait(list(self._calls), timeout=1.0)
        for conn in list(self._connections):
            conn.close()
        for server in self._servers:
            try:
                await asyncio.wait_for(server.wait_closed(), 1.0)
            except (asyncio.TimeoutError, Exception):  # noqa: BLE001 - shutting down regardless
                pass
        if self._stopped is not None:
            self._stopped.set()

    async def wait_for_termination(self, timeout: float | None = None) -> bool:
        if self._stopped is None:
            return True
        try:
            await asyncio.wait_for(self._stopped.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    # ------------------------------------------------------------------ calls
    def _start_call(self, stream: _Stream, fields: list, end_stream: bool) -> None:
        path = ""
        metadata = []
        add = metadata.append
        timeout = None
        bad = None
        kinds = _FIELD_KINDS
        for name, value in fields:
            kind = kinds.get(name)
            if kind is None:  # the handler's metadata (most fields of a RocketMQ call)
                if not name or name[0] == ":":
                    continue  # a pseudo-header gRPC does not use (or no name at all)
                if name.endswith("-bin"):
                    try:
                        value = base64.b64decode(value + "=" * (-len(value) % 4))
                    except ValueError:
                        continue
                add((name, value))
            elif kind == _F_PATH:
                path = value
            elif kind == _F_METHOD:
                if value != "POST":
                    bad = f"method {value} (gRPC calls are POST)"
            elif kind == _F_CONTENT_TYPE:
                if not value.startswith("application/grpc"):
                    bad = f"content-type {value!r}"
            elif kind == _F_TIMEOUT:
                timeout = _timeout_s(value)
                add((name, value))
            elif kind == _F_ENCODING:
                stream.encoding = value
                add((name, value))
            # _F_SKIP: transport fields, not the handler's
        deadline = stream.conn.loop.time() + timeout if timeout is not None else None
        context = Context(stream, tuple(metadata), deadline, stream.conn.loop)
        if bad or not path:
            stream.finish(_status_code(grpc.StatusCode.INTERNAL if bad else grpc.StatusCode.UNIMPLEMENTED),
                          f"bad request: {bad or 'no :path'}")
            stream.conn.streams.pop(stream.id, None)
            return
        if end_stream:
            stream.half_closed = True
        stream.conn._starting.append((stream, path, context))  # run when the read is parsed

    def _launch(self, stream: _Stream, path: str, context: Context) -> None:
        """Run a call's handler now, up to its first wait; only a call that waits gets a task.

        Most calls (an ack, a send under the async flush policy, a receive that finds messages)
        never wait: they answer within this step and cost no task, no loop pass and no
        done-callback. A call that waits (a group commit, a long poll, a unary request whose DATA
        has not come yet, in ``_unary_request``) goes on in a task from where it stopped
        (``_Resumed``). Handlers must not rely on ``asyncio.current_task()`` before their first wait."""
        coro = self._run(stream, path, context)
        try:
            waiting_on = coro.send(None)
        except StopIteration:
            return
        except asyncio.CancelledError:  # a handler awaited something cancelled: _run answered
            return
        task = stream.conn.loop.create_task(_Resumed(coro, waiting_on))
        stream.task = task
        self._calls.add(task)
        task.add_done_callback(self._calls.discard)

    def _unary_ready(self, stream: _Stream) -> None:
        waiter = stream.ready
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _lookup(self, details: CallDetails):
        handler = self._registered.get(details.method)
        if handler is not None:
            return handler
        for generic in self._generic:
            handler = generic.service(details)
            if handler is not None:
                return handler
        return None

    async def _handler(self, details: CallDetails):
        if not self._interceptors:
            return await self._lookup(details)
        if len(self._interceptors) == 1:  # chronoq's one (the access gate): no chain to build
            return await self._interceptors[0].intercept_service(self._lookup, details)

        async def chain(index: int, d: CallDetails):
            if index == len(self._interceptors):
                return await self._lookup(d)
            return await self._interceptors[index].intercept_service(lambda dd: chain(index + 1, dd), d)

        return await chain(0, details)

    async def _run(self, stream: _Stream, path: str, context: Context) -> None:
        conn = stream.conn
        try:
            handler = await self._handler(CallDetails(path, context._metadata))
            if handler is None:
                raise _CallError(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")
            stream.deserializer = handler.request_deserializer
            stream.serializer = handler.response_serializer
            if handler.request_streaming:
                stream.queue = asyncio.Queue()
                for message in stream.messages():
                    stream.queue.put_nowait(message)
                conn.release(stream)  # what came before the handler was known was counted as held
                if stream.half_closed:
                    stream.queue.put_nowait(None)
                requests = stream.request_iterator()
            else:
                request = await self._unary_request(stream)
            if handler.request_streaming and handler.response_streaming:
                result = await self._stream_out(handler.stream_stream(requests, context), stream)
            elif handler.request_streaming:
                result = await handler.stream_unary(requests, context)
                await self._answer(stream, result)
            elif handler.response_streaming:
                result = await self._stream_out(handler.unary_stream(request, context), stream)
            else:
                result = await handler.unary_unary(request, context)
                await self._answer(stream, result)
            code = context.code or 0
            stream.finish(code, context.details, context.trailing_metadata)
        except Abort:
            stream.finish(context.code or 2, context.details, context.trailing_metadata)
        except _CallError as exc:
            stream.finish(exc.code, exc.details)
        except _Closed:
            pass
        except asyncio.CancelledError:
            if not stream.cancelled and not conn.closed:
                stream.finish(1, "the call was cancelled by the server")
            raise
        except Exception as exc:  # noqa: BLE001 - a handler's bug answers UNKNOWN, as grpcio does
            log.exception("call %s failed", path)
            stream.finish(2, f"Unexpected {type(exc).__name__}: {exc}")
        finally:
            if not stream.ended and not stream.cancelled and not conn.closed:
                stream.finish(2, "the call ended without a status")

    async def _unary_request(self, stream: _Stream):
        if not stream.half_closed:
            waiter = stream.conn.loop.create_future()
            stream.ready = waiter
            await waiter
        messages = stream.messages()
        stream.conn.release(stream)
        if len(messages) != 1 or stream.buf:
            raise _CallError(grpc.StatusCode.INTERNAL if messages or stream.buf else grpc.StatusCode.UNIMPLEMENTED,
                             "a unary call takes exactly one request message")
        data = messages[0]
        deserialize = stream.deserializer
        if deserialize is None:
            return data
        try:
            return deserialize(data)
        except Exception as exc:  # noqa: BLE001 - a malformed request is the client's error
            raise _CallError(grpc.StatusCode.INTERNAL, f"Exception deserializing request: {exc}") from None

    async def _answer(self, stream: _Stream, result) -> None:
        if result is None:
            raise _CallError(grpc.StatusCode.UNKNOWN, "the handler returned no response")
        serialize = stream.serializer
        await stream.send_message(serialize(result) if serialize is not None else result)

    async def _stream_out(self, produced, stream: _Stream):
        if hasattr(produced, "__aiter__"):
            serialize = stream.serializer
            try:
                async for item in produced:
                    await stream.send_message(serialize(item) if serialize is not None else item)
            finally:
                # A call that ends early (client gone, cancelled) closes the generator now, so its
                # own clean-up (``finally``) runs at once, as under grpcio.
                await produced.aclose()
            return None
        return await produced  # a coroutine that writes with context.write


class _Resumed:
    """A coroutine that a task goes on with after its first step ran outside any task
    (``Server._launch``): the task's first step gets what the coroutine waits on (a future, or
    None for a bare yield), each later step goes to the coroutine. Throws (a cancellation) go to
    the coroutine at any time, before the task's first step too, so its clean-up always runs."""

    __slots__ = ("_coro", "_first", "_started")

    def __init__(self, coro, waiting_on) -> None:
        self._coro = coro
        self._first = waiting_on
        self._started = False

    def send(self, value):
        if not self._started:
            self._started = True
            first, self._first = self._first, None
            return first
        return self._coro.send(value)

    def throw(self, *exc):
        self._started = True
        self._first = None
        return self._coro.throw(*exc)

    def close(self) -> None:
        self._coro.close()

    def __await__(self):
        return self

    def __iter__(self):
        return self

    def __next__(self):
        return self.send(None)


collections.abc.Coroutine.register(_Resumed)


def server_ssl_context(cert_pem: bytes, key_pem: bytes) -> ssl.SSLContext:
    """A TLS context for gRPC: TLS 1.2+, ALPN ``h2`` (gRPC clients require it)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.set_alpn_protocols(["h2"])
    # load_cert_chain reads files only: write the PEMs to a private temporary file for the call.
    fd, path = tempfile.mkstemp(prefix="chronoq-tls-")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(key_pem + b"\n" + cert_pem)
        context.load_cert_chain(path)
    finally:
        os.unlink(path)
    return context
