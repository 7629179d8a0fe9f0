"""Fuzzing every on-disk and handle decoder with random and structure-aware bytes (Hypothesis).

The rule (STYLE lesson 11, DESIGN invariant 7): a decoder given bytes it did not write answers
with its module's own error type — never ``struct.error``, ``IndexError``,
``UnicodeDecodeError`` or any other exception that would surface as a crash or an
INTERNAL_ERROR. "Structure-aware" inputs carry valid lengths, magic numbers and CRCs around random
contents, so the fuzzer gets past the checksum to the field decoding behind it.

Bounded by time: ``CHRONOQ_FUZZ_SECONDS`` (default 8) is split across the targets; run longer by
hand, e.g. ``CHRONOQ_FUZZ_SECONDS=600 pytest -s tests/unit/test_fuzz_decoders.py``. Hypothesis
prints a ``@reproduce_failure`` blob for any failure; each crash found is kept below as an
explicit regression case.
"""

from __future__ import annotations

import os
import struct
import time
import zlib

import google_crc32c
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chronoq.core import errors, fsutil
from chronoq.pop import handle as pop_handle
from chronoq.pop import poplog
from chronoq.store import record
from chronoq.timer import handle as recall_handle
from chronoq.timer import schedlog

FUZZ_SECONDS = float(os.environ.get("CHRONOQ_FUZZ_SECONDS", "8"))
CHUNK = settings(max_examples=150, deadline=None, database=None, print_blob=True,
                 suppress_health_check=list(HealthCheck))

counts: dict[str, int] = {}


def _run_for(name: str, budget_s: float, test) -> None:
    """Call the ``@given`` function ``test`` (one Hypothesis run each) until ``budget_s`` is spent."""
    counts.setdefault(name, 0)
    deadline = time.monotonic() + budget_s
    test()  # at least one full run, however small the budget
    while time.monotonic() < deadline:
        test()


def _tick(name: str) -> None:
    counts[name] = counts.get(name, 0) + 1


# ------------------------------------------------------------------------------------- records
def _record_with_crc(flags, qid, qoff, born, stored, deliver, fields: list[bytes], body: bytes) -> bytes:
    topic, msgid, tag, keys, props = fields
    tail = struct.pack("<HHQqqqBBHHII", flags, qid, qoff, born, stored, deliver, len(topic), len(msgid), len(tag),
                       len(keys), len(props), len(body)) + topic + msgid + tag + keys + props
    total = record.CRC_START + len(tail) + len(body)
    crc = google_crc32c.value(tail + body)
    return struct.pack("<IBBI", total, record.MAGIC, record.VERSION, crc) + tail + body


_u16 = st.integers(0, 0xFFFF)
_i64 = st.integers(-(1 << 63), (1 << 63) - 1)
_name_bytes = st.binary(min_size=1, max_size=40)

structured_records = st.builds(
    _record_with_crc, _u16, _u16, st.integers(0, (1 << 64) - 1), _i64, _i64, _i64,
    st.tuples(_name_bytes, _name_bytes, st.binary(max_size=20), st.binary(max_size=40), st.binary(max_size=60)),
    st.binary(max_size=200))


def _valid_record(topic: str, body: bytes, props: dict) -> bytes:
    return record.encode(0, 1, 2, 3, 4, 0, topic.encode(), b"ID-1", b"tag", record.encode_keys(("k",)),
                         record.encode_properties(props), body)


# (the encoder asserts that no property holds a separator; the mutations below add any byte)
_NO_SEPARATOR = st.characters(codec="utf-8", exclude_characters="\x01\x02")


@st.composite
def mutated_records(draw):
    data = bytearray(_valid_record(draw(st.text(min_size=1, max_size=20)), draw(st.binary(max_size=100)),
                                   draw(st.dictionaries(st.text(_NO_SEPARATOR, min_size=1, max_size=5),
                                                        st.text(_NO_SEPARATOR, max_size=5), max_size=3))))
    for _ in range(draw(st.integers(1, 4))):
        i = draw(st.integers(0, len(data) - 1))
        data[i] = draw(st.integers(0, 255))
    cut = draw(st.integers(0, len(data)))
    return bytes(data[:cut])


