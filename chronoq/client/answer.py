"""What a unary gRPC answer means (``answer_of``): its message, or the ``grpc.aio.AioRpcError``
that its status, its HTTP status or its framing calls for. Pure: no I/O, no connection state; the
transport (``chronoq.client.h2channel``) collects an answer's header fields and DATA and hands
them here once the stream has ended.

Errors are ``grpc.aio.AioRpcError``, as grpc's own channel raises, so callers handle both alike.
Compiled (``chronoq.COMPILED_MODULES``): ``answer_of`` runs once per call, and the transport calls
it as a C function (answer.pxd, cimported by h2channel.pxd).
"""

from __future__ import annotations

import zlib
from urllib.parse import unquote

import grpc

from chronoq.protocol.h2 import MESSAGE_PREFIX, UnsupportedEncoding, decompress

# HTTP status -> gRPC code for answers that are not gRPC (gRPC's "HTTP to gRPC status code mapping").
_HTTP_CODES = {400: grpc.StatusCode.INTERNAL, 401: grpc.StatusCode.UNAUTHENTICATED,
               403: grpc.StatusCode.PERMISSION_DENIED, 404: grpc.StatusCode.UNIMPLEMENTED,
               429: grpc.StatusCode.UNAVAILABLE, 502: grpc.StatusCode.UNAVAILABLE,
               503: grpc.StatusCode.UNAVAILABLE, 504: grpc.StatusCode.UNAVAILABLE}
_CODES = {c.value[0]: c for c in grpc.StatusCode}
_CODES_BY_TEXT = {str(number): c for number, c in _CODES.items()}  # grpc-status as sent: no int() per call
_OK = grpc.StatusCode.OK


def rpc_error(code: grpc.StatusCode, details: str, initial=(), trailing=()) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(*initial), grpc.aio.Metadata(*trailing), details)


def http_error(status: str) -> grpc.aio.AioRpcError:
    """The error for an answer whose ``:status`` is not 200 (``status``: "" when it had none)."""
    code = _HTTP_CODES.get(int(status) if status.isdigit() else 0, grpc.StatusCode.UNKNOWN)
    return rpc_error(code, f"the server answered HTTP status {status or 'none'}")


def answer_of(headers, trailers, data):
    """A whole answer -> its message's bytes, or the AioRpcError to raise. ``headers``: its first
    header block's fields (``:status`` 200 checked already), ``trailers``: the fields of the block
    that ended the stream (the same block for a trailers-only answer), ``data``: its DATA, bytes
    or bytearray."""
    trailers = trailers or []
    status = message = ""
    for key, value in trailers:
        if key == "grpc-status":
            status = value
        elif key == "grpc-message":
            message = unquote(value, errors="replace")
    code = _CODES_BY_TEXT.get(status)
    if code is None and status.isdigit():
        code = _CODES.get(int(status))
    if code is None:
        return rpc_error(grpc.StatusCode.UNKNOWN if status else grpc.StatusCode.INTERNAL,
                         f"bad grpc-status {status!r}" if status else "the answer has no grpc-status")
    if code is not _OK:
        return rpc_error(code, message, _metadata(headers), _metadata(trailers))
    if len(data) < 5:
        return rpc_error(grpc.StatusCode.INTERNAL, "the answer holds no message")
    compressed, size = MESSAGE_PREFIX.unpack_from(data, 0)
    if 5 + size != len(data):
        return rpc_error(grpc.StatusCode.INTERNAL, "a unary answer must hold exactly one message")
    body = data[5:] if type(data) is bytes else bytes(data[5:])
    if compressed:
        encoding = _grpc_encoding(headers)
        try:
            body = decompress(body, encoding)
        except (UnsupportedEncoding, zlib.error) as exc:
            return rpc_error(grpc.StatusCode.INTERNAL, f"cannot decompress the answer ({encoding}): {exc}")
    return body


def _grpc_encoding(fields) -> str:
    return next((v for k, v in fields or () if k == "grpc-encoding"), "identity")


def _metadata(fields) -> list[tuple[str, str]]:
    return [(k, v) for k, v in fields or () if not k.startswith(":") and k not in ("grpc-status", "grpc-message")]
