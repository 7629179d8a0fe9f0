"""Commit-log record codec: the one place that knows the byte layout of a stored message.

Layout (all integers little-endian; offsets in bytes from the start of the record)::

    off  size  field
      0     4  total_len      u32, whole record including this field
      4     1  magic          0xC9
      5     1  version        1
      6     4  crc32c         CRC-32C (Castagnoli) of bytes [10, total_len)
     10     2  flags          bit 0 DELAYED, bit 1 TRANSACTION_HALF, bit 2 SYSTEM, bit 3 HELD,
                          bit 4 CONTINUES (FLAG_*)
     12     2  queue_id       u16
     14     8  queue_offset   u64, logical offset of this message in its (topic, queue_id)
     22     8  born_ms        i64, epoch ms the producer created it
     30     8  stored_ms      i64, epoch ms the broker appended it (HELD: the due time)
     38     8  deliver_at_ms  i64, epoch ms it may first be consumed; 0 means at once
     46     1  topic_len      u8, 1..127
     47     1  msgid_len      u8, 1..128
     48     2  tag_len        u16
     50     2  keys_len       u16
     52     4  props_len      u32
     56     4  body_len       u32
     60        topic, message id, tag (UTF-8), keys, properties, body (in this order)

Keys are UTF-8 joined by 0x01. Properties are ``key 0x01 value`` pairs joined by 0x02
(``chronoq.core.validate`` forbids both bytes inside keys, property names and values, and the message
group, which is stored as a property; the encoders assert it).

A record is valid iff: at least ``HEADER_SIZE`` bytes are present, magic and version match,
``HEADER_SIZE <= total_len <= RECORD_SIZE_MAX``, the six lengths add up to ``total_len``,
``topic_len`` and ``msgid_len`` are non-zero, the CRC matches, and the five text fields (topic,
message id, tag, keys, properties) are each valid UTF-8. Version changes bump
``VERSION`` and keep a reader for every older version.

Appends (``FLAG_CONTINUES``): the store writes each batch with one append (one ``pwrite``), and
every record of it but the last carries CONTINUES ("another record of this append follows"). A
``pwrite`` cut short by ``kill -9`` leaves a prefix of the append on disk, possibly of whole,
CRC-valid records that were never acknowledged; recovery (``chronoq.store.recovery``, R11)
cuts such a trailing group, whose last record is missing, back to its first record, so an append
is on disk whole or not at all. The bit is framing, not part of the message: readers test the
other bits only. Files written before the bit existed have it clear everywhere: every record is
an append of its own, as it was (same VERSION; an older reader ignores the bit).
"""

from __future__ import annotations

import struct

import google_crc32c

MAGIC = 0xC9
VERSION = 1
HEADER = struct.Struct("<IBBIHHQqqqBBHHII")
HEADER_SIZE = 60
assert HEADER.size == HEADER_SIZE, HEADER.size
# The part of the header covered by the CRC, packed separately so the CRC can be computed first.
_PREFIX = struct.Struct("<IBBI")
_TAIL = struct.Struct("<HHQqqqBBHHII")
CRC_START = 10
assert _PREFIX.size == CRC_START and _PREFIX.size + _TAIL.size == HEADER_SIZE

FLAG_DELAYED = 0x0001
FLAG_TRANSACTION_HALF = 0x0002
FLAG_SYSTEM = 0x0004
# A timer copy written ahead of its due time (``timer_prewrite_ms``): its stored_ms is the due time
# and readers do not see it, nor anything after it in its queue, before then (ConsumeQueue.hold).
FLAG_HELD = 0x0008
# Another record of the same append follows this one (see "Appends" above).
FLAG_CONTINUES = 0x0010
_FLAGS = struct.Struct("<H")
_FLAGS_AT = CRC_START  # the flags field's offset in a record

# Body limit is configurable up to 64 MiB; topic/id/tag/keys/properties add at most ~100 KiB.
RECORD_SIZE_MAX = 64 * 1024 * 1024 + 256 * 1024

KEY_SEP = b"\x01"
PROP_PAIR_SEP = b"\x01"
PROP_SEP = b"\x02"