def check_record(data: bytes) -> None:
    try:
        length = record.check(data, 0, len(data))
    except record.RecordError:
        return
    header = record.RecordHeader(data, 0)  # what the dispatcher and recovery read
    fields = record.decode(data, 0)          # what every reader builds a Message from
    assert header.length == length and header.topic == fields["topic"]


@given(st.one_of(st.binary(max_size=300), structured_records, mutated_records()))
@CHUNK
def _fuzz_record(data: bytes) -> None:
    _tick("record")
    check_record(data)


# ------------------------------------------------------------------------------------- POP log
def _poplog_file(generation: int, records: list[tuple[int, bytes]]) -> bytes:
    header = poplog._header(generation, 1_700_000_000_000)
    salt = struct.unpack_from("<I", header, poplog.HEADER_CRC_START)[0]
    body = poplog._record(salt, poplog.T_BATCH, poplog.BATCH.pack(0, poplog.HEADER_SIZE))
    body += b"".join(poplog._record(salt, rtype, payload) for rtype, payload in records)
    return header + body


_pop_records = st.lists(st.one_of(
    st.tuples(st.just(poplog.T_NAME), st.builds(lambda i, raw: poplog.NAME_ID.pack(i) + raw,
                                                st.integers(0, 4), st.binary(min_size=1, max_size=12))),
    st.tuples(st.just(poplog.T_CK), st.builds(
        lambda head, n, entries: head + entries[:n * poplog.CK_ENTRY.size],
        st.builds(lambda *a: poplog.CK_HEAD.pack(*a), st.integers(0, 3), st.integers(0, 4), st.integers(0, 4),
                  st.integers(0, 4), _u16, st.integers(0, 255), st.integers(0, 40), _i64, _i64, _i64,
                  st.integers(0, 0xFFFFFFFF)),
        st.integers(1, 4), st.binary(min_size=40, max_size=40))),
    st.tuples(st.just(poplog.T_ACK), st.builds(poplog.ACK.pack, st.integers(0, 3), st.integers(0, 255))),
    st.tuples(st.just(poplog.T_DONE), st.builds(poplog.DONE.pack, st.integers(0, 3))),
    st.tuples(st.just(poplog.T_SEEN), st.builds(
        lambda gid, pid, qid, n, offs: poplog.SEEN_HEAD.pack(gid, pid, qid, n) + offs,
        st.integers(0, 4), st.integers(0, 4), _u16, st.integers(0, 5),
        st.binary(min_size=8, max_size=8).map(lambda b: b * 2))),
    st.tuples(st.integers(0, 9), st.binary(max_size=30)),
), max_size=12)


@st.composite
def poplog_files(draw):
    data = bytearray(_poplog_file(7, draw(_pop_records)))
    for _ in range(draw(st.integers(0, 3))):
        i = draw(st.integers(0, len(data) - 1))
        data[i] ^= 1 << draw(st.integers(0, 7))
    if draw(st.booleans()):
        data = data[:draw(st.integers(0, len(data)))]
    return bytes(data)


def check_poplog(tmp_dir: str, data: bytes) -> None:
    for name in os.listdir(tmp_dir):
        os.unlink(os.path.join(tmp_dir, name))
    with open(os.path.join(tmp_dir, poplog.file_name(7)), "wb") as fh:
        fh.write(data)
    try:
        poplog.load(tmp_dir)
    except errors.CorruptionError:
        pass


# ------------------------------------------------------------------------------------- schedule log
def _sched_entry(kind: int, ident: int, due: int, aux: int, payload: bytes) -> bytes:
    after = struct.pack("<BBHqqq", schedlog.ENTRY_MAGIC, kind, 0, ident, due, aux)
    total = schedlog.ENTRY_HEAD_SIZE + len(payload)
    return struct.pack("<II", total, google_crc32c.value(after + payload)) + after + payload


_sched_entries = st.lists(st.builds(
    _sched_entry, st.integers(0, 5), _i64, _i64, _i64,
    st.one_of(st.just(b""), structured_records, st.binary(min_size=4, max_size=40))), max_size=6)


