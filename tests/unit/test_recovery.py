"""One test (or one group) per row of the recovery decision table in ``chronoq/store/recovery.py``.

A "crash" is ``storekit.crash``: the store's file descriptors are closed and nothing else happens
(no dispatch, no checkpoint), which is what a killed process leaves behind. Damage is made by hand
on the files afterwards. Every store uses a ``FakeClock``.
"""

from __future__ import annotations

import os
import shutil

import pytest
from storekit import (
    SMALL_SEGMENT,
    crash,
    fill,
    data_end,
    flip_bit,
    log_bytes,
    open_store,
    queue_snapshot,
    raw_files,
    read_all,
    record_positions,
    segments,
)

from chronoq.core import errors, fsutil
from chronoq.store import record, recovery
from chronoq.store.commitlog import LostRange
from chronoq.store.store import CHECKPOINT_FILE

OPTS = {"segment_bytes": SMALL_SEGMENT, "cq_entries_per_file": 16}


def expected(sent, gone=()) -> dict:
    gone = set(gone)
    return {(s["topic"], s["queue_id"], s["queue_offset"]): (s["id"], s["commit_offset"], s["body"])
            for s in sent if s["id"] not in gone}


def by_offset(sent) -> dict:
    return {s["commit_offset"]: s for s in sent}


def assert_dense_and_consistent(store) -> None:
    """Every entry of every queue names a valid record of that queue at that queue offset."""
    for (topic, qid), cq in store.queues.items():
        for n in range(cq.min_offset, cq.next_offset):
            ((phys, size, _tag, _t),) = store.entries(topic, qid, n, 1)
            if phys < store.log.min_offset or store.log.is_lost(phys):
                continue
            if size == 0:  # a hole: only where records were quarantined
                assert store.log.lost, (topic, qid, n)
                continue
            h = record.RecordHeader(store.log.read_record(phys, size), 0)
            assert (h.topic, h.queue_id, h.queue_offset) == (topic, qid, n)


def reopen(path, **extra):
    return open_store(path, **{**OPTS, **extra})


def checkpoint_doc(path) -> dict:
    return fsutil.read_json(os.path.join(str(path), CHECKPOINT_FILE))


# ---------------------------------------------------------------- R1 clean stop
def test_r1_clean_stop_verifies_and_replays_nothing(tmp_path):
    store = reopen(tmp_path)
    sent = fill(store, 200, seed=11)
    store.close()
    assert len(segments(tmp_path)) >= 4
    # Damage an old sealed record after the clean stop: a clean start must not scan for it...
    first_seg = segments(tmp_path)[0]
    pos, length = record_positions(first_seg)[2]
    flip_bit(first_seg, pos + length - 1)
    store = reopen(tmp_path)
    rep = store.report
    assert rep.clean and rep.records_replayed == 0 and not rep.rebuilt_queues
    assert rep.truncated == [] and rep.quarantined == []
    # ...but reading the damaged record fails with a named error instead of returning bad bytes.
    victim = by_offset(sent)[pos]
    with pytest.raises(errors.CorruptionError) as info:
        store.read(victim["topic"], victim["queue_id"], victim["queue_offset"], 1)
    assert info.value.path == first_seg and info.value.offset == pos
    for s in sent:
        if s is not victim:
            (m,), _ = store.read(s["topic"], s["queue_id"], s["queue_offset"], 1)
            assert (m.message_id, m.body) == (s["id"], s["body"])
    store.close()


# ---------------------------------------------------------------- R2 crash, log intact
def test_r2_crash_with_an_intact_log_replays_from_the_checkpoint(tmp_path):
    store = reopen(tmp_path)
    sent = fill(store, 150, seed=12)
    store.checkpoint()
    dispatched = store.log.written
    sent += fill(store, 60, seed=12, start=150)
    crash(store)
    before = log_bytes(tmp_path)
    store = reopen(tmp_path)
    rep = store.report
    assert not rep.clean
    assert rep.truncated == [] and rep.quarantined == [] and not rep.rebuilt_queues
    assert rep.replayed_from == dispatched and rep.records_replayed == 60
    assert rep.log_end == len(before)
    assert log_bytes(tmp_path) == before
    assert read_all(store) == expected(sent)
    assert_dense_and_consistent(store)
    store.close()


