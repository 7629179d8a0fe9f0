"""HPACK (RFC 7541) encoding for both ends of chronoq's HTTP/2. Sans-IO.

The server's answers touch no table: every field is a "literal header field without indexing",
no Huffman (``literal``), so it keeps no encoder state and a client's SETTINGS_HEADER_TABLE_SIZE
cannot matter; the few blocks it sends are built once as constants (``literal_block``).

The client's requests repeat the same fields call after call, so ``RequestEncoder`` indexes the
stable ones once and then sends each as a one-byte reference into the server's table.
"""

from __future__ import annotations

from chronoq.protocol.h2.hpackdec import ENTRY_OVERHEAD, STATIC_LEN

DEFAULT_TABLE = 4096   # the peer's HPACK table until its SETTINGS say otherwise (RFC 7541 default)
STATUS_200 = b"\x88"   # ":status: 200", static index 8


# Every one-byte string: an integer within its prefix (most) is one of these, not a new object.
_BYTE = tuple(bytes((i,)) for i in range(256))


def encode_integer(value: int, prefix: int, first: int = 0) -> bytes:
    """RFC 7541 §5.1: ``value`` with a ``prefix``-bit prefix, ``first`` holding the bits above it."""
    limit = (1 << prefix) - 1
    if value < limit:
        return _BYTE[first | value]
    out = bytearray([first | limit])
    value -= limit
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def literal(name: str, value: str | bytes) -> bytes:
    """One field as "literal header field without indexing, new name", no Huffman."""
    n = name.encode("latin-1")
    v = value if isinstance(value, bytes) else value.encode("latin-1")
    return b"".join((b"\x00", encode_integer(len(n), 7), n, encode_integer(len(v), 7), v))  # (one copy)


def literal_block(fields) -> bytes:
    """A header block of ``(name, value)`` pairs; ``:status 200`` uses its static index."""
    out = []
    for name, value in fields:
        if name == ":status" and value == "200":
            out.append(STATUS_200)
        else:
            out.append(literal(name, value))
    return b"".join(out)


class RequestEncoder:
    """A client's request header blocks, with the server's dynamic table mirrored just enough.

    Fields named in ``stable`` are inserted (``0x40`` literal with incremental indexing) only while
    they fit without evicting anything, so an entry's index is simply 62 + the number of entries
    inserted after it. Everything else is a literal without indexing. A smaller table announced
    by the server empties ours and stops indexing (a size update of 0 opens the next block)."""

    __slots__ = ("authority", "scheme", "user_agent", "stable", "inserted", "size", "limit", "order",
                 "pending_update", "_blocks")

    def __init__(self, authority: str, scheme: str, user_agent: str, stable: frozenset) -> None:
        self.authority, self.scheme, self.user_agent = authority, scheme, user_agent
        self.stable = stable
        self.order: dict[tuple[str, str], int] = {}   # field -> its insertion number
        self.inserted = 0
        self.size = 0
        self.limit = DEFAULT_TABLE
        self.pending_update = False
        self._blocks: dict[str, tuple[int, bytes]] = {}

    def table_size(self, value: int) -> None:
        """The server's SETTINGS_HEADER_TABLE_SIZE."""
        if value < self.limit:
            self.limit = 0
            self.order.clear()
            self._blocks.clear()
            self.pending_update = True

    def field(self, name: str, value) -> bytes:
        if name not in self.stable or type(value) is not str:
            return literal(name, value)
        key = (name, value)
        number = self.order.get(key)
        if number is not None:
            return encode_integer(STATIC_LEN + self.inserted - number, 7, 0x80)
        n, v = name.encode("latin-1"), value.encode("latin-1")
        cost = ENTRY_OVERHEAD + len(n) + len(v)
        if self.size + cost > self.limit:
            return literal(name, value)
        self.order[key] = self.inserted
        self.inserted += 1
        self.size += cost
        return b"\x40" + encode_integer(len(n), 7) + n + encode_integer(len(v), 7) + v

    def request(self, path: str) -> bytes:
        """The fixed part of a call's header block: method, scheme, path, authority and the rest."""
        cached = self._blocks.get(path)
        if cached is not None and cached[0] == self.inserted:
            return cached[1]
        head = b"\x20" if self.pending_update else b""  # dynamic table size update: 0
        self.pending_update = False
        before = self.inserted
        block = head + b"\x83" + (b"\x87" if self.scheme == "https" else b"\x86") + b"".join(
            self.field(k, v) for k, v in (
                (":path", path), (":authority", self.authority), ("content-type", "application/grpc"),
                ("te", "trailers"), ("grpc-accept-encoding", "identity,deflate,gzip"),
                ("user-agent", self.user_agent)))
        if not head and self.inserted == before:  # references only: valid until the next insertion
            self._blocks[path] = (before, block)
        return block
