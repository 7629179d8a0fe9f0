"""The commit-log record codec: round trips, and ``check`` rejecting every kind of damage.

Hypothesis runs derandomized (a fixed seed derived from each test), so every run is the same.
"""

from __future__ import annotations

import random
import struct

import google_crc32c
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sourcekit import from_source

from chronoq.store import record

SETTINGS = settings(derandomize=True, database=None, deadline=None, max_examples=300,
                    suppress_health_check=[HealthCheck.too_slow])
FEWER = settings(SETTINGS, max_examples=100)

TOPIC_ALPHABET = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_%|-"
# The codec's separators may not appear inside keys or properties (chronoq.core.model forbids them).
_SEP_FREE = st.characters(blacklist_characters="\x01\x02", blacklist_categories=("Cs",))

U16 = st.integers(0, 0xFFFF)
I64 = st.integers(-(2**63), 2**63 - 1)


@st.composite
def fields(draw) -> dict:
    return {
        "flags": draw(U16),
        "queue_id": draw(U16),
        "queue_offset": draw(st.integers(0, 2**64 - 1)),
        "born_ms": draw(I64),
        "stored_ms": draw(I64),
        "deliver_at_ms": draw(I64),
        "topic": draw(st.text(TOPIC_ALPHABET, min_size=1, max_size=127)),
        # Message ids: printable ASCII, 1..128 characters (validate.message_id).
        "message_id": draw(st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E),
                                   min_size=1, max_size=128)),
        "tag": draw(st.text(max_size=40)),
        # A lone empty key is indistinguishable from "no keys" in the codec; the model rejects
        # blank keys, so keys are non-empty here.
        "keys": tuple(draw(st.lists(st.text(_SEP_FREE, min_size=1, max_size=20), max_size=5))),
        "properties": draw(st.dictionaries(st.text(_SEP_FREE, min_size=1, max_size=20),
                                           st.text(_SEP_FREE, max_size=40), max_size=6)),
        "body": draw(st.binary(max_size=3000)),
    }


def encode(f: dict) -> bytes:
    return record.encode(
        f["flags"], f["queue_id"], f["queue_offset"], f["born_ms"], f["stored_ms"], f["deliver_at_ms"],
        f["topic"].encode(), f["message_id"].encode(), f["tag"].encode(), record.encode_keys(f["keys"]),
        record.encode_properties(f["properties"]), f["body"],
    )


SAMPLE = {
    "flags": record.FLAG_DELAYED, "queue_id": 3, "queue_offset": 41, "born_ms": -5, "stored_ms": 1_700_000_000_000,
    "deliver_at_ms": 1_700_000_060_000, "topic": "orders%x|y-z_1", "message_id": "01ABCDEF0123456789ABCDEF0123456789",
    "tag": "paid", "keys": ("k1", "k2"), "properties": {"a": "b", "empty": ""}, "body": b"hello, world",
}


@SETTINGS
@given(fields())
def test_round_trip(f):
    rec = encode(f)
    assert record.check(rec, 0, len(rec)) == len(rec)
    assert struct.unpack_from("<I", rec, 0)[0] == len(rec)
    assert record.decode(rec) == f
    assert record.check_decode(rec, 0, len(rec)) == record.decode_tuple(rec, 0)
    h = record.RecordHeader(rec, 0)
    assert (h.length, h.flags, h.queue_id, h.queue_offset, h.stored_ms, h.deliver_at_ms, h.topic, h.tag) == (
        len(rec), f["flags"], f["queue_id"], f["queue_offset"], f["stored_ms"], f["deliver_at_ms"], f["topic"],
        f["tag"].encode())
    assert record.ROUTE.unpack_from(rec, 0) == (
        len(rec), f["flags"], f["queue_id"], f["queue_offset"], f["stored_ms"], f["deliver_at_ms"],
        len(f["topic"].encode()), len(f["message_id"].encode()), len(f["tag"].encode()))
    assert record.check_run(rec, 0, len(rec)) == len(rec)  # (text beyond ASCII too)
    assert record.span(rec, 0, len(rec)) == len(rec)


