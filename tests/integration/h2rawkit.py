"""A live ``chronoq.server.h2grpc.Server`` and a raw HTTP/2 client to attack it with, for
``test_h2_attacks.py`` and ``test_h2_held_answers.py``.

``run`` starts a server on 127.0.0.1 with small limits (``h2limits.Limits``), runs the test, then
checks that a normal gRPC call on a new connection is still served. ``RawClient`` sends whatever
frames it is told (built with ``hyperframe`` and ``hpack``) and reads what comes back;
``goaway_case`` is the common shape: a script must end its connection with GOAWAY
ENHANCE_YOUR_CALM naming a limit, and one refusal counted (``chronoq.core.refusals``).
"""

from __future__ import annotations

import asyncio
import socket
import struct
import time

import grpc
import hpack
from hyperframe.frame import DataFrame, Frame, GoAwayFrame, HeadersFrame, SettingsFrame

from chronoq.core.refusals import Refusals
from chronoq.protocol import h2
from chronoq.server import h2grpc
from chronoq.server.h2limits import Limits

SERVICE = "test.Echo"
NO_ERROR, PROTOCOL_ERROR, REFUSED_STREAM, CANCEL, ENHANCE_YOUR_CALM = 0, 1, 7, 8, 11


class Echo:
    def __init__(self) -> None:
        self.release = asyncio.Event()  # lets "linger" handlers finish their clean-up
        self.server = None  # the server under test (``run``): a test may look at its counters

    async def unary(self, request: bytes, context) -> bytes:
        if request == b"sleep":
            await asyncio.sleep(30)
        if request == b"linger":  # a handler whose clean-up outlives its stream's reset
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                await self.release.wait()
                raise
        return request

    async def bidi(self, requests, context):
        async for r in requests:
            await context.write(r)

    def handlers(self):
        return grpc.method_handlers_generic_handler(SERVICE, {
            "Unary": grpc.unary_unary_rpc_method_handler(self.unary),
            "Bidi": grpc.stream_stream_rpc_method_handler(self.bidi),
        })


def run(test, **limits):
    """``await test(endpoint, refusals, echo)`` against a live server with these limits."""
    async def main():
        echo = Echo()
        refusals = Refusals(time.monotonic_ns)
        server = h2grpc.Server(limits=Limits(**limits), refusals=refusals)
        server.add_generic_rpc_handlers((echo.handlers(),))
        echo.server = server
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            await test(f"127.0.0.1:{port}", refusals, echo)
            # Whatever the attack did, a normal client on a new connection is served.
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                assert await ch.unary_unary(f"/{SERVICE}/Unary")(b"still serving", timeout=5) == b"still serving"
        finally:
            echo.release.set()
            await server.stop(0.5)

    asyncio.run(main())


def refused(refusals: Refusals) -> dict:
    return {reason: n for reason, n in refusals.counts.items() if n}


# ---------------------------------------------------------------------------------- a raw client
class RawClient:
    """A blocking HTTP/2 client that sends whatever frames it is told (run it in a thread)."""

    def __init__(self, endpoint: str, *, preface: bool = True, rcvbuf: int = 0) -> None:
        host, port = endpoint.rsplit(":", 1)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if rcvbuf:  # a small receive buffer: the server's writes back up quickly when we do not read
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        self.sock.settimeout(5)
        self.sock.connect((host, int(port)))
        self.encoder = hpack.Encoder()
        self.pending = b""
        self.frames: list = []
        self.closed = False
        if preface:
            self.sock.sendall(h2.PREFACE + SettingsFrame(0).serialize())

    def send(self, *frames) -> None:
        try:
            self.sock.sendall(b"".join(f.serialize() for f in frames))
        except (BrokenPipeError, ConnectionResetError):  # the server closed: what it said is read next
            pass

    def request_block(self, extra=()) -> bytes:
        return self.encoder.encode([(":method", "POST"), (":scheme", "http"), (":path", f"/{SERVICE}/Unary"),
                                    (":authority", "x"), ("content-type", "application/grpc"),
                                    ("te", "trailers"), *extra])

    def open(self, sid: int, body: bytes | None = None, path: str = "Unary") -> None:
        """HEADERS for a call; with ``body``, its one message and END_STREAM."""
        block = self.request_block() if path == "Unary" else self.encoder.encode(
            [(":method", "POST"), (":scheme", "http"), (":path", f"/{SERVICE}/{path}"), (":authority", "x"),
             ("content-type", "application/grpc"), ("te", "trailers")])
        frames = [HeadersFrame(sid, block, flags=["END_HEADERS"])]
        if body is not None:
            frames.append(DataFrame(sid, struct.pack(">BI", 0, len(body)) + body, flags=["END_STREAM"]))
        self.send(*frames)

    def read(self, quiet_s: float = 1.0) -> list:
        """Frames the server sends until it closes or is quiet for ``quiet_s``; all so far."""
        self.sock.settimeout(quiet_s)
        try:
            while True:
                chunk = self.sock.recv(1 << 16)
                if not chunk:
                    self.closed = True
                    break
                self.pending += chunk
                self._parse()
        except socket.timeout:
            pass
        except ConnectionResetError:  # closed with our bytes unread: the kernel resets instead
            self.closed = True
        return self.frames

    def read_until_closed(self, limit_s: float = 10.0) -> list:
        deadline = time.monotonic() + limit_s
        while not self.closed and time.monotonic() < deadline:
            self.read(0.5)
        return self.frames

    def _parse(self) -> None:
        data = self.pending
        while len(data) >= 9:
            frame, length = Frame.parse_frame_header(memoryview(data[:9]), strict=False)
            if len(data) < 9 + length:
                break
            frame.parse_body(memoryview(data[9:9 + length]))
            self.frames.append(frame)
            data = data[9 + length:]
        self.pending = data

    def goaway(self):
        found = [f for f in self.frames if isinstance(f, GoAwayFrame)]
        return found[0] if found else None

    def close(self) -> None:
        self.sock.close()


async def attack(endpoint: str, script, **kw) -> RawClient:
    """Run ``script(client)`` in a thread against a new raw connection; the client, closed."""
    def go():
        client = RawClient(endpoint, **kw)
        try:
            script(client)
        finally:
            client.close()
        return client

    return await asyncio.to_thread(go)


def assert_goaway(client: RawClient, code: int, names: str) -> None:
    goaway = client.goaway()
    assert goaway is not None, f"no GOAWAY; got {[type(f).__name__ for f in client.frames][-10:]}"
    assert goaway.error_code == code, (goaway.error_code, goaway.additional_data)
    assert names in goaway.additional_data.decode(), goaway.additional_data  # the debug data names the limit
    assert client.closed


def goaway_case(script, names: str, reason: str, **limits) -> None:
    """Run ``script`` against a live server with ``limits``: the connection must end with GOAWAY
    ENHANCE_YOUR_CALM naming ``names``, and exactly one refusal counted, for ``reason``."""
    async def test(endpoint, refusals, echo):
        client = await attack(endpoint, script)
        assert_goaway(client, ENHANCE_YOUR_CALM, names)
        assert refused(refusals) == {reason: 1}

    run(test, **limits)
