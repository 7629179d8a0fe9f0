"""The transport of chronoq's gRPC server: HTTP/2 (RFC 9113) connections and streams on the event loop.

Why chronoq has its own: grpcio's server hands every call between its poller thread, its
event-engine threads and the loop thread (GIL hand-offs included). On small VMs, where a thread
wake-up costs tens of microseconds, that measured ~340 us of server CPU for a call that does
nothing (``bench/grpc_floor.py``: ~14 context switches per call). This server parses frames in
the loop's ``data_received`` and runs each call there, once the read's frames are parsed, up to
its first wait; a call that waits once goes on from its future's done-callback, only one that waits
again gets a task. A call costs a few dozen us.

The server is four modules, each importing only those below it, over a sans-IO protocol package:
``chronoq.server.h2grpc`` (``Server``: the part of ``grpc.aio.server`` chronoq uses, listening
sockets, TLS), ``chronoq.server.h2calls`` (the handler's ``Context`` and how a call runs, the
eager first step included), this one (one ``Connection``, an asyncio protocol, per client:
frames in, streams opened and ended, windows granted, the defences; its opening and its timers,
once per connection, are ``chronoq.server.h2opening``'s, plain Python) and
``chronoq.server.h2streams`` (a call's ``Stream``, and answers out within the peer's windows).
Frames, SETTINGS, HPACK and gRPC's message framing are ``chronoq.protocol.h2``'s, shared with the
client (``chronoq.client.h2channel``).

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
import logging

import grpc

from chronoq.core import refusals as R
from chronoq.protocol.h2 import (ACK, COMPRESSION_ERROR, CONTINUATION, DATA, END_HEADERS, END_STREAM,
                                 ENHANCE_YOUR_CALM, FRAME_SIZE_ERROR, GOAWAY, HEADERS, HEADERS_EXTRAS, INTERNAL_ERROR,
                                 MESSAGE_PREFIX, NO_ERROR, PADDED, PING, PREFACE, PRIORITY, PROTOCOL_ERROR,
                                 PUSH_PROMISE, REFUSED_STREAM, RST_STREAM, SETTINGS, SETTINGS_ACK, STREAM_CLOSED,
                                 S_INITIAL_WINDOW_SIZE, S_MAX_FRAME_SIZE, WINDOW_UPDATE, ConnectionWindows,
                                 FrameError, HeaderListTooLarge, HpackError, frame, goaway_frame, header_fragment,
                                 parse_settings, rst_stream_frame, unpad, window_increment)
# (from their modules: the compiled build cimports these, h2server.pxd)
from chronoq.protocol.h2.frames import read_frames
from chronoq.protocol.h2.hpackdec import Decoder
from chronoq.server import h2opening
from chronoq.server.h2limits import IdleWatch, TokenBucket
from chronoq.server.h2opening import OUR_CONN_WINDOW, OUR_MAX_FRAME, OUR_STREAM_WINDOW
from chronoq.server.h2streams import Answers, CallError, Stream, StreamClosed, status_code

log = logging.getLogger("chronoq.h2")

# What we advertise (OUR_STREAM_WINDOW, OUR_CONN_WINDOW, OUR_MAX_FRAME): chronoq.server.h2opening.
# Concurrent streams, connections, timeouts and the attack budgets: chronoq.server.h2limits
# (Server(limits=...)). The decoded header list's cap is advertised in SETTINGS_MAX_HEADER_LIST_SIZE.
MAX_HEADER_BLOCK = 256 << 10      # HEADERS + CONTINUATION bytes, before decoding
LINGER_S = 1.0                    # a failed connection drains the peer's frames this long (``_fail``)
READ_AHEAD_MESSAGES = 64          # a streaming call's unread requests before its window stops growing
BUFFERED_MAX = 64 << 20           # unary request bytes a connection may hold before its window stops growing


class Connection(Answers):
    """One HTTP/2 connection: frame parsing, streams, flow control (answers: ``Answers``), defences."""

    def __init__(self, server) -> None:
        """``server``: the ``chronoq.server.h2grpc.Server`` that accepted it (its limits, refusals and
        calls: ``_start_call``, ``_launch``, ``_unary_ready``)."""
        self.server = server
        ConnectionWindows.__init__(self, OUR_CONN_WINDOW, OUR_STREAM_WINDOW)
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
        self.streams: dict[int, Stream] = {}
        # Streams the client ended (END_STREAM, then our answer; or its RST_STREAM), the latest
        # up to PEER_CLOSED_KEPT: DATA or HEADERS on one of them breaks the protocol (STREAM_CLOSED).
        # Forgotten ones are treated as streams we reset: what comes on those is dropped.
        self.peer_closed: dict[int, None] = {}
        # Streams with answer bytes waiting for window, oldest first: a connection WINDOW_UPDATE
        # (clients send one every few KiB) looks at these, not at every open stream.
        self.waiting: dict[int, Stream] = {}
        self.held_answers = 0                    # their answer bytes (Answers._hold), in the server's total too
        self.held_out = 0                        # the transport's buffer as last seen while paused (Answers._see_out)
        self.last_stream = 0
        self.closed = False
        self.goaway_sent = False
        self.paused = False
        self._resumed: asyncio.Event | None = None
        self.peer_max_frame = 16_384
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

    # ------------------------------------------------------------------ asyncio.Protocol (and its timers: h2opening)
    def connection_made(self, transport) -> None:
        """The cap, our SETTINGS and the preface deadline: ``chronoq.server.h2opening`` (once per
        connection: not compiled), as are the idle checks that follow."""
        self.transport = transport
        h2opening.open_connection(self, transport)

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
        self.drop_held()
        if self._resumed is not None:
            self._resumed.set()

    def eof_received(self) -> None:
        """The peer half-closed: the transport closes (``asyncio.Protocol``'s default, which a
        compiled Connection, a C type, cannot inherit)."""
        return None

    def data_received(self, data: bytes) -> None:
        # What this read's calls answer (most answer within it, ``_launch_calls``), its SETTINGS
        # and PING acks and window updates leave in one send at the end: no loop pass to wait for.
        if self.closed:  # failed, lingering until its close (``_fail``): what comes is dropped
            return
        self.server.stats.bytes_in += len(data)
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
        if buf or not self.preface_seen:
            buf += data
        else:  # nothing held from the last read (the usual case): its frames are read from ``data``,
            buf = data  # and only a frame it cuts in two is held (``del`` below, on the copy)
        try:
            if not self.preface_seen:
                if len(buf) < len(PREFACE):
                    if not PREFACE.startswith(bytes(buf)):
                        raise ConnError(PROTOCOL_ERROR, "not an HTTP/2 connection preface")
                    return
                if buf[:len(PREFACE)] != PREFACE:
                    raise ConnError(PROTOCOL_ERROR, "not an HTTP/2 connection preface")
                del buf[:len(PREFACE)]
                self.preface_seen = True
            end, too_long = read_frames(buf, OUR_MAX_FRAME, self._frame)
            if buf is data:
                if end < len(data):
                    self.buf += memoryview(data)[end:]
            elif end:
                del buf[:end]
            if too_long and not self.closed:  # refused on its header, before its bytes are held
                raise ConnError(FRAME_SIZE_ERROR, f"frame of {too_long} bytes")
        except FrameError as exc:
            self._conn_error(ConnError(exc.code, str(exc)))
        except ConnError as exc:
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
        run to its end at once (``h2calls.Calls._launch``)."""
        starting, self._starting = self._starting, []
        if self.closed:
            return
        launch = self.server._launch
        for stream, path, context in starting:
            if not (stream.cancelled or stream.ended):  # not reset or failed meanwhile
                launch(stream, path, context)

    # ------------------------------------------------------------------ frames
    def _frame(self, kind: int, flags: int, sid: int, payload: bytes) -> bool:
        """One frame from the client; True when the connection has ended (``read_frames`` stops)."""
        if self._header_stream and kind != CONTINUATION:
            raise ConnError(PROTOCOL_ERROR, "a header block was interrupted")
        if kind == DATA:
            self._data(flags, sid, payload)
        elif kind == HEADERS:
            self._headers(flags, sid, payload)
        elif kind == CONTINUATION:
            if sid != self._header_stream or not sid:
                raise ConnError(PROTOCOL_ERROR, "CONTINUATION without a header block")
            self._continuations += 1  # frames, not bytes: zero-length ones count too
            if self._continuations > self.limits.max_continuations:
                raise ConnError(ENHANCE_YOUR_CALM, f"more than {self.limits.max_continuations} CONTINUATION "
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
                raise ConnError(PROTOCOL_ERROR if sid else FRAME_SIZE_ERROR, "bad PING")
            if not flags & ACK:
                self._control("PING")
                if self.paused:  # the peer does not read what we send: count the acks piling up
                    self._unread_ack()
                self._write(frame(PING, ACK, 0, payload))
            else:  # we send no PINGs: an ack answers nothing
                self._empty("an unsolicited PING ack")
        elif kind == RST_STREAM:
            if not sid or len(payload) != 4:
                raise ConnError(PROTOCOL_ERROR, "bad RST_STREAM")
            if not self.resets.take():  # rapid reset (CVE-2023-44487)
                raise ConnError(ENHANCE_YOUR_CALM, f"stream resets over the budget ({self.limits.reset_burst}, "
                                 f"then {self.limits.reset_rate:g}/s)", R.RAPID_RESET)
            stream = self.streams.pop(sid, None) or self.waiting.get(sid)  # (a failed call's answer waits)
            if stream is not None:
                self._cancel(stream)
            if sid <= self.last_stream:
                self.peer_ended(sid)
        elif kind == GOAWAY:
            # The client stops opening calls; those running finish. It closes when it is done.
            pass
        elif kind == PRIORITY:
            if not sid:
                raise ConnError(PROTOCOL_ERROR, "PRIORITY on stream 0")
            self._empty("PRIORITY")  # priorities are ignored here: the frame carries nothing
        elif kind == PUSH_PROMISE:
            raise ConnError(PROTOCOL_ERROR, "clients may not push")
        else:  # unknown frame types are ignored (RFC 9113 §4.1), within the empty-frame budget
            self._empty(f"frame type {kind}")
        return self.closed

    def _conn_error(self, exc: "ConnError") -> None:
        """A connection error: counted, then GOAWAY with its code and the connection closed."""
        self.refuse(exc.reason, str(exc))
        self._fail(exc.code, str(exc))

    def _empty(self, what: str) -> None:
        """A frame that carries nothing (CVE-2019-9518): within a budget."""
        if not self.empties.take():
            raise ConnError(ENHANCE_YOUR_CALM, f"frames carrying nothing over the budget ({self.limits.empty_burst}, "
                             f"then {self.limits.empty_rate:g}/s; last: {what})", R.EMPTY_FRAMES)

    def _control(self, what: str) -> None:
        """A PING or SETTINGS frame, which we must acknowledge: within a budget."""
        if not self.controls.take():
            raise ConnError(ENHANCE_YOUR_CALM, f"PING/SETTINGS frames over the budget ({self.limits.control_burst}, "
                             f"then {self.limits.control_rate:g}/s; last: {what})", R.CONTROL_FLOOD)

    def _unread_ack(self) -> None:
        """One more PING or SETTINGS ack queued while the transport is paused (CVE-2019-9512/9515)."""
        self.unread_acks += 1
        if self.unread_acks > self.limits.max_unread_acks:
            raise ConnError(ENHANCE_YOUR_CALM, f"more than {self.limits.max_unread_acks} PING/SETTINGS acks "
                             "queued unread", R.CONTROL_FLOOD)

    def _server_reset(self, sid: int, code: int) -> None:
        """RST_STREAM from us: it spends the same budget as the client's (MadeYouReset, CVE-2025-8671)."""
        if not self.resets.take():
            raise ConnError(ENHANCE_YOUR_CALM, f"streams reset by the server over the budget "
                             f"({self.limits.reset_burst}, then {self.limits.reset_rate:g}/s)", R.SERVER_RESETS)
        self._write(rst_stream_frame(sid, code))

    def _settings(self, flags: int, sid: int, payload: bytes) -> None:
        if sid:
            raise ConnError(PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & ACK:
            self._empty("a SETTINGS ack")  # one per SETTINGS we send (once): more carry nothing
            return
        if len(payload) % 6:
            raise ConnError(FRAME_SIZE_ERROR, "SETTINGS length")
        if len(payload) > 6 * self.limits.max_settings_entries:
            raise ConnError(ENHANCE_YOUR_CALM, f"more than {self.limits.max_settings_entries} entries in "
                             "one SETTINGS frame", R.CONTROL_FLOOD)
        self._control("SETTINGS")
        if not self.settings_seen:  # the preface is complete: from now on only idleness is timed
            h2opening.settings_seen(self)
        if self.paused:
            self._unread_ack()
        grown = False
        for key, value in parse_settings(payload):  # (FrameError on a value out of range)
            if key == S_INITIAL_WINDOW_SIZE:
                # (failed calls whose answers wait are open to the peer too: ``answering``)
                grown = self.peer_settings_window(value, (self.streams | self.waiting).values()) > 0 or grown
            elif key == S_MAX_FRAME_SIZE:
                self.peer_max_frame = value
            # HEADER_TABLE_SIZE: our answers never use the table. Others need nothing from us.
        self._write(SETTINGS_ACK)
        if grown:  # only after the ACK: a client checks our data against the windows it knows we have
            self._unblock_all()

    def _window_update(self, sid: int, payload: bytes) -> None:
        increment = window_increment(payload)
        if not sid:
            self.connection_update(increment)  # (FrameError: a connection error)
            self._unblock_all()
            return
        stream = self.answering(sid)
        if stream is None:
            return  # a stream that has ended: allowed
        code = self.stream_update(stream, increment)
        if code:
            self._reset(stream, code)
            return
        if stream.blocked:
            self._flush_stream(stream)

    def _headers(self, flags: int, sid: int, payload: bytes) -> None:
        if not sid or not sid & 1:
            raise ConnError(PROTOCOL_ERROR, f"HEADERS on stream {sid}")
        fragment = header_fragment(flags, payload) if flags & HEADERS_EXTRAS else payload  # (FrameError)
        if flags & END_HEADERS:  # the whole block in this frame (every HEADERS a gRPC client sends)
            if len(fragment) > MAX_HEADER_BLOCK:
                raise ConnError(ENHANCE_YOUR_CALM, f"header block over {MAX_HEADER_BLOCK} bytes", R.HEADER_LIST)
            self._header_block(sid, flags, fragment)
            return
        self._header_stream = sid  # CONTINUATION frames follow (_header_part)
        self._header_flags = flags
        self._header_parts = []
        self._header_size = 0
        self._continuations = 0
        if not fragment:
            self._empty("an empty HEADERS")
        self._header_part(fragment, flags)

    def _header_part(self, part: bytes, flags: int) -> None:
        """A part of a header block that CONTINUATION frames carry on."""
        self._header_size += len(part)
        if self._header_size > MAX_HEADER_BLOCK:
            raise ConnError(ENHANCE_YOUR_CALM, f"header block over {MAX_HEADER_BLOCK} bytes", R.HEADER_LIST)
        self._header_parts.append(part)
        if not flags & END_HEADERS:
            return
        sid, first_flags = self._header_stream, self._header_flags
        block = b"".join(self._header_parts)
        self._header_stream, self._header_parts = 0, []
        self._header_block(sid, first_flags, block)

    def _header_block(self, sid: int, first_flags: int, block: bytes) -> None:
        """A whole header block of stream ``sid`` (``first_flags``: its HEADERS frame's)."""
        fields = self.decoder.decode(block)  # always: the table must follow every block
        stream = self.streams.get(sid)
        if stream is not None:  # trailers of a streaming request: only END_STREAM matters
            if stream.half_closed:  # after its END_STREAM: RFC 9113 section 5.1, a stream error
                self._reset(stream, STREAM_CLOSED)
                self.refuse(R.PROTOCOL, f"HEADERS on stream {sid} after its END_STREAM")
            elif first_flags & END_STREAM:
                self._half_close(stream)
            return
        if sid <= self.last_stream:
            if sid in self.peer_closed:
                raise ConnError(STREAM_CLOSED, f"HEADERS on stream {sid}, which the client closed")
            raise ConnError(PROTOCOL_ERROR, f"stream {sid} reused or out of order")
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
        stream = Stream(self, sid, self.peer_initial_window)
        self.streams[sid] = stream
        self.server._start_call(stream, fields, bool(first_flags & END_STREAM))

    def _data(self, flags: int, sid: int, payload: bytes) -> None:
        if not sid:
            raise ConnError(PROTOCOL_ERROR, "DATA on stream 0")
        if not payload and not flags & END_STREAM:
            self._empty("an empty DATA")
        due = self.received(len(payload))
        try:
            self._stream_data(flags, sid, payload)
        finally:  # after the frame's bytes are counted as held (or not)
            if due:
                self._credit_connection()

    def _stream_data(self, flags: int, sid: int, payload: bytes) -> None:
        length = len(payload)
        if flags & PADDED:
            payload = unpad(payload)  # (FrameError on bad padding)
        stream = self.streams.get(sid)
        if stream is None or stream.half_closed:
            if stream is not None:  # half-closed (remote): RFC 9113 section 5.1, a stream error
                self._reset(stream, STREAM_CLOSED)
                self.refuse(R.PROTOCOL, f"DATA on stream {sid} after its END_STREAM")
            elif sid > self.last_stream:
                raise ConnError(PROTOCOL_ERROR, f"DATA on idle stream {sid}")
            elif sid in self.peer_closed:  # closed by the client itself: a connection error
                raise ConnError(STREAM_CLOSED, f"DATA on stream {sid}, which the client closed")
            return  # a stream we reset or finished: the data is dropped (window already counted)
        stream.buf += payload
        if stream.queue is None:  # unary: held until END_STREAM and the handler takes it
            stream.counted += len(payload)
            self.buffered += len(payload)
            server = self.server
            server.buffered_requests += len(payload)
            if server.buffered_requests > server.limits.max_buffered_request_bytes_total:
                server.shed_requests()  # (may end this very call: then nothing more to do here)
                if stream.ended or stream.cancelled or self.streams.get(sid) is not stream:
                    return
        if not flags & END_STREAM and self.stream_received(stream, length):
            self.credit(stream)
        try:
            if stream.queue is not None:  # streaming request: hand messages over as they complete
                for message in stream.messages():
                    stream.queue.put_nowait(message)
            else:
                held, limit = len(stream.buf), self.server.max_receive
                if held > limit + 5:
                    self.refuse(R.MESSAGE_TOO_LARGE, f"a request of more than {held - 5} bytes")
                    raise CallError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                     f"Received message larger than max ({held - 5} vs. {limit})")
                if held - len(payload) < 5 <= held:  # this frame completed the length prefix:
                    announced = MESSAGE_PREFIX.unpack_from(stream.buf)[1]  # refused before its bytes come
                    if announced > limit:
                        self.refuse(R.MESSAGE_TOO_LARGE, f"a message of {announced} bytes announced")
                        raise CallError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                         f"Received message larger than max ({announced} vs. {limit})")
        except CallError as exc:
            self._fail_call(stream, exc.code, exc.details)
            return
        if flags & END_STREAM:
            self._half_close(stream)

    def _credit_connection(self) -> None:
        """Grant the connection more window once half is used, unless unary requests not yet
        taken by their handlers hold BUFFERED_MAX: a client cannot make us hold more than that
        plus one window, however many streams it opens."""
        if self.recv_unacked >= self._conn_half and self.buffered < BUFFERED_MAX and not self.closed:
            self._write(self.grant_connection())

    def release(self, stream: Stream) -> None:
        """The stream's held request bytes are taken (or dropped): count them off the cap."""
        if stream.counted:
            self.buffered -= stream.counted
            self.server.buffered_requests -= stream.counted
            stream.counted = 0
            if self.recv_unacked >= self._conn_half:  # (the test first: no call per call)
                self._credit_connection()

    def credit(self, stream: Stream) -> None:
        """Grant the stream more window once half of it is used, unless its handler is behind:
        a streaming call whose handler does not read stops its client after one window."""
        if (not stream.half_closed and not self.closed
                and (stream.queue is None or stream.queue.qsize() < READ_AHEAD_MESSAGES)):
            update = self.grant_stream(stream.id, stream)
            if update:
                self._write(update)

    def _half_close(self, stream: Stream) -> None:
        stream.half_closed = True
        if stream.queue is not None:
            if stream.buf:
                self._fail_call(stream, status_code(grpc.StatusCode.INTERNAL), "the request ends inside a message")
                return
            stream.queue.put_nowait(None)
        else:
            self.server._unary_ready(stream)

    def _fail_call(self, stream: Stream, code: int, details: str) -> None:
        """End one call with a status (the client gets it; its task, if any, is cancelled)."""
        stream.finish(code, details)
        if stream.task is not None and not stream.task.done():
            stream.cancelled = True
            stream.task.cancel()
        self.streams.pop(stream.id, None)
        if not stream.half_closed:  # we want no more of its request (after its status: it may wait)
            self.reset_after_answer(stream, NO_ERROR)

    # ------------------------------------------------------------------ ending
    def _reset(self, stream: Stream, code: int) -> None:
        self.streams.pop(stream.id, None)
        self._cancel(stream)
        self._server_reset(stream.id, code)

    def _cancel(self, stream: Stream) -> None:
        self.release(stream)
        self._forget(stream)
        stream.buf = bytearray()  # its request bytes are never read now
        stream.cancelled = True
        if stream.task is not None and not stream.task.done():
            stream.task.cancel()
            # Its clean-up still runs: it counts against the stream cap until it is done.
            self.lingering += 1
            stream.task.add_done_callback(self._handler_done)
        if stream.queue is not None:
            stream.queue.put_nowait(StreamClosed("the call was cancelled"))
        if stream.window_open is not None:
            stream.window_open.set()

    def _handler_done(self, _task) -> None:
        self.lingering -= 1

    def _fail(self, code: int, reason: str) -> None:
        log.debug("closing connection from %s: %s", self.peer, reason)
        transport = self.transport
        if transport is not None and not self.closed:
            self._write(goaway_frame(self.last_stream, code, reason))
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
            self._write(goaway_frame(self.last_stream, NO_ERROR))

    def close(self) -> None:
        if self.transport is not None and not self.closed:
            self._flush_out()
            self.transport.close()


class ConnError(Exception):
    """A connection error: GOAWAY with ``code``, the message as its debug data, ``reason`` counted."""

    def __init__(self, code: int, message: str, reason: str = R.PROTOCOL) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason

