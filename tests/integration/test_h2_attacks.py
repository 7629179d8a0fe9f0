"""The HTTP/2 front end against the known attacks (issue 20 §3) and its transport caps (§2).

Each test drives raw frames (built with ``hyperframe`` and ``hpack``) at a live
``chronoq.server.h2grpc.Server`` listening on 127.0.0.1, and checks three things: the attacking
connection's reaction read off the socket (the GOAWAY code, or REFUSED_STREAM), the refusal
counted by reason (``chronoq.core.refusals``), and that a normal gRPC client call on a new connection
still succeeds afterwards. Limits are injected small (``h2limits.Limits``) so no test waits long.
``test_serve_counts_refusals_and_takes_the_config_keys`` does the same against ``chronoq serve``.
"""

from __future__ import annotations

import asyncio
import re
import socket
import struct
import time
import urllib.request

import grpc
import hpack
import pytest
from hyperframe.frame import (ContinuationFrame, DataFrame, ExtensionFrame, Frame, GoAwayFrame, HeadersFrame,
                              PingFrame, RstStreamFrame, SettingsFrame, WindowUpdateFrame)

from chronoq.core import refusals as R
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


# ---------------------------------------------------------------------------------- §3 attacks
def test_rapid_reset_spends_a_budget_then_goaway():
    # CVE-2023-44487: open a stream, reset it, repeat.
    def script(c: RawClient):
        for sid in range(1, 2 * 60, 2):
            c.open(sid, b"sleep")
            c.send(RstStreamFrame(sid, error_code=CANCEL))
        c.read_until_closed()

    goaway_case(script, "resets over the budget", R.RAPID_RESET, reset_burst=50, reset_rate=1.0)


def test_handlers_of_reset_streams_count_against_the_stream_cap():
    # Go's lesson from rapid reset: a reset stream whose handler is still running (here: its
    # clean-up waits) still occupies a slot, so resets cannot run more handlers than the cap.
    async def test(endpoint, refusals, echo):
        def first(c: RawClient):
            for sid in (1, 3, 5):
                c.open(sid, b"linger")
            c.read(0.5)  # the three handlers are running
            c.send(*(RstStreamFrame(sid, error_code=CANCEL) for sid in (1, 3, 5)))
            c.open(7, b"x")  # a free slot: answered
            c.open(9, b"x")  # three handlers still finishing + none open: over the cap of 3
            c.read(0.5)

        client = await attack(endpoint, first)
        resets = {f.stream_id: f.error_code for f in client.frames if isinstance(f, RstStreamFrame)}
        answered = {f.stream_id for f in client.frames if isinstance(f, HeadersFrame) and "END_STREAM" in f.flags}
        assert 7 in answered or resets.get(7) == REFUSED_STREAM
        assert resets.get(9) == REFUSED_STREAM
        assert refusals.counts[R.STREAMS] >= 1
        echo.release.set()  # the clean-ups end: the slots are free again

    run(test, max_concurrent_streams=3)


def test_resets_the_server_sends_spend_the_same_budget():
    # MadeYouReset (CVE-2025-8671): frames that make the server reset streams (here a
    # WINDOW_UPDATE of 0 on an open stream, a stream error) cost the client the same budget.
    def script(c: RawClient):
        for sid in range(1, 2 * 40, 2):
            c.open(sid)  # no END_STREAM: the call waits for its request
            c.send(WindowUpdateFrame(sid, window_increment=0))
        c.read_until_closed()

    async def test(endpoint, refusals, echo):
        client = await attack(endpoint, script)
        assert sum(1 for f in client.frames if isinstance(f, RstStreamFrame) and f.error_code == PROTOCOL_ERROR) == 20
        assert_goaway(client, ENHANCE_YOUR_CALM, "reset by the server over the budget")
        assert refused(refusals) == {R.SERVER_RESETS: 1}

    run(test, reset_burst=20, reset_rate=0.5)


