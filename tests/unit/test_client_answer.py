"""What a unary gRPC answer means (chronoq/client/answer.py), on the fields and DATA the client's
transport collects: its message, or the error its status, HTTP status or framing calls for.
(test_h2client.py drives the same code through the transport against grpcio's server.) Also run
on the pure-Python build (test_compiled.py's CODEC_TESTS)."""

from __future__ import annotations

import gzip
import struct

import grpc

from chronoq.client.answer import answer_of, http_error

OK_HEADERS = [(":status", "200"), ("content-type", "application/grpc")]


def _message(body: bytes, compressed: int = 0) -> bytes:
    return struct.pack(">BI", compressed, len(body)) + body


def test_an_ok_answer_is_its_message_from_bytes_or_a_bytearray():
    assert answer_of(OK_HEADERS, [("grpc-status", "0")], _message(b"hello")) == b"hello"
    got = answer_of(OK_HEADERS, [("grpc-status", "0")], bytearray(_message(b"x" * 70_000)))
    assert type(got) is bytes and got == b"x" * 70_000


def test_a_failed_status_carries_its_code_message_and_metadata():
    headers = OK_HEADERS + [("x-initial", "a")]
    trailers = [("grpc-status", "5"), ("grpc-message", "no%20such%20topic"), ("x-trailing", "b")]
    err = answer_of(headers, trailers, b"")
    assert isinstance(err, grpc.aio.AioRpcError)
    assert err.code() is grpc.StatusCode.NOT_FOUND and err.details() == "no such topic"
    assert err.initial_metadata()["x-initial"] == "a" and err.trailing_metadata()["x-trailing"] == "b"
    assert "grpc-status" not in err.trailing_metadata() and ":status" not in err.initial_metadata()


def test_a_missing_or_unknown_status_is_an_error_not_a_message():
    missing = answer_of(OK_HEADERS, [], _message(b"hello"))
    assert missing.code() is grpc.StatusCode.INTERNAL and "no grpc-status" in missing.details()
    bad = answer_of(OK_HEADERS, [("grpc-status", "99")], _message(b"hello"))
    assert bad.code() is grpc.StatusCode.UNKNOWN and "'99'" in bad.details()


def test_an_ok_answer_must_hold_exactly_one_whole_message():
    ok = [("grpc-status", "0")]
    assert "no message" in answer_of(OK_HEADERS, ok, b"\x00\x00").details()
    assert "exactly one" in answer_of(OK_HEADERS, ok, _message(b"a") + _message(b"b")).details()
    assert "exactly one" in answer_of(OK_HEADERS, ok, _message(b"abc")[:-1]).details()


def test_a_compressed_message_is_decompressed_by_the_headers_encoding():
    headers = OK_HEADERS + [("grpc-encoding", "gzip")]
    assert answer_of(headers, [("grpc-status", "0")], _message(gzip.compress(b"zipped"), 1)) == b"zipped"
    err = answer_of(headers, [("grpc-status", "0")], _message(b"not gzip", 1))
    assert err.code() is grpc.StatusCode.INTERNAL and "cannot decompress" in err.details()
    unknown = answer_of(OK_HEADERS + [("grpc-encoding", "snappy")], [("grpc-status", "0")], _message(b"?", 1))
    assert "snappy" in unknown.details()


def test_a_trailers_only_answer_reads_its_one_block_for_both():
    block = OK_HEADERS + [("grpc-status", "7"), ("grpc-message", "denied")]
    err = answer_of(block, block, b"")
    assert err.code() is grpc.StatusCode.PERMISSION_DENIED and err.details() == "denied"


def test_an_http_status_maps_to_grpcs_code():
    assert http_error("404").code() is grpc.StatusCode.UNIMPLEMENTED
    assert http_error("503").code() is grpc.StatusCode.UNAVAILABLE
    assert http_error("418").code() is grpc.StatusCode.UNKNOWN
    assert http_error("").code() is grpc.StatusCode.UNKNOWN and "none" in http_error("").details()
