"""The HTTP listener (/metrics, /healthz, the console: chronoq.server.http) holds at most
``http_max_connections`` connections, through a real ``chronoq serve``.

Raw TCP connections past the limit are each answered 503 naming the limit and closed, while the
ones held still serve requests and a gRPC send and receive go on; once the flood closes, a plain
GET /metrics works again. A client sending a request's headers a byte at a time ("slow loris")
is closed after ``http_idle_timeout_ms``, as is one that sends nothing.
"""

from __future__ import annotations

import asyncio
import http.client
import socket
import urllib.error
import urllib.request
from contextlib import ExitStack

from chronoq.client.client import Client

from .conftest import ChronoqProcess, wait_until
from .test_metrics import scrape

CAP = 8
EXTRA = 12


def _connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=10)


def _read_to_eof(sock: socket.socket, limit: int = 1 << 16) -> bytes:
    """Everything the server sends until it closes (socket timeout 10 s: a hang fails)."""
    out = b""
    while len(out) < limit:
        part = sock.recv(4096)
        if not part:
            return out
        out += part
    raise AssertionError(f"more than {limit} bytes and still open: {out[:200]!r}")


def _get_on(sock: socket.socket, path: str) -> bytes:
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n".encode())
    return _read_to_eof(sock)


async def _round_trip(endpoint: str) -> list[bytes]:
    async with Client(endpoint) as client:
        await client.send("http-flood", b"still serving")
        got = await client.receive("http-flood-group", "http-flood", max_messages=4, wait_s=5)
        await client.ack("http-flood-group", "http-flood", got)
        return [m.body for m in got]


def _metrics_ok(url: str) -> bool:
    try:
        return bool(scrape(url))
    except urllib.error.HTTPError as exc:
        assert exc.code == 503, exc  # refused while the server has not yet seen the flood's closes
        return False


def test_connections_past_http_max_connections_are_refused_and_the_broker_serves_on(tmp_path, monkeypatch):
    monkeypatch.setenv("CHRONOQ_HTTP_MAX_CONNECTIONS", str(CAP))
    proc = ChronoqProcess(str(tmp_path / "data"))
    try:
        assert scrape(proc.http_url)
        with ExitStack() as stack:
            held = [stack.enter_context(_connect(proc.http_port)) for _ in range(CAP)]
            # Accepted in order: every connection after the first CAP is past the limit.
            extra = [stack.enter_context(_connect(proc.http_port)) for _ in range(EXTRA)]
            for sock in extra:
                answer = _read_to_eof(sock)
                assert answer.startswith(b"HTTP/1.1 503 "), answer
                assert b"http_max_connections (%d)" % CAP in answer
            try:
                urllib.request.urlopen(proc.http_url + "metrics", timeout=10)
                raise AssertionError("a connection past the limit was served")
            except urllib.error.HTTPError as exc:
                assert exc.code == 503 and b"http_max_connections" in exc.read()
            except (ConnectionResetError, http.client.RemoteDisconnected):
                pass  # (its request arrived before the close: the kernel may reset instead of the 503)
            assert asyncio.run(_round_trip(proc.endpoint)) == [b"still serving"]  # gRPC unaffected
            answer = _get_on(held[0], "/healthz")  # a held connection is a served one
            assert answer.startswith(b"HTTP/1.1 200 ") and answer.endswith(b"ok\n"), answer
        # The flood closed: a plain scrape works again (once the server has seen the closes).
        wait_until(lambda: _metrics_ok(proc.http_url), 30, what="GET /metrics after the flood")
        assert "connection(s) refused since start" in proc.output()
    finally:
        proc.stop()


def test_a_slow_loris_and_a_silent_connection_are_closed_after_the_idle_timeout(tmp_path, monkeypatch):
    monkeypatch.setenv("CHRONOQ_HTTP_IDLE_TIMEOUT_MS", "1000")
    proc = ChronoqProcess(str(tmp_path / "data"))
    try:
        with _connect(proc.http_port) as silent, _connect(proc.http_port) as loris:
            request = b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 400
            loris.settimeout(0.2)
            closed = False
            for i in range(len(request)):  # one byte every 0.2 s: 80 s of headers if never cut
                try:
                    loris.sendall(request[i:i + 1])
                    if loris.recv(4096) == b"":
                        closed = True
                        break
                except socket.timeout:
                    continue
                except (BrokenPipeError, ConnectionResetError):
                    closed = True
                    break
            assert closed, "the slow headers were never cut off"
            assert i < len(request) - 1
            assert _read_to_eof(silent) == b""  # closed without a word
        assert scrape(proc.http_url)
    finally:
        proc.stop()
