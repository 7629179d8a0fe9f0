"""HPACK (RFC 7541) for the HTTP/2 front end: a decoder with a fast path, and constant header blocks.

Requests from gRPC clients repeat almost every header. grpcio's client (the official Python
client's transport) does not index its own metadata: every call carries its eight ``x-mq-*`` and
``authorization`` fields as literals, names and values spelled out, most values Huffman-coded. So:

- a literal whose name is spelled out or static is looked up whole, by its bytes, in a cache
  shared by all connections (``_FIELDS``): the same bytes always mean the same field there, so a
  repeated field costs one dict lookup, not two string decodes. A name taken from the *dynamic*
  table is never cached (the same index names another field once the table moves);
- Huffman strings are decoded a byte at a time through a table of (state, byte) -> (next state,
  symbols out), filled in as bytes are first seen: a request id (the one field new on every call)
  costs about a third of walking the code bit by bit. The code (RFC 7541 Appendix B) comes from
  the ``hpack`` package, as does the static table; the walk and the table are ours;
- the dynamic table is a plain list, and the answer is a list of ``(name, value)`` pairs.

Answers are encoded without touching any table ("literal header field without indexing", no
Huffman), so chronoq keeps no encoder state and a client's SETTINGS_HEADER_TABLE_SIZE cannot
matter: the few header blocks it sends are built once as constants (``literal_block``).
"""

from __future__ import annotations

from hpack.huffman_constants import REQUEST_CODES, REQUEST_CODES_LENGTH
from hpack.table import HeaderTable

STATIC = [(n.decode("latin-1"), v.decode("latin-1")) for n, v in HeaderTable.STATIC_TABLE]
STATIC_LEN = len(STATIC)  # 61
ENTRY_OVERHEAD = 32  # RFC 7541 §4.1
HUFFMAN_CACHE_MAX = 512     # decoded Huffman strings kept per connection
FIELDS_CACHE_MAX = 4096     # whole literal fields kept, shared by all connections
EOS = 256                   # the Huffman code's end-of-string symbol: never valid inside a string


class HpackError(Exception):
    """The header block cannot be decoded: a connection error (COMPRESSION_ERROR)."""


class Decoder:
    """One connection's HPACK decoder (its dynamic table). ``decode`` raises ``HpackError``."""

    __slots__ = ("table", "size", "max_size", "settings_max", "_huffman")

    def __init__(self, max_size: int = 4096) -> None:
        self.table: list[tuple[str, str]] = []  # newest first
        self.size = 0
        self.max_size = max_size
        self.settings_max = max_size  # what we advertised: a size update may not exceed it
        self._huffman: dict[bytes, str] = {}

    def _string(self, data, pos: int) -> tuple[str, int]:
        if pos >= len(data):
            raise HpackError("truncated string")
        huffman = data[pos] & 0x80
        length, pos = _integer(data, pos, 7)
        end = pos + length
        if end > len(data):
            raise HpackError("truncated string")
        raw = bytes(data[pos:end])
        if not huffman:
            return raw.decode("latin-1"), end
        text = self._huffman.get(raw)
        if text is None:
            try:
                text = huffman_decode(raw).decode("latin-1")
            except HpackError as exc:
                raise HpackError(f"bad Huffman string: {exc}") from None
            if len(self._huffman) >= HUFFMAN_CACHE_MAX:
                self._huffman.clear()
            self._huffman[raw] = text
        return text, end

    def _entry(self, index: int) -> tuple[str, str]:
        if index <= 0:
            raise HpackError("header index 0")
        if index <= STATIC_LEN:
            return STATIC[index - 1]
        try:
            return self.table[index - STATIC_LEN - 1]
        except IndexError:
            raise HpackError(f"header index {index} is beyond the table") from None

    def _add(self, name: str, value: str) -> None:
        size = len(name) + len(value) + ENTRY_OVERHEAD
        table = self.table
        table.insert(0, (name, value))
        self.size += size
        while self.size > self.max_size and table:
            n, v = table.pop()
            self.size -= len(n) + len(v) + ENTRY_OVERHEAD

    def _resize(self, new_max: int) -> None:
        if new_max > self.settings_max:
            raise HpackError(f"table size update {new_max} over the advertised {self.settings_max}")
        self.max_size = new_max
        table = self.table
        while self.size > new_max and table:
            n, v = table.pop()
            self.size -= len(n) + len(v) + ENTRY_OVERHEAD

    def decode(self, data: bytes) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        append = out.append
        fields, static = _FIELDS, STATIC
        pos, end = 0, len(data)
        while pos < end:
            b = data[pos]
            if b & 0x80:  # indexed field
                index = b & 0x7F
                if index == 0x7F:
                    index, pos = _integer(data, pos, 7)
                else:
                    pos += 1
                append(static[index - 1] if 0 < index <= STATIC_LEN else self._entry(index))
                continue
            if b & 0x40:  # literal with incremental indexing
                prefix, indexing = 6, True
            elif b & 0x20:  # dynamic table size update
                size, pos = _integer(data, pos, 5)
                self._resize(size)
                continue
            else:  # literal without indexing (0000) or never indexed (0001)
                prefix, indexing = 4, False
            # The field's extent first: its bytes are its cache key, unless its name is an index
            # into the dynamic table (those bytes name different fields as the table moves).
            start, limit = pos, (1 << prefix) - 1
            index = b & limit
            if index == limit:
                index, p = _integer(data, pos, prefix)
            else:
                p = pos + 1
            for _ in range(1 if index else 2):  # the name (unless indexed), then the value
                if p >= end:
                    raise HpackError("truncated string")
                length = data[p] & 0x7F
                if length == 0x7F:
                    length, p = _integer(data, p, 7)
                else:
                    p += 1
                p += length
            if p > end:
                raise HpackError("truncated string")
            if index <= STATIC_LEN:
                key = data[start:p]
                field = fields.get(key)
                if field is None:
                    field, _ = self._literal(data, start, prefix)
                    if len(fields) >= FIELDS_CACHE_MAX:
                        fields.clear()
                    fields[key] = field
            else:
                field, _ = self._literal(data, start, prefix)
            pos = p
            if indexing:
                self._add(*field)
            append(field)
        return out

    def _literal(self, data, pos: int, prefix: int) -> tuple[tuple[str, str], int]:
        """A literal field: its name indexed (a ``prefix``-bit index) or a string, then its value."""
        index, pos = _integer(data, pos, prefix)
        if index:
            name = self._entry(index)[0]
        else:
            name, pos = self._string(data, pos)
        value, pos = self._string(data, pos)
        return (name, value), pos


