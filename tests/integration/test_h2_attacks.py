"""The HTTP/2 front end against the known attacks (issue 20 §3) and its transport caps (§2).

Each test drives raw frames (built with ``hyperframe`` and ``hpack``) at a live
``chronoq.server.h2grpc.Server`` listening on 127.0.0.1, and checks three things: the attacking
connection's reaction read off the socket (the GOAWAY code, or REFUSED_STREAM), the refusal
counted by reason (``chronoq.core.refusals``), and that a normal gRPC client call on a new connection
still succeeds afterwards. Limits are injected small (``h2limits.Limits``) so no test waits long.
``test_serve_counts_refusals_and_takes_the_config_keys`` does the same against ``chronoq serve``.
The server and the raw client are ``h2rawkit``'s; answers a peer leaves untaken are
``test_h2_held_answers.py``'s.
"""

from __future__ import annotations

import asyncio
import re
import socket
import struct
import urllib.request

import grpc
import hpack
import pytest
from hyperframe.frame import (ContinuationFrame, DataFrame, ExtensionFrame, HeadersFrame, PingFrame, RstStreamFrame,
                              SettingsFrame, WindowUpdateFrame)

from chronoq.core import refusals as R
from chronoq.protocol import h2

from .h2rawkit import (CANCEL, ENHANCE_YOUR_CALM, NO_ERROR, PROTOCOL_ERROR, REFUSED_STREAM, RawClient,
                       assert_goaway, attack, goaway_case, refused, run)

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
