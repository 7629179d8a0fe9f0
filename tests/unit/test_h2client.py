"""chronoq.client.h2channel against grpcio's own server: an HTTP/2 and gRPC implementation that is not ours.

(chronoq's server is its other peer: every integration test that uses ``chronoq.client.client`` runs on it.)
"""

from __future__ import annotations

import asyncio
import os

import grpc
import pytest

from chronoq.client import h2channel as h2client


async def _echo(request: bytes, context) -> bytes:
    return request


async def _fail(request: bytes, context) -> bytes:
    await context.abort(grpc.StatusCode.NOT_FOUND, "nö such thing: 100% gone")


async def _slow(request: bytes, context) -> bytes:
    await asyncio.sleep(5)
    return b"late"


async def _meta(request: bytes, context) -> bytes:
    md = dict(context.invocation_metadata())
    context.set_trailing_metadata((("x-answer", "42"),))
    remaining = context.time_remaining()  # from our grpc-timeout header
    return f"{md.get('x-k')}|{remaining is not None and 0 < remaining <= 5}|{md.get('x-mq-client-id')}".encode()


async def _big(request: bytes, context) -> bytes:
    return bytes(range(256)) * (int(request or b"0") // 256)


async def _zipped(request: bytes, context) -> bytes:
    context.set_compression(grpc.Compression.Gzip)
    return b"z" * 50_000


HANDLERS = {name: grpc.unary_unary_rpc_method_handler(fn) for name, fn in
            (("Echo", _echo), ("Fail", _fail), ("Slow", _slow), ("Meta", _meta), ("Big", _big), ("Zipped", _zipped))}


class _Generic(grpc.GenericRpcHandler):
    def service(self, details):
        service, _, method = details.method.rpartition("/")
        return HANDLERS.get(method) if service == "/t.S" else None


async def _serve() -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", -1),
                                      ("grpc.max_send_message_length", -1)])
    server.add_generic_rpc_handlers((_Generic(),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


def _run(scenario):
    async def main():
        server, target = await _serve()
        channel = h2client.Channel(target)
        try:
            await scenario(channel, server)
        finally:
            await channel.close()
            await server.stop(None)

    asyncio.run(main())


def test_a_unary_call_round_trips_its_bytes():
    async def scenario(channel, _server):
        echo = channel.unary_unary("/t.S/Echo")
        assert await echo(b"hello", timeout=5) == b"hello"
        assert await echo(b"", timeout=5) == b""  # an empty message is still one message
        assert await echo(b"again", timeout=5) == b"again"  # same connection, next stream

    _run(scenario)


def test_serializers_apply_both_ways():
    async def scenario(channel, _server):
        echo = channel.unary_unary("/t.S/Echo", request_serializer=str.encode, response_deserializer=bytes.decode)
        assert await echo("text", timeout=5) == "text"

    _run(scenario)


def test_a_failed_call_raises_the_servers_code_and_details():
    async def scenario(channel, _server):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await channel.unary_unary("/t.S/Fail")(b"", timeout=5)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        assert info.value.details() == "nö such thing: 100% gone"  # percent-decoded UTF-8
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await channel.unary_unary("/t.S/Nothing")(b"", timeout=5)
        assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED  # a trailers-only answer
        assert await channel.unary_unary("/t.S/Echo")(b"still fine", timeout=5) == b"still fine"

    _run(scenario)


def test_metadata_and_the_deadline_reach_the_server():
    async def scenario(channel, _server):
        got = await channel.unary_unary("/t.S/Meta")(b"", metadata=[("x-k", "v1")], timeout=5)
        assert got == b"v1|True|None"

    _run(scenario)


def test_stable_headers_are_indexed_once_and_referenced_after():
    # The server's HPACK table must stay in step with ours across paths, ids and calls.
    async def scenario(channel, _server):
        meta, echo = channel.unary_unary("/t.S/Meta"), channel.unary_unary("/t.S/Echo")
        for i in range(40):
            client = f"client-{i % 3}"
            got = await meta(b"", metadata=[("x-mq-client-id", client), ("x-k", str(i))], timeout=5)
            assert got == f"{i}|True|{client}".encode()
            assert await echo(str(i).encode(), metadata=[("x-mq-client-id", client)], timeout=5) == str(i).encode()
        encoder = channel._conn.headers
        assert len(encoder.order) == 2 + 3 + 5  # two paths, three client ids, five fixed fields
        block = encoder.request("/t.S/Echo")
        assert len(block) == 2 + 6  # method, scheme, then six one-byte references
        encoder.table_size(0)  # a server that wants no table: a size update, then literals only
        assert encoder.request("/t.S/Echo").startswith(b"\x20\x83")
        assert await echo(b"after", timeout=5) == b"after"

    _run(scenario)


def test_a_calls_fixed_metadata_is_encoded_once_and_again_after_the_table_changes():
    async def scenario(channel, _server):
        meta = channel.unary_unary("/t.S/Meta")
        fixed = (("x-mq-client-id", "fixed-1"), ("x-mq-language", "PYTHON"))
        for i in range(3):
            got = await meta(b"", metadata=[("x-k", str(i))], fixed=fixed, timeout=5)
            assert got == f"{i}|True|fixed-1".encode()
        conn = channel._conn
        assert len(conn._blocks) == 1  # the block of path, deadline and fixed fields: made once
        encoder = conn.headers
        encoder.table_size(0)  # as a server's SETTINGS_HEADER_TABLE_SIZE of 0 does
        block = conn._header_block("/t.S/Meta", 5, fixed, ())
        assert block.startswith(b"\x20\x83")  # the size update, then literals: not the block made before
        assert b"fixed-1" in block

    _run(scenario)


def test_a_shorter_deadline_after_a_longer_one_ends_its_call_first():
    # (guards the move from a timer per call to one per connection: the old code passed it too)
    async def scenario(channel, _server):
        assert await channel.unary_unary("/t.S/Echo")(b"up", timeout=5) == b"up"  # connected
        slow = channel.unary_unary("/t.S/Slow")
        longer = asyncio.ensure_future(slow(b"", timeout=2))
        await asyncio.sleep(0)  # sent: the connection's deadline timer is set for it
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await slow(b"", timeout=0.2)
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert not longer.done()  # still within its own deadline
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await longer
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert not channel._conn.calls

    _run(scenario)


def test_metadata_that_cannot_be_encoded_fails_that_call_and_the_next_call_is_fine():
    async def scenario(channel, _server):
        echo = channel.unary_unary("/t.S/Echo")
        assert await echo(b"1", metadata=[("x-mq-client-id", "a")], timeout=5) == b"1"
        with pytest.raises(grpc.aio.AioRpcError) as info:  # a new path indexed, then a bad value
            await channel.unary_unary("/t.S/Meta")(b"", metadata=[("x-k", "snow \u2603")], timeout=5)
        assert info.value.code() == grpc.StatusCode.INTERNAL
        # The next call goes out on a fresh connection (the old table copy is not trusted).
        got = await channel.unary_unary("/t.S/Meta")(b"", metadata=[("x-k", "ok"), ("x-mq-client-id", "a")],
                                                    timeout=5)
        assert got == b"ok|True|a"

    _run(scenario)


def test_a_deadline_ends_the_call_and_the_connection_lives_on():
    async def scenario(channel, _server):
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await channel.unary_unary("/t.S/Slow")(b"", timeout=0.3)
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert loop.time() - t0 < 3
        assert await channel.unary_unary("/t.S/Echo")(b"after", timeout=5) == b"after"

    _run(scenario)


def test_big_messages_both_ways_respect_the_flow_control_windows():
    # 3 MiB up (the server's initial windows are 64 KiB: we must wait for its WINDOW_UPDATEs) and
    # 20 MiB down (past our own stream window: we must grant more as we read).
    async def scenario(channel, _server):
        up = os.urandom(3 << 20)
        assert await channel.unary_unary("/t.S/Echo")(up, timeout=30) == up
        down = await channel.unary_unary("/t.S/Big")(str(20 << 20).encode(), timeout=30)
        assert down == bytes(range(256)) * ((20 << 20) // 256)

    _run(scenario)


def test_many_concurrent_calls_share_one_connection():
    async def scenario(channel, _server):
        echo = channel.unary_unary("/t.S/Echo")
        bodies = [os.urandom(n % 5000) for n in range(300)]
        assert await asyncio.gather(*(echo(b, timeout=30) for b in bodies)) == bodies
        assert channel._conn is not None and channel._conn.next_id == 1 + 2 * 300

    _run(scenario)


def test_a_gzip_answer_is_decompressed():
    async def scenario(channel, _server):
        assert await channel.unary_unary("/t.S/Zipped")(b"", timeout=5) == b"z" * 50_000

    _run(scenario)


def test_a_lost_server_fails_calls_as_unavailable_and_a_new_one_is_reached():
    async def scenario(channel, server):
        echo = channel.unary_unary("/t.S/Echo")
        assert await echo(b"1", timeout=5) == b"1"
        await server.stop(None)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await echo(b"2", timeout=5)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE

    _run(scenario)


def test_a_cancelled_caller_resets_only_its_own_stream():
    async def scenario(channel, _server):
        slow = asyncio.ensure_future(channel.unary_unary("/t.S/Slow")(b"", timeout=30))
        await asyncio.sleep(0.2)
        slow.cancel()
        with pytest.raises(asyncio.CancelledError):
            await slow
        assert not channel._conn.calls  # forgotten at once
        assert await channel.unary_unary("/t.S/Echo")(b"ok", timeout=5) == b"ok"

    _run(scenario)


def test_nothing_listening_is_unavailable():
    async def main():
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        channel = h2client.Channel(f"127.0.0.1:{port}")
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await channel.unary_unary("/t.S/Echo")(b"", timeout=5)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        await channel.close()

    asyncio.run(main())


def test_a_bad_target_is_refused_up_front():
    with pytest.raises(ValueError):
        h2client.Channel("no-port-here")


def test_a_restarted_server_is_reached_again_on_a_new_connection():
    async def main():
        server, target = await _serve()
        port = int(target.rsplit(":", 1)[1])
        channel = h2client.Channel(target)
        echo = channel.unary_unary("/t.S/Echo")
        try:
            assert await echo(b"before", timeout=5) == b"before"
            first = channel._conn
            await server.stop(None)
            server = grpc.aio.server()
            server.add_generic_rpc_handlers((_Generic(),))
            if server.add_insecure_port(f"127.0.0.1:{port}") != port:
                pytest.skip("the port could not be bound again")
            await server.start()
            for _ in range(50):  # the old connection's loss may be seen a moment after the stop
                if first.closed:
                    break
                await asyncio.sleep(0.02)
            assert await echo(b"after", timeout=5) == b"after"
            assert channel._conn is not first
        finally:
            await channel.close()
            await server.stop(None)

    asyncio.run(main())


def test_a_server_that_overflows_a_calls_window_fails_that_call_and_resets_its_stream():
    # A raw server (not grpcio: it never breaks the rules) grows stream 1's send window past
    # 2^31-1 (RFC 9113 §6.9.1: a stream error FLOW_CONTROL_ERROR). The call fails at once with
    # INTERNAL and the client resets the stream with that code; the connection is not dropped.
    from chronoq.protocol import h2

    async def main():
        resets = []

        async def handle(reader, writer):
            writer.write(h2.settings_frame(()))
            buf = bytearray()

            def frame_in(kind, flags, sid, payload):
                if kind == h2.HEADERS and sid == 1:
                    writer.write(h2.window_update_frame(1, h2.MAX_WINDOW))
                elif kind == h2.RST_STREAM:
                    resets.append((sid, int.from_bytes(payload, "big")))
                return False

            preface_left = len(h2.PREFACE)
            for _ in range(100):  # bounded: a few reads carry all the client sends
                data = await reader.read(1 << 16)
                if not data:
                    break
                if preface_left:
                    cut = min(preface_left, len(data))
                    data, preface_left = data[cut:], preface_left - cut
                buf += data
                end, _ = h2.read_frames(buf, 1 << 24, frame_in)
                del buf[:end]
            writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        channel = h2client.Channel(f"127.0.0.1:{port}")
        try:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await channel.unary_unary("/t.S/Echo")(b"x", timeout=10)
            assert info.value.code() == grpc.StatusCode.INTERNAL
            assert "flow control" in info.value.details()
            for _ in range(100):  # the reset reaches the server within a few loop passes
                if resets:
                    break
                await asyncio.sleep(0.01)
            assert resets == [(1, h2.FLOW_CONTROL_ERROR)]
        finally:
            await channel.close()
            server.close()

    asyncio.run(main())


def test_a_call_waiting_for_a_free_stream_ends_at_its_deadline_and_is_never_sent():
    """The server's limit of concurrent streams reached, a call waits for one to come free. The
    wait counts against its deadline: it ends DEADLINE_EXCEEDED then, and is not sent afterwards
    (it was sent, with no time left, once a stream came free: a send stored while its caller
    had been told it failed)."""
    served: list[bytes] = []

    async def record(request: bytes, context) -> bytes:
        served.append(request)
        return request

    class Limited(grpc.GenericRpcHandler):
        def service(self, details):
            return {"/t.S/Slow": HANDLERS["Slow"],
                    "/t.S/Record": grpc.unary_unary_rpc_method_handler(record)}.get(details.method)

    async def main():
        server = grpc.aio.server(options=[("grpc.max_concurrent_streams", 2)])
        server.add_generic_rpc_handlers((Limited(),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        channel = h2client.Channel(f"127.0.0.1:{port}")
        try:
            assert await channel.unary_unary("/t.S/Record")(b"first", timeout=5) == b"first"  # (the limit learnt)
            slow = [asyncio.ensure_future(channel.unary_unary("/t.S/Slow")(b"", timeout=10)) for _ in range(2)]
            await asyncio.sleep(0.2)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await channel.unary_unary("/t.S/Record")(b"late", timeout=0.3)
            assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert "waiting for a stream" in info.value.details()
            assert await asyncio.gather(*slow) == [b"late", b"late"]  # the streams come free ...
            await asyncio.sleep(0.3)
            assert served == [b"first"]  # ... and the call that gave up was never sent
        finally:
            await channel.close()
            await server.stop(None)

    asyncio.run(main())
