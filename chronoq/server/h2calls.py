"""The calls of chronoq's HTTP/2 gRPC server: the handler's ``Context`` and how a call runs.

``Calls`` is the part of ``chronoq.server.h2grpc.Server`` that turns a stream whose HEADERS came
in (``chronoq.server.h2server``) into a running handler: ``_start_call`` takes the request's
header fields (path, deadline, encoding, the handler's metadata: ``request_head``), ``_launch`` runs the handler
*eagerly*, in the read that parsed the request, up to its first wait, and only a call that waits
gets a task (``_Resumed``); ``_run`` is the call from handler lookup to trailers, in the shapes
``grpc.aio`` knows (unary or streaming either way), with grpcio's statuses for what goes wrong.
"""

from __future__ import annotations

import asyncio
import collections.abc
import logging

import grpc

from chronoq.protocol.h2 import CANCEL, request_head
from chronoq.server.h2server import ConnError
from chronoq.server.h2streams import CallError, Stream, StreamClosed, status_code

log = logging.getLogger("chronoq.h2")

class CallDetails:
    """What ``ServerInterceptor.intercept_service`` and generic handlers are given."""

    __slots__ = ("method", "invocation_metadata")

    def __init__(self, method: str, invocation_metadata: tuple) -> None:
        self.method = method
        self.invocation_metadata = invocation_metadata


class Abort(Exception):
    """Raised by ``Context.abort``: the call ends with the status set."""


class Context:
    """The handler's view of one call (the subset of ``grpc.aio.ServicerContext`` in use)."""

    __slots__ = ("_stream", "_metadata", "_deadline", "code", "details", "trailing_metadata", "_loop")

    def __init__(self, stream: "Stream", metadata: tuple, deadline: float | None, loop) -> None:
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
        self.code = status_code(code)

    def set_details(self, details: str) -> None:
        self.details = details

    def set_trailing_metadata(self, metadata) -> None:
        self.trailing_metadata = tuple(metadata)

    def cancelled(self) -> bool:
        return self._stream.cancelled

    def done(self) -> bool:
        return self._stream.ended

    async def abort(self, code, details: str = "", trailing_metadata=()) -> None:
        self.code = status_code(code)
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
            except ConnError as exc:  # our resets spend the connection's budget too: over it, the
                conn._conn_error(exc)  # connection ends here (outside a read: nothing else catches it)


class Calls:
    """How a call runs (a mixin of ``chronoq.server.h2grpc.Server``, which gives ``_handler``,
    ``_calls`` and ``max_receive``; the connection calls ``_start_call``, ``_launch`` and
    ``_unary_ready``)."""

    def _start_call(self, stream: Stream, fields: list, end_stream: bool) -> None:
        path, metadata, timeout, encoding, bad = request_head(fields)
        if encoding is not None:
            stream.encoding = encoding
        deadline = stream.conn.loop.time() + timeout if timeout is not None else None
        context = Context(stream, metadata, deadline, stream.conn.loop)
        if bad or not path:
            stream.finish(status_code(grpc.StatusCode.INTERNAL if bad else grpc.StatusCode.UNIMPLEMENTED),
                          f"bad request: {bad or 'no :path'}")
            stream.conn.streams.pop(stream.id, None)
            return
        if end_stream:
            stream.half_closed = True
        stream.conn._starting.append((stream, path, context))  # run when the read is parsed

    def _launch(self, stream: Stream, path: str, context: Context) -> None:
        """Run a call's handler now, up to its first wait; only a call that waits gets a task.

        Most calls (an ack, a send under the async flush policy, a receive that finds messages)
        never wait: they answer within this step and cost no task, no loop pass and no
        done-callback. A call that waits (a group commit, a long poll, a unary request whose DATA
        has not come yet, in ``_run``) goes on in a task from where it stopped
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

    def _unary_ready(self, stream: Stream) -> None:
        waiter = stream.ready
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _run(self, stream: Stream, path: str, context: Context) -> None:
        conn = stream.conn
        try:
            handler = await self._handler(CallDetails(path, context._metadata))
            if handler is None:
                raise CallError(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")
            stream.method = path  # a label of the call metrics: the broker's methods only
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
                if not stream.half_closed:  # its DATA has not all come: _unary_ready wakes it
                    stream.ready = conn.loop.create_future()
                    await stream.ready
                request = self._unary_request(stream)
            if handler.request_streaming and handler.response_streaming:
                result = await self._stream_out(handler.stream_stream(requests, context), stream)
            elif handler.request_streaming:
                result = await handler.stream_unary(requests, context)
                if self._answer(stream, result):
                    await stream.sent()
            elif handler.response_streaming:
                result = await self._stream_out(handler.unary_stream(request, context), stream)
            else:
                result = await handler.unary_unary(request, context)
                if self._answer(stream, result):
                    await stream.sent()
            code = context.code or 0
            stream.finish(code, context.details, context.trailing_metadata)
        except Abort:
            stream.finish(context.code or 2, context.details, context.trailing_metadata)
        except CallError as exc:
            stream.finish(exc.code, exc.details)
        except StreamClosed:
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
            elif stream.started:  # reset by the client, or its connection lost: never answered
                stream.count_end(1)  # CANCELLED

    def _unary_request(self, stream: Stream):
        """The request of a unary call whose DATA has all come (END_STREAM)."""
        messages = stream.messages()
        stream.conn.release(stream)
        if len(messages) != 1 or stream.buf:
            raise CallError(grpc.StatusCode.INTERNAL if messages or stream.buf else grpc.StatusCode.UNIMPLEMENTED,
                             "a unary call takes exactly one request message")
        data = messages[0]
        deserialize = stream.deserializer
        if deserialize is None:
            return data
        try:
            return deserialize(data)
        except Exception as exc:  # noqa: BLE001 - a malformed request is the client's error
            raise CallError(grpc.StatusCode.INTERNAL, f"Exception deserializing request: {exc}") from None

    def _answer(self, stream: Stream, result) -> bool:
        """Queue a unary call's answer; True when the caller must wait for it to leave (``Stream.sent``)."""
        if result is None:
            raise CallError(grpc.StatusCode.UNKNOWN, "the handler returned no response")
        serialize = stream.serializer
        return stream.put_message(serialize(result) if serialize is not None else result)

    async def _stream_out(self, produced, stream: Stream):
        if hasattr(produced, "__aiter__"):
            serialize = stream.serializer
            try:
                async for item in produced:
                    if stream.put_message(serialize(item) if serialize is not None else item):
                        await stream.sent()
            finally:
                # A call that ends early (client gone, cancelled) closes the generator now, so its
                # own clean-up (``finally``) runs at once, as under grpcio.
                await produced.aclose()
            return None
        return await produced  # a coroutine that writes with context.write


class _Resumed:
    """A coroutine that a task goes on with after its first step ran outside any task
    (``Calls._launch``): the task's first step gets what the coroutine waits on (a future, or
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

