"""chronoq's HTTP/2 gRPC server (chronoq.server.h2server) against grpcio's client and raw sockets.

The service here is a small echo service built from grpc's own handler factories, so what is
tested is the transport: framing, flow control, statuses, deadlines, cancellation, compression,
interceptors and protocol errors. The RocketMQ service over it is tested in tests/integration.
"""

import asyncio
import socket
import struct

import grpc
import pytest

from chronoq.protocol import h2
from chronoq.server import h2calls, h2grpc, h2server

SERVICE = "test.Echo"  # bytes in, bytes out: no protobuf needed to test the transport


class Echo:
    def __init__(self) -> None:
        self.cancelled = asyncio.Event()
        self.closed_generators = 0
        self.gate: asyncio.Future | None = None  # what a b"gate" call waits on (set by the test)

    async def _until_cancelled(self, awaitable) -> None:
        """Await it; a cancellation is noted (``cancelled``) and goes on."""
        try:
            await awaitable
        except asyncio.CancelledError:
            self.cancelled.set()
            raise

    async def unary(self, request: bytes, context) -> bytes:
        if request == b"abort":
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, "no, thanks: ünïcode")
        if request == b"fail":
            raise RuntimeError("boom")
        if request == b"deadline":
            return str(round(context.time_remaining())).encode()
        if request == b"metadata":
            return repr(sorted(context.invocation_metadata())).encode()
        if request == b"sleep":
            await self._until_cancelled(asyncio.sleep(30))
        if request in (b"nap", b"nap-fail", b"twice"):  # a wait on a future, then an answer (or a failure)
            await asyncio.sleep(0.001)
            if request == b"nap-fail":
                raise RuntimeError("boom after a wait")
            if request == b"twice":
                await self._until_cancelled(asyncio.sleep(30))
        if request == b"gate":
            await self._until_cancelled(self.gate)
            return b"passed"
        if request == b"code":
            context.set_code(grpc.StatusCode.NOT_FOUND)
            context.set_details("set by hand")
            return b""
        return request

    async def stream_out(self, request: bytes, context):
        try:
            count, size = map(int, request.split(b"x"))
            for i in range(count):
                yield bytes([i % 256]) * size
        finally:
            self.closed_generators += 1

    async def stream_in(self, requests, context) -> bytes:
        total = 0
        async for r in requests:
            total += len(r)
        return str(total).encode()

    async def bidi(self, requests, context):
        async for r in requests:
            await context.write(r.upper())

    def handlers(self):
        return grpc.method_handlers_generic_handler(SERVICE, {
            "Unary": grpc.unary_unary_rpc_method_handler(self.unary),
            "StreamOut": grpc.unary_stream_rpc_method_handler(self.stream_out),
            "StreamIn": grpc.stream_unary_rpc_method_handler(self.stream_in),
            "Bidi": grpc.stream_stream_rpc_method_handler(self.bidi),
        })


class Tagging(grpc.aio.ServerInterceptor):
    """Refuses calls that carry ``x-refuse``; counts the rest."""

    def __init__(self) -> None:
        self.seen = 0

    async def intercept_service(self, continuation, details):
        self.seen += 1
        if any(k == "x-refuse" for k, _ in details.invocation_metadata):
            async def refuse(request, context):
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, "refused")
            return grpc.unary_unary_rpc_method_handler(refuse)
        return await continuation(details)