def _integer(data, pos: int, prefix: int) -> tuple[int, int]:
    """RFC 7541 §5.1: the integer at ``pos`` with a ``prefix``-bit prefix; (value, next position)."""
    limit = (1 << prefix) - 1
    value = data[pos] & limit
    pos += 1
    if value < limit:
        return value, pos
    shift = 0
    end = len(data)
    while True:
        if pos >= end:
            raise HpackError("truncated integer")
        b = data[pos]
        pos += 1
        value += (b & 0x7F) << shift
        if not b & 0x80:
            return value, pos
        shift += 7
        if shift > 28:
            raise HpackError("integer too large")


# Literal fields by their bytes (name spelled out or static): shared by every connection's
# decoder, all on one event loop; a race between threads (h2client) could only cost a miss.
_FIELDS: dict[bytes, tuple[str, str]] = {}


# ---------------------------------------------------------------------- Huffman (RFC 7541 §5.2)
def _huffman_tree() -> tuple[list[list[int]], list[bool]]:
    """The code as a binary tree: ``children[node] = [on 0, on 1]``, inner nodes >= 0 (the root
    is 0), a leaf is ``-(symbol + 1)``. And which inner nodes a string may end on: reached from
    the root by at most seven 1-bits (padding is a prefix of EOS, shorter than a byte)."""
    children: list[list[int]] = [[0, 0]]
    for symbol, (code, length) in enumerate(zip(REQUEST_CODES, REQUEST_CODES_LENGTH)):
        node = 0
        for shift in range(length - 1, 0, -1):
            bit = code >> shift & 1
            nxt = children[node][bit]
            if nxt <= 0:  # (0 is the root: never a child)
                nxt = len(children)
                children.append([0, 0])
                children[node][bit] = nxt
            node = nxt
        children[node][code & 1] = -(symbol + 1)
    may_end = [False] * len(children)
    node = 0
    for _ in range(8):
        may_end[node] = True
        node = children[node][1]
    return children, may_end


_TREE, _MAY_END = _huffman_tree()
# (state << 8 | byte) -> (next state, the symbols it completes as bytes), filled on first use.
_STEPS: list[tuple[int, bytes] | None] = [None] * (len(_TREE) << 8)


def _huffman_step(state: int, byte: int) -> tuple[int, bytes]:
    node, done = state, bytearray()
    for shift in range(7, -1, -1):
        node = _TREE[node][byte >> shift & 1]
        if node < 0:
            symbol = -node - 1
            if symbol == EOS:
                raise HpackError("EOS inside a string")
            done.append(symbol)
            node = 0
    step = _STEPS[state << 8 | byte] = (node, bytes(done))
    return step


def huffman_decode(raw: bytes) -> bytes:
    """Decode a Huffman-coded string (HpackError on EOS inside it or on bad padding)."""
    steps, state, parts = _STEPS, 0, []
    for byte in raw:
        step = steps[state << 8 | byte]
        if step is None:
            step = _huffman_step(state, byte)
        state, done = step
        if done:
            parts.append(done)
    if not _MAY_END[state]:
        raise HpackError("the padding is not a prefix of EOS or is a byte or longer")
    return b"".join(parts)


def _encode_integer(value: int, prefix: int, first: int = 0) -> bytes:
    limit = (1 << prefix) - 1
    if value < limit:
        return bytes([first | value])
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
    return b"\x00" + _encode_integer(len(n), 7) + n + _encode_integer(len(v), 7) + v


def literal_block(fields) -> bytes:
    """A header block of ``(name, value)`` pairs; ``:status 200`` uses its static index."""
    out = []
    for name, value in fields:
        if name == ":status" and value == "200":
            out.append(b"\x88")
        else:
            out.append(literal(name, value))
    return b"".join(out)
