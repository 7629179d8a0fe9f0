"""HTTP/2 and gRPC rules a well-behaved client never breaks, and what the server answers when a
client does: stream states (RFC 9113 section 5.1), malformed request heads (section 8.3), a
compressed flag without an encoding and a deadline already past (gRPC's PROTOCOL-HTTP2.md).

Each test drives raw frames at a live ``chronoq.server.h2grpc.Server`` (``h2rawkit``), reads the
server's reaction off the socket, and ``h2rawkit.run`` checks that a normal call on a new
connection is served afterwards.
"""

from __future__ import annotations

import struct

import grpc
import hpack
import pytest
from hyperframe.frame import DataFrame, HeadersFrame, RstStreamFrame

from chronoq.core import refusals as R

from .h2rawkit import CANCEL, PROTOCOL_ERROR, REFUSED_STREAM, SERVICE, RawClient, assert_goaway, attack, refused, run

STREAM_CLOSED = 5
HEAD = [(":method", "POST"), (":scheme", "http"), (":path", f"/{SERVICE}/Unary"), (":authority", "x"),
        ("content-type", "application/grpc"), ("te", "trailers")]


def message(body: bytes, compressed: int = 0) -> bytes:
    return struct.pack(">BI", compressed, len(body)) + body


def call(c: RawClient, sid: int, fields, body: bytes = b"hi", compressed: int = 0) -> None:
    c.send(HeadersFrame(sid, c.encoder.encode(fields), flags=["END_HEADERS"]),
           DataFrame(sid, message(body, compressed), flags=["END_STREAM"]))


def resets(c: RawClient) -> dict:
    return {f.stream_id: f.error_code for f in c.frames if isinstance(f, RstStreamFrame)}


def statuses(c: RawClient) -> dict:
    """grpc-status (and message) of each stream the server ended with trailers."""
    decoder, out = hpack.Decoder(), {}
    for f in c.frames:
        if isinstance(f, HeadersFrame):
            fields = dict(decoder.decode(f.data))
            if "END_STREAM" in f.flags:
                out[f.stream_id] = (int(fields["grpc-status"]), fields.get("grpc-message", ""))
    return out


# ------------------------------------------------------------------ stream states (section 5.1)
def test_data_on_a_half_closed_stream_resets_that_stream_only():
    async def test(endpoint, refusals, echo):
        def script(c: RawClient):
            call(c, 1, HEAD, b"sleep")  # its handler runs on: the stream is half-closed (remote)
            c.send(DataFrame(1, message(b"more")))
            c.read(0.5)
            call(c, 3, HEAD, b"next")  # the connection goes on
            c.read(0.5)

        client = await attack(endpoint, script)
        assert resets(client) == {1: STREAM_CLOSED}
        assert statuses(client) == {3: (0, "")}
        assert not client.goaway()
        assert refused(refusals) == {R.PROTOCOL: 1}

    run(test)


@pytest.mark.parametrize("late", ["DATA", "HEADERS"])
def test_frames_on_a_stream_the_client_ended_are_a_connection_error(late):
    async def test(endpoint, refusals, echo):
        def script(c: RawClient):
            call(c, 1, HEAD)
            c.read(0.5)  # answered: closed both ways
            if late == "DATA":
                c.send(DataFrame(1, message(b"late"), flags=["END_STREAM"]))
            else:
                c.send(HeadersFrame(1, c.encoder.encode([("x-late", "1")]), flags=["END_HEADERS", "END_STREAM"]))
            c.read_until_closed(5)

        client = await attack(endpoint, script)
        assert statuses(client) == {1: (0, "")}
        assert_goaway(client, STREAM_CLOSED, "which the client closed")

    run(test)


def test_data_after_the_client_reset_its_stream_is_a_connection_error():
    async def test(endpoint, refusals, echo):
        def script(c: RawClient):
            c.open(1)
            c.send(RstStreamFrame(1, error_code=CANCEL))
            c.send(DataFrame(1, message(b"late"), flags=["END_STREAM"]))
            c.read_until_closed(5)

        client = await attack(endpoint, script)
        assert_goaway(client, STREAM_CLOSED, "which the client closed")

    run(test)


