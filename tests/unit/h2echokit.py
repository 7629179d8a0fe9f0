"""The HTTP/2 server tests' echo service (test_h2server.py, test_h2server_calls.py): bytes in,
bytes out, built from grpc's own handler factories, an interceptor that tags calls, a server
on loopback, and a raw frame builder."""

import asyncio
import struct

import grpc

from chronoq.protocol.h2 import Parts
from chronoq.server import h2grpc

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
        if request.startswith(b"parts "):  # an answer given in parts (chronoq.protocol.h2.Parts)
            size = int(request[6:])
            return Parts(b"head", (bytes(range(256)) * (size // 256 + 1))[:size])
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




def _frame(kind, flags, sid, payload=b""):
    n = len(payload)
    return struct.pack(">HBBBI", n >> 8, n & 0xFF, kind, flags, sid) + payload


def _frames(data: bytes):
    pos = 0
    while len(data) - pos >= 9:
        hi, lo, kind, flags, sid = struct.unpack_from(">HBBBI", data, pos)
        length = hi << 8 | lo
        yield kind, flags, sid, data[pos + 9:pos + 9 + length]
        pos += 9 + length