# ---------------------------------------------------------------- R3 torn tail
def _crashed_store(tmp_path, count=120, seed=13):
    store = reopen(tmp_path)
    sent = fill(store, count, seed=seed)
    crash(store)
    return sent


@pytest.mark.parametrize("keep", [1, 3, 4, 10, 59, 60, 61, -1])
def test_r3_torn_last_record_is_truncated_and_reported(tmp_path, keep):
    sent = _crashed_store(tmp_path)
    active = segments(tmp_path)[-1]
    base = int(os.path.basename(active)[:20])
    pos, length = record_positions(active)[-1]
    old_size = data_end(active)
    os.truncate(active, pos + (keep if keep > 0 else length + keep))
    last = by_offset(sent)[base + pos]
    store = reopen(tmp_path)
    rep = store.report
    assert not rep.clean
    assert [(lr.start, lr.end, lr.path) for lr in rep.truncated] == [
        (base + pos, base + pos + (keep if keep > 0 else length + keep), active)]
    assert os.path.getsize(active) == pos and old_size == pos + length
    assert read_all(store) == expected(sent, gone=[last["id"]])
    # The cut message's queue slot is free again, and the next write reuses it in place.
    assert store.bounds(last["topic"], last["queue_id"])[1] == last["queue_offset"]
    assert_dense_and_consistent(store)
    store.close()


@pytest.mark.parametrize("zeros", [1, 24, 60, 4096, 10_000])
def test_r3_partial_record_then_zero_filled_tail_is_truncated_and_reported(tmp_path, zeros):
    """A record torn after a few bytes, followed by zeros (space allocated but never written)."""
    sent = _crashed_store(tmp_path)
    active = segments(tmp_path)[-1]
    base = int(os.path.basename(active)[:20])
    pos, _length = record_positions(active)[-1]
    os.truncate(active, pos + 17)
    with open(active, "ab") as fh:
        fh.write(bytes(zeros))
    size = os.path.getsize(active)
    store = reopen(tmp_path)
    assert [(lr.start, lr.end) for lr in store.report.truncated] == [(base + pos, base + size)]
    assert os.path.getsize(active) == pos
    assert read_all(store) == expected(sent, gone=[by_offset(sent)[base + pos]["id"]])
    store.close()


@pytest.mark.parametrize("zeros", [1, 24, 60, 4096, 10_000])
def test_r0_zero_tail_at_a_record_boundary_is_free_space(tmp_path, zeros):
    """Row R0: zeros from a record boundary to the end are preallocated space, cut silently."""
    sent = _crashed_store(tmp_path)
    active = segments(tmp_path)[-1]
    end = data_end(active)
    with open(active, "ab") as fh:
        fh.write(bytes(zeros))
    store = reopen(tmp_path)
    assert store.report.truncated == [] and store.report.quarantined == []
    assert os.path.getsize(active) == end
    assert read_all(store) == expected(sent)
    store.close()


# ---------------------------------------------------------------- R4 bit flip in the active tail
@pytest.mark.parametrize("where", ["length", "crc", "topic", "body", "last-byte"])
def test_r4_bit_flip_in_the_last_record_is_truncated_and_reported(tmp_path, where):
    sent = _crashed_store(tmp_path, seed=14)
    active = segments(tmp_path)[-1]
    base = int(os.path.basename(active)[:20])
    pos, length = record_positions(active)[-1]
    at = {"length": 1, "crc": 7, "topic": record.HEADER_SIZE, "body": length - 20,
          "last-byte": length - 1}[where]
    flip_bit(active, pos + at, 3)
    victim = by_offset(sent)[base + pos]
    size = os.path.getsize(active)  # the crashed segment still has its preallocated zero tail
    assert size >= pos + length
    store = reopen(tmp_path)
    (lost,) = store.report.truncated
    assert (lost.start, lost.end, lost.path) == (base + pos, base + size, active)
    assert lost.reason
    assert store.report.quarantined == []
    assert os.path.getsize(active) == pos
    assert read_all(store) == expected(sent, gone=[victim["id"]])
    assert "truncated torn tail" in store.report.summary()
    store.close()