@pytest.mark.parametrize("payload_size", [0, 100])
def test_continuation_flood_is_cut_at_eight_frames(payload_size):
    # CVE-2024-27316 and kin: a header block that never ends. Zero-length frames never trip a
    # byte cap, so frames are counted. Default limit (8).
    def script(c: RawClient):
        c.send(HeadersFrame(1, c.request_block()[:5]))  # no END_HEADERS
        c.send(*(ContinuationFrame(1, b"\x00" * payload_size) for _ in range(50)))
        c.read_until_closed()

    goaway_case(script, "more than 8 CONTINUATION", R.CONTINUATION_FLOOD)


def test_hpack_bomb_is_stopped_while_decoding():
    # CVE-2016-6581: one 4,000-byte table entry, then 1-byte references to it: ~20 kB on the wire
    # would decode to 64 MB. The decoded list is capped at 64 KiB (32 bytes per field counted).
    def script(c: RawClient):
        big = ("x-big", "a" * 4000)
        block = c.request_block([big] * 16_000)  # hpack indexes the first, then refers to it
        assert len(block) < 40_000
        parts = [block[i:i + 16_384] for i in range(0, len(block), 16_384)]
        c.send(HeadersFrame(1, parts[0], flags=["END_STREAM"] + (["END_HEADERS"] if len(parts) == 1 else [])),
               *(ContinuationFrame(1, p, flags=["END_HEADERS"] if i == len(parts) - 1 else [])
                 for i, p in enumerate(parts[1:], 1)))
        c.read_until_closed()

    goaway_case(script, "header list over 65536", R.HEADER_LIST)


def test_ping_flood_from_a_peer_that_does_not_read():
    # CVE-2019-9512: PINGs whose acks the client never reads pile up in the server's buffer.
    def script(c: RawClient):
        c.sock.settimeout(0.5)
        pings = b"".join(PingFrame(0, opaque_data=b"%08d" % i).serialize() for i in range(1000))
        for _ in range(400):  # bounded: at most 6.8 MB of PINGs
            try:
                c.sock.sendall(pings)
            except (socket.timeout, BrokenPipeError, ConnectionResetError):
                break  # the server stopped reading us (it closed the connection)
        c.read_until_closed(30)

    async def test(endpoint, refusals, echo):
        client = await attack(endpoint, script, rcvbuf=4096)
        # The server closed the connection; its GOAWAY sits behind the acks this client never
        # read, and closing a socket with our PINGs unread makes the kernel reset it: the GOAWAY
        # may never arrive. When it does, it says why.
        assert client.closed
        goaway = client.goaway()
        assert goaway is None or (goaway.error_code == ENHANCE_YOUR_CALM
                                  and b"acks queued unread" in goaway.additional_data)
        assert refused(refusals) == {R.CONTROL_FLOOD: 1}

    run(test, max_unread_acks=100, control_burst=10**9)  # this test is about the unread acks


@pytest.mark.parametrize("kind", ["PING", "SETTINGS"])
def test_ping_and_settings_frames_spend_a_budget_even_when_acks_are_read(kind):
    # CVE-2019-9512/9515 from a peer that reads: every ack leaves, yet each frame costs work.
    def script(c: RawClient):
        for i in range(80):
            c.send(PingFrame(0, opaque_data=b"%08d" % i) if kind == "PING"
                   else SettingsFrame(0, settings={0x1: 4096}))
            c.read(0.001)
        c.read_until_closed()

    goaway_case(script, "PING/SETTINGS frames over the budget", R.CONTROL_FLOOD, control_burst=50, control_rate=1.0)


def test_settings_frame_with_too_many_entries():
    # nghttp2's rule: at most 32 entries in one SETTINGS frame.
    def script(c: RawClient):
        c.send(SettingsFrame(0, settings={0x100 + i: 1 for i in range(40)}))  # unknown ids: legal, ignored
        c.read_until_closed()

    goaway_case(script, "more than 32 entries", R.CONTROL_FLOOD)


