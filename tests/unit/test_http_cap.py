"""chronoq.server.http's CappedFactory on a real aiohttp listener in this process (aiohttp's runner,
its server as the protocol factory behind the cap, as HttpFrontEnd listens): the count of open
connections, the 503 past the limit, and the abort of a connection older than LIFETIME_S."""

from __future__ import annotations

import asyncio

from aiohttp import web

from chronoq.server import http


async def _echo(request: web.Request) -> web.Response:
    return web.Response(body=await request.read())


async def _serve(limit: int):
    app = web.Application()
    app.router.add_post("/echo", _echo)
    app.router.add_get("/ok", _ok)
    runner = web.AppRunner(app, access_log=None, keepalive_timeout=60)
    await runner.setup()
    cap = http.CappedFactory(runner.server, limit)
    listener = await asyncio.get_running_loop().create_server(cap, "127.0.0.1", 0)
    return (runner, listener), cap, listener.sockets[0].getsockname()[1]


async def _ok(request: web.Request) -> web.Response:
    return web.Response(text="ok")


async def _until(predicate, what: str, polls: int = 400) -> None:
    for _ in range(polls):  # bounded: 400 loop passes of 10 ms
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never: {what}")


def test_connections_past_the_limit_get_503_and_closed_ones_make_room():
    async def main():
        runner, server, port = await _serve(2)
        try:
            held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
            await _until(lambda: server.open == 2, "two connections open")
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            answer = await asyncio.wait_for(reader.read(), 10)
            assert answer.startswith(b"HTTP/1.1 503 ") and b"http_max_connections (2)" in answer
            writer.close()
            assert server.open == 2 and server.refused == 1
            for _, w in held:
                w.close()
            await _until(lambda: server.open == 0, "closed connections released")
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /ok HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert (await asyncio.wait_for(reader.read(), 10)).startswith(b"HTTP/1.1 200 ")
            writer.close()
        finally:
            await http._close(*runner)

    asyncio.run(main())


def test_a_body_trickled_in_is_cut_off_at_the_connection_lifetime(monkeypatch):
    monkeypatch.setattr(http, "LIFETIME_S", 0.5)

    async def main():
        runner, server, port = await _serve(4)
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n" + b"x" * 10)
            # The handler waits for 990 more bytes; the lifetime aborts the connection.
            assert await asyncio.wait_for(reader.read(), 10) == b""
            await _until(lambda: server.open == 0, "the aborted connection released")
            writer.close()
        finally:
            await http._close(*runner)

    asyncio.run(main())