# ---------------------------------------------------------------- R5 damage mid active segment
def _damage_mid_active(tmp_path, seed=15):
    store = reopen(tmp_path)
    sent = fill(store, 200, seed=seed)
    store.checkpoint()
    sent += fill(store, 30, seed=seed, start=200)
    # A batch is one append, never split over segments: the active one may begin with the last.
    while len(record_positions(segments(tmp_path)[-1])) < 4:
        sent += fill(store, 7, seed=seed, start=200 + len(sent))
    crash(store)
    active = segments(tmp_path)[-1]
    base = int(os.path.basename(active)[:20])
    recs = record_positions(active)
    assert len(recs) >= 4, "the active segment needs records after the damaged one"
    pos, length = recs[len(recs) // 2]
    flip_bit(active, pos + length // 2, 5)
    return sent, active, base, pos, length


def test_r5_damage_in_the_middle_of_the_active_segment_is_fatal(tmp_path):
    sent, active, base, pos, length = _damage_mid_active(tmp_path)
    before = raw_files(tmp_path)
    with pytest.raises(errors.CorruptionError) as info:
        reopen(tmp_path)
    err = info.value
    assert (err.path, err.offset) == (active, pos)
    assert active in str(err) and str(pos) in str(err) and "--quarantine" in str(err)
    assert raw_files(tmp_path) == before, "the middle of the log must never be truncated"


def test_r5_with_quarantine_starts_reports_and_keeps_later_records(tmp_path):
    sent, active, base, pos, length = _damage_mid_active(tmp_path)
    damaged = open(active, "rb").read()[pos:pos + length]
    victim = by_offset(sent)[base + pos]
    store = reopen(tmp_path, quarantine=True)
    rep = store.report
    assert rep.truncated == []
    assert [(lr.start, lr.end, lr.path) for lr in rep.quarantined] == [(base + pos, base + pos + length, active)]
    assert "quarantined" in rep.summary()
    qdir = tmp_path / "quarantine"
    (dump,) = os.listdir(qdir)
    assert (qdir / dump).read_bytes() == damaged
    assert read_all(store) == expected(sent, gone=[victim["id"]])
    assert_dense_and_consistent(store)
    # New writes go on after the end; the lost range stays known across a crash and a restart.
    more = fill(store, 10, seed=99)
    crash(store)
    store = reopen(tmp_path)  # quarantine not needed any more: the range is recorded in lost.json
    assert store.log.lost == [LostRange(base + pos, base + pos + length, active, rep.quarantined[0].reason)]
    assert read_all(store) == expected(sent + more, gone=[victim["id"]])
    store.close()


def test_r5_quarantine_then_queue_rebuild_skips_the_hole(tmp_path):
    """A quarantined record has no consume-queue entry after a rebuild: reads skip the gap."""
    sent, active, base, pos, length = _damage_mid_active(tmp_path)
    victim = by_offset(sent)[base + pos]
    shutil.rmtree(tmp_path / "consumequeue")
    os.unlink(tmp_path / CHECKPOINT_FILE)
    store = reopen(tmp_path, quarantine=True)
    assert len(store.report.quarantined) == 1
    assert read_all(store) == expected(sent, gone=[victim["id"]])
    store.close()


# ---------------------------------------------------------------- R6 damage in a sealed segment
WIDE = 2  # scan from the start of the segment before the one holding the checkpoint


def test_default_scan_starts_at_the_checkpoint_offset(tmp_path):
    """Below the checkpoint everything was fsynced: by default the scan does not re-read it."""
    sent, segs = _sealed_setup(tmp_path)
    dispatched = checkpoint_doc(tmp_path)["dispatched"]
    assert dispatched > int(os.path.basename(segs[-1])[:20])  # inside the active segment
    store = reopen(tmp_path)
    assert store.report.verified_from == dispatched
    assert read_all(store) == expected(sent)
    store.close()
    store = reopen(tmp_path)
    crash(store)
    store = reopen(tmp_path, verify_extra_segments=1)
    assert store.report.verified_from == int(os.path.basename(segs[-1])[:20])
    store.close()


def _sealed_setup(tmp_path, seed=16):
    store = reopen(tmp_path)
    sent = fill(store, 250, seed=seed)
    store.checkpoint()  # with verify_extra_segments=2 the scan covers [penultimate segment, end)
    sent += fill(store, 5, seed=seed, start=250)
    crash(store)
    segs = segments(tmp_path)
    assert len(segs) >= 4
    return sent, segs


@pytest.mark.parametrize("which", ["middle", "last"])
def test_r6_damage_in_a_sealed_segment_is_fatal(tmp_path, which):
    sent, segs = _sealed_setup(tmp_path)
    sealed = segs[-2]
    recs = record_positions(sealed)
    # Even the sealed segment's *last* record is not a torn tail: only the active one may be cut.
    pos, length = recs[len(recs) // 2] if which == "middle" else recs[-1]
    flip_bit(sealed, pos + length - 2, 1)
    before = raw_files(tmp_path)
    with pytest.raises(errors.CorruptionError) as info:
        reopen(tmp_path, verify_extra_segments=WIDE)
    assert (info.value.path, info.value.offset) == (sealed, pos)
    assert raw_files(tmp_path) == before


def test_r6_with_quarantine_starts_and_reports(tmp_path):
    sent, segs = _sealed_setup(tmp_path)
    sealed = segs[-2]
    base = int(os.path.basename(sealed)[:20])
    pos, length = record_positions(sealed)[-1]
    flip_bit(sealed, pos + 70)
    store = reopen(tmp_path, quarantine=True, verify_extra_segments=WIDE)
    assert [(lr.start, lr.end, lr.path) for lr in store.report.quarantined] == [
        (base + pos, base + pos + length, sealed)]
    assert store.report.truncated == []
    assert read_all(store) == expected(sent, gone=[by_offset(sent)[base + pos]["id"]])
    store.close()


def test_r6_old_sealed_segment_damage_is_caught_when_read(tmp_path):
    """Segments before the verify window are checked on read, with the same named error."""
    sent, segs = _sealed_setup(tmp_path)
    old = segs[0]
    pos, length = record_positions(old)[1]
    flip_bit(old, pos + length - 1)
    store = reopen(tmp_path)
    assert store.report.verified_from > 0
    victim = by_offset(sent)[pos]
    with pytest.raises(errors.CorruptionError) as info:
        store.read(victim["topic"], victim["queue_id"], victim["queue_offset"], 5)
    assert (info.value.path, info.value.offset) == (old, pos)
    store.close()


def test_r6_old_sealed_damage_during_a_full_rebuild_is_a_named_error(tmp_path):
    """A rebuild (here R8) replays segments the start-up scan did not verify: still named."""
    sent, segs = _sealed_setup(tmp_path)
    old = segs[0]
    pos, length = record_positions(old)[1]
    flip_bit(old, pos + length - 1)
    shutil.rmtree(tmp_path / "consumequeue")
    with pytest.raises(errors.CorruptionError) as info:
        reopen(tmp_path)
    assert (info.value.path, info.value.offset) == (old, pos)


@pytest.mark.parametrize("chunk", [100, 2500, 7001])
def test_a_rebuild_reads_the_log_in_chunks_whatever_their_size(tmp_path, monkeypatch, chunk):
    """The replay reads the log in chunks (``recovery.READ_CHUNK``): records across a chunk's
    end, and records larger than a chunk (100 bytes: every one), come whole; damage found in
    a record read across chunks is the same named error at the record's own offset."""
    store = reopen(tmp_path)
    sent = fill(store, 200, seed=19)
    store.close()
    store = reopen(tmp_path)
    reads, snap = read_all(store), queue_snapshot(store)
    crash(store)
    (tmp_path / CHECKPOINT_FILE).unlink()
    monkeypatch.setattr(recovery, "READ_CHUNK", chunk)
    store = reopen(tmp_path)
    assert store.report.records_replayed == len(sent)
    assert read_all(store) == reads and queue_snapshot(store) == snap
    store.checkpoint()  # the start-up scan then covers the last segments only (verify_extra_segments)
    crash(store)
    old = segments(tmp_path)[0]
    assert len(segments(tmp_path)) >= 4
    positions = record_positions(old)
    pos, length = next((p, n) for p, n in positions if p < chunk < p + n)  # across the first chunk's end
    for byte, what in ((pos + length - 1, "CRC mismatch"), (pos + 2, "do not add up"),  # the body, the length
                       (pos + 3, "out of range")):
        flip_bit(old, byte, 7)
        shutil.rmtree(tmp_path / "consumequeue", ignore_errors=True)  # R8: the whole log replayed
        with pytest.raises(errors.CorruptionError, match=what) as info:
            reopen(tmp_path)
        assert (info.value.path, info.value.offset) == (old, pos)
        flip_bit(old, byte, 7)


# ---------------------------------------------------------------- R7 checkpoint missing/unreadable
@pytest.mark.parametrize("damage", ["truncate", "garble", "delete", "version"])
@pytest.mark.parametrize("queues_too", [False, True])
def test_r7_bad_checkpoint_rebuilds_every_queue_from_the_log(tmp_path, damage, queues_too):
    store = reopen(tmp_path)
    sent = fill(store, 200, seed=17)
    store.close()
    store = reopen(tmp_path)
    reads, snap = read_all(store), queue_snapshot(store)
    assert reads == expected(sent)
    crash(store)
    path = tmp_path / CHECKPOINT_FILE
    raw = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(raw[: len(raw) // 2])
    elif damage == "garble":
        path.write_bytes(raw[:20] + b"\xff" * 10 + raw[30:])
    elif damage == "delete":
        path.unlink()
    else:
        doc = fsutil.read_json(str(path))
        fsutil.write_json(str(path), {**doc, "version": 99})
    if queues_too:
        shutil.rmtree(tmp_path / "consumequeue")
    store = reopen(tmp_path)
    rep = store.report
    assert not rep.clean and rep.rebuilt_queues
    assert rep.replayed_from == 0 and rep.records_replayed == len(sent)
    assert rep.verified_from == 0
    assert any("checkpoint" in note for note in rep.notes)
    assert read_all(store) == reads
    assert queue_snapshot(store) == snap
    store.close()


# ---------------------------------------------------------------- R8 consume queue missing/short
@pytest.mark.parametrize("damage", ["queue-dir", "only-file", "last-file", "middle-file", "first-file", "short-file"])
def test_r8_missing_consume_queue_is_rebuilt_byte_identical(tmp_path, damage):
    store = reopen(tmp_path, cq_entries_per_file=8)
    sent = fill(store, 200, seed=18, topics=("a",), queues=1 if damage != "only-file" else 40)
    store.close()
    store = reopen(tmp_path, cq_entries_per_file=8)
    reads, snap = read_all(store), queue_snapshot(store)
    store.close()
    qdir = tmp_path / "consumequeue" / "a" / "0"
    files = sorted(qdir.iterdir())
    if damage == "queue-dir":
        shutil.rmtree(qdir)
    elif damage == "only-file":
        assert len(files) == 1
        files[0].unlink()
    elif damage == "last-file":
        files[-1].unlink()
    elif damage == "middle-file":
        assert len(files) >= 3
        files[len(files) // 2].unlink()
    elif damage == "first-file":
        files[0].unlink()
    else:
        os.truncate(files[1], 24 * 3)
    store = reopen(tmp_path, cq_entries_per_file=8)
    assert store.report.rebuilt_queues
    assert any("consume queue" in n for n in store.report.notes)
    assert queue_snapshot(store) == snap
    assert read_all(store) == reads == expected(sent)
    store.close()


# ---------------------------------------------------------------- R9 entries past the log end
def test_r9_consume_queue_entries_past_the_log_end_are_cut(tmp_path):
    store = reopen(tmp_path)
    sent = fill(store, 100, seed=19)
    store.checkpoint()
    dispatched = store.log.written
    sent += fill(store, 60, seed=19, start=100)
    crash(store)
    # Lose the last 25 records by hand, at a record boundary (no torn tail), above the checkpoint.
    ordered = sorted(sent, key=lambda s: s["commit_offset"])
    keep, gone = ordered[:-25], ordered[-25:]
    cut = gone[0]["commit_offset"]
    assert cut > dispatched
    segs = segments(tmp_path)
    for seg in segs:
        base = int(os.path.basename(seg)[:20])
        if base >= cut and seg != segs[0]:
            os.unlink(seg)
    last = segments(tmp_path)[-1]
    os.truncate(last, cut - int(os.path.basename(last)[:20]))
    store = reopen(tmp_path)
    rep = store.report
    assert rep.truncated == [] and rep.log_end == cut
    assert rep.replayed_from == dispatched and not rep.rebuilt_queues
    assert read_all(store) == expected(keep)
    for (topic, qid), cq in store.queues.items():
        want = sum(1 for s in keep if (s["topic"], s["queue_id"]) == (topic, qid))
        assert (cq.min_offset, cq.next_offset) == (0, want)
    assert_dense_and_consistent(store)
    # The freed queue offsets are reused densely by new writes.
    more = fill(store, 30, seed=20)
    crash(store)
    store = reopen(tmp_path)
    assert read_all(store) == expected(keep + more)
    assert_dense_and_consistent(store)
    store.close()


# ---------------------------------------------------------------- R10 checkpoint past the log end
def test_r10_checkpoint_past_the_log_end_rebuilds_everything(tmp_path):
    store = reopen(tmp_path)
    sent = fill(store, 120, seed=21, batch=1)  # appends of one record: any record boundary ends one
    store.checkpoint()
    assert checkpoint_doc(tmp_path)["dispatched"] == store.log.written
    crash(store)
    ordered = sorted(sent, key=lambda s: s["commit_offset"])
    keep = ordered[:-3]
    cut = ordered[-3]["commit_offset"]
    last = segments(tmp_path)[-1]
    base = int(os.path.basename(last)[:20])
    assert cut > base, "the lost records must sit in the active segment"
    os.truncate(last, cut - base)
    store = reopen(tmp_path)
    rep = store.report
    assert rep.rebuilt_queues and rep.replayed_from == 0 and rep.records_replayed == len(keep)
    assert any("past the log end" in n for n in rep.notes)
    assert read_all(store) == expected(keep)
    assert_dense_and_consistent(store)
    store.close()


def test_r8_retention_is_not_mistaken_for_lost_queue_files(tmp_path):
    """Retention deletes old consume-queue files too; recovery must not take that for damage."""
    store = reopen(tmp_path)
    sent = fill(store, 250, seed=22)
    store.checkpoint()  # records every queue's start (0) before retention moves it
    deleted = store.retention(None, 1)  # over any size limit: every sealed segment below the floor goes
    assert deleted
    assert any(cq.min_offset > 0 for cq in store.queues.values())
    bounds = {k: store.bounds(*k) for k in store.queues}
    survivors = {k: v for k, v in expected(sent).items() if v[1] >= store.log.min_offset}
    crash(store)
    store = reopen(tmp_path)
    assert not store.report.rebuilt_queues, store.report.notes
    assert {k: store.bounds(*k) for k in store.queues} == bounds
    got = read_all(store)
    assert got == {k: v for k, v in survivors.items() if k in got}
    assert set(survivors) <= set(got)
    store.close()
