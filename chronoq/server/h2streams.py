"""The streams of chronoq's HTTP/2 server (``chronoq.server.h2server``) and how their answers leave.

``Stream`` is one call on a connection: its request bytes in (cut into gRPC messages), its
answer out (HEADERS once, then DATA, then trailers). ``Answers`` is the connection's output
side (a mixin of ``h2server.Connection``): frames are buffered and leave once per event-loop
pass, and answer bytes wait, per stream and oldest first, for the peer's flow-control windows
(stream and connection) without holding up any other stream.
"""

from __future__ import annotations

import asyncio
import zlib

import grpc

from chronoq.core import refusals as R
from chronoq.protocol.h2 import (DATA, MESSAGE_PREFIX, MessageTooLarge, Parts, UnsupportedEncoding, cut_messages,
                                 literal_block, trailers)
# (from their modules: the compiled build cimports these, h2streams.pxd)
from chronoq.protocol.h2.flow import ConnectionWindows, StreamWindows
from chronoq.protocol.h2.frames import frame, frame_head, headers_frame
from chronoq.server.callstats import NO_ANSWER, STATUS_ANSWER_PREFIXES, UNKNOWN_METHOD, answer_code

FLUSH_BYTES = 64 << 10            # buffered output beyond this is written at once
PEER_CLOSED_KEPT = 64            # streams the client closed, remembered to catch frames sent after

_ANSWER_HEADERS = literal_block([(":status", "200"), ("content-type", "application/grpc")])
_OK_TRAILERS = trailers(0, None)


def status_code(code) -> int:
    """A ``grpc.StatusCode`` (or an int) as the int ``grpc-status`` carries."""
    if isinstance(code, grpc.StatusCode):
        return code.value[0]
    return int(code)


class StreamClosed(Exception):
    """The stream or connection went away while a handler wrote."""


