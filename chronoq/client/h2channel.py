"""An HTTP/2 transport for ``chronoq.client.client``'s unary gRPC calls.

Why: grpc.aio's client hands every call to a poller thread and back to the event loop. On a
small VM a thread wake-up is tens of µs, and a unary call cost the client 0.5-0.9 ms of CPU:
with batches of 16 messages the consumer spent more CPU per message than the broker did. This
transport parses HTTP/2 in ``data_received`` on the loop thread and resolves the call's future
there: no thread, one write per call, one read per answer.

What it speaks: one connection per ``Channel`` (TCP, or TLS with ALPN ``h2``), opened on first use
and again after it is lost. A call is one stream: HEADERS (HPACK: the fields that never change
are indexed once and then sent as one-byte references, the rest as literals; ``RequestEncoder``),
the request as one gRPC message in DATA frames within the peer's windows and frame size, then the
answer's HEADERS, DATA and trailers. SETTINGS (acknowledged; initial window, frame size
and concurrent-stream limits applied), PING, WINDOW_UPDATE both ways, RST_STREAM, GOAWAY (calls
the server never saw are retried once on a new connection, as grpc does), CONTINUATION, gzip or
deflate answers. Deadlines travel as ``grpc-timeout`` and end the call here too (RST_STREAM CANCEL).
Failures raise ``grpc.aio.AioRpcError``, as grpc's own channel does, so callers handle both alike;
what a whole answer means (its message, or its status's error) is ``chronoq.client.answer``'s.
Not here: streaming calls (``chronoq.client.client`` keeps a grpc channel for those), request compression.

The cost per call (issue 24: one message per call is what most applications do): a call's header
fields that repeat (path, deadline, the ``fixed`` metadata a ``Client`` keeps for a second) are
encoded once per connection and reused while the HPACK table copy is unchanged; deadlines share one
timer per connection, set for the earliest; HEADERS and the one DATA frame leave in one write.
``bench/client_encode.py --callgrind`` counts the instructions of a whole send.
"""

from __future__ import annotations

import asyncio
import base64
import ssl as ssl_module

import grpc

from chronoq import __version__
# (answer_of: a C function in the compiled build, h2channel.pxd)
from chronoq.client.answer import answer_of, http_error, rpc_error
# HTTP/2, HPACK and gRPC's framing are chronoq.protocol.h2's, shared with the server.
from chronoq.protocol.h2 import (ACK, CANCEL, CONTINUATION, DATA, END_HEADERS, END_STREAM, FRAME_HEAD, GOAWAY,
                                 HEADERS, HEADERS_EXTRAS, MAX_FRAME_LENGTH, MESSAGE_PREFIX, NO_ERROR, PADDED, PING,
                                 PREFACE, PROTOCOL_ERROR, REFUSED_STREAM, RST_STREAM, SETTINGS, SETTINGS_ACK,
                                 S_ENABLE_PUSH, S_HEADER_TABLE_SIZE, S_INITIAL_WINDOW_SIZE, S_MAX_CONCURRENT_STREAMS,
                                 S_MAX_FRAME_SIZE, U32, WINDOW_UPDATE, Decoder, HpackError, RequestEncoder, frame,
                                 goaway_frame, header_fragment, literal_block, parse_goaway, parse_settings,
                                 read_frames, rst_stream_frame, settings_frame, timeout_text, trailers, unpad,
                                 window_increment)
# (from their modules: the compiled build's _Call and _Connection extend these C types, and calls
# literal as a C function, h2channel.pxd)
from chronoq.protocol.h2.flow import ConnectionWindows, StreamWindows
from chronoq.protocol.h2.hpackenc import literal

OUR_STREAM_WINDOW = 8 << 20    # what a server may send per call before we grant more
OUR_CONN_WINDOW = 32 << 20     # and on the whole connection
MAX_FRAME_IN = MAX_FRAME_LENGTH  # the largest frame we accept: the protocol's limit
MAX_HEADER_BLOCK = 1 << 20     # an answer's header block, before decoding

_NO_DEADLINE = float("inf")

# Header fields that stay the same call after call: sent once with incremental indexing, then as a
# one-byte reference into the server's table. Per-call values (request id, date, deadline) stay
# literals that touch no table.
STABLE_NAMES = frozenset((":path", ":authority", "content-type", "te", "grpc-accept-encoding", "user-agent",
                          "x-mq-client-id", "x-mq-language", "x-mq-protocol", "x-mq-client-version",
                          "x-mq-namespace"))