# The routing fields of a header, unpacked in one call (a dispatch walk's: chronoq.store.routing):
# total_len, flags, queue_id, queue_offset, stored_ms, deliver_at_ms, topic_len, msgid_len, tag_len.
ROUTE = struct.Struct("<I6xHHQ8xqqBBH")
assert ROUTE.size == 50
_crc = google_crc32c.value
# The compiled build's check_run walks in C (record.pxd's ``_check_run_in_c``); this source's loop
# is the pure build's, and the reference the C walk is held to (tests/unit/test_record.py).
_COMPILED = not __file__.endswith(".py")
# Compiled, on a CPU with SSE4.2: the C walk computes the CRC-32C itself, in place (record.pxd's
# ``chronoq_crc32c``), not by a call to google_crc32c on a copy of the record's bytes.
_CRC_IN_CPU = _COMPILED and bool(chronoq_crc32c_in_cpu())  # noqa: F821 - in record.pxd
_pack_tail = _TAIL.pack
_pack_prefix = _PREFIX.pack
_unpack_header = HEADER.unpack_from


def continues(buf, pos: int) -> bool:
    """Whether the (valid) record at ``buf[pos:]`` says another record of its append follows."""
    return bool(_FLAGS.unpack_from(buf, pos + _FLAGS_AT)[0] & FLAG_CONTINUES)


class RecordError(ValueError):
    """Bytes at a position are not a valid record; ``reason`` says which rule failed."""

    def __init__(self, reason: str, torn: bool = False):
        super().__init__(reason)
        self.reason = reason
        # True when the record runs past the end of the available bytes (a short write).
        self.torn = torn
        self.at = -1  # where the bad record starts, when a walk says so (``check_all``)


def encode_keys(keys: tuple[str, ...] | list[str]) -> bytes:
    if not keys:
        return b""
    raw = KEY_SEP.join(k.encode() for k in keys)
    # Fields arrive checked (chronoq.core.validate); a separator inside one would read back as
    # another message. Two C-level counts make sure no path forgot.
    assert raw.count(KEY_SEP) == len(keys) - 1, "a message key holds the key separator"
    return raw


def encode_properties(props: dict[str, str]) -> bytes:
    if not props:
        return b""
    raw = PROP_SEP.join(k.encode() + PROP_PAIR_SEP + v.encode() for k, v in props.items())
    assert raw.count(PROP_SEP) == len(props) - 1 and raw.count(PROP_PAIR_SEP) == len(props), \
        "a property holds a record separator"
    return raw


def decode_keys(raw: bytes) -> tuple[str, ...]:
    return tuple(k.decode() for k in raw.split(KEY_SEP)) if raw else ()


def decode_properties(raw: bytes) -> dict[str, str]:
    if not raw:
        return {}
    out = {}
    for pair in raw.split(PROP_SEP):
        key, _, value = pair.partition(PROP_PAIR_SEP)
        out[key.decode()] = value.decode()
    return out


def encode(
    flags: int,
    queue_id: int,
    queue_offset: int,
    born_ms: int,
    stored_ms: int,
    deliver_at_ms: int,
    topic: bytes,
    msgid: bytes,
    tag: bytes,
    keys: bytes,
    props: bytes,
    body: bytes,
) -> bytes:
    """Return one record. Callers pass fields already validated and encoded to bytes."""
    parts: list[bytes] = []
    encode_batch(parts, (flags,), (queue_id,), (queue_offset,), (born_ms,), (stored_ms,), (deliver_at_ms,),
                 (topic,), (msgid,), (tag,), (keys,), (props,), (body,))
    return b"".join(parts)


_extend = google_crc32c.extend