@st.composite
def sched_files(draw):
    start = 60_000 * draw(st.integers(0, 3))
    data = bytearray(schedlog.encode_header(start, 60_000) + b"".join(draw(_sched_entries)))
    for _ in range(draw(st.integers(0, 3))):
        i = draw(st.integers(0, len(data) - 1))
        data[i] ^= 1 << draw(st.integers(0, 7))
    if draw(st.booleans()):
        data = data[:draw(st.integers(0, len(data)))]
    return start, bytes(data)


def check_schedlog(start: int, data: bytes) -> None:
    try:
        schedlog.check_header(data, start)
    except schedlog.SchedLogError:
        pass
    try:
        schedlog.validate_tail("f.sch", start, data)
    except schedlog.SchedLogError:
        pass
    damage: list = []
    try:
        for _pos, total, kind, _ident, _due, _aux in schedlog.scan("f.sch", start, data, damage):
            assert kind in schedlog.KIND_NAMES and total >= schedlog.ENTRY_HEAD_SIZE
    except schedlog.SchedLogError:
        pass
    schedlog.decode_journal(data, 1)  # never raises: a bad record ends the journal


# ------------------------------------------------------------------------------------- handles
def _pop_handle_with_crc(raw: bytes) -> str:
    return (raw + struct.pack("<I", zlib.crc32(raw))).hex()


def _recall_with_crc(raw: bytes) -> str:
    import base64

    blob = raw + struct.pack("<I", google_crc32c.value(raw))
    return "1" + base64.urlsafe_b64encode(blob).rstrip(b"=").decode()


handles = st.one_of(
    st.text(max_size=60), st.text(alphabet="0123456789abcdefABCDEF", min_size=48, max_size=48),
    st.binary(min_size=20, max_size=20).map(_pop_handle_with_crc),
    st.binary(max_size=60).map(_recall_with_crc), st.binary(max_size=40).map(lambda b: "1" + b.hex()),
    st.builds(lambda raw, t, m: _recall_with_crc(raw + bytes([len(t)]) + t + bytes([len(m)]) + m),
              st.binary(min_size=18, max_size=18), st.binary(max_size=8), st.binary(max_size=8)),
)


def check_handles(text: str) -> None:
    try:
        pop_handle.decode(text)
    except errors.InvalidReceiptHandle:
        pass
    try:
        recall_handle.decode(text)
    except errors.ClientError:
        pass


# ------------------------------------------------------------------------------------- JSON documents
def check_json(tmp_dir: str, data: bytes) -> None:
    path = os.path.join(tmp_dir, "doc.json")
    with open(path, "wb") as fh:
        fh.write(data)
    try:
        fsutil.read_json(path)
    except ValueError:
        pass


def _json_with_crc(body: bytes) -> bytes:
    return f"chronoq-json v1 crc32c={google_crc32c.value(body):08x}\n".encode() + body


# ------------------------------------------------------------------------------------- the harness
@pytest.mark.timeout(int(FUZZ_SECONDS * 2) + 120)
def test_decoders_answer_only_their_own_errors(tmp_path, capsys):
    targets = 6
    budget = max(FUZZ_SECONDS, 0.5) / targets
    pop_dir = tmp_path / "pop"
    pop_dir.mkdir()
    _prepare_cq_store(tmp_path)  # before any drawing: the entries strategy reads its records

    @given(st.one_of(st.binary(max_size=400), poplog_files()))
    @CHUNK
    def fuzz_poplog(data):
        _tick("poplog")
        check_poplog(str(pop_dir), data)

    @given(st.one_of(sched_files(), st.tuples(st.just(0), st.binary(max_size=200))))
    @CHUNK
    def fuzz_schedlog(start_and_data):
        _tick("schedlog")
        check_schedlog(*start_and_data)

    @given(handles)
    @CHUNK
    def fuzz_handles(text):
        _tick("handles")
        check_handles(text)

    @given(st.one_of(st.binary(max_size=200), st.binary(max_size=100).map(_json_with_crc)))
    @CHUNK
    def fuzz_json(data):
        _tick("json")
        check_json(str(tmp_path), data)

    @given(st.integers(0, 7), st.one_of(st.binary(max_size=24 * 12), real_entries()))
    @settings(CHUNK, max_examples=25)  # each input opens a store: small chunks keep the budget
    def fuzz_consume_queue(which, raw):
        _tick("consume queue")
        check_consume_queue(tmp_path, which, raw)

    _run_for("record", budget, _fuzz_record)
    _run_for("poplog", budget, fuzz_poplog)
    _run_for("schedlog", budget, fuzz_schedlog)
    _run_for("handles", budget, fuzz_handles)
    _run_for("json", budget, fuzz_json)
    _run_for("consume queue", budget, fuzz_consume_queue)
    with capsys.disabled():
        print(f"\nfuzz decoders: {sum(counts.values())} inputs in ~{FUZZ_SECONDS:g} s: "
              + ", ".join(f"{k} {v}" for k, v in counts.items()))