@FEWER
@given(st.lists(fields(), min_size=1, max_size=6), st.integers(0, 64), st.integers(0, 3))
def test_check_run_walks_as_check_does(fs, lead, cut):
    """Walking records with check_run, and check where it stops, gives the same boundaries as
    check record by record (a cut last record: the same torn error at the same place)."""
    buf = b"\xAA" * lead + b"".join(encode(f) for f in fs)
    end = len(buf) - cut * 7

    def walk(step) -> list:  # each record's end, then the error that stopped the walk, at its place
        out: list = []
        try:
            step(out)
        except record.RecordError as exc:
            out.append((out[-1] if out else lead, exc.reason, exc.torn))
        return out

    def by_check(out):
        pos = lead
        while pos < end:
            pos += record.check(buf, pos, end)
            out.append(pos)

    def by_run(out):
        pos = lead
        while pos < end:
            stop = record.check_run(buf, pos, end)
            while pos < stop:  # (each record it passed ends where check says)
                pos += record.check(buf, pos, end)
                out.append(pos)
            assert pos == stop
            if pos < end:
                pos += record.check(buf, pos, end)
                out.append(pos)

    walked = walk(by_check)
    assert walk(by_run) == walked

    try:  # check_all, the one call: every record, or the first bad one's error, at its place
        assert record.check_all(buf, lead, end) == end == walked[-1]
    except record.RecordError as exc:
        assert (exc.at, exc.reason, exc.torn) == walked[-1]
    whole = [p for p in walked if isinstance(p, int)]  # (span steps by lengths: to the last whole record)
    assert record.span(buf, lead, end) == (whole[-1] if whole else lead)


@FEWER
@given(st.lists(fields(), min_size=2, max_size=4), st.integers(0, 64))
def test_records_back_to_back_at_an_offset(fs, lead):
    """check/decode honour ``pos``: records packed after arbitrary leading bytes."""
    recs = [encode(f) for f in fs]
    buf = b"\xAA" * lead + b"".join(recs)
    pos = lead
    for f, rec in zip(fs, recs):
        assert record.check(buf, pos, len(buf)) == len(rec)
        assert record.decode(buf, pos) == f
        assert record.check_decode(buf, pos, len(buf)) == record.decode_tuple(buf, pos)
        assert record.check_decode(memoryview(buf), pos, len(buf)) == record.decode_tuple(memoryview(buf), pos)
        pos += len(rec)
    assert pos == len(buf)


def _assert_rejected(buf: bytes, end: int | None = None, *, torn: bool) -> record.RecordError:
    end = len(buf) if end is None else end
    with pytest.raises(record.RecordError) as info:
        record.check(buf, 0, end)
    assert info.value.torn is torn, (info.value.reason, info.value.torn)
    # The read path's one-pass check_decode refuses the same bytes for the same reason.
    with pytest.raises(record.RecordError) as fused:
        record.check_decode(buf, 0, end)
    assert (fused.value.reason, fused.value.torn) == (info.value.reason, info.value.torn)
    # The run walk (a replica's check of what it is shipped) never passes what check refuses.
    assert record.check_run(buf, 0, end) == 0
    return info.value