def encode_batch(out: list, flags, queue_ids, queue_offsets, borns, stamps, dues, topics, msgids, tags, keys, props,
                 bodies) -> list[int]:
    """Encode a batch of records given as columns (one iterable per field, in ``encode``'s order,
    all of one length): append each record's pieces (its CRC-led prefix, the rest of its head,
    its body) to ``out``, for one join per batch, and return the records' sizes.

    The one loop that lays records down (``StoreWriter.write_columns`` calls it once per batch; a
    call per message would cost as much as its body). The body is never copied here; the CRC is
    computed over the pieces in order. Raises ``ValueError`` for a record over RECORD_SIZE_MAX.

    Compiled, the loop is record.pxd's ``_encode_batch_in_c``: the same pieces, each header laid
    out in C and its CRC computed in place (tests/unit/test_record.py holds it to this loop).
    """
    if _COMPILED:  # record.pxd's ``_encode_batch_in_c`` (this loop is the pure build's, and its reference)
        return _encode_batch_in_c(out, flags, queue_ids, queue_offsets, borns, stamps, dues, topics,  # noqa: F821
                                  msgids, tags, keys, props, bodies, _CRC_IN_CPU, _crc, _extend)
    sizes: list[int] = []
    add_piece, add_size = out.append, sizes.append
    pack_tail, pack_prefix, crc, extend = _pack_tail, _pack_prefix, _crc, _extend
    for f, queue_id, qoff, born_ms, stamp, deliver_at_ms, topic, msgid, tag, k, pr, body in zip(
            flags, queue_ids, queue_offsets, borns, stamps, dues, topics, msgids, tags, keys, props, bodies):
        head = pack_tail(f, queue_id, qoff, born_ms, stamp, deliver_at_ms, len(topic), len(msgid), len(tag),
                         len(k), len(pr), len(body)) + topic + msgid + tag + k + pr
        size = CRC_START + len(head) + len(body)
        if size > RECORD_SIZE_MAX:
            raise ValueError(f"record of {size} bytes exceeds {RECORD_SIZE_MAX}")
        add_piece(pack_prefix(size, MAGIC, VERSION, extend(crc(head), body)))
        add_piece(head)
        add_piece(body)
        add_size(size)
    return sizes


def check(buf: bytes, pos: int, end: int) -> int:
    """Validate the record at ``buf[pos:]`` (``end`` = bytes available). Return its length.

    Raises ``RecordError`` (with ``torn=True`` when the record would run past ``end``).
    """
    if end - pos < HEADER_SIZE:
        if end - pos < 4 or not any(buf[pos:end]):
            raise RecordError("short header", torn=True)
        raise RecordError(f"only {end - pos} bytes left, header needs {HEADER_SIZE}", torn=True)
    (total, magic, version, crc, _flags, _qid, _qoff, _born, _stored, _deliver,
     tlen, mlen, taglen, klen, plen, blen) = _unpack_header(buf, pos)
    if magic != MAGIC or version != VERSION:
        if total == 0 and magic == 0 and not any(buf[pos:min(end, pos + 4096)]):
            raise RecordError("zero-filled tail", torn=True)
        raise RecordError(f"bad magic/version {magic:#x}/{version}")
    if total < HEADER_SIZE or total > RECORD_SIZE_MAX:
        raise RecordError(f"length {total} out of range")
    if HEADER_SIZE + tlen + mlen + taglen + klen + plen + blen != total or tlen == 0 or mlen == 0:
        raise RecordError("field lengths do not add up to the record length")
    if pos + total > end:
        raise RecordError(f"record of {total} bytes runs past the end ({end - pos} left)", torn=True)
    covered = bytes(buf[pos + CRC_START:pos + total])
    if _crc(covered) != crc:
        raise RecordError("CRC mismatch")
    # A matching CRC does not make the text fields text (a bug or a hand may have written them),
    # and every reader decodes them: check here, once, so no decoder meets bad UTF-8.
    text = covered[_TEXT_START:_TEXT_START + tlen + mlen + taglen + klen + plen]
    if not text.isascii():
        _check_utf8(text, (tlen, mlen, taglen, klen, plen))
    return total


_TEXT_START = HEADER_SIZE - CRC_START  # where the topic starts in the CRC-covered bytes


def check_all(buf: bytes, pos: int, end: int) -> int:
    """Check every record of ``buf[pos:end]`` (``buf``: bytes) and return ``end``: ``check_run``'s
    walk, ``check`` where it stops. The first bad record raises ``check``'s ``RecordError``, with
    ``at``, its position. (A replica's check of what it is shipped; a replay's of what it reads.)"""
    while pos < end:
        pos = check_run(buf, pos, end)
        if pos < end:
            try:
                pos += check(buf, pos, end)
            except RecordError as exc:
                exc.at = pos
                raise
    return pos