@pytest.mark.parametrize("kind", ["empty DATA", "unknown type", "empty HEADERS"])
def test_frames_carrying_nothing_spend_a_budget(kind):
    # CVE-2019-9518: floods of frames that cost the server work and carry nothing.
    def script(c: RawClient):
        if kind == "empty DATA":
            c.open(1)
            c.send(*(DataFrame(1, b"") for _ in range(80)))
        elif kind == "unknown type":
            c.send(*(ExtensionFrame(type=0x42, stream_id=0, flag_byte=0, body=b"") for _ in range(80)))
        else:  # empty HEADERS without END_HEADERS, each ended by a CONTINUATION that carries the block
            for sid in range(1, 2 * 80, 2):
                c.send(HeadersFrame(sid, b"", flags=["END_STREAM"]),
                       ContinuationFrame(sid, c.request_block(), flags=["END_HEADERS"]))
        c.read_until_closed()

    goaway_case(script, "frames carrying nothing over the budget", R.EMPTY_FRAMES, empty_burst=50, empty_rate=1.0)


def test_streams_past_the_advertised_cap_are_refused():
    async def test(endpoint, refusals, echo):
        def script(c: RawClient):
            for sid in (1, 3, 5, 7, 9):  # no END_STREAM: each call stays open
                c.open(sid)
            c.read(0.5)
            c.send(DataFrame(1, struct.pack(">BI", 0, 2) + b"ok", flags=["END_STREAM"]))  # one ends
            c.open(11, b"again")  # a slot is free again
            c.read(0.5)

        client = await attack(endpoint, script)
        settings = next(f for f in client.frames if isinstance(f, SettingsFrame) and "ACK" not in f.flags)
        assert settings.settings[SettingsFrame.MAX_CONCURRENT_STREAMS] == 4
        resets = {f.stream_id: f.error_code for f in client.frames if isinstance(f, RstStreamFrame)}
        assert resets == {9: REFUSED_STREAM}
        answered = {f.stream_id for f in client.frames if isinstance(f, HeadersFrame) and "END_STREAM" in f.flags}
        assert answered == {1, 11}
        assert not client.goaway()
        assert refused(refusals) == {R.STREAMS: 1}

    run(test, max_concurrent_streams=4)


def test_answers_a_peer_does_not_take_are_bounded():
    """A peer that announces stream windows of 0 and keeps calling: its answers wait, and once
    the connection holds some, one that would take it past ``max_unread_answer_bytes`` is refused
    with RESOURCE_EXHAUSTED (trailers only: HEADERS are not flow-controlled); the calls before
    it stay answered as soon as the peer opens its windows, and the connection goes on."""
    body = b"a" * (512 << 10)

    async def test(endpoint, refusals, echo):
        def script(c: RawClient):
            c.send(SettingsFrame(0, settings={SettingsFrame.INITIAL_WINDOW_SIZE: 0}))
            for sid in range(1, 17, 2):  # 8 calls, each answered with its 512 KiB
                c.open(sid, body)
            c.read(1.0)
            c.send(SettingsFrame(0, settings={SettingsFrame.INITIAL_WINDOW_SIZE: 1 << 30}),
                   WindowUpdateFrame(0, (1 << 30)))
            c.read(1.0)

        client = await attack(endpoint, script)
        status = _statuses(client)
        assert status == {1: "0", 3: "0", 5: "0", 7: "0", 9: "8", 11: "8", 13: "8", 15: "8"}, status
        answered = sum(len(f.data) for f in client.frames if isinstance(f, DataFrame))
        assert answered == 4 * (len(body) + 5)
        assert not client.goaway()
        assert refused(refusals) == {R.ANSWER_BUDGET: 4}

    run(test, max_unread_answer_bytes=4 * (len(body) + 5))  # four framed answers, exactly


def _statuses(client: RawClient) -> dict:
    """stream id -> grpc-status, of the trailers received so far (our server's header blocks
    touch no HPACK table: a new decoder reads them all again)."""
    decoder, status = hpack.Decoder(), {}
    for f in client.frames:
        if isinstance(f, HeadersFrame):
            for name, value in decoder.decode(f.data):
                if name == "grpc-status":
                    status[f.stream_id] = value
    return status


