"""HPACK (RFC 7541) decoding for both ends of chronoq's HTTP/2: a decoder with a fast path. Sans-IO.

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
- the dynamic table is a plain list, and the answer is a list of ``(name, value)`` pairs;
- a block that begins with the bytes of one of the connection's two previous blocks takes that
  block's fields for them: grpcio's requests repeat their first dozen fields byte for byte
  (indexed fields, then literals up to the request id), so a call decodes only its last few. Two,
  because a consumer alternates two calls (receive, ack): their blocks differ at ``:path``, so the
  block before the previous one is the one that runs on to the request id. Only fields that leave
  the table as it was (indexed fields and literals without indexing) are taken, and only while the
  table is the one they were decoded against (``_generation``).

Encoding is ``chronoq.protocol.h2.hpackenc``'s.
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
# A mark of the previous block: the end of one of its fields << _MARK_SHIFT | the dynamic table
# references up to it (both below 2**20: a block is at most h2server.MAX_HEADER_BLOCK, 256 KiB).
_MARK_SHIFT = 20
_MARK_MASK = (1 << _MARK_SHIFT) - 1
_COMPILED = not __file__.endswith(".py")  # the compiled build: hpackdec.pxd's C helpers


MAX_LIST_DEFAULT = 64 << 10  # decoded header list (chronoq.server.h2limits.MAX_HEADER_LIST)
# A field not taken from the dynamic table decodes to at most its overhead plus the longest static
# entry (28) plus its strings, which are at most 8/5 of their bytes on the wire (Huffman's shortest
# code is 5 bits): ``decode`` bounds a block's list by that and counts exactly only past the bound.
_FIELD_BOUND = ENTRY_OVERHEAD + max(len(n) + len(v) for n, v in STATIC)


class HpackError(Exception):
    """The header block cannot be decoded: a connection error (COMPRESSION_ERROR)."""


class HeaderListTooLarge(HpackError):
    """The decoded header list passed ``Decoder.max_list`` (RFC 9113 §6.5.2 sizes: name + value + 32
    per field). Raised while decoding, at the dynamic-table reference that passes it, so a small
    block of references to one big entry (the HPACK bomb) never becomes a big list. The table may
    have missed the rest of the block: the connection cannot go on (GOAWAY ENHANCE_YOUR_CALM)."""


class Decoder:
    """One connection's HPACK decoder (its dynamic table). ``decode`` raises ``HpackError``."""

    __slots__ = ("table", "size", "max_size", "settings_max", "_huffman", "max_list", "largest", "_generation", "taken",
                 "_last_block", "_last_marks", "_last_fields", "_last_generation", "_last_taken",
                 "_prior_block", "_prior_marks", "_prior_fields", "_prior_generation", "_prior_taken")

    def __init__(self, max_size: int = 4096, max_list: int = MAX_LIST_DEFAULT) -> None:
        self.max_list = max_list  # the decoded header list's cap (HeaderListTooLarge)
        self.largest = ENTRY_OVERHEAD  # the largest entry ever in the table (name + value + 32)
        self.table: list[tuple[str, str]] = []  # newest first
        self.size = 0
        self.max_size = max_size
        self.settings_max = max_size  # what we advertised: a size update may not exceed it
        self._huffman: dict[bytes, str] = {}
        self._generation = 0  # counts the table's changes
        self.taken = 0  # how many fields the last block took from an earlier one
        # The previous block (its reusable fields: ``decode``): its bytes, one mark per field
        # (_MARK_SHIFT), its fields, the table generation they were decoded against and how many
        # it took (the first guess of how many the next block like it takes); the block before it,
        # the same ("prior").
        self._last_block = self._prior_block = b""
        self._last_marks: list[int] = []
        self._prior_marks: list[int] = []
        self._last_fields: list[tuple[str, str]] = []
        self._prior_fields: list[tuple[str, str]] = []
        self._last_generation = self._prior_generation = -1
        self._last_taken = self._prior_taken = 0

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
        if size > self.largest:
            self.largest = size
        table = self.table
        table.insert(0, (name, value))
        self._generation += 1
        self.size += size
        while self.size > self.max_size and table:
            n, v = table.pop()
            self.size -= len(n) + len(v) + ENTRY_OVERHEAD

    def _resize(self, new_max: int) -> None:
        if new_max > self.settings_max:
            raise HpackError(f"table size update {new_max} over the advertised {self.settings_max}")
        self.max_size = new_max
        self._generation += 1
        table = self.table
        while self.size > new_max and table:
            n, v = table.pop()
            self.size -= len(n) + len(v) + ENTRY_OVERHEAD

    def decode(self, data: bytes) -> list[tuple[str, str]]:
        """The block's fields, in order. The list is also kept for the next block (see the module
        docstring): callers read it and never change it."""
        # (kept for the next block: never a buffer its owner may change)
        block = data if type(data) is bytes else bytes(data)
        fields, static, table = _FIELDS, STATIC, self.table  # (the table list is changed in place only)
        pos, end = 0, len(block)
        # References to the dynamic table, the only amplifier (a 1-byte reference to a 4 KB entry):
        # while there are at most ref_cap of them, even all of the largest entry fit in max_list.
        max_list = self.max_list
        dynamic, ref_cap = 0, max_list // self.largest
        size = sized = 0  # the exact size of out[:sized], once counted
        generation = self._generation
        taken = prior = 0  # fields taken from the previous block (or, ``prior``, the one before it)
        if self._last_generation == generation:
            taken = _common_run(block, self._last_block, self._last_marks, self._last_taken)
        if self._prior_generation == generation and len(self._prior_marks) > taken:
            prior = _common_run(block, self._prior_block, self._prior_marks, self._prior_taken)
        if prior > taken:
            taken, last_marks, last_fields = prior, self._prior_marks, self._prior_fields
        else:
            last_marks, last_fields = self._last_marks, self._last_fields
        if taken:
            last = last_marks[taken - 1]
            pos, dynamic = last >> _MARK_SHIFT, last & _MARK_MASK
            out = last_fields[:taken]
            marks = last_marks[:taken]
            if dynamic > ref_cap:  # as in the loop below, for the fields taken at once
                size, sized = _list_size(out, 0), taken
                if size > max_list:
                    raise HeaderListTooLarge(f"decoded header list over {max_list} bytes "
                                             "(SETTINGS_MAX_HEADER_LIST_SIZE)")
                ref_cap = dynamic + (max_list - size) // self.largest
        else:
            out: list[tuple[str, str]] = []
            marks: list[int] = []
        append, mark = out.append, marks.append
        reusable = True  # until this block changes the table: its fields so far can be taken next time
        while pos < end:
            b = block[pos]
            if b & 0x80:  # indexed field
                index = b & 0x7F
                if index == 0x7F:
                    index, pos = _integer(block, pos, 7)
                else:
                    pos += 1
                if 0 < index <= STATIC_LEN:
                    append(static[index - 1])
                    if reusable:
                        mark(pos << _MARK_SHIFT | dynamic)
                    continue
                if index > STATIC_LEN and index <= STATIC_LEN + len(table):
                    field = table[index - STATIC_LEN - 1]
                else:
                    field = self._entry(index)  # (raises)
                append(field)
                dynamic += 1
                if reusable:
                    mark(pos << _MARK_SHIFT | dynamic)
                if dynamic > ref_cap:  # perhaps too big: count what is new, so a bomb stops here
                    size += _list_size(out, sized)
                    sized = len(out)
                    if size > max_list:
                        raise HeaderListTooLarge(f"decoded header list over {max_list} bytes "
                                                 "(SETTINGS_MAX_HEADER_LIST_SIZE)")
                    ref_cap = dynamic + (max_list - size) // self.largest
                continue
            if b & 0x40:  # literal with incremental indexing
                prefix, indexing = 6, True
                reusable = False
            elif b & 0x20:  # dynamic table size update
                new_max, pos = _integer(block, pos, 5)  # (not ``size``: that counts the list)
                self._resize(new_max)
                reusable = False
                continue
            else:  # literal without indexing (0000) or never indexed (0001)
                prefix, indexing = 4, False
            # The field's extent first: its bytes are its cache key, unless its name is an index
            # into the dynamic table (those bytes name different fields as the table moves).
            start, limit = pos, (1 << prefix) - 1
            index = b & limit
            if index == limit:
                index, p = _integer(block, pos, prefix)
            else:
                p = pos + 1
            strings = 1 if index else 2  # the name (unless indexed), then the value
            while strings:  # (not a for over a range: that is an object and an iterator per field)
                if p >= end:
                    raise HpackError("truncated string")
                length = block[p] & 0x7F
                if length == 0x7F:
                    length, p = _integer(block, p, 7)
                else:
                    p += 1
                p += length
                strings -= 1
            if p > end:
                raise HpackError("truncated string")
            if index <= STATIC_LEN:
                key = block[start:p]
                field = fields.get(key)
                if field is None:
                    field, _ = self._literal(block, start, prefix)
                    if len(fields) >= FIELDS_CACHE_MAX:
                        fields.clear()
                    fields[key] = field
            else:  # the name is a dynamic table entry's
                field, _ = self._literal(block, start, prefix)
                dynamic += 1
            pos = p
            if indexing:
                self._add(field[0], field[1])
            append(field)
            if reusable:
                mark(pos << _MARK_SHIFT | dynamic)
        self._prior_block, self._prior_marks, self._prior_fields = self._last_block, self._last_marks, self._last_fields
        self._prior_generation, self._prior_taken = self._last_generation, self._last_taken
        self._last_block = block
        self._last_marks, self._last_fields, self._last_generation = marks, out, generation
        self.taken = self._last_taken = taken
        # The list's size is at most this (see _FIELD_BOUND); count it exactly only past the cap.
        if len(out) * _FIELD_BOUND + 2 * end + dynamic * self.largest > max_list:
            size += _list_size(out, sized)
            if size > max_list:
                raise HeaderListTooLarge(f"decoded header list of {size} bytes over {max_list} "
                                         "(SETTINGS_MAX_HEADER_LIST_SIZE)")
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