def check_run(buf: bytes, pos: int, end: int) -> int:
    """Walk the records of ``buf[pos:end]`` (``buf``: bytes) while each passes every rule of
    ``check``, and return where the walk stopped: ``end`` when all did. The record there is for
    ``check``, which names the rule it fails. A replica checks what it is shipped this way
    (``Store.append_shipped``): one call per answer, not per record. Text beyond ASCII is checked
    here too, field by field (a record with a non-ASCII tag, key or property left to ``check``
    cost ~16 k instructions compiled, not 0.7 k).

    The header is read byte by byte: compiled (``record.pxd`` gives the locals C types) these are
    C loads, where ``check``'s ``struct`` unpacking makes 16 integer objects a record. Compiled,
    the walk is record.pxd's ``_check_run_in_c``: the CRC computed over the record's bytes in place
    (by the CPU's crc32 instruction where it has one), the text scanned 8 bytes a step. A replica's
    apply then took 5.74 k instructions a 1 KiB message, not 9.16 k (this walk's share 4.05 k ->
    0.66 k, 0.57 k of it the CRC; bench/replica_apply.py's apply under callgrind, 20,000 messages
    in answers of ~110 KB; CPU a message, alternating runs: 3.6-4.2 -> 3.3-3.5 us).
    """
    if _COMPILED and type(buf) is bytes:
        return _check_run_in_c(buf, pos, end, _CRC_IN_CPU, _crc)  # noqa: F821 - in record.pxd
    header, size_max, magic, version = HEADER_SIZE, RECORD_SIZE_MAX, MAGIC, VERSION
    while end - pos >= header:
        total = _u32(buf, pos)
        if buf[pos + 4] != magic or buf[pos + 5] != version or total < header or total > size_max \
                or total > end - pos:
            return pos
        tlen, mlen, taglen, klen, plen = buf[pos + 46], buf[pos + 47], _u16(buf, pos + 48), _u16(buf, pos + 50), \
            _u32(buf, pos + 52)
        text = tlen + mlen + taglen + klen + plen
        if not tlen or not mlen or header + text + _u32(buf, pos + 56) != total:
            return pos
        if _crc(buf[pos + CRC_START:pos + total]) != _u32(buf, pos + 6):
            return pos
        p = pos + header
        stop = p + text
        while p < stop:
            if buf[p] >= 0x80:
                if not _utf8(buf[pos + header:stop], (tlen, mlen, taglen, klen, plen)):
                    return pos
                break
            p += 1
        pos += total
    return pos


def crc32c(data: bytes) -> int:
    """The CRC-32C of ``data`` as ``check_run`` computes it: compiled on a CPU with SSE4.2, record.pxd's
    ``chronoq_crc32c`` (tests hold it to google_crc32c), else google_crc32c's."""
    if _CRC_IN_CPU and type(data) is bytes:
        return chronoq_crc32c(data, len(data))  # noqa: F821 - in record.pxd
    return _crc(data)


def span(buf: bytes, pos: int, end: int) -> int:
    """Step from ``pos`` over the records of ``buf[pos:end]`` by their length fields, without
    checking them (records this process checked already: ``chronoq.store.recovery.iter_chunks``),
    and return where the last whole one ends (a length below ``HEADER_SIZE`` stops the walk)."""
    header = HEADER_SIZE
    while end - pos >= header:
        total = _u32(buf, pos)
        if total < header or total > end - pos:
            break
        pos += total
    return pos


def _u32(buf: bytes, p: int) -> int:
    """The little-endian u32 at ``buf[p:p + 4]`` (``check_run``'s reader; compiled, C loads)."""
    b0, b1, b2, b3 = buf[p], buf[p + 1], buf[p + 2], buf[p + 3]
    return b0 | b1 << 8 | b2 << 16 | b3 << 24


def _u16(buf: bytes, p: int) -> int:
    b0, b1 = buf[p], buf[p + 1]
    return b0 | b1 << 8


def _check_utf8(text: bytes, lengths: tuple[int, ...]) -> None:
    if not _utf8(text, lengths):
        raise RecordError("a text field (topic, id, tag, keys, properties) is not UTF-8")


def _utf8(text: bytes, lengths: tuple[int, ...]) -> bool:
    """Whether each of the fields of ``text`` (their ``lengths``, in order) is UTF-8."""
    p = 0
    for n in lengths:  # field by field: a character may not straddle two fields
        try:
            text[p:p + n].decode()
        except UnicodeDecodeError:
            return False
        p += n
    return True


class RecordHeader:
    """Routing fields of a record, parsed without touching the body (for the dispatcher)."""

    __slots__ = ("length", "flags", "queue_id", "queue_offset", "stored_ms", "deliver_at_ms", "topic", "tag")

    def __init__(self, buf: bytes, pos: int):
        (total, _m, _v, _c, flags, qid, qoff, _born, stored, deliver,
         tlen, mlen, taglen, _k, _p, _b) = _unpack_header(buf, pos)
        self.length = total
        self.flags = flags
        self.queue_id = qid
        self.queue_offset = qoff
        self.stored_ms = stored
        self.deliver_at_ms = deliver
        start = pos + HEADER_SIZE
        self.topic = bytes(buf[start:start + tlen]).decode()
        tag_start = start + tlen + mlen
        self.tag = bytes(buf[tag_start:tag_start + taglen])