def run(coro_fn, **server_kw):
    async def main():
        echo, gate = Echo(), Tagging()
        server = h2grpc.Server(interceptors=[gate], **server_kw)
        server.add_generic_rpc_handlers((echo.handlers(),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            return await coro_fn(f"127.0.0.1:{port}", echo, gate)
        finally:
            await server.stop(0.5)

    return asyncio.run(main())


def test_unary_calls_statuses_metadata_and_deadlines():
    async def go(endpoint, echo, gate):
        async with grpc.aio.insecure_channel(endpoint) as ch:
            unary = ch.unary_unary(f"/{SERVICE}/Unary")
            assert await unary(b"hello", timeout=5) == b"hello"
            assert await unary(b"", timeout=5) == b""
            big = bytes(range(256)) * 12_000  # 3 MB: many DATA frames, window updates both ways
            assert await unary(big, timeout=10) == big
            assert 25 <= int(await unary(b"deadline", timeout=30)) <= 30
            md = (await unary(b"metadata", metadata=(("x-a", "1"), ("x-b-bin", b"\x00\xff")), timeout=5)).decode()
            assert "('x-a', '1')" in md and "('x-b-bin', b'\\x00\\xff')" in md
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await unary(b"abort", timeout=5)
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert err.value.details() == "no, thanks: ünïcode"
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await unary(b"fail", timeout=5)
            assert err.value.code() == grpc.StatusCode.UNKNOWN and "boom" in err.value.details()
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await unary(b"code", timeout=5)
            assert err.value.code() == grpc.StatusCode.NOT_FOUND and err.value.details() == "set by hand"
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await ch.unary_unary("/test.Echo/Nope")(b"x", timeout=5)
            assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await unary(b"x", metadata=(("x-refuse", "1"),), timeout=5)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            # Many at once on one connection.
            answers = await asyncio.gather(*(unary(str(i).encode(), timeout=10) for i in range(500)))
            assert answers == [str(i).encode() for i in range(500)]
            assert gate.seen >= 510

    run(go)


def test_compressed_requests_are_accepted():
    async def go(endpoint, echo, gate):
        for compression in (grpc.Compression.Gzip, grpc.Compression.Deflate):
            async with grpc.aio.insecure_channel(endpoint, compression=compression) as ch:
                body = b"compress me " * 1000
                assert await ch.unary_unary(f"/{SERVICE}/Unary")(body, timeout=5) == body

    run(go)


def test_oversized_requests_are_refused_and_the_connection_goes_on():
    async def go(endpoint, echo, gate):
        async with grpc.aio.insecure_channel(endpoint) as ch:
            unary = ch.unary_unary(f"/{SERVICE}/Unary")
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await unary(b"x" * 200_000, timeout=5)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert await unary(b"small", timeout=5) == b"small"

    run(go, max_receive_message_length=100_000)


def test_streams_both_ways_and_flow_control():
    async def go(endpoint, echo, gate):
        # A tiny client window: the server must wait for WINDOW_UPDATEs, not overrun it.
        async with grpc.aio.insecure_channel(endpoint, options=[("grpc.http2.lookahead_bytes", 16_384),
                                                                 ("grpc.http2.bdp_probe", 0)]) as ch:
            got = [m async for m in ch.unary_stream(f"/{SERVICE}/StreamOut")(b"40x100000", timeout=20)]
            assert len(got) == 40 and all(len(m) == 100_000 and m[0] == i % 256 for i, m in enumerate(got))

            async def chunks():
                for i in range(50):
                    yield b"y" * 10_000

            assert await ch.stream_unary(f"/{SERVICE}/StreamIn")(chunks(), timeout=10) == b"500000"
            call = ch.stream_stream(f"/{SERVICE}/Bidi")(timeout=10)
            for word in (b"one", b"two", b"three"):
                await call.write(word)
                assert await call.read() == word.upper()
            await call.done_writing()
            assert await call.read() == grpc.aio.EOF
            assert await call.code() == grpc.StatusCode.OK

    run(go)


def test_a_cancelled_call_cancels_its_handler_and_closes_its_generator():
    async def go(endpoint, echo, gate):
        async with grpc.aio.insecure_channel(endpoint) as ch:
            call = ch.unary_unary(f"/{SERVICE}/Unary")(b"sleep", timeout=30)
            await asyncio.sleep(0.2)
            call.cancel()
            await asyncio.wait_for(echo.cancelled.wait(), 5)
            stream = ch.unary_stream(f"/{SERVICE}/StreamOut")(b"1000x100000", timeout=30)
            await stream.read()
            stream.cancel()
            for _ in range(50):
                if echo.closed_generators:
                    break
                await asyncio.sleep(0.1)
            assert echo.closed_generators == 1
            assert await ch.unary_unary(f"/{SERVICE}/Unary")(b"still here", timeout=5) == b"still here"

    run(go)


# ---------------------------------------------------------------------------------- raw sockets
def _frames(data: bytes):
    pos = 0
    while len(data) - pos >= 9:
        hi, lo, kind, flags, sid = struct.unpack_from(">HBBBI", data, pos)
        length = hi << 8 | lo
        yield kind, flags, sid, data[pos + 9:pos + 9 + length]
        pos += 9 + length


def _read_until_quiet(s: socket.socket, wait_s: float) -> bytes:
    """Everything the server sends until the socket closes or stays quiet for ``wait_s``."""
    s.settimeout(wait_s)
    out = b""
    try:
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            out += chunk
    except socket.timeout:
        pass
    return out


def _raw(endpoint: str, payload: bytes, wait_s: float = 1.0) -> bytes:
    host, port = endpoint.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=wait_s) as s:
        s.sendall(payload)
        return _read_until_quiet(s, wait_s)


def _frame(kind, flags, sid, payload=b""):
    n = len(payload)
    return struct.pack(">HBBBI", n >> 8, n & 0xFF, kind, flags, sid) + payload


@pytest.mark.parametrize("payload, error_code", [
    (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", h2.PROTOCOL_ERROR),                     # not HTTP/2
    (h2.PREFACE + _frame(h2.HEADERS, 0x4, 1, b"\xbf\xff\xff\xff\x0f"), h2.COMPRESSION_ERROR),
    (h2.PREFACE + _frame(h2.DATA, 0x1, 0, b"x"), h2.PROTOCOL_ERROR),   # DATA on stream 0
    (h2.PREFACE + _frame(h2.SETTINGS, 0, 0, b"\x00\x04\xff\xff\xff\xff"), h2.FLOW_CONTROL_ERROR),
    (h2.PREFACE + _frame(h2.HEADERS, 0x0, 1, b"\x82") + _frame(h2.PING, 0, 0, b"\0" * 8),
     h2.PROTOCOL_ERROR),                                                          # interrupted block
])
def test_protocol_errors_close_the_connection_with_goaway(payload, error_code):
    async def go(endpoint, echo, gate):
        out = await asyncio.to_thread(_raw, endpoint, payload)
        goaways = [p for kind, _f, _s, p in _frames(out) if kind == h2.GOAWAY]
        assert goaways and struct.unpack(">I", goaways[0][4:8])[0] == error_code
        async with grpc.aio.insecure_channel(endpoint) as ch:  # the server itself is unharmed
            assert await ch.unary_unary(f"/{SERVICE}/Unary")(b"ok", timeout=5) == b"ok"

    run(go)


def test_settings_and_ping_are_acknowledged():
    async def go(endpoint, echo, gate):
        payload = h2.PREFACE + _frame(h2.SETTINGS, 0, 0) + _frame(h2.PING, 0, 0, b"12345678")
        frames = list(_frames(await asyncio.to_thread(_raw, endpoint, payload, 0.5)))
        assert (h2.SETTINGS, 0x1, 0, b"") in frames
        assert (h2.PING, 0x1, 0, b"12345678") in frames

    run(go)


def test_held_unary_requests_stop_the_connection_window_until_taken(monkeypatch):
    # A client opening many streams and never ending them must not make the server hold more than
    # BUFFERED_MAX (plus one connection window) of request bytes: connection credit stops there
    # and resumes once the handlers take the requests.
    monkeypatch.setattr(h2server, "OUR_CONN_WINDOW", 1 << 20)
    monkeypatch.setattr(h2server, "BUFFERED_MAX", 1 << 20)
    chunk = 256 << 10
    block = h2.literal_block([(":method", "POST"), (":scheme", "http"), (":path", f"/{SERVICE}/Unary"),
                                    (":authority", "x"), ("content-type", "application/grpc"), ("te", "trailers")])
    body = struct.pack(">BI", 0, chunk - 5) + b"x" * (chunk - 5)  # one gRPC message of `chunk` bytes

    def conversation(endpoint: str):
        host, port = endpoint.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=5) as s:
            def read_for(seconds: float) -> list:
                return list(_frames(_read_until_quiet(s, seconds)))

            def open_streams(sids):  # END_STREAM held back: the requests wait in the server
                s.sendall(b"".join(_frame(h2.HEADERS, 0x4, sid, block) + _frame(h2.DATA, 0, sid, body)
                                   for sid in sids))

            s.sendall(h2.PREFACE + _frame(h2.SETTINGS, 0, 0))
            open_streams([1, 3, 5, 7])      # 1 MiB: the whole initial window
            first = read_for(0.7)
            open_streams([9, 11])           # 512 KiB more: the credit the first half earned
            second = read_for(0.7)
            s.sendall(b"".join(_frame(h2.DATA, 0x1, sid) for sid in (1, 3, 5, 7, 9, 11)))
            third = read_for(1.0)
        return first, second, third

    async def go(endpoint, echo, gate):
        first, second, third = await asyncio.to_thread(conversation, endpoint)

        def conn_credit(frames):
            return sum(struct.unpack(">I", p)[0] for kind, _f, sid, p in frames
                       if kind == h2.WINDOW_UPDATE and sid == 0)

        # Start-up grants the window; 512 KiB received while less than the cap was held earns
        # 512 KiB; with 1 MiB and more held nothing more is granted...
        assert conn_credit(first) == (1 << 20) - h2.DEFAULT_WINDOW + (512 << 10)
        assert conn_credit(second) == 0
        # ...until the calls took their requests: the window comes back and every call answers (its
        # headers: the echoed bodies wait for this raw client's windows, which it never opens).
        assert conn_credit(third) >= 1 << 20
        answered = {sid for kind, _flags, sid, _p in third if kind == h2.HEADERS}
        assert answered == {1, 3, 5, 7, 9, 11}

    run(go)


# ---------------------------------------------------------------------------------- eager calls
class _Transport:
    """What a connection writes, kept (the calls below feed it bytes by hand, in one loop pass)."""

    def __init__(self) -> None:
        self.out = bytearray()
        self.writes = 0
        self.buffered = 0  # what a paused transport holds (set by hand)

    def write(self, data: bytes) -> None:
        self.out += data
        self.writes += 1

    def get_write_buffer_size(self) -> int:
        return self.buffered

    def get_extra_info(self, key, default=None):
        return ("127.0.0.1", 1) if key == "peername" else default

    def close(self) -> None:
        pass

    def can_write_eof(self) -> bool:  # (as TLS: a failed connection is closed at once)
        return False

    def is_closing(self) -> bool:
        return False


_UNARY_BLOCK = h2.literal_block([(":method", "POST"), (":scheme", "http"), (":path", f"/{SERVICE}/Unary"),
                                       (":authority", "x"), ("content-type", "application/grpc"), ("te", "trailers")])


def _request(sid: int, body: bytes, *, split: bool = False):
    """A unary call's frames: one piece, or (HEADERS, DATA) when ``split``."""
    head = _frame(h2.HEADERS, 0x4, sid, _UNARY_BLOCK)
    data = _frame(h2.DATA, 0x1, sid, struct.pack(">BI", 0, len(body)) + body)
    return (head, data) if split else head + data


def _answers(out: bytes) -> dict:
    """stream id -> (answer messages' bytes, ended with trailers)"""
    got: dict = {}
    for kind, flags, sid, payload in _frames(bytes(out)):
        if kind == h2.DATA:
            got.setdefault(sid, [b"", False])[0] += payload[5:]
        elif kind == h2.HEADERS and flags & 0x1:
            got.setdefault(sid, [b"", False])[1] = True
    return {sid: tuple(v) for sid, v in got.items()}


def _in_process(test):
    async def main():
        echo, gate = Echo(), Tagging()
        server = h2grpc.Server(interceptors=[gate])
        server.add_generic_rpc_handlers((echo.handlers(),))
        conn = h2server.Connection(server)
        transport = _Transport()
        conn.connection_made(transport)
        conn.data_received(h2.PREFACE + _frame(h2.SETTINGS, 0, 0))
        transport.out.clear()  # our SETTINGS and their acknowledgement
        transport.writes = 0
        await test(server, conn, transport, echo)

    asyncio.run(main())


def test_a_call_that_never_waits_is_answered_within_the_read_that_completes_it():
    async def test(server, conn, transport, echo):
        conn.data_received(_request(1, b"one") + _request(3, b"two"))
        assert not server._calls  # no task: both ran to their end inside data_received
        # ...and their answers left with it, in one write, without waiting for a loop pass
        assert _answers(transport.out) == {1: (b"one", True), 3: (b"two", True)}
        assert transport.writes == 1

    _in_process(test)


def test_a_call_whose_request_comes_in_a_later_read_goes_on_in_a_task():
    async def test(server, conn, transport, echo):
        head, data = _request(1, b"later", split=True)
        conn.data_received(head)
        assert len(server._calls) == 1  # waiting for its DATA
        conn.data_received(data)
        for _ in range(5):
            await asyncio.sleep(0)
        conn._flush_out()
        assert _answers(transport.out) == {1: (b"later", True)}
        assert not server._calls

    _in_process(test)


def test_a_call_reset_before_its_task_first_runs_still_sees_its_cancellation():
    # The handler ran up to its first wait inside data_received; the client's RST_STREAM comes in
    # the next read, before the task that goes on with it has taken a step. The handler must get
    # the CancelledError there (its clean-up runs), and no answer goes out.
    async def test(server, conn, transport, echo):
        conn.data_received(_request(1, b"sleep"))
        (task,) = server._calls
        conn.data_received(_frame(h2.RST_STREAM, 0, 1, struct.pack(">I", h2.CANCEL)))
        for _ in range(5):
            await asyncio.sleep(0)
        assert task.cancelled() and echo.cancelled.is_set()
        conn._flush_out()
        assert 1 not in _answers(transport.out)
        conn.data_received(_request(3, b"next"))  # the connection goes on
        conn._flush_out()
        assert _answers(transport.out)[3] == (b"next", True)

    _in_process(test)


def test_a_call_that_waits_once_is_resumed_by_its_future_without_a_task():
    # A sync send waits once (its group commit): its future's done-callback goes on with it.
    async def test(server, conn, transport, echo):
        conn.data_received(_request(1, b"nap") + _request(3, b"nap-fail"))
        calls = list(server._calls)
        assert len(calls) == 2 and not any(isinstance(c, asyncio.Task) for c in calls)
        assert conn.streams[1].task in calls and not calls[0].done()
        for _ in range(50):
            if not server._calls:
                break
            await asyncio.sleep(0.002)
        assert not server._calls and all(c.done() and not c.cancelled() for c in calls)
        conn._flush_out()
        # (3 failed after its wait: trailers only, its status UNKNOWN)
        assert _answers(transport.out) == {1: (b"nap", True), 3: (b"", True)}

    _in_process(test)


def test_a_call_that_waits_twice_goes_on_in_a_task_that_can_be_cancelled():
    async def test(server, conn, transport, echo):
        conn.data_received(_request(1, b"twice"))
        (first,) = server._calls
        assert not isinstance(first, asyncio.Task)
        while first in server._calls:  # its first wait ends; the second goes on in a task
            await asyncio.sleep(0.002)
        (task,) = server._calls
        assert isinstance(task, asyncio.Task) and conn.streams[1].task is task and first.done()
        conn.data_received(_frame(h2.RST_STREAM, 0, 1, struct.pack(">I", h2.CANCEL)))
        for _ in range(5):
            await asyncio.sleep(0)
        assert task.cancelled() and echo.cancelled.is_set() and not server._calls
        assert conn.lingering == 0  # the reset's done-callback ran
        conn._flush_out()
        assert 1 not in _answers(transport.out)

    _in_process(test)


def test_a_call_reset_after_its_future_is_done_but_before_it_resumed_is_cancelled():
    # The future it waits on is done (its wake-up scheduled) when the RST_STREAM comes: as with a
    # task, the call must see the cancellation where it waits, not answer.
    async def test(server, conn, transport, echo):
        echo.gate = asyncio.get_running_loop().create_future()
        conn.data_received(_request(1, b"gate"))
        (call,) = server._calls
        echo.gate.set_result(None)
        conn.data_received(_frame(h2.RST_STREAM, 0, 1, struct.pack(">I", h2.CANCEL)))
        for _ in range(5):
            await asyncio.sleep(0)
        assert call.cancelled() and echo.cancelled.is_set() and not server._calls
        assert conn.lingering == 0
        conn._flush_out()
        assert 1 not in _answers(transport.out)

    _in_process(test)


def test_stop_waits_for_a_call_resumed_by_its_future():
    async def test(server, conn, transport, echo):
        conn.data_received(_request(1, b"nap"))
        (call,) = server._calls
        await server.stop(5.0)
        assert call.done() and not call.cancelled()

    _in_process(test)


def test_a_reset_from_outside_a_read_over_the_reset_budget_ends_the_connection_cleanly():
    # Context.reset (the answer budget's timeout, from the POP ticker) spends the connection's
    # reset budget; over it, the connection must end with GOAWAY, not raise into the caller.
    async def test(server, conn, transport, echo):
        conn.data_received(_request(1, b"sleep"))
        stream = conn.streams[1]
        while conn.resets.take():  # the budget spent by earlier resets
            pass
        h2calls.Context(stream, (), None, conn.loop).reset()  # must not raise
        assert conn.closed and stream.cancelled
        goaways = [(payload[4:8], payload[8:]) for kind, _f, _s, payload in _frames(bytes(transport.out))
                   if kind == h2.GOAWAY]
        assert goaways and goaways[0][0] == struct.pack(">I", h2.ENHANCE_YOUR_CALM), goaways
        assert b"reset by the server over the budget" in goaways[0][1]

    _in_process(test)


@pytest.mark.parametrize("cut", [1, 7, 9, 10, 33, 1000])
def test_frames_cut_anywhere_across_reads_and_continued_header_blocks_are_read_whole(cut):
    """A read's frames are read from its bytes; only a frame it cuts in two is held for the next
    read. A header block may go on in CONTINUATION frames."""
    async def test(server, conn, transport, echo):
        continued = (_frame(h2.HEADERS, 0, 5, _UNARY_BLOCK[:4]) + _frame(h2.CONTINUATION, 0, 5, _UNARY_BLOCK[4:9])
                     + _frame(h2.CONTINUATION, 0x4, 5, _UNARY_BLOCK[9:])
                     + _frame(h2.DATA, 0x1, 5, struct.pack(">BI", 0, 4) + b"cont"))
        wire = _request(1, b"one") + _request(3, b"x" * 300) + continued + _request(7, b"last")
        for start in range(0, len(wire), cut):
            conn.data_received(wire[start:start + cut])
        for _ in range(5):
            await asyncio.sleep(0)
        conn._flush_out()
        assert _answers(transport.out) == {1: (b"one", True), 3: (b"x" * 300, True), 5: (b"cont", True),
                                           7: (b"last", True)}
        assert not conn.closed and not conn.buf

    _in_process(test)


# ---------------------------------------------------------------------------------- answers held for the peer
_BIDI_BLOCK = h2.literal_block([(":method", "POST"), (":scheme", "http"), (":path", f"/{SERVICE}/Bidi"),
                                (":authority", "x"), ("content-type", "application/grpc"), ("te", "trailers")])
_WINDOWS_OF_0 = _frame(h2.SETTINGS, 0, 0, struct.pack(">HI", 0x4, 0))  # SETTINGS_INITIAL_WINDOW_SIZE = 0


def _blocked(conn) -> int:
    """The answer bytes waiting on ``conn``'s peer, summed the slow way (what ``held_answers`` keeps)."""
    return sum(len(item) for stream in conn.waiting.values() for item in stream.blocked)


def test_answer_bytes_held_for_peers_go_back_to_0_when_their_connections_drop():
    """Connections whose peers announce windows of 0 hold their answers; the server's total
    (``h2limits.UnreadAnswers``) follows each byte as it starts waiting, leaves or is dropped,
    and connections lost abruptly while holding take all of theirs off it: answers waiting, a
    failed call's answer left waiting behind it, and a paused transport's buffer."""
    async def main():
        server = h2grpc.Server()
        server.add_generic_rpc_handlers((Echo().handlers(),))
        total = server.unread_answers
        conns = []
        for _ in range(2):
            conn = h2server.Connection(server)
            conn.connection_made(_Transport())
            conn.data_received(h2.PREFACE + _WINDOWS_OF_0)
            conns.append(conn)
        a, b = conns

        def settle() -> None:  # the kept counts against the slow sums, at every step
            for conn in conns:
                assert conn.held_answers == _blocked(conn)
            assert total.held == sum(conn.held_answers + conn.held_out for conn in conns)

        async def steps() -> None:
            for _ in range(5):
                await asyncio.sleep(0)

        a.data_received(_request(1, b"x" * 1000) + _request(3, b"y" * 2000))
        await steps()
        assert a.held_answers == 1005 + 2005
        settle()
        a.data_received(_frame(h2.WINDOW_UPDATE, 0, 1, struct.pack(">I", 400)))  # 400 bytes of one leave
        assert a.held_answers == 605 + 2005
        settle()
        a.transport.buffered = 90_000  # the transport passes its high-water mark, then drains
        a.pause_writing()
        assert a.held_out == 90_000 and total.held == 605 + 2005 + 90_000
        a.resume_writing()
        assert a.held_out == 0
        settle()

        # b: a streaming call whose answer waits, then fails on a request cut inside a message: its
        # trailers queue behind the answer, and it leaves ``streams`` while still ``waiting``.
        b.data_received(_frame(h2.HEADERS, 0x4, 1, _BIDI_BLOCK)
                        + _frame(h2.DATA, 0, 1, struct.pack(">BI", 0, 5) + b"hello"))
        await steps()
        assert b.held_answers == 10
        b.data_received(_frame(h2.DATA, 0x1, 1, struct.pack(">BI", 0, 10) + b"cut"))
        await steps()
        assert 1 in b.waiting and 1 not in b.streams and b.held_answers > 10
        b.transport.buffered = 70_000
        b.pause_writing()
        assert b.held_out == 70_000
        settle()
        assert total.held == 605 + 2005 + b.held_answers + 70_000

        a.connection_lost(ConnectionResetError())
        b.connection_lost(ConnectionResetError())
        await steps()
        assert total.held == 0
        assert [(c.held_answers, c.held_out, c.waiting) for c in conns] == [(0, 0, {}), (0, 0, {})]
        assert not server._calls  # the waiting handlers were cancelled with their connections

    asyncio.run(main())