@SETTINGS
@given(fields(), st.data())
def test_any_single_bit_flip_is_rejected(f, data):
    rec = bytearray(encode(f))
    bit = data.draw(st.integers(0, len(rec) * 8 - 1), label="bit")
    rec[bit // 8] ^= 1 << (bit % 8)
    # A flipped bit is damage, not a short write: it must never pass as a torn tail.
    _assert_rejected(bytes(rec), torn=False)


def test_every_single_bit_flip_of_a_sample_record_is_rejected():
    rec = encode(SAMPLE)
    for bit in range(len(rec) * 8):
        damaged = bytearray(rec)
        damaged[bit // 8] ^= 1 << (bit % 8)
        _assert_rejected(bytes(damaged), torn=False)


@FEWER
@given(fields())
def test_truncation_at_every_length_is_torn(f):
    rec = encode(f)
    for length in range(len(rec)):
        _assert_rejected(rec[:length], torn=True)
        # Same with the bytes present in the buffer but beyond ``end``.
        _assert_rejected(rec, end=length, torn=True)


@pytest.mark.parametrize("zeros", [1, 3, 4, 10, 59, 60, 61, 200, 4096, 5000])
def test_zero_filled_tail_is_torn(zeros):
    rec = encode(SAMPLE)
    buf = rec + bytes(zeros)
    assert record.check(buf, 0, len(buf)) == len(rec)
    with pytest.raises(record.RecordError) as info:
        record.check(buf, len(rec), len(buf))
    assert info.value.torn


@pytest.mark.parametrize("magic", [0x00, 0xC8, 0xCA, 0xFF])
def test_wrong_magic_is_rejected(magic):
    rec = bytearray(encode(SAMPLE))
    rec[4] = magic
    err = _assert_rejected(bytes(rec), torn=False)
    assert "magic" in err.reason


def test_wrong_version_is_rejected():
    rec = bytearray(encode(SAMPLE))
    rec[5] = record.VERSION + 1
    _assert_rejected(bytes(rec), torn=False)


def test_garbage_is_not_torn():
    _assert_rejected(b"\x01" * 100, torn=False)
    _assert_rejected(b"\xff" * 100, torn=False)


def test_length_out_of_range_is_rejected():
    rec = bytearray(encode(SAMPLE))
    struct.pack_into("<I", rec, 0, record.RECORD_SIZE_MAX + 1)
    _assert_rejected(bytes(rec), torn=False)
    struct.pack_into("<I", rec, 0, record.HEADER_SIZE - 1)
    _assert_rejected(bytes(rec), torn=False)


def test_encode_refuses_oversized_records():
    with pytest.raises(ValueError):
        record.encode(0, 0, 0, 0, 0, 0, b"t", b"m", b"", b"", b"", bytes(record.RECORD_SIZE_MAX))


def test_empty_topic_or_message_id_is_invalid():
    for topic, msgid in ((b"", b"m"), (b"t", b"")):
        rec = record.encode(0, 0, 0, 0, 0, 0, topic, msgid, b"", b"", b"", b"x")
        _assert_rejected(rec, torn=False)


@pytest.mark.parametrize("field", range(5))
def test_text_that_is_not_utf8_is_rejected_despite_a_good_crc(field):
    texts = [b"topic", b"id-1", b"tag", b"k1", b"a\x01b"]
    texts[field] = texts[field][:1] + b"\xff" + texts[field][1:]
    rec = record.encode(0, 0, 0, 1, 2, 0, *texts, b"body")
    err = _assert_rejected(rec, torn=False)
    assert "UTF-8" in err.reason


# --- The compiled check_run (record.pxd's C walk) held to the source's loop ------------------------
# Compiled, check_run walks in C: the CRC computed in place (by the CPU's crc32 instruction, or by
# google_crc32c on a slice where the CPU has none: ``_CRC_IN_CPU`` False), the text scanned 8 bytes a
# step. Each case below runs both ways and must stop where record.py's own loop stops. (On the pure
# build both sides are that loop.)

def source_record():
    """record.py loaded from its source under another name: the pure build's loop, whichever build
    ``record`` is."""
    module = from_source(record, "record_from_source")
    assert not module._CRC_IN_CPU
    return module


SOURCE = source_record()


@pytest.fixture(params=[True, False], ids=["crc-in-cpu", "crc-by-library"])
def crc_in_cpu(request, monkeypatch):
    if request.param and not record._CRC_IN_CPU:
        pytest.skip("the pure build, or a CPU without SSE4.2: no CRC of record.pxd's own")
    monkeypatch.setattr(record, "_CRC_IN_CPU", request.param)
    return request.param


def with_crc(rec: bytearray, pos: int = 0) -> bytearray:
    """``rec``'s record at ``pos`` with its CRC made to match its bytes again (damage the CRC cannot see)."""
    total = struct.unpack_from("<I", rec, pos)[0]
    struct.pack_into("<I", rec, pos + 6, google_crc32c.value(bytes(rec[pos + record.CRC_START:pos + total])))
    return rec


def assert_walks_agree(buf: bytes, pos: int, end: int) -> int:
    want = SOURCE.check_run(buf, pos, end)
    assert record.check_run(buf, pos, end) == want, (pos, end)
    return want


def hand_laid() -> list[bytes]:
    """Records of every text shape: lengths 1..9 (the 8-byte scan's tail alone, a word and a tail),
    empty tag/keys/properties or long ones, bodies of odd lengths (the CRC's byte tail)."""
    out = []
    for n in range(1, 10):
        out.append(record.encode(0, n, n, 1, 2, 0, b"t" * n, b"m" * (10 - n), b"g" * (n % 3), b"", b"", b"b" * n))
    out.append(record.encode(record.FLAG_CONTINUES, 7, 8, 9, 10, 11, b"orders", b"01ABC", b"red",
                             record.encode_keys(["k1", "k2"]), record.encode_properties({"a": "b", "c": ""}),
                             bytes(range(256)) * 4 + b"\x80\xff"))  # (a body's high bytes are not text)
    out.append(record.encode(0, 0, 0, 0, 0, 0, b"x" * 127, b"y" * 128, b"z" * 300, b"k" * 41, b"p" * 1000, b""))
    return out


@pytest.mark.parametrize("lead", [0, 1, 3, 7])
def test_compiled_check_run_stops_where_the_source_loop_does(crc_in_cpu, lead):
    recs = hand_laid()
    buf = b"\xAA" * lead + b"".join(recs) + b"\0" * 5
    end = len(buf) - 5
    assert assert_walks_agree(buf, lead, end) == end
    assert assert_walks_agree(buf, lead, len(buf)) == end  # (zeros after: too short for a header)
    starts = [lead + sum(map(len, recs[:i])) for i in range(len(recs) + 1)]
    for cut in range(lead, end):  # truncated anywhere: stops at the cut record's start
        stop = assert_walks_agree(buf, lead, cut)
        assert stop == max(s for s in starts if s <= cut)
    for k, at in enumerate(starts[:-1]):
        rec = recs[k]
        total = len(rec)
        text = sum(record.HEADER.unpack_from(rec, 0)[10:15])
        for i in range(record.CRC_START, total):  # a byte changed anywhere the CRC covers: bad CRC
            bad = bytearray(buf)
            bad[at + i] ^= 0x5A
            assert assert_walks_agree(bytes(bad), lead, end) == at
        for i in range(text):  # a non-ASCII byte at each text position, the CRC made good
            bad = with_crc(bytearray(buf), at)
            bad[at + record.HEADER_SIZE + i] |= 0x80
            assert assert_walks_agree(bytes(with_crc(bad, at)), lead, end) == at
        if total > record.HEADER_SIZE + text:  # ... in the body instead: the walk goes on
            bad = bytearray(buf)
            bad[at + total - 1] = 0xC3
            assert assert_walks_agree(bytes(with_crc(bad, at)), lead, end) == end


def test_compiled_check_run_refuses_bad_headers_as_the_source_loop_does(crc_in_cpu):
    rec = record.encode(0, 1, 2, 3, 4, 5, b"topic", b"id", b"tag", b"", b"", b"body" * 9)
    cases = {"magic": (4, "<B", 0xC8), "version": (5, "<B", 2), "short length": (0, "<I", record.HEADER_SIZE - 1),
             "long length": (0, "<I", record.RECORD_SIZE_MAX + 1), "past the end": (0, "<I", len(rec) + 1),
             "no topic": (46, "<B", 0), "no id": (47, "<B", 0), "tag too long": (48, "<H", 4),
             "props too long": (52, "<I", 1), "huge props": (52, "<I", 0xFFFFFFFF), "body short": (56, "<I", 35),
             "crc": (6, "<I", 0)}
    for name, (at, fmt, value) in cases.items():
        bad = bytearray(rec * 2)
        struct.pack_into(fmt, bad, len(rec) + at, value)  # the second record: the first passes
        assert assert_walks_agree(bytes(bad), 0, len(bad)) == len(rec), name
    # An end past the bytes: the C walk's bounds assert (the source loop's reads run off the bytes).
    with pytest.raises(AssertionError if record._COMPILED else IndexError):
        record.check_run(rec, 0, len(rec) + 61)
    with pytest.raises(IndexError):
        SOURCE.check_run(rec, 0, len(rec) + 61)


# --- The compiled encode_batch (record.pxd's C loop) held to the source's loop ---------------------

def _columns(batch: list[dict]) -> tuple:
    return (tuple(f["flags"] for f in batch), [f["queue_id"] for f in batch], [f["queue_offset"] for f in batch],
            [f["born_ms"] for f in batch], [f["stored_ms"] for f in batch], [f["deliver_at_ms"] for f in batch],
            [f["topic"].encode() for f in batch], [f["message_id"].encode() for f in batch],
            [f["tag"].encode() for f in batch], [record.encode_keys(f["keys"]) for f in batch],
            [record.encode_properties(f["properties"]) for f in batch], [f["body"] for f in batch])


@FEWER
@given(st.lists(fields(), min_size=1, max_size=5), st.booleans())
def test_compiled_encode_batch_lays_down_the_source_loops_bytes(batch, crc_in_cpu):
    """The same pieces byte for byte (a record's prefix, head and body: the store takes the heads
    apart) and sizes, with the CRC by the CPU's instruction or by google_crc32c; compiled, text
    and bodies given as other buffers than bytes too (copied to bytes first)."""
    if crc_in_cpu and not record._CRC_IN_CPU:
        crc_in_cpu = False  # (the pure build, or a CPU without SSE4.2)
    cols = _columns(batch)
    want_pieces, got_pieces = [], []
    want_sizes = SOURCE.encode_batch(want_pieces, *cols)
    saved = record._CRC_IN_CPU
    record._CRC_IN_CPU = crc_in_cpu
    try:
        assert record.encode_batch(got_pieces, *cols) == want_sizes
        assert got_pieces == want_pieces
        if record._COMPILED:
            others = [cols[i] if i < 6 else [bytearray(v) if j % 2 else memoryview(v) for j, v in enumerate(cols[i])]
                      for i in range(len(cols))]
            again: list = []
            assert record.encode_batch(again, *others) == want_sizes
            assert again == want_pieces
    finally:
        record._CRC_IN_CPU = saved
    at = 0
    for size in want_sizes:  # (and each is a record check accepts)
        assert record.check(b"".join(want_pieces), at, at + size) == size
        at += size


def test_compiled_encode_batch_refuses_what_the_source_loop_refuses():
    """Out-of-range integers and over-long records are refused both ways (OverflowError compiled
    where struct refuses with struct.error; ValueError for a field or record too long)."""
    good = _columns([SAMPLE])
    for i, bad in ((0, -1), (1, 0x10000), (2, 2**64), (3, 2**63)):
        cols = list(good)
        cols[i] = [bad]
        for codec in (record, SOURCE):
            with pytest.raises((OverflowError, struct.error)):
                codec.encode_batch([], *cols)
    cols = list(good)
    cols[11] = [bytes(record.RECORD_SIZE_MAX)]
    for codec in (record, SOURCE):
        with pytest.raises(ValueError, match="exceeds"):
            codec.encode_batch([], *cols)
    cols = list(good)
    cols[6] = [b"t" * 256]
    with pytest.raises((ValueError, struct.error)):
        record.encode_batch([], *cols)


@FEWER
@given(st.lists(fields(), min_size=1, max_size=5), st.integers(0, 9), st.data())
def test_compiled_check_run_agrees_on_random_damaged_chunks(fs, lead, data):
    recs = [encode(f) for f in fs]
    buf = bytearray(b"\x55" * lead + b"".join(recs))
    damage = data.draw(st.sampled_from(["none", "byte", "text", "cut"]), label="damage")
    k = data.draw(st.integers(0, len(recs) - 1), label="record")
    at = lead + sum(map(len, recs[:k]))
    if damage == "byte":
        buf[data.draw(st.integers(lead, len(buf) - 1), label="at")] ^= data.draw(st.integers(1, 255), label="xor")
    elif damage == "text":
        text = sum(record.HEADER.unpack_from(buf, at)[10:15])
        buf[at + record.HEADER_SIZE + data.draw(st.integers(0, text - 1), label="i")] |= 0x80
        with_crc(buf, at)
    end = len(buf) - (data.draw(st.integers(1, len(buf) - lead), label="cut") if damage == "cut" else 0)
    for crc_in_cpu in {False, record._CRC_IN_CPU}:
        record._CRC_IN_CPU = crc_in_cpu  # (restored below: hypothesis runs this body many times)
        try:
            assert_walks_agree(bytes(buf), lead, end)
        finally:
            record._CRC_IN_CPU = SOURCE_CRC_IN_CPU


SOURCE_CRC_IN_CPU = record._CRC_IN_CPU


def test_the_crc_in_c_is_google_crc32c():
    rng = random.Random(22)
    data = bytes(rng.getrandbits(8) for _ in range(5000))
    for n in [*range(0, 70), 1023, 1024, 1025, 1094, 4096, 4999]:
        for start in (0, 1, 5):  # (crc32c takes whole bytes objects: slices give other lengths' tails)
            piece = data[start:start + n]
            assert record.crc32c(piece) == google_crc32c.value(piece), (start, n)
    assert record.crc32c(b"123456789") == 0xE3069283  # CRC-32C's check value
    assert record._CRC_IN_CPU or not record._COMPILED or "sse4_2" not in open("/proc/cpuinfo").read()


def utf8(raw: bytes) -> bool:
    try:
        raw.decode()
    except UnicodeDecodeError:
        return False
    return True


def assert_text_walk(texts: list[bytes]) -> None:
    """Records with each of ``texts`` as their tag (a good CRC): the walks pass exactly those whose
    tag Python decodes, and ``check`` agrees."""
    for tag in texts:
        rec = record.encode(0, 0, 0, 0, 0, 0, b"t", b"m", tag, b"k", b"", b"")
        want = len(rec) if utf8(tag) else 0
        assert assert_walks_agree(rec, 0, len(rec)) == want, tag
        if want:
            assert record.check(rec, 0, len(rec)) == want
        else:
            with pytest.raises(record.RecordError, match="UTF-8"):
                record.check(rec, 0, len(rec))


def test_the_walks_check_utf8_as_python_decodes_it(crc_in_cpu):
    lead = [bytes([a, b]) for a in range(0x80, 0x100) for b in range(0x100)]  # every 2-byte start
    three = [bytes([a, b, c]) for a in range(0xE0, 0xF0) for b in (0x7F, 0x80, 0x9F, 0xA0, 0xBF, 0xC0)
             for c in (0x7F, 0x80, 0xBF, 0xC0)]
    four = [bytes([a, b, c, d]) for a in range(0xF0, 0xF8) for b in (0x7F, 0x80, 0x8F, 0x90, 0xBF, 0xC0)
            for c in (0x80, 0xC0) for d in (0x7F, 0x80, 0xBF)]
    edges = ["é", "€", "😀", "\U0010FFFF", "\uD7FF", "\uE000"]
    assert_text_walk(lead + three + four + [b"ab" + e.encode() + b"cd" for e in edges]
                     + [e.encode()[:-1] for e in edges] + [b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xc0\x80"])


def test_a_character_may_not_straddle_two_fields(crc_in_cpu):
    rec = record.encode(0, 0, 0, 0, 0, 0, b"t", b"m", b"caf\xc3", b"\xa9", b"", b"")  # "café" cut in two
    assert assert_walks_agree(rec, 0, len(rec)) == 0
    rec = record.encode(0, 0, 0, 0, 0, 0, b"t", b"m", b"caf\xc3\xa9", b"", b"", b"")
    assert assert_walks_agree(rec, 0, len(rec)) == len(rec)


@FEWER
@given(st.lists(st.one_of(st.binary(min_size=1, max_size=12), st.text(min_size=1, max_size=6).map(str.encode)),
                min_size=1, max_size=20))
def test_the_walks_check_random_text_as_python_decodes_it(texts):
    for crc_in_cpu in {False, record._CRC_IN_CPU}:
        record._CRC_IN_CPU = crc_in_cpu
        try:
            assert_text_walk(texts)
        finally:
            record._CRC_IN_CPU = SOURCE_CRC_IN_CPU
