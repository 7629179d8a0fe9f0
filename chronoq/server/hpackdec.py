"""HPACK (RFC 7541) for the HTTP/2 front end: a decoder with a fast path, and constant header blocks.

Requests from gRPC clients repeat almost every header: after the first call on a connection nearly
all fields are one-byte references into the dynamic table, and the literals that change (a request
id, a date) are short. The decoder therefore keeps its table as a plain list, caches the Huffman
decoding of recently seen strings, and never builds more than a list of ``(name, value)`` pairs.
The static table and the Huffman code come from the ``hpack`` package; only the table walk is ours.

Answers are encoded without touching any table ("literal header field without indexing", no
Huffman), so chronoq keeps no encoder state and a client's SETTINGS_HEADER_TABLE_SIZE cannot
matter: the few header blocks it sends are built once as constants (``literal_block``).
"""

from __future__ import annotations

from hpack.huffman_table import decode_huffman
from hpack.table import HeaderTable

STATIC = [(n.decode("latin-1"), v.decode("latin-1")) for n, v in HeaderTable.STATIC_TABLE]
STATIC_LEN = len(STATIC)  # 61
ENTRY_OVERHEAD = 32  # RFC 7541 §4.1
HUFFMAN_CACHE_MAX = 4096


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
                text = decode_huffman(raw).decode("latin-1")
            except Exception as exc:  # noqa: BLE001 - any failure is a malformed block
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
        pos, end = 0, len(data)
        while pos < end:
            b = data[pos]
            if b & 0x80:  # indexed field
                index, pos = _integer(data, pos, 7)
                out.append(self._entry(index))
            elif b & 0x40:  # literal with incremental indexing
                field, pos = self._literal(data, pos, 6)
                self._add(*field)
                out.append(field)
            elif b & 0x20:  # dynamic table size update
                size, pos = _integer(data, pos, 5)
                self._resize(size)
            else:  # literal without indexing (0000) or never indexed (0001)
                field, pos = self._literal(data, pos, 4)
                out.append(field)
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
