"""The calls of chronoq's HTTP/2 gRPC server: the handler's ``Context`` and how a call runs.

``Calls`` is the part of ``chronoq.server.h2grpc.Server`` that turns a stream whose HEADERS came
in (``chronoq.server.h2server``) into a running handler: ``_start_call`` takes the request's
header fields (path, deadline, encoding, the handler's metadata: ``request_head``), ``_launch`` runs the handler
*eagerly*, in the read that parsed the request, up to its first wait; a call that waits once is
resumed by its future's done-callback (``_Waiting``), and only one that waits again gets a task
(``_Resumed``); ``_run`` is the call from handler lookup to trailers, in the shapes
``grpc.aio`` knows (unary or streaming either way), with grpcio's statuses for what goes wrong.
"""

from __future__ import annotations

import asyncio
import collections.abc
import logging

import grpc

from chronoq.core import refusals as R
from chronoq.protocol.h2 import CANCEL, PROTOCOL_ERROR, Parts, request_head
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
        path, metadata, timeout, encoding, bad, malformed = request_head(fields)
        if malformed is not None:  # RFC 9113 section 8.1.1: a stream error, PROTOCOL_ERROR
            stream.conn.refuse(R.PROTOCOL, f"stream {stream.id}: {malformed}")
            stream.conn._reset(stream, PROTOCOL_ERROR)
            return
        if encoding is not None:
            stream.encoding = encoding
        deadline = stream.conn.loop.time() + timeout if timeout is not None else None
        context = Context(stream, metadata, deadline, stream.conn.loop)
        if bad or (timeout is not None and timeout <= 0):  # (a deadline already past: not served)
            stream.finish(status_code(grpc.StatusCode.INTERNAL if bad else grpc.StatusCode.DEADLINE_EXCEEDED),
                          f"bad request: {bad}" if bad else "Deadline Exceeded")
            stream.conn.streams.pop(stream.id, None)
            return
        if end_stream:
            stream.half_closed = True
        stream.conn._starting.append((stream, path, context))  # run when the read is parsed

    def _launch(self, stream: Stream, path: str, context: Context) -> None:
        """Run a call's handler now, up to its first wait; a call that waits goes on from the
        done-callback of what it waits on, and only one that waits twice gets a task.

        Most calls (an ack, a send under the async flush policy, a receive that finds messages)
        never wait: they answer within this step and cost no task, no loop pass and no
        done-callback. A call that waits once (a send's group commit, a unary request whose DATA
        has not come yet, in ``_run``) is resumed by its future's done-callback (``_Waiting``),
        and one that waits again goes on in a task from there (``_Resumed``). Handlers must not
        rely on ``asyncio.current_task()`` before their second wait."""
        coro = self._run(stream, path, context)
        try:
            waiting_on = coro.send(None)
        except StopIteration:
            return
        except asyncio.CancelledError:  # a handler awaited something cancelled: _run answered
            return
        if getattr(waiting_on, "_asyncio_future_blocking", False):
            stream.task = _Waiting(self, stream, coro, waiting_on)
        else:  # a bare yield (``asyncio.sleep(0)``): a task goes on at once
            self._go_on_in_a_task(stream, coro, waiting_on)

    def _go_on_in_a_task(self, stream: Stream, coro, waiting_on) -> asyncio.Task:
        task = stream.conn.loop.create_task(_Resumed(coro, waiting_on))
        stream.task = task
        self._calls.add(task)
        task.add_done_callback(self._calls.discard)
        return task

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
        if serialize is None or type(result) is Parts:  # (an answer encoded in parts leaves as they are)
            return stream.put_message(result)
        return stream.put_message(serialize(result))

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


class _Waiting:
    """A call waiting on its first future, resumed from that future's done-callback instead of a
    task (``Calls._launch``): a lone sync send waits once, for its group commit, and a task
    cost it ~7% of the broker's work (made, its steps scheduled, its result and callbacks).

    It stands for the task in ``Stream.task`` and ``Server._calls``: ``cancel`` cancels the
    future it waits on, as ``Task.cancel`` does, so the call sees ``CancelledError`` where it
    waits and its clean-up runs; when that future is done already (its wake-up is scheduled),
    the wake-up throws the cancellation in instead. If the call waits again, a task
    (``_Resumed``) goes on from there and takes its place (the done-callbacks added so far move
    to it)."""

    __slots__ = ("_server", "_stream", "_loop", "_coro", "_fut", "_must_cancel", "_state", "_callbacks",
                 "_finished")

    def __init__(self, server: Calls, stream: Stream, coro, fut) -> None:
        self._server = server
        self._stream = stream
        self._loop = stream.conn.loop
        self._coro = coro
        self._fut = fut
        self._must_cancel = False
        self._state = 0  # 0 waiting, 1 ended, 2 cancelled, 3 handed to a task
        self._callbacks: list | None = None
        self._finished: asyncio.Future | None = None  # made on demand (``finished``)
        fut._asyncio_future_blocking = False  # (what a task does with a future its coroutine yields)
        fut.add_done_callback(self._wake)
        server._calls.add(self)

    # --- what the connection and the server ask of a call's task
    def done(self) -> bool:
        return self._state != 0

    def cancelled(self) -> bool:
        return self._state == 2

    def cancel(self, msg=None) -> bool:
        if self._state:
            return False
        fut = self._fut
        if not fut.cancel(msg):  # done already: its wake-up (scheduled) throws the cancellation in
            self._must_cancel = True
        return True

    def add_done_callback(self, fn) -> None:
        if self._state:
            self._loop.call_soon(fn, self)
        elif self._callbacks is None:
            self._callbacks = [fn]
        else:
            self._callbacks.append(fn)

    def finished(self) -> asyncio.Future:
        """A future done once the call is (``Server.stop`` waits on it)."""
        if self._finished is None:
            self._finished = self._loop.create_future()
            if self._state:
                self._finished.set_result(None)
        return self._finished

    # --- the call's next step
    def _wake(self, fut) -> None:
        coro = self._coro
        try:
            if self._must_cancel:
                waiting_on = coro.throw(asyncio.CancelledError())
            else:
                waiting_on = coro.send(None)
        except StopIteration:
            self._end(1)
            return
        except asyncio.CancelledError:
            self._end(2)
            return
        except BaseException:
            self._end(1)
            raise
        # It waits again: a task goes on from here, in its place.
        self._state = 3
        self._server._calls.discard(self)
        task = self._server._go_on_in_a_task(self._stream, coro, waiting_on)
        callbacks, self._callbacks = self._callbacks, None
        for fn in callbacks or ():
            task.add_done_callback(fn)
        if self._finished is not None:
            task.add_done_callback(lambda _task, finished=self._finished: finished.done() or finished.set_result(None))
        self._coro = self._fut = None

    def _end(self, state: int) -> None:
        self._state = state
        # (and the stream: it holds this in ``task``, a cycle only the garbage collector would
        # break, with the stream's buffers in it: megabytes a call under a flood of failed calls)
        self._coro = self._fut = self._stream = None
        self._server._calls.discard(self)
        for fn in self._callbacks or ():
            self._loop.call_soon(fn, self)
        self._callbacks = None
        if self._finished is not None and not self._finished.done():
            self._finished.set_result(None)


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

