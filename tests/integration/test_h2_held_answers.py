"""Answers a peer does not take (issue 20 §3): held within the connection's and the server's
caps, and an answer waiting for window still reaching the peer with its status.

As in ``test_h2_attacks.py``: raw frames at a live ``chronoq.server.h2grpc.Server`` on 127.0.0.1
(``h2rawkit``), the refusals counted, and a normal call served afterwards.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import struct
import time

import grpc
import hpack
import pytest
from hyperframe.frame import DataFrame, HeadersFrame, PingFrame, RstStreamFrame, SettingsFrame, WindowUpdateFrame

from chronoq.core import refusals as R

from .h2rawkit import CANCEL, RawClient, attack, refused, run

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


@contextlib.asynccontextmanager
async def _waiting_answer(endpoint: str, server, body: bytes):
    """``_waiting_bidi_call`` (on a thread), then the server's one connection and the stream whose
    echo waits: ``(client, connection, stream)``; the client is closed after."""
    client = await asyncio.to_thread(_waiting_bidi_call, endpoint, body)
    try:
        (conn,) = server._connections
        yield client, conn, conn.waiting[1]
    finally:
        client.close()


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
        async with _waiting_answer(endpoint, server, body) as (client, conn, stream):
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

    run(test)


def test_a_failed_call_reset_by_the_peer_drops_its_waiting_answer():
    """The peer resets a call that failed while its answer waited: the answer and trailers are
    dropped at once (off the bytes held), and opening the windows afterwards sends nothing on it."""
    body = b"r" * 1000

    async def test(endpoint, refusals, echo):
        server = echo.server
        async with _waiting_answer(endpoint, server, body) as (client, conn, stream):
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

    run(test)


def test_unfinished_requests_are_bounded_in_all_the_hoarder_loses_first():
    """Peers that start unary requests and never finish them: the request bytes all connections
    hold are capped (``max_buffered_request_bytes_total``). Past the cap, the unfinished request
    holding the most, on the connection holding the most, is ended RESOURCE_EXHAUSTED
    (``request_budget``) until the sum is under it: a client whose request comes whole is served
    and the hoarders lose theirs. Before, each connection could hold ~80 MiB for ever."""
    part = b"p" * (256 << 10)
    cap = 3 * (len(part) + 5) + (128 << 10)

    async def test(endpoint, refusals, echo):
        server = echo.server

        def start_unfinished(client: RawClient, sids) -> None:
            for sid in sids:  # HEADERS, then a message announced of 1 MiB of which 256 KiB come
                client.send(HeadersFrame(sid, client.request_block(), flags=["END_HEADERS"]),
                            DataFrame(sid, struct.pack(">BI", 0, 1 << 20) + part))
            client.read(0.5)

        hog = RawClient(endpoint)
        await asyncio.to_thread(start_unfinished, hog, (1, 3, 5))
        assert server.buffered_requests == 3 * (len(part) + 5) and not refused(refusals)
        other = RawClient(endpoint)
        await asyncio.to_thread(start_unfinished, other, (1,))  # past the cap: the hog's biggest goes
        assert refused(refusals) == {R.REQUEST_BUDGET: 1}
        assert server.buffered_requests == 3 * (len(part) + 5) <= cap
        await asyncio.to_thread(hog.read, 0.5)
        assert list(_statuses(hog).values()) == ["8"] and _statuses(other) == {}
        # The ended request's bytes are let go at once, not when the garbage collector breaks the
        # call's cycles (a flood of them held a gigabyte).
        from chronoq.server.h2streams import Stream
        ended = [st for st in gc.get_objects() if isinstance(st, Stream) and st.ended]
        assert all(not st.buf for st in ended), [len(st.buf) for st in ended]
        # A whole request still gets through (its bytes pass the cap only for as long as it takes
        # the hoarder's next request to be ended), and is answered.
        fine = RawClient(endpoint)

        def whole_call(client: RawClient) -> None:
            client.send(SettingsFrame(0, settings={SettingsFrame.INITIAL_WINDOW_SIZE: 1 << 30}),
                        WindowUpdateFrame(0, 1 << 30))  # (its echo comes back whole)
            client.open(1, b"w" * (200 << 10))
            _read_until(client, lambda c: 1 in _statuses(c))
        await asyncio.to_thread(whole_call, fine)
        assert _statuses(fine) == {1: "0"}
        for c in (hog, other, fine):
            c.sock.close()
        deadline = time.monotonic() + 5
        while server.buffered_requests and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert server.buffered_requests == 0  # connections gone: their bytes off the sum

    run(test, max_buffered_request_bytes_total=cap)
