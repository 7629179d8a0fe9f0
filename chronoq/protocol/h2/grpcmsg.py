"""gRPC over HTTP/2 (gRPC's PROTOCOL-HTTP2.md): messages in DATA, status in trailers. Sans-IO.

A message in a stream's DATA is a 5-byte prefix and the message::

    offset 0  compressed  8 bits: 1 when the message is compressed with the call's grpc-encoding
    offset 1  length     32 bits, big-endian: the message's bytes (after compression)

``MESSAGE_PREFIX.pack(0, len(message))`` writes an uncompressed message's prefix (inline at the
callers: a call per message costs more than the pack), ``cut_messages`` reads messages off a
buffer (checking each length prefix against a cap *before* holding its bytes), ``decompress``
undoes ``gzip`` or ``deflate``; ``trailers`` encodes a status, ``timeout_s``/``timeout_text``
read and write ``grpc-timeout``; ``request_head`` reads a request's header fields.
"""

from __future__ import annotations

import base64
import struct
import zlib
from urllib.parse import quote

from chronoq.protocol.h2.hpackenc import literal

MESSAGE_PREFIX = struct.Struct(">BI")   # compressed flag, length
assert MESSAGE_PREFIX.size == 5

# zlib's wbits for each grpc-encoding we read: gzip's header and trailer, or zlib's (deflate).
_WBITS = {"gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}
# gRPC's percent-encoding of grpc-message: printable ASCII but '%' stays, everything else %XX of UTF-8.
_MESSAGE_SAFE = " !\"#$&'()*+,-./:;<=>?@[\\]^_`{|}~"
_TIMEOUT_UNITS = {"H": 3600.0, "M": 60.0, "S": 1.0, "m": 1e-3, "u": 1e-6, "n": 1e-9}
TIMEOUT_DIGITS_MAX = 8


class MessageTooLarge(ValueError):
    """A length prefix over the cap: refused before its bytes are held."""

    def __init__(self, length: int) -> None:
        super().__init__(f"a message of {length} bytes")
        self.length = length


class UnsupportedEncoding(ValueError):
    """A compressed message in an encoding we do not read."""


class Parts:
    """One message given as buffers that follow each other, for an answer whose bulk is a buffer
    already held (a replica's pull answer: the commit-log bytes as read, ~0.5 MB): the server
    sends them as they are (``writelines``) instead of joining them into one message, a DATA
    frame and a pass's output, each a copy. ``bytes(parts)`` is the message whole."""

    __slots__ = ("buffers", "size")

    def __init__(self, *buffers: bytes) -> None:
        assert buffers and all(type(b) is bytes for b in buffers), "Parts holds bytes"
        self.buffers = buffers
        self.size = sum(len(b) for b in buffers)

    def __bytes__(self) -> bytes:
        return b"".join(self.buffers)

    def __len__(self) -> int:
        return self.size


def cut_messages(buf: bytearray, limit: int, encoding: str) -> list[bytes]:
    """Cut the complete messages off the front of ``buf`` (decompressed with ``encoding``); an
    incomplete one stays. ``MessageTooLarge`` on a length prefix over ``limit`` (``buf`` is then
    left as it was), ``UnsupportedEncoding`` or ``zlib.error`` from ``decompress``."""
    out = []
    pos, n = 0, len(buf)
    while n - pos >= 5:
        flag, length = MESSAGE_PREFIX.unpack_from(buf, pos)
        if length > limit:
            raise MessageTooLarge(length)
        if n - pos - 5 < length:
            break
        data = bytes(buf[pos + 5:pos + 5 + length])
        pos += 5 + length
        if flag:
            data = decompress(data, encoding)
        out.append(data)
    if pos:
        del buf[:pos]
    return out


def decompress(data: bytes, encoding: str) -> bytes:
    """A compressed message's bytes (``zlib.error`` when they are not what ``encoding`` says)."""
    wbits = _WBITS.get(encoding)
    if wbits is None:
        raise UnsupportedEncoding(f"message compressed with unsupported encoding {encoding!r}")
    return zlib.decompress(data, wbits)


def trailers(code: int, details: str | None, metadata=()) -> bytes:
    """The header block that ends a call: ``grpc-status``, ``grpc-message``, trailing metadata
    (``-bin`` values base64 without padding), as literals that touch no HPACK table."""
    fields = [literal("grpc-status", str(code))]
    if details:
        fields.append(literal("grpc-message", quote(details, safe=_MESSAGE_SAFE)))
    for key, value in metadata:
        fields.append(literal(key, base64.b64encode(value).rstrip(b"=") if key.endswith("-bin") else value))
    return b"".join(fields)


def timeout_s(text: str) -> float | None:
    """``grpc-timeout`` (at most 8 digits and a unit) in seconds; None when absent or malformed."""
    if not text or len(text) < 2:
        return None
    unit = _TIMEOUT_UNITS.get(text[-1])
    digits = text[:-1]
    if unit is None or not digits.isdigit() or len(digits) > TIMEOUT_DIGITS_MAX:
        return None
    return int(digits) * unit


# What ``request_head`` does with a request header field, by its name. Regular fields: the
# handler's metadata (its value as is, or base64-decoded for ``-bin``), the transport's, dropped
# (``_F_SKIP``), or fields HTTP/2 forbids (connection-specific ones, upper-case or empty names:
# ``_F_MALFORMED``). From ``_F_PSEUDO`` on, the pseudo-header fields, one bit each in a mask.
(_F_META, _F_META_BIN, _F_SKIP, _F_CONTENT_TYPE, _F_TIMEOUT, _F_ENCODING, _F_TE, _F_MALFORMED,
 _F_PATH, _F_METHOD, _F_SCHEME, _F_AUTHORITY, _F_BAD_PSEUDO) = range(13)
_F_PSEUDO = _F_PATH
_REQUIRED = (1 << (_F_PATH - _F_PSEUDO)) | (1 << (_F_METHOD - _F_PSEUDO)) | (1 << (_F_SCHEME - _F_PSEUDO))
FIELD_KINDS_MAX = 1024  # names remembered beyond the transport's (a client chooses them: bounded)
# RFC 9113 section 8.2.2: fields of HTTP/1.1 connections, malformed in an HTTP/2 request.
_CONNECTION_SPECIFIC = frozenset(("connection", "keep-alive", "proxy-connection", "transfer-encoding", "upgrade"))


def _field_kind(name: str) -> int:
    """What ``request_head`` does with a field of a name not yet seen: classified once and
    remembered in ``_FIELD_KINDS`` (up to FIELD_KINDS_MAX names), so a call's fields cost one
    lookup each."""
    if not name or name != name.lower() or name in _CONNECTION_SPECIFIC:
        kind = _F_MALFORMED
    elif name[0] == ":":
        kind = _F_BAD_PSEUDO  # (``:status`` too: a response's)
    else:
        kind = _F_META_BIN if name.endswith("-bin") else _F_META
    if len(_FIELD_KINDS) < FIELD_KINDS_MAX:
        _FIELD_KINDS[name] = kind
    return kind


# name -> kind. (A plain dict: compiled with a C type, ``get`` is a C call; a dict subclass with
# ``__missing__``, as this was, costs ~4k instructions more a call through its slot.)
_FIELD_KINDS = {":path": _F_PATH, ":method": _F_METHOD, ":authority": _F_AUTHORITY, ":scheme": _F_SCHEME,
                "content-type": _F_CONTENT_TYPE, "grpc-timeout": _F_TIMEOUT, "grpc-encoding": _F_ENCODING,
                "te": _F_TE, "user-agent": _F_SKIP, "grpc-accept-encoding": _F_SKIP, "accept-encoding": _F_SKIP}


def request_head(fields) -> tuple[str, tuple, float | None, str | None, str | None, str | None]:
    """A gRPC request's header fields (``(name, value)`` pairs, as ``Decoder.decode`` gives them):
    ``(path, metadata, timeout in seconds or None, grpc-encoding or None, what gRPC refuses or
    None, what makes the request malformed in HTTP/2 or None)``.

    The metadata is every regular field but the transport's (``grpc-timeout`` and
    ``grpc-encoding`` stay), in order, ``-bin`` values base64-decoded (a value that does not
    decode is dropped). Malformed (RFC 9113 section 8.3; the server resets such a stream with
    PROTOCOL_ERROR): a pseudo-header field after a regular one, twice, unknown or missing
    (``:method``, ``:scheme``, a non-empty ``:path``), a connection-specific field, ``te`` other
    than ``trailers``, a name with upper-case letters. Compiled with the hot path: it runs once
    per call, over every field."""
    path = ""
    metadata = []
    add = metadata.append
    timeout = encoding = bad = malformed = None
    kinds = _FIELD_KINDS
    seen = 0        # pseudo-header fields seen, a bit each
    regular = False  # a regular field came: no pseudo-header field may follow
    for field in fields:
        name, value = field
        kind = kinds.get(name, -1)
        if kind < 0:
            kind = _field_kind(name)
        if kind == _F_META:  # the handler's metadata (most fields of a RocketMQ call)
            add(field)
            regular = True
        elif kind < _F_PSEUDO:
            regular = True
            if kind == _F_META_BIN:
                try:
                    add((name, base64.b64decode(value + "=" * (-len(value) % 4))))
                except ValueError:
                    pass
            elif kind == _F_CONTENT_TYPE:
                if not value.startswith("application/grpc"):
                    bad = f"content-type {value!r}"
            elif kind == _F_TIMEOUT:
                timeout = timeout_s(value)
                add(field)
            elif kind == _F_ENCODING:
                encoding = value
                add(field)
            elif kind == _F_TE:
                if value != "trailers":
                    malformed = f"te: {value!r} (only 'trailers' is allowed)"
            elif kind == _F_MALFORMED:
                malformed = f"field {name!r} is not allowed in HTTP/2"
        else:
            bit = 1 << (kind - _F_PSEUDO)
            if regular:
                malformed = f"pseudo-header {name} after a regular field"
            elif seen & bit:
                malformed = f"pseudo-header {name} twice"
            seen |= bit
            if kind == _F_PATH:
                path = value
            elif kind == _F_METHOD:
                if value != "POST":
                    bad = f"method {value} (gRPC calls are POST)"
            elif kind == _F_BAD_PSEUDO:
                malformed = f"pseudo-header {name} in a request"
    if malformed is None and (seen & _REQUIRED != _REQUIRED or not path):
        malformed = "a request needs :method, :scheme and a :path"
    return path, tuple(metadata), timeout, encoding, bad, malformed


def timeout_text(seconds: float) -> str:
    """``grpc-timeout`` for ``seconds``: milliseconds, or whole seconds past 8 digits of them."""
    ms = max(1, int(seconds * 1000))
    return f"{ms}m" if ms < 100_000_000 else f"{min(int(seconds), 99_999_999)}S"