class Stream(StreamWindows):
    """One call: request bytes in, answer frames out, and the task running the handler."""

    __slots__ = ("conn", "id", "buf", "queue", "half_closed", "cancelled", "ended", "headers_sent",
                 "blocked", "window_open", "task", "deserializer", "serializer", "encoding", "ready", "counted",
                 "method", "started", "answer", "reset_due")

    def __init__(self, conn, stream_id: int, send_window: int) -> None:
        self.send_window = send_window  # (StreamWindows' counters, set here: no call per stream)
        self.recv_unacked = 0
        self.conn = conn
        self.id = stream_id
        self.buf = bytearray()          # request bytes not yet cut into messages
        self.queue: asyncio.Queue | None = None  # parsed request messages for streaming handlers
        self.half_closed = False        # the client sent END_STREAM
        self.cancelled = False
        self.ended = False              # we sent END_STREAM (or RST_STREAM)
        self.headers_sent = False
        self.blocked: list[bytes] = []  # answer bytes waiting for flow-control window
        self.window_open: asyncio.Event | None = None
        self.task = None  # the call past its first step: an asyncio.Task or h2calls._Waiting
        self.deserializer = None
        self.serializer = None
        self.encoding = "identity"
        self.ready: asyncio.Future | None = None  # a unary call's task waits here for END_STREAM
        self.counted = 0                # request bytes held for a unary call (the connection's cap)
        self.method = UNKNOWN_METHOD    # the handler's path, once one was found (h2calls)
        self.started = conn.loop.time()  # for the call's latency; 0.0 once it was counted
        self.answer = NO_ANSWER         # RocketMQ code of the last MessagingService answer (callstats)
        self.reset_due: int | None = None  # RST_STREAM code to send once its waiting trailers leave

    # ------------------------------------------------------------------ requests
    def messages(self) -> list[bytes]:
        """Cut complete gRPC messages off the buffer (decompressed)."""
        limit = self.conn.server.max_receive
        try:
            return cut_messages(self.buf, limit, self.encoding)
        except MessageTooLarge as exc:  # refused on its length prefix, before its bytes are held
            self.conn.refuse(R.MESSAGE_TOO_LARGE, str(exc))
            raise CallError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                             f"Received message larger than max ({exc.length} vs. {limit})") from None
        except UnsupportedEncoding as exc:
            if self.encoding == "identity":  # the compressed flag with no grpc-encoding: gRPC says INTERNAL
                raise CallError(grpc.StatusCode.INTERNAL, "a compressed message without grpc-encoding") from None
            raise CallError(grpc.StatusCode.UNIMPLEMENTED, str(exc)) from None
        except zlib.error as exc:
            raise CallError(grpc.StatusCode.INTERNAL, f"cannot decompress the request: {exc}") from None

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
        # Our blocks are small (a few hundred bytes at most): one HEADERS frame, no CONTINUATION.
        return headers_frame(self.id, _ANSWER_HEADERS, False)

    async def send_message(self, data: bytes) -> None:
        if self.put_message(data):
            await self.sent()

    def put_message(self, data) -> bool:
        """Queue one answer message, bytes or ``Parts`` (as much as the windows allow leaves with
        the loop pass's writes); True when the caller must wait (``sent``) before it writes more:
        the message waits for window, or the transport is paused. (Not a coroutine: most answers
        never wait.)"""
        if self.ended or self.cancelled:
            raise StreamClosed("the call has ended")
        parts = type(data) is Parts
        if self.method.startswith(STATUS_ANSWER_PREFIXES):
            code = answer_code(data.buffers[0] if parts else data)  # (a Status is the first field)
            if code != NO_ANSWER:
                self.answer = code
        conn = self.conn
        n = len(data)
        # Bounded while this peer, or any peer of this server, leaves answers untaken.
        if conn.waiting or conn.paused or conn.server.unread_answers.held:
            conn.room_for_answer(MESSAGE_PREFIX.size + n)
        if parts:
            conn.send_data(self, self._head(), Parts(MESSAGE_PREFIX.pack(0, n) + data.buffers[0], *data.buffers[1:]))
        else:
            conn.send_data(self, self._head(), MESSAGE_PREFIX.pack(0, n) + data)
        return bool(self.blocked) or conn.paused

    async def sent(self) -> None:
        """Wait until what ``put_message`` queued has left for the transport (windows, pause)."""
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
            raise StreamClosed("the call has ended")

    def finish(self, code: int, details: str | None, metadata=()) -> None:
        """Trailers: the call's last frame."""
        if self.started:
            self.count_end(code)
        self.conn.release(self)
        if self.buf:  # a request that will never be read (the call failed or ended first): let it go
            self.buf = bytearray()
        if self.ended or self.cancelled:
            return
        block = _OK_TRAILERS if code == 0 and not details and not metadata else trailers(code, details, metadata)
        # (the headers test first: after an answer's message, no call to learn there is no head)
        self.conn.send_trailers(self, b"" if self.headers_sent else self._head(), headers_frame(self.id, block, True))

    def count_end(self, code: int) -> None:
        """Count the call once, with the status it ended with (chronoq.server.callstats)."""
        stats = self.conn.server.stats
        stats.call_ended(self.method, code, self.conn.loop.time() - self.started, self.answer)
        self.started = 0.0


class CallError(Exception):
    """The call ends with this gRPC status (its trailers); the connection and other calls go on."""

    def __init__(self, code, details: str) -> None:
        super().__init__(details)
        self.code = status_code(code)
        self.details = details