def test_data_in_flight_on_a_stream_the_server_reset_is_dropped():
    """The client may have sent DATA before it saw our RST_STREAM: ignored, never an error."""
    async def test(endpoint, refusals, echo):
        def script(c: RawClient):
            for sid in (1, 3):  # open, no END_STREAM: the cap is 2
                c.open(sid)
            c.open(5)  # refused
            c.send(DataFrame(5, message(b"in flight"), flags=["END_STREAM"]))
            c.read(0.5)
            c.send(DataFrame(1, message(b"ok"), flags=["END_STREAM"]))
            c.read(0.5)

        client = await attack(endpoint, script)
        assert resets(client) == {5: REFUSED_STREAM}
        assert statuses(client) == {1: (0, "")}
        assert not client.goaway()

    run(test, max_concurrent_streams=2)


# ------------------------------------------------------------------ malformed requests (section 8.3)
@pytest.mark.parametrize("fields", [
    [("content-type", "application/grpc")] + [f for f in HEAD if f[0] != "content-type"],  # pseudo after regular
    HEAD[:4] + [(":foo", "bar")] + HEAD[4:],
    HEAD[:4] + [(":status", "200")] + HEAD[4:],
    HEAD[:3] + [HEAD[2]] + HEAD[3:],                       # :path twice
    [f for f in HEAD if f[0] != ":scheme"],
    [f for f in HEAD if f[0] != ":method"],
    [(k, "" if k == ":path" else v) for k, v in HEAD],
    HEAD + [("X-Upper", "1")],
    HEAD + [("connection", "keep-alive")],
    HEAD[:5] + [("te", "gzip")],
], ids=["pseudo-after-regular", "unknown-pseudo", "status-pseudo", "path-twice", "no-scheme", "no-method",
        "empty-path", "upper-case-name", "connection", "te-gzip"])
def test_a_malformed_request_head_resets_its_stream_and_the_connection_goes_on(fields):
    async def test(endpoint, refusals, echo):
        def script(c: RawClient):
            call(c, 1, fields)
            c.read(0.5)
            call(c, 3, HEAD, b"next")
            c.read(0.5)

        client = await attack(endpoint, script)
        assert resets(client) == {1: PROTOCOL_ERROR}  # never served
        assert statuses(client) == {3: (0, "")}
        assert not client.goaway()
        assert refused(refusals) == {R.PROTOCOL: 1}

    run(test)


# ------------------------------------------------------------------ gRPC
@pytest.mark.parametrize("encoding, status", [(None, grpc.StatusCode.INTERNAL), ("identity", grpc.StatusCode.INTERNAL),
                                              ("br", grpc.StatusCode.UNIMPLEMENTED)])
def test_a_compressed_flag_without_a_readable_encoding(encoding, status):
    async def test(endpoint, refusals, echo):
        def script(c: RawClient):
            call(c, 1, HEAD + ([("grpc-encoding", encoding)] if encoding else []), b"x", compressed=1)
            c.read(0.5)

        client = await attack(endpoint, script)
        assert statuses(client)[1][0] == status.value[0]

    run(test)


@pytest.mark.parametrize("timeout", ["0n", "0m", "0S"])
def test_a_deadline_already_past_is_not_served(timeout):
    async def test(endpoint, refusals, echo):
        def script(c: RawClient):
            call(c, 1, HEAD + [("grpc-timeout", timeout)], b"sleep")  # served, it would sleep 30 s
            call(c, 3, HEAD + [("grpc-timeout", "5S")], b"served")
            c.read(0.5)

        client = await attack(endpoint, script)
        assert statuses(client) == {1: (grpc.StatusCode.DEADLINE_EXCEEDED.value[0], "Deadline Exceeded"), 3: (0, "")}

    run(test)