def _common_run(block: bytes, earlier: bytes, marks: list, guess: int) -> int:
    """How many of an earlier block's fields ``block`` begins with (``marks``: the end of each of
    ``earlier``'s fields, _MARK_SHIFT): first ``guess`` (a client's blocks repeat the same run),
    else a binary search. The compiled build's is hpackdec.pxd's ``_common_run_in_c`` (the bytes
    compared in place: each probe here makes a slice)."""
    if _COMPILED:
        return _common_run_in_c(block, earlier, marks, guess)  # noqa: F821 - hpackdec.pxd's
    low, high = 0, len(marks)
    if 0 < guess < high and block.startswith(earlier[:marks[guess - 1] >> _MARK_SHIFT]):
        low = guess
        if not block.startswith(earlier[:marks[guess] >> _MARK_SHIFT]):
            high = guess
    while low < high:
        mid = (low + high + 1) >> 1
        if block.startswith(earlier[:marks[mid - 1] >> _MARK_SHIFT]):
            low = mid
        else:
            high = mid - 1
    return low


def _list_size(fields: list, start: int) -> int:
    """RFC 9113 §6.5.2: name + value + 32 per field, of ``fields[start:]``."""
    return sum(len(n) + len(v) + ENTRY_OVERHEAD for n, v in fields[start:])


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
# decoder, all on one event loop; a race between threads (clients on several loops) could only cost a miss.
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