def _read_until(client: RawClient, done, limit_s: float = 10.0) -> None:
    """Read until ``done(client)``: the test goes on from a known state, not after a guessed pause."""
    deadline = time.monotonic() + limit_s
    while not done(client) and not client.closed and time.monotonic() < deadline:
        client.read(0.1)
    assert done(client), [(type(f).__name__, f.stream_id) for f in client.frames][-10:]


def test_answers_untaken_on_many_connections_are_bounded_in_all():
    """Peers that announce stream windows of 0 and keep calling, each under the per-connection
    cap, together pass the server's total (``max_unread_answer_bytes_total``): an answer that
    would take the total past it is then refused with RESOURCE_EXHAUSTED, a connection's first
    answer too (only a lone answer while nothing is held anywhere is always taken). Once the peers open their windows and read, the total is back
    to 0 and the answers refused before are taken again; a peer that goes away with answers
    unread takes them off the total too."""
    body = b"t" * (512 << 10)
    framed = len(body) + 5  # what one answer holds while it waits (its trailers wait for it to leave)

    async def test(endpoint, refusals, echo):
        server = echo.server
        total = server.unread_answers

        def call(client: RawClient, sids) -> None:
            """Open these calls on a peer with stream windows of 0, until each has its first HEADERS:
            the answer's (held, since its DATA cannot leave) or the trailers of a refusal."""
            client.send(SettingsFrame(0, settings={SettingsFrame.INITIAL_WINDOW_SIZE: 0}))
            for sid in sids:
                client.open(sid, body)
            _read_until(client, lambda c: set(sids) <= {f.stream_id for f in c.frames if isinstance(f, HeadersFrame)})

        def connect_and_call(sids) -> RawClient:
            client = RawClient(endpoint)
            call(client, sids)
            return client

        def held_per_connection() -> list:
            return sorted(conn.held_answers + conn.held_out for conn in server._connections)

        # One peer after another, three calls each: 3 + 2 + 0 answers held (5 x framed), 0 + 1 + 3 refused.
        x = await asyncio.to_thread(connect_and_call, (1, 3, 5))
        assert total.held == 3 * framed and not refused(refusals)
        y = await asyncio.to_thread(connect_and_call, (1, 3, 5))
        assert total.held == 5 * framed  # exactly the total cap: the next answer passes it
        assert refused(refusals) == {R.ANSWER_BUDGET: 1}
        z = await asyncio.to_thread(connect_and_call, (1, 3, 5))
        assert total.held == 5 * framed  # z held nothing, but the total had no room even for its first
        assert refused(refusals) == {R.ANSWER_BUDGET: 4}
        assert held_per_connection() == [0, 2 * framed, 3 * framed]  # each under its own cap (4 x framed)
        assert _statuses(x) == {}
        assert sorted(_statuses(y).values()) == ["8"]  # RESOURCE_EXHAUSTED, trailers only
        assert sorted(_statuses(z).values()) == ["8", "8", "8"]

        def open_and_read(client: RawClient, answers: int) -> None:
            client.send(SettingsFrame(0, settings={SettingsFrame.INITIAL_WINDOW_SIZE: 1 << 30}),
                        WindowUpdateFrame(0, 1 << 30))
            _read_until(client, lambda c: list(_statuses(c).values()).count("0") == answers)

        for client, answers in ((x, 3), (y, 2), (z, 0)):
            await asyncio.to_thread(open_and_read, client, answers)
        assert total.held == 0 and held_per_connection() == [0, 0, 0]
        for client, answers in ((x, 3), (y, 2), (z, 0)):
            assert sum(len(f.data) for f in client.frames if isinstance(f, DataFrame)) == answers * framed

        # Room again: z's three new calls are all held (they would have passed the total before).
        await asyncio.to_thread(call, z, (7, 9, 11))
        assert total.held == 3 * framed
        assert refused(refusals) == {R.ANSWER_BUDGET: 4}
        # z goes away without reading them: the server's total forgets its bytes with the connection.
        z.close()
        for _ in range(100):
            if len(server._connections) == 2:
                break
            await asyncio.sleep(0.05)
        assert total.held == 0 and held_per_connection() == [0, 0]
        for client in (x, y):
            assert not client.goaway()
            client.close()

    run(test, max_unread_answer_bytes=4 * framed, max_unread_answer_bytes_total=5 * framed)