# ------------------------------------------------------------------------------------- consume queues
_cq_store: dict = {}
_CQ_SENT = 40


@st.composite
def real_entries(draw):
    """Entries that point at real records of the store (of any queue), in any order, sizes kept
    or bent: what a consume queue damaged in place, or mixed up with another, would hold."""
    from chronoq.store.consumequeue import ENTRY

    records = _cq_store.get("records") or [(0, 100)]
    out = []
    for i in draw(st.lists(st.integers(0, len(records) - 1), max_size=10)):
        phys, size = records[i]
        out.append(ENTRY.pack(phys, size + draw(st.sampled_from((0, 0, 0, 1, -1))), 0, 0))
    return b"".join(out)


def _prepare_cq_store(tmp_path):
    """A store with 40 messages in 4 queues, and a copy of every one of its files."""
    from storekit import fill, open_store

    base = tmp_path / "cq"
    if _cq_store.get("base") != base:
        _cq_store.clear()
        store = open_store(base, segment_bytes=64 * 1024)
        sent = fill(store, _CQ_SENT, topics=("a", "b"), queues=2, seed=3, size=50)
        store.close()
        _cq_store["records"] = [(m["commit_offset"], m["size"]) for m in sent]
        _cq_store["base"] = base
        _cq_store["files"] = {}  # every file of the store, restored before each input
        for root, _dirs, names in os.walk(base):
            for name in names:
                path = os.path.join(root, name)
                _cq_store["files"][path] = open(path, "rb").read()
    return base


def check_consume_queue(tmp_path, which: int, raw: bytes) -> None:
    """Overwrite a consume-queue file of a real store with ``raw``; reading the queue afterwards
    answers messages of that queue, or ``CorruptionError``/``NotFound`` — never another queue's
    messages and never a crash."""
    from storekit import open_store

    base = _prepare_cq_store(tmp_path)
    queue_files = sorted(p for p in _cq_store["files"] if p.endswith(".cq"))
    target = queue_files[which % len(queue_files)]
    for root, _dirs, names in os.walk(base):
        for name in names:
            if os.path.join(root, name) not in _cq_store["files"]:
                os.unlink(os.path.join(root, name))
    for path, original in _cq_store["files"].items():
        with open(path, "wb") as fh:
            fh.write(raw if path == target else original)
    topic, qid = target.split(os.sep)[-3], int(target.split(os.sep)[-2])
    store = open_store(base, segment_bytes=64 * 1024)
    try:
        lo, hi = store.bounds(topic, qid)
        offset = lo
        while offset < hi:
            try:
                messages, nxt = store.read(topic, qid, offset, 7)
            except (errors.CorruptionError, errors.NotFound):
                nxt = offset + 1
            else:
                for m in messages:
                    assert (m.topic, m.queue_id) == (topic, qid)
            assert nxt > offset
            offset = nxt
    finally:
        store.close()


# ------------------------------------------------------------------------------------- regressions
@pytest.mark.parametrize("data", [
    b"",
    b"\x00" * 60,
])
def test_record_regressions(data):
    check_record(data)