def _table_neutral(*blocks: bytes) -> dict[bytes, list[tuple[str, str]]]:
    """Header blocks -> their fields, for blocks that neither read nor change a decoder's dynamic
    table (literals without indexing, static references): their fields are the same every time,
    so they need no decoding when they come again."""
    out = {}
    for block in blocks:
        decoder = Decoder()
        fields = decoder.decode(block)
        assert not decoder.table, "a block that changes the table"
        out[block] = fields
    return out


# What chronoq's server answers every successful call with (chronoq.server.h2streams): two
# constant header blocks that touch no HPACK table. Other blocks are decoded as they come.
_KNOWN_BLOCKS = _table_neutral(literal_block([(":status", "200"), ("content-type", "application/grpc")]),
                               trailers(0, None))


class _Call(StreamWindows):
    __slots__ = ("id", "future", "headers", "trailers", "data", "pending", "deadline")

    def __init__(self, stream_id: int, future: asyncio.Future, send_window: int, deadline: float) -> None:
        self.send_window = send_window  # (StreamWindows' counters, set here: no call per call)
        self.recv_unacked = 0
        self.id = stream_id
        self.future = future
        self.headers: list[tuple[str, str]] | None = None
        self.trailers: list[tuple[str, str]] | None = None
        self.data = b""                  # the answer's DATA (bytes for one frame, a bytearray past it)
        self.pending = b""               # request bytes waiting for flow-control window
        self.deadline = deadline         # loop time; inf without one


