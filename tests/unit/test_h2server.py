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

from h2echokit import SERVICE, _frame, _frames, run

from chronoq.protocol import h2
from chronoq.server import h2server

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


def test_an_answer_in_parts_arrives_whole_within_the_windows_or_waiting_for_them():
    """A unary answer given as ``Parts`` (a replica's pull answer is one) leaves as its buffers in
    one write when it fits the peer's frame size and windows (``Answers._write_parts``), else
    joined and cut into frames as the windows open; grpcio's client reads the message whole."""
    async def go(endpoint, echo, gate):
        async with grpc.aio.insecure_channel(endpoint) as ch:
            unary = ch.unary_unary(f"/{SERVICE}/Unary")
            for size in (0, 1, 10_000, 40_000, 3_000_000):  # (grpcio's frames: 16 KiB; its window: 64 KiB at first)
                want = b"head" + (bytes(range(256)) * (size // 256 + 1))[:size]
                assert await unary(b"parts %d" % size, timeout=20) == want

    run(go)