def decode(buf: bytes, pos: int = 0) -> dict:
    """Decode a record already validated by ``check`` into its fields (a plain dict)."""
    (flags, qid, qoff, born, stored, deliver, topic, msgid, tag, keys, props, body) = decode_tuple(buf, pos)
    return {
        "flags": flags, "queue_id": qid, "queue_offset": qoff, "born_ms": born, "stored_ms": stored,
        "deliver_at_ms": deliver, "topic": topic, "message_id": msgid, "tag": tag, "keys": keys,
        "properties": props, "body": body,
    }


_TOPICS_CACHE_MAX = 4096
_topics: dict[bytes, str] = {}


def decode_tuple(buf: bytes, pos: int = 0) -> tuple:
    """``decode`` as a tuple, for the read path (no dict per message): (flags, queue_id,
    queue_offset, born_ms, stored_ms, deliver_at_ms, topic, message_id, tag, keys, properties,
    body). ``buf`` may hold other records around ``pos``; only the body is copied out."""
    (total, _m, _v, _c, flags, qid, qoff, born, stored, deliver,
     tlen, mlen, taglen, klen, plen, blen) = _unpack_header(buf, pos)
    if type(buf) is not bytes:  # (slices of bytes are bytes: hashable, decodable)
        buf, pos = bytes(buf[pos:pos + total]), 0
    p = pos + HEADER_SIZE
    text_end = p + tlen + mlen + taglen + klen + plen
    assert text_end + blen == pos + total
    return (flags, qid, qoff, born, stored, deliver, *_text_fields(buf, p, tlen, mlen, taglen, klen, plen),
            buf[text_end:text_end + blen])


def topic_name(raw: bytes) -> str:
    """A record's topic as text, from a bounded cache (a few topics are read over and over)."""
    topic = _topics.get(raw)
    if topic is None:
        topic = raw.decode()
        if len(_topics) >= _TOPICS_CACHE_MAX:
            _topics.clear()
        _topics[raw] = topic
    return topic


def _text_fields(buf: bytes, p: int, tlen: int, mlen: int, taglen: int, klen: int, plen: int) -> tuple:
    """(topic, message id, tag, keys, properties) of a record whose topic starts at ``p``."""
    topic = topic_name(buf[p:p + tlen])
    p += tlen
    msgid = buf[p:p + mlen].decode(); p += mlen
    tag = buf[p:p + taglen].decode() if taglen else ""; p += taglen
    keys = decode_keys(buf[p:p + klen]) if klen else (); p += klen
    props = decode_properties(buf[p:p + plen]) if plen else {}
    return topic, msgid, tag, keys, props


def check_decode(buf: bytes, pos: int, end: int) -> tuple:
    """``check`` then ``decode_tuple`` in one pass (the read path: the header is unpacked once
    and the fields are cut from the bytes the CRC was computed over). Same errors as ``check``."""
    try:
        (total, magic, version, crc, flags, qid, qoff, born, stored, deliver,
         tlen, mlen, taglen, klen, plen, blen) = _unpack_header(buf, pos)
    except Exception:  # noqa: BLE001 - too short for a header: check names the case
        check(buf, pos, end)
        raise  # (check always raises here)
    if magic != MAGIC or version != VERSION or not HEADER_SIZE <= total <= RECORD_SIZE_MAX \
            or HEADER_SIZE + tlen + mlen + taglen + klen + plen + blen != total or not tlen or not mlen \
            or pos + total > end:
        check(buf, pos, end)  # raises, with the precise reason
        raise RecordError("record header is invalid")  # unreachable while the rules agree
    covered = bytes(buf[pos + CRC_START:pos + total])  # (a no-op for bytes; memoryviews are copied)
    if _crc(covered) != crc:
        raise RecordError("CRC mismatch")
    p = _TEXT_START
    text_end = p + tlen + mlen + taglen + klen + plen
    if not covered[p:text_end].isascii():
        _check_utf8(covered[p:text_end], (tlen, mlen, taglen, klen, plen))
    return (flags, qid, qoff, born, stored, deliver, *_text_fields(covered, p, tlen, mlen, taglen, klen, plen),
            covered[text_end:])