class _Connection(ConnectionWindows):
    """One HTTP/2 connection and its calls. Everything runs on the event loop thread."""

    def __init__(self, authority: str, scheme: str) -> None:
        ConnectionWindows.__init__(self, OUR_CONN_WINDOW, OUR_STREAM_WINDOW)
        self.authority, self.scheme = authority, scheme
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.calls: dict[int, _Call] = {}
        self.next_id = 1
        self.decoder = Decoder()
        self.headers = RequestEncoder(authority, scheme, f"chronoq-python/{__version__}", STABLE_NAMES)
        # (path, timeout, fixed metadata) -> (the encoder's state when made, header block)
        self._blocks: dict[tuple, tuple[tuple[int, int], bytes]] = {}
        self.loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None  # the one deadline timer, at _timer_at
        self._timer_at = _NO_DEADLINE
        self.peer_max_frame = 16_384
        self.peer_max_streams = 1 << 31
        self.closed = False
        self.goaway_last: int | None = None     # the server will not take streams above this
        self.error: str = ""
        self._header_call = 0                   # a header block continues on this stream
        self._header_flags = 0
        self._header_parts: list[bytes] = []
        self._room: asyncio.Event | None = None  # set when a stream slot frees up

    @property
    def usable(self) -> bool:
        return not self.closed and self.goaway_last is None and self.next_id < (1 << 31) - 2

    # ----------------------------------------------------------------- asyncio.Protocol
    def connection_made(self, transport) -> None:
        self.transport = transport
        self.loop = asyncio.get_running_loop()
        transport.write(PREFACE + settings_frame((
            (S_ENABLE_PUSH, 0), (S_INITIAL_WINDOW_SIZE, OUR_STREAM_WINDOW), (S_MAX_FRAME_SIZE, MAX_FRAME_IN)))
                        + self.opening_update())

    def connection_lost(self, exc) -> None:
        self._close(self.error or f"connection lost{f': {exc}' if exc else ''}")

    # (asyncio.Protocol's defaults, which a compiled _Connection, a C type, cannot inherit: a
    # half-close closes the transport; a full write buffer does not stop the calls, as before)
    def eof_received(self) -> None:
        return None

    def pause_writing(self) -> None:
        pass

    def resume_writing(self) -> None:
        pass

    def data_received(self, data: bytes) -> None:
        if self.closed:  # (what still comes is dropped)
            return
        buf = self.buf
        buf += data
        end = 0
        try:  # (no frame is too long: we take the most the protocol allows)
            end, _too_long = read_frames(buf, MAX_FRAME_IN, self._frame)
        except (HpackError, ValueError) as exc:  # the server broke the protocol (FrameError too): give up
            self._abort(f"HTTP/2 protocol error from the server: {exc}")
        if end and not self.closed:
            del buf[:end]

    # ----------------------------------------------------------------- frames in
    def _frame(self, kind: int, flags: int, sid: int, payload: bytes) -> bool:
        """One frame from the server; True when the connection has ended (``read_frames`` stops)."""
        if self._header_call and kind != CONTINUATION:
            raise ValueError("a header block was interrupted")
        if kind == DATA:
            self._data(flags, sid, payload)
        elif kind == HEADERS:
            if flags & HEADERS_EXTRAS:
                payload = header_fragment(flags, payload)
            if flags & END_HEADERS:  # the whole block in this frame, as a rule
                self._end_headers(sid, flags, payload)
            else:
                self._header_call, self._header_flags, self._header_parts = sid, flags, [payload]
        elif kind == CONTINUATION:
            if sid != self._header_call or not sid:
                raise ValueError("CONTINUATION without a header block")
            self._header_parts.append(payload)
            if sum(map(len, self._header_parts)) > MAX_HEADER_BLOCK:
                raise ValueError("header block too large")
            if flags & END_HEADERS:
                parts = self._header_parts
                self._header_call, self._header_parts = 0, []
                self._end_headers(sid, self._header_flags, b"".join(parts))
        elif kind == SETTINGS:
            if not flags & ACK:
                self._settings(payload)
        elif kind == WINDOW_UPDATE:
            increment = window_increment(payload)
            if sid == 0:
                self.connection_update(increment)  # (FrameError, a ValueError: the connection's end)
                self._send_pending()
            else:
                call = self.calls.get(sid)
                if call is not None:
                    code = self.stream_update(call, increment)
                    if code:  # the server broke the stream's flow control: the call fails, the stream is reset
                        del self.calls[sid]
                        self.transport.write(rst_stream_frame(sid, code))
                        self._freed()
                        self._fail(call, rpc_error(
                            grpc.StatusCode.INTERNAL,
                            f"the server's WINDOW_UPDATE broke flow control (HTTP/2 error {code})"))
                    else:
                        self._send_pending()
        elif kind == PING:
            if not flags & ACK:
                self.transport.write(frame(PING, ACK, 0, payload))
        elif kind == RST_STREAM:
            call = self.calls.pop(sid, None)
            if call is not None:
                code = U32.unpack(payload)[0] if len(payload) == 4 else PROTOCOL_ERROR
                self._freed()
                if code == REFUSED_STREAM:  # never processed: the caller may retry it
                    self._fail(call, _Refused())
                else:
                    self._fail(call, rpc_error(
                        grpc.StatusCode.CANCELLED if code == CANCEL else grpc.StatusCode.INTERNAL,
                        f"the server reset the stream (HTTP/2 error {code})"))
        elif kind == GOAWAY:
            last, code, debug = parse_goaway(payload)
            self.goaway_last = last
            reason = f"the server closed the connection (GOAWAY, HTTP/2 error {code}: " \
                     f"{debug[:192].decode('utf-8', 'replace') or 'no detail'})"
            for call_id in [i for i in self.calls if i > last]:
                self._fail(self.calls.pop(call_id), _Refused(reason))
            if not self.calls:
                self._abort("")
        # PRIORITY, PUSH_PROMISE (disabled by our SETTINGS) and unknown types are ignored
        return self.closed

    def _settings(self, payload: bytes) -> None:
        for key, value in parse_settings(payload):  # (FrameError, a ValueError, on a value out of range)
            if key == S_INITIAL_WINDOW_SIZE:
                self.peer_settings_window(value, self.calls.values())
            elif key == S_MAX_FRAME_SIZE:
                self.peer_max_frame = value
            elif key == S_MAX_CONCURRENT_STREAMS:
                self.peer_max_streams = value
            elif key == S_HEADER_TABLE_SIZE:
                self.headers.table_size(value)
        self.transport.write(SETTINGS_ACK)
        self._send_pending()

    def _end_headers(self, sid: int, flags: int, block: bytes) -> None:
        """A whole header block on stream ``sid`` (its HEADERS frame's ``flags``)."""
        fields = _KNOWN_BLOCKS.get(block)
        if fields is None:
            fields = self.decoder.decode(block)  # always: it keeps the decoder's table in step
        call = self.calls.get(sid)
        if call is None:
            return  # a call we gave up on (deadline, cancel)
        if call.headers is None:
            call.headers = fields
            # (pseudo-header fields come first: RFC 9113 §8.3)
            status = fields[0][1] if fields and fields[0][0] == ":status" else ""
            if status != "200":
                self._finish(call, http_error(status))
                return
            if flags & END_STREAM:  # trailers only: the status is in these headers
                call.trailers = fields
                self._finish(call, answer_of(fields, fields, call.data))
        else:
            call.trailers = fields
            if flags & END_STREAM:  # the answer is whole: its message, or its status's error
                self._finish(call, answer_of(call.headers, fields, call.data))

    def _data(self, flags: int, sid: int, payload: bytes) -> None:
        call = self.calls.get(sid)
        update = self.data_in(sid, call if call is not None and not flags & END_STREAM else None, len(payload))
        if call is not None:
            if flags & PADDED:
                payload = unpad(payload)
            data = call.data
            if not data:
                call.data = payload  # one DATA frame, as a rule: no copy
            elif type(data) is bytes:
                call.data = bytearray(data) + payload
            else:
                data += payload
            if flags & END_STREAM:
                self._finish(call, rpc_error(grpc.StatusCode.INTERNAL, "the answer ended without trailers"))
        if update:
            self.transport.write(update)

    # ----------------------------------------------------------------- calls
    def _finish(self, call: _Call, outcome) -> None:
        if self.calls.pop(call.id, None) is not None and self._room is not None:
            self._room.set()  # (``_freed``, inline: once per call)
        if isinstance(outcome, BaseException):
            self._fail(call, outcome)
        elif not call.future.done():
            call.future.set_result(outcome)
        if self.goaway_last is not None and not self.calls:
            self._abort("")

    @staticmethod
    def _fail(call: _Call, exc: BaseException) -> None:
        if not call.future.done():
            call.future.set_exception(exc)

    def _freed(self) -> None:
        if self._room is not None:
            self._room.set()

    async def wait_for_slot(self) -> None:
        """Wait while the server's limit of concurrent streams is reached (and the connection usable)."""
        while len(self.calls) >= self.peer_max_streams and self.usable:
            if self._room is None:
                self._room = asyncio.Event()
            self._room.clear()
            await self._room.wait()

    def _header_block(self, path: str, timeout: float | None, fixed, metadata) -> bytes:
        """The call's header block. Its constant part (request fields, deadline, ``fixed``) is
        encoded once and reused while the HPACK table copy is unchanged; ``metadata`` each call."""
        encoder = self.headers
        key = (path, timeout, fixed)
        cached = self._blocks.get(key)
        # A block of references stays valid until the table changes: an insertion, or a smaller
        # table announced by the server (the limit drops; a size update opens the next block).
        state = (encoder.inserted, encoder.limit)
        try:
            if cached is not None and cached[0] == state:
                block = cached[1]
            else:
                clean = not encoder.pending_update
                fields = [encoder.request(path)]
                if timeout is not None:
                    fields.append(literal("grpc-timeout", timeout_text(timeout)))
                self._fields(fixed, fields)
                block = b"".join(fields)
                if clean and encoder.inserted == state[0]:  # references only
                    if len(self._blocks) >= 64:
                        self._blocks.clear()
                    self._blocks[key] = (state, block)
            if not metadata:
                return block
            out = [block]
            self._fields(metadata, out)
            return b"".join(out)
        except (UnicodeError, TypeError, ValueError) as exc:
            # Fields indexed for this block may be in our copy of the server's table but will never
            # reach it: no later call may reference them. Calls already sent finish normally.
            self.goaway_last = self.next_id - 2
            raise rpc_error(grpc.StatusCode.INTERNAL, f"cannot encode the call's headers: {exc}") from None

    def _fields(self, metadata, out: list) -> None:
        """Each ``(key, value)`` of ``metadata`` encoded, appended to ``out`` (``-bin`` values in
        base64); only the stable names go through the table (``RequestEncoder.field``)."""
        field, stable = self.headers.field, self.headers.stable
        for key, value in metadata:
            if key.endswith("-bin"):
                value = base64.b64encode(value if isinstance(value, bytes) else value.encode()).rstrip(b"=")
            out.append(field(key, value) if key in stable else literal(key, value))

    def send(self, path: str, fixed, metadata, timeout: float | None, message: bytes) -> _Call:
        """Start one call on this (usable) connection: its HEADERS and, as far as the windows
        allow, its message go out in one write; ``await call.future`` for its answer's message
        bytes (or AioRpcError). ``fixed``: metadata that repeats call after call (a tuple),
        ``metadata`` the rest."""
        block = self._header_block(path, timeout, fixed, metadata)
        sid = self.next_id
        self.next_id += 2
        loop = self.loop
        call = _Call(sid, loop.create_future(), self.peer_initial_window,
                     _NO_DEADLINE if timeout is None else loop.time() + timeout)
        self.calls[sid] = call
        # HEADERS, then the message: in one DATA frame when the windows and the frame size allow
        # (the usual case: one write, the message copied once), else as far as they allow (_take).
        n, size = len(block), len(message) + 5
        head = FRAME_HEAD.pack(n >> 8, n & 0xFF, HEADERS, END_HEADERS, sid)
        if size <= self.peer_max_frame and size <= call.send_window and size <= self.peer_window:
            call.send_window -= size  # (ConnectionWindows.spend, inline)
            self.peer_window -= size
            self.transport.write(b"".join((head, block, FRAME_HEAD.pack(size >> 8, size & 0xFF, DATA, END_STREAM, sid),
                                           MESSAGE_PREFIX.pack(0, len(message)), message)))
        else:
            call.pending = MESSAGE_PREFIX.pack(0, len(message)) + message
            self.transport.write(head + block + self._take(call))
        # The deadline: one timer per connection, at the earliest of its calls' deadlines.
        if call.deadline < self._timer_at:
            self._arm(call.deadline)
        return call

    def _arm(self, when: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = when
        self._timer = self.loop.call_at(when, self._expire_due)

    def _expire_due(self) -> None:
        """The deadline timer: end the calls whose deadline has come, wait for the next one."""
        self._timer, self._timer_at = None, _NO_DEADLINE
        now = self.loop.time() + 0.001  # (a timer may fire a little early: the loop's clock resolution)
        due = [call for call in self.calls.values() if call.deadline <= now]
        for call in due:
            if not call.future.done():
                call.future.set_exception(rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))
            self._give_up(call)
        if self.calls and not self.closed:
            nearest = min(call.deadline for call in self.calls.values())
            if nearest < _NO_DEADLINE:
                self._arm(nearest)

    def _take(self, call: _Call) -> bytes:
        """DATA frames for as much of ``call.pending`` as the windows allow; END_STREAM on the last."""
        pending = call.pending
        frames, taken = self.data_out(call.id, call, pending, self.peer_max_frame, END_STREAM)
        call.pending = pending[taken:] if taken < len(pending) else b""
        return b"".join(frames)

    def _send_pending(self) -> None:
        out = [self._take(call) for call in self.calls.values() if call.pending]
        if out:
            self.transport.write(b"".join(out))

    def _give_up(self, call: _Call) -> None:
        """The caller stopped waiting (deadline, cancel): reset the stream; its answer is dropped."""
        if self.calls.pop(call.id, None) is not None and not self.closed:
            self.transport.write(rst_stream_frame(call.id, CANCEL))
            self._freed()

    # ----------------------------------------------------------------- closing
    def _abort(self, reason: str) -> None:
        self.error = reason
        if self.transport is not None and not self.closed:
            if reason:
                self.transport.write(goaway_frame(0, PROTOCOL_ERROR))
            self.transport.close()
        self._close(reason or "connection closed")

    def _close(self, reason: str) -> None:
        self.closed = True
        self._stop_timer()
        calls, self.calls = list(self.calls.values()), {}
        for call in calls:
            self._fail(call, rpc_error(grpc.StatusCode.UNAVAILABLE, reason))
        self._freed()

    def close(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.write(goaway_frame(0, NO_ERROR))
            self.transport.close()
        self.closed = True
        self._stop_timer()
        calls, self.calls = list(self.calls.values()), {}
        for call in calls:
            self._fail(call, rpc_error(grpc.StatusCode.CANCELLED, "the channel was closed"))
        self._freed()


    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._timer_at = None, _NO_DEADLINE


class _Refused(Exception):
    """The server did not process the call (REFUSED_STREAM, or above a GOAWAY's last stream)."""


class Channel:
    """Unary gRPC calls to ``target`` ("host:port") over one HTTP/2 connection.

    ``ssl``: an ``ssl.SSLContext`` for TLS (ALPN ``h2`` is set on it), or None for plaintext.
    """

    def __init__(self, target: str, *, ssl: ssl_module.SSLContext | None = None) -> None:
        host, sep, port = target.rpartition(":")
        if not sep or not port.isdigit():
            raise ValueError(f"target {target!r} should be host:port")
        self.host, self.port = host.strip("[]"), int(port)
        self.authority = target
        self.ssl = ssl
        if ssl is not None:
            ssl.set_alpn_protocols(["h2"])
        self._scheme = "https" if ssl is not None else "http"
        self._conn: _Connection | None = None
        self._connecting: asyncio.Future | None = None
        self._closed = False

    def unary_unary(self, path: str, request_serializer=None, response_deserializer=None) -> "UnaryMethod":
        return UnaryMethod(self, path, request_serializer, response_deserializer)

    async def _connection(self, timeout: float | None) -> _Connection:
        conn = self._conn
        if conn is not None and conn.usable:
            return conn
        if self._closed:
            raise rpc_error(grpc.StatusCode.CANCELLED, "the channel was closed")
        if self._connecting is None:  # one connect for all the callers that need it now
            self._connecting = asyncio.ensure_future(self._open())
        try:
            return await asyncio.wait_for(asyncio.shield(self._connecting), timeout)
        except asyncio.TimeoutError:
            raise rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded while connecting") from None

    async def _open(self) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            _transport, conn = await loop.create_connection(
                lambda: _Connection(self.authority, self._scheme), self.host, self.port, ssl=self.ssl,
                server_hostname=self.host if self.ssl is not None else None)
        except (OSError, ssl_module.SSLError) as exc:
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, f"failed to connect to {self.authority}: {exc}") from None
        finally:
            self._connecting = None
        if self.ssl is not None and _transport.get_extra_info("ssl_object").selected_alpn_protocol() != "h2":
            conn.close()
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, f"{self.authority} does not speak HTTP/2 over TLS (ALPN)")
        old, self._conn = self._conn, conn
        if old is not None and not old.calls:
            old.close()
        return conn

    async def call(self, path: str, request: bytes, metadata, timeout: float | None, fixed=(),
                   deserialize=None):
        """One unary call: its answer's message (``deserialize``d when given), or AioRpcError.
        ``fixed``: metadata that repeats call after call, as a tuple (its header fields are encoded
        once per connection); ``metadata`` the rest, encoded each call."""
        for attempt in (1, 2):  # a call the server never processed is tried once more
            conn = self._conn
            call = None
            try:
                if conn is None or not conn.usable or len(conn.calls) >= conn.peer_max_streams:
                    conn, timeout = await self._ready(timeout)
                call = conn.send(path, fixed, metadata, timeout, request)
                answer = await call.future
                return answer if deserialize is None else deserialize(answer)
            except _Refused as exc:
                if attempt == 2:
                    raise rpc_error(grpc.StatusCode.UNAVAILABLE,
                                    f"the server refused the call twice: {exc or 'stream refused'}") from None
                if call is not None and timeout is not None:  # what is left of the call's deadline
                    timeout = call.deadline - conn.loop.time()
                    if timeout <= 0:  # (never sent with none left: the server would still serve it)
                        raise rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded") from None
            except asyncio.CancelledError:
                if call is not None:
                    conn._give_up(call)
                raise
        raise AssertionError("unreachable")

    async def _ready(self, timeout: float | None) -> tuple[_Connection, float | None]:
        """A usable connection with room for one more stream (connected or waited for), and what
        is left of ``timeout`` then."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        conn = await self._connection(timeout)
        if deadline is None:
            await conn.wait_for_slot()
        else:  # the wait for a free stream counts against the deadline, and a call past it is not sent
            # (it was sent with 0 left once a stream came free, and stored while its caller had
            # been told DEADLINE_EXCEEDED)
            try:
                await asyncio.wait_for(conn.wait_for_slot(), max(deadline - loop.time(), 0.0))
            except asyncio.TimeoutError:
                raise rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded while waiting for a stream: "
                                f"{len(conn.calls)} calls on this connection, the server's limit") from None
        if not conn.usable:
            raise _Refused()
        if deadline is None:
            return conn, None
        left = deadline - loop.time()
        if left <= 0:
            raise rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded")
        return conn, left

    async def close(self) -> None:
        self._closed = True
        if self._conn is not None:
            self._conn.close()
            self._conn = None


class UnaryMethod:
    """A unary method of a ``Channel``, called like grpc's ``UnaryUnaryMultiCallable``."""

    __slots__ = ("channel", "path", "serialize", "deserialize")

    def __init__(self, channel: Channel, path: str, serialize, deserialize) -> None:
        self.channel = channel
        self.path = path
        self.serialize, self.deserialize = serialize, deserialize

    def __call__(self, request, *, metadata=None, timeout: float | None = None, fixed=()):
        """The call, as a coroutine. ``fixed`` (not in grpc's API): ``Channel.call``'s."""
        raw = request if self.serialize is None else self.serialize(request)
        return self.channel.call(self.path, raw, metadata, timeout, fixed, self.deserialize)