async def _until(done, limit_s: float = 5.0) -> None:
    """Poll the server's state (on its loop) until ``done()``: the next step starts from it."""
    deadline = time.monotonic() + limit_s
    while not done() and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    assert done()


def _frames_of(client: RawClient, sid: int) -> list:
    """What the server sent on stream ``sid``, in order: HEADERS, DATA (a run of DATA frames as
    one), TRAILERS (HEADERS with END_STREAM), RST_STREAM with its code."""
    kinds = []
    for f in client.frames:
        if f.stream_id != sid:
            continue
        if isinstance(f, HeadersFrame):
            kinds.append("TRAILERS" if "END_STREAM" in f.flags else "HEADERS")
        elif isinstance(f, DataFrame) and kinds[-1:] != ["DATA"]:
            kinds.append("DATA")
        elif isinstance(f, RstStreamFrame):
            kinds.append(f"RST {f.error_code}")
    return kinds


def _waiting_bidi_call(endpoint: str, body: bytes) -> RawClient:
    """A peer with stream windows of 0 and a Bidi call whose first request the handler echoes: the
    echo waits for window (its HEADERS, not flow-controlled, have come)."""
    client = RawClient(endpoint)
    client.send(SettingsFrame(0, settings={SettingsFrame.INITIAL_WINDOW_SIZE: 0}))
    client.open(1, path="Bidi")
    client.send(DataFrame(1, struct.pack(">BI", 0, len(body)) + body))
    _read_until(client, lambda c: _frames_of(c, 1) == ["HEADERS"])
    return client


# How the call ends while its echo waits, the frame that ends it, and the grpc-status the peer must get.
_ENDINGS = {
    "normally": (lambda: DataFrame(1, b"", flags=["END_STREAM"]), grpc.StatusCode.OK),
    # half-closed by the peer: the failed call is answered, not reset
    "inside a message": (lambda: DataFrame(1, b"\x00\x00", flags=["END_STREAM"]), grpc.StatusCode.INTERNAL),
    # not half-closed: RST_STREAM NO_ERROR stops the request, after the trailers
    "too large": (lambda: DataFrame(1, struct.pack(">BI", 0, 0xFFFF_FFFF)), grpc.StatusCode.RESOURCE_EXHAUSTED),
}


@pytest.mark.parametrize("opened_by", ["SETTINGS", "stream WINDOW_UPDATE"])
@pytest.mark.parametrize("ending", list(_ENDINGS))
def test_an_answer_waiting_for_window_reaches_the_peer_with_its_status(ending, opened_by):
    """A call ends (normally, or failed by the peer's request) while its answer waits for the
    peer's windows: once they open, the peer gets the answer, then the trailers with the call's
    status (then RST_STREAM NO_ERROR when the request was not over), and the bytes held for it
    go back to 0. A failed call leaves ``streams`` while its answer still waits, and the windows
    the peer then opens (SETTINGS or its stream's WINDOW_UPDATE) must still reach it."""
    body = b"w" * 1000
    end_frame, status = _ENDINGS[ending]
    code = status.value[0]

    async def test(endpoint, refusals, echo):
        server = echo.server
        client = await asyncio.to_thread(_waiting_bidi_call, endpoint, body)
        try:
            (conn,) = server._connections
            stream = conn.waiting[1]
            assert conn.held_answers == server.unread_answers.held == len(body) + 5
            await asyncio.to_thread(client.send, end_frame())
            await _until(lambda: stream.ended if code else stream.half_closed)
            assert conn.waiting.get(1) is stream and server.unread_answers.held >= len(body) + 5

            def open_windows() -> None:
                opening = (SettingsFrame(0, settings={SettingsFrame.INITIAL_WINDOW_SIZE: 1 << 20})
                           if opened_by == "SETTINGS" else WindowUpdateFrame(1, 1 << 20))
                client.send(opening, WindowUpdateFrame(0, 1 << 20))
                _read_until(client, lambda c: "TRAILERS" in _frames_of(c, 1)
                            and ("RST 0" in _frames_of(c, 1) or ending != "too large"), limit_s=5)

            await asyncio.to_thread(open_windows)
            data = b"".join(f.data for f in client.frames if isinstance(f, DataFrame) and f.stream_id == 1)
            assert data == struct.pack(">BI", 0, len(body)) + body
            assert _statuses(client) == {1: str(code)}
            reset = ["RST 0"] if ending == "too large" else []  # NO_ERROR: we want no more of the request
            assert _frames_of(client, 1) == ["HEADERS", "DATA", "TRAILERS", *reset]
            await _until(lambda: not (conn.streams or server._calls))  # the handler is done too
            assert (conn.held_answers, server.unread_answers.held, conn.waiting) == (0, 0, {})
            assert not client.goaway()
            assert refused(refusals) == ({R.MESSAGE_TOO_LARGE: 1} if ending == "too large" else {})
        finally:
            client.close()

    run(test)