class Answers(ConnectionWindows):
    """The connection's output (the base of ``h2server.Connection``, which sets the state it uses:
    ``_out``, ``_out_bytes``, ``_reading``, ``paused``, ``_resumed``, the peer's windows and frame
    size, ``streams`` and ``waiting``)."""

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
            self.server.stats.bytes_out += len(data)
            self.transport.write(data)

    def _write_parts(self, first: bytes, rest: tuple) -> None:
        """A message's frame in parts (``Parts``): leaves now, after what is queued, its buffers
        handed to the transport as they are (one ``writev``), not joined."""
        out = self._out
        n = self._out_bytes + len(first)
        out.append(first)
        for buf in rest:
            n += len(buf)
            out.append(buf)
        if not self.closed:
            self.server.stats.bytes_out += n
            self.transport.writelines(out)
        out.clear()
        self._out_bytes = 0

    # ------------------------------------------------------------------ answers the peer leaves untaken
    # What a connection holds for its peer: ``held_answers``, the bytes in the blocked lists of the
    # streams in ``waiting`` (counted as they are queued, leave or are dropped, never summed), and
    # ``held_out``, the transport's buffer while paused (sampled at the pause and at each check).
    # Both are in the server's total too (``server.unread_answers``, h2limits.UnreadAnswers).
    # Ensures: held_answers == the bytes blocked in ``waiting``; both 0 once the connection is lost.

    def room_for_answer(self, nbytes: int) -> None:
        """Refuse (``CallError`` RESOURCE_EXHAUSTED) an answer of ``nbytes`` that would take what
        this connection holds for its peer past ``max_unread_answer_bytes``, or what all the
        server's connections hold past ``max_unread_answer_bytes_total`` (h2limits). Asked only
        while answers wait on the peer's windows or the transport is paused, so a peer that reads
        costs nothing here; a connection holding nothing takes one answer when the total has room
        for it or is empty."""
        if self.paused:  # since the last look the kernel took some, our writes added some
            self._see_out(self.transport.get_write_buffer_size())
        held = self.held_answers + self.held_out
        total = self.server.unread_answers
        if not held:
            # Its first answer: taken when the total has room or nothing is held anywhere (a lone
            # large answer is never refused); else many idle connections, each taking one answer
            # of up to 64 MiB, would hold that many times over.
            if total.held and not total.room(nbytes):
                self._refuse_answer(f"this server's connections hold {total.held} bytes of answers their peers "
                                    f"have not taken; another of {nbytes} would pass {total.cap}")
            return
        cap = self.limits.max_unread_answer_bytes
        if held + nbytes > cap:
            self._refuse_answer(f"this connection holds {held} bytes of answers its peer has not taken; "
                                f"another of {nbytes} would pass {cap}")
        if not total.room(nbytes):
            self._refuse_answer(f"this server's connections hold {total.held} bytes of answers their peers have "
                                f"not taken (this one {held}); another of {nbytes} would pass {total.cap}")

    def _refuse_answer(self, detail: str) -> None:
        detail += " (read the answers, or open the windows)"
        self.refuse(R.ANSWER_BUDGET, detail)
        raise CallError(grpc.StatusCode.RESOURCE_EXHAUSTED, detail)

    def _hold(self, nbytes: int) -> None:
        """``nbytes`` more (fewer when negative) wait in ``waiting`` for the peer's windows."""
        held = self.held_answers + nbytes
        assert held >= 0, f"answer bytes held below 0: {self.held_answers} {nbytes:+d}"
        self.held_answers = held
        self.server.unread_answers.add(nbytes)

    def _forget(self, stream: Stream) -> None:
        """``stream``'s waiting bytes will never leave (reset either way, cancelled, connection lost):
        no longer held. Its blocked list stays as it is: a handler still waiting reads it
        (``Stream.sent``) and learns that the call has ended."""
        if self.waiting.pop(stream.id, None) is not None:
            self._hold(-sum(map(len, stream.blocked)))

    def _see_out(self, size: int) -> None:
        """The transport buffers ``size`` bytes the peer has not read (0: it reads again, or is gone)."""
        self.server.unread_answers.add(size - self.held_out)
        self.held_out = size

    def drop_held(self) -> None:
        """The connection is lost: what it held goes with it, off the server's total. (Streams that
        failed while their answers waited are in ``waiting`` but no longer in ``streams``.)"""
        for stream in list(self.waiting.values()):
            self._forget(stream)
        self._see_out(0)
        assert self.held_answers == 0, f"{self.held_answers} answer bytes held after the connection was lost"

    def pause_writing(self) -> None:
        self.paused = True
        # (asyncio calls this as the buffer passes its high-water mark, not per write: cheap enough)
        self._see_out(self.transport.get_write_buffer_size())

    def resume_writing(self) -> None:
        self.paused = False
        self._see_out(0)
        self.unread_acks = 0  # the peer reads again: what it was sent has left
        if self._resumed is not None:
            self._resumed.set()

    async def drain(self) -> None:
        while self.paused and not self.closed:
            if self._resumed is None:
                self._resumed = asyncio.Event()
            self._resumed.clear()
            await self._resumed.wait()

    # ------------------------------------------------------------------ answers
    def send_data(self, stream: Stream, head: bytes, message: bytes) -> None:
        """Queue one framed gRPC message for ``stream``; sends as much as the windows allow."""
        if head:
            self._write(head)
        n = len(message)
        if not stream.blocked and n <= self.peer_max_frame and n <= stream.send_window and n <= self.peer_window:
            self.spend(stream, n)
            if type(message) is Parts:
                bufs = message.buffers
                self._write_parts(frame_head(DATA, 0, stream.id, n) + bufs[0], bufs[1:])
            else:
                self._write(frame(DATA, 0, stream.id, message))
            return
        if type(message) is Parts:  # it waits for window: its frames are cut from one buffer
            message = bytes(message)
        stream.blocked.append(message)
        self.waiting[stream.id] = stream
        self._hold(n)
        self._flush_stream(stream)

    def send_trailers(self, stream: Stream, head: bytes, block: bytes) -> None:
        if stream.blocked:  # trailers wait behind the data
            if head:
                self._write(head)
            stream.blocked.append(block)
            self._hold(len(block))
            stream.ended = True  # no more writes; the frames leave when the windows open
            self._flush_stream(stream)
            return
        stream.ended = True
        self._write(head + block if head else block)
        self.streams.pop(stream.id, None)
        if stream.half_closed:  # both sides ended it
            self.peer_ended(stream.id)

    def peer_ended(self, sid: int) -> None:
        """Remember that the client closed stream ``sid`` (``h2server.Connection.peer_closed``)."""
        ids = self.peer_closed
        if len(ids) >= PEER_CLOSED_KEPT:  # (cleared, not trimmed: one dict store a call)
            ids.clear()
        ids[sid] = None

    def answering(self, sid: int) -> Stream | None:
        """Stream ``sid`` if the peer may still get frames on it: open (``streams``), or a call that
        failed while its answer waited (``h2server.Connection._fail_call``: it left ``streams``, its
        answer and trailers wait in ``waiting`` until the peer opens its windows or resets it)."""
        stream = self.streams.get(sid)
        return stream if stream is not None else self.waiting.get(sid)

    def reset_after_answer(self, stream: Stream, code: int) -> None:
        """RST_STREAM ``code`` on an ended ``stream``: now, or once its trailers leave when they wait
        for window. Sent first, it would close the stream under them: the peer would never see
        the call's status, and frames after it break the protocol (RFC 9113 §5.1, "closed")."""
        if stream.id in self.waiting:
            stream.reset_due = code
        else:
            self._server_reset(stream.id, code)

    def _flush_stream(self, stream: Stream) -> None:
        # Only a waiting stream has bytes counted as held (``_hold``): one forgotten must not come here.
        assert self.waiting.get(stream.id) is stream, f"stream {stream.id} flushed but not waiting"
        write, max_frame = self._write, self.peer_max_frame
        blocked = stream.blocked
        left = 0  # bytes that left for the transport
        while blocked:
            item = blocked[0]
            if stream.ended and len(blocked) == 1:  # only the trailers (a HEADERS frame) remain
                write(item)
                left += len(item)
                blocked.clear()
                self.streams.pop(stream.id, None)
                break
            if self.room(stream) <= 0:  # a WINDOW_UPDATE (stream or connection) or SETTINGS resumes it
                break
            frames, taken = self.data_out(stream.id, stream, item, max_frame)
            for data in frames:
                write(data)
            left += taken
            if taken < len(item):  # the windows are spent
                blocked[0] = item[taken:]
                break
            blocked.pop(0)
        if left:
            self._hold(-left)
        if not blocked:
            self.waiting.pop(stream.id, None)
            if stream.window_open is not None:
                stream.window_open.set()
            if stream.reset_due is not None:  # last: over the reset budget it raises ConnError, and
                self._server_reset(stream.id, stream.reset_due)  # the counts above must be right by then

    def _unblock_all(self) -> None:
        """More connection window (or a larger initial window): oldest waiting streams first."""
        waiting = self.waiting
        if not waiting:  # (the usual case: a client's WINDOW_UPDATE every few KiB, nothing waits)
            return
        # Every stream here still owes its peer these bytes: a stream reset (either way) or cancelled
        # left ``waiting`` then (``_cancel`` -> ``_forget``). One that failed, and so left ``streams``,
        # is here until its answer and trailers have left: its peer is waiting for its status.
        for stream in list(waiting.values()):
            if stream.blocked:
                self._flush_stream(stream)
            else:  # (never: a stream leaves ``waiting`` with its last byte; kept as the safe way out)
                self._forget(stream)