def test_a_failed_call_reset_by_the_peer_drops_its_waiting_answer():
    """The peer resets a call that failed while its answer waited: the answer and trailers are
    dropped at once (off the bytes held), and opening the windows afterwards sends nothing on it."""
    body = b"r" * 1000

    async def test(endpoint, refusals, echo):
        server = echo.server
        client = await asyncio.to_thread(_waiting_bidi_call, endpoint, body)
        try:
            (conn,) = server._connections
            stream = conn.waiting[1]
            await asyncio.to_thread(client.send, DataFrame(1, b"\x00\x00", flags=["END_STREAM"]))
            await _until(lambda: stream.ended)
            assert server.unread_answers.held > 0

            def reset_then_open() -> None:
                client.send(RstStreamFrame(1, error_code=CANCEL), PingFrame(0, opaque_data=b"reset!!!"))
                _read_until(client, lambda c: any(isinstance(f, PingFrame) and f.opaque_data == b"reset!!!"
                                                  for f in c.frames))

            await asyncio.to_thread(reset_then_open)
            assert (conn.held_answers, server.unread_answers.held, conn.waiting) == (0, 0, {})

            def open_windows() -> None:
                client.send(SettingsFrame(0, settings={SettingsFrame.INITIAL_WINDOW_SIZE: 1 << 20}),
                            WindowUpdateFrame(1, 1 << 20), WindowUpdateFrame(0, 1 << 20),
                            PingFrame(0, opaque_data=b"opened!!"))
                _read_until(client, lambda c: any(isinstance(f, PingFrame) and f.opaque_data == b"opened!!"
                                                  for f in c.frames))

            await asyncio.to_thread(open_windows)
            assert _frames_of(client, 1) == ["HEADERS"]
            assert (conn.held_answers, server.unread_answers.held, conn.waiting) == (0, 0, {})
            assert not client.goaway()
        finally:
            client.close()

    run(test)


@pytest.mark.parametrize("path", ["Unary", "Bidi"])
def test_a_length_prefix_of_4_gib_is_refused_before_buffering(path):
    async def test(endpoint, refusals, echo):
        def script(c: RawClient):
            c.open(1, path=path)
            c.send(DataFrame(1, struct.pack(">BI", 0, 0xFFFF_FFFF) + b"x" * 100))  # and nothing more
            c.read(1.0)

        client = await attack(endpoint, script)
        trailers = [f for f in client.frames if isinstance(f, HeadersFrame) and "END_STREAM" in f.flags]
        assert trailers, [type(f).__name__ for f in client.frames]
        fields = dict(hpack.Decoder().decode(trailers[0].data))
        assert fields["grpc-status"] == str(grpc.StatusCode.RESOURCE_EXHAUSTED.value[0])
        assert "4294967295" in fields["grpc-message"]
        assert not client.goaway()  # the connection goes on
        assert refused(refusals) == {R.MESSAGE_TOO_LARGE: 1}

    run(test)


# ---------------------------------------------------------------------------------- §2 transport caps
def test_connections_past_the_cap_are_turned_away_and_the_others_go_on():
    async def test(endpoint, refusals, echo):
        def script():
            a, b = RawClient(endpoint), RawClient(endpoint)
            try:
                a.read(0.3), b.read(0.3)
                third = RawClient(endpoint)
                third.read_until_closed()
                third.close()
                a.open(1, b"a still works")
                frames = a.read(0.5)
                return third, frames
            finally:
                a.close(), b.close()

        third, frames = await asyncio.to_thread(script)
        assert_goaway(third, ENHANCE_YOUR_CALM, "connection limit 2")
        assert any(isinstance(f, DataFrame) and f.data.endswith(b"a still works") for f in frames)
        assert refused(refusals) == {R.CONNECTIONS: 1}
        await asyncio.sleep(0.2)  # the server sees the two raw connections close: room for the check in run()

    run(test, max_connections=2)


def test_half_a_preface_is_not_held_past_its_deadline():
    async def test(endpoint, refusals, echo):
        def script(c: RawClient):
            c.sock.sendall(h2.PREFACE[:10])
            c.read_until_closed()

        client = await attack(endpoint, script, preface=False)
        assert_goaway(client, PROTOCOL_ERROR, "h2_preface_timeout_ms")
        assert refused(refusals) == {R.PREFACE_TIMEOUT: 1}

    run(test, preface_timeout_s=0.3)


def test_an_idle_connection_is_closed_with_goaway_no_error():
    async def test(endpoint, refusals, echo):
        def script(c: RawClient):
            c.open(1, b"one call")
            c.read_until_closed()

        client = await attack(endpoint, script)
        assert any(isinstance(f, DataFrame) and f.data.endswith(b"one call") for f in client.frames)
        assert_goaway(client, NO_ERROR, "h2_idle_timeout_ms")
        assert client.goaway().last_stream_id == 1
        assert refused(refusals) == {R.IDLE_TIMEOUT: 1}

    run(test, idle_timeout_s=0.3)


def test_a_connection_with_an_open_call_is_not_idle():
    async def test(endpoint, refusals, echo):
        def script(c: RawClient):
            c.open(1, b"sleep")  # a call that stays open (as a long poll does)
            c.read(1.5)          # five idle intervals
            c.send(PingFrame(0, opaque_data=b"stillup!"))
            c.read(0.5)

        client = await attack(endpoint, script)
        assert not client.goaway() and not client.closed
        assert any(isinstance(f, PingFrame) and f.opaque_data == b"stillup!" for f in client.frames)
        assert refused(refusals) == {}

    run(test, idle_timeout_s=0.3)


# ---------------------------------------------------------------------------------- chronoq serve
def _refused_metric(url: str, reason: str) -> float:
    with urllib.request.urlopen(url + "metrics", timeout=10) as reply:
        text = reply.read().decode()
    found = re.search(r'^chronoq_requests_refused_total\{reason="%s"\} (\S+)$' % reason, text, re.M)
    return float(found.group(1)) if found else 0.0


@pytest.mark.parametrize("mode", ["chronoq", "grpcio"])
def test_serve_counts_refusals_and_takes_the_config_keys(chronoq_process, mode):
    server = chronoq_process(f'grpc_server = "{mode}"\nh2_max_concurrent_streams = 7\n')

    def script(c: RawClient):
        c.read(0.3)  # the server's SETTINGS
        c.send(HeadersFrame(1, c.request_block()[:5]))
        try:
            c.send(*(ContinuationFrame(1, b"") for _ in range(20_000)))
        except (BrokenPipeError, ConnectionResetError):  # grpcio closes without a GOAWAY
            c.closed = True
        c.read_until_closed()

    client = asyncio.run(attack(server.endpoint, script))
    settings = next(f for f in client.frames if isinstance(f, SettingsFrame) and "ACK" not in f.flags)
    assert settings.settings[SettingsFrame.MAX_CONCURRENT_STREAMS] == 7  # the config key reached the server
    assert client.closed
    if mode == "chronoq":  # grpcio's server does not report to chronoq's counters
        assert_goaway(client, ENHANCE_YOUR_CALM, "CONTINUATION")
        assert _refused_metric(server.http_url, R.CONTINUATION_FLOOD) == 1
