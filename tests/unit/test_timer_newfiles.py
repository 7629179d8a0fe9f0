"""New bucket files made ahead on a worker thread (``chronoq.timer.newfiles``), on real files.

The maker's own thread runs for real; the committer's thread (``sync_side`` then
``files_synced``) is played by hand, and the loop's ``files_made`` is called once the maker's
report (a ``threading.Event`` here, ``call_soon_threadsafe`` under the server) came.
"""

from __future__ import annotations

import os
import threading

from chronoq.core.clock import FakeClock
from chronoq.timer import newfiles, schedlog
from chronoq.timer.schedfiles import ScheduleFiles
from chronoq.timer.schedlog import DISPATCHED
from tests.unit.timerkit import T0, TOPIC, bodies, crash, drain, open_broker

MIN = 60_000
B = (T0 // MIN + 10) * MIN
WAIT_S = 10


def _entry(ident: int) -> bytes:
    return schedlog.encode_entry(DISPATCHED, ident, B + 1, ident + 1)


def _maker(directory: str):
    ev = threading.Event()
    return newfiles.FileMaker(directory, MIN, ev.set), ev


def _take_all(maker, ev, n: int) -> list[int]:
    got: list[int] = []
    while len(got) < n:
        assert ev.wait(WAIT_S), f"the maker reported {got} of {n}"
        ev.clear()
        got += maker.take()
    return got


def test_the_maker_makes_files_holding_a_valid_header_and_leaves_no_temporary_file(tmp_path):
    maker, ev = _maker(str(tmp_path))
    starts = [B + i * MIN for i in range(300)]  # more than one batch
    assert maker.request(starts) == starts
    assert sorted(_take_all(maker, ev, len(starts))) == starts
    maker.close()
    assert sorted(os.listdir(tmp_path)) == sorted(schedlog.file_name(s) for s in starts)
    for start in starts:
        data = schedlog.read_file(os.path.join(tmp_path, schedlog.file_name(start)))
        assert len(data) == schedlog.FILE_HEAD_SIZE
        assert schedlog.check_header(data, start) == MIN
    assert maker.take_unsynced() and maker.files_made == len(starts)


def test_a_file_the_loop_made_first_is_kept_as_it_is(tmp_path):
    path = os.path.join(tmp_path, schedlog.file_name(B))
    with open(path, "wb") as fh:
        fh.write(schedlog.encode_header(B, MIN) + _entry(1))
    maker, ev = _maker(str(tmp_path))
    maker.request([B])
    assert _take_all(maker, ev, 1) == [B]
    maker.close()
    assert schedlog.read_file(path) == schedlog.encode_header(B, MIN) + _entry(1)
    assert os.listdir(tmp_path) == [schedlog.file_name(B)]


def test_leftover_temporary_files_are_deleted_at_start_and_never_read_as_buckets(tmp_path):
    sched = tmp_path / schedlog.SCHEDULE_DIR
    sched.mkdir()
    leftover = sched / newfiles.making_name(B)
    leftover.write_bytes(schedlog.encode_header(B, MIN)[:10])
    assert schedlog.parse_file_name(leftover.name) is None
    (sched / schedlog.file_name(B + MIN)).write_bytes(schedlog.encode_header(B + MIN, MIN))
    ScheduleFiles(str(tmp_path), MIN).close()
    assert os.listdir(sched) == [schedlog.file_name(B + MIN)]


def test_a_forgotten_start_is_never_linked_after_the_loop_deleted_it(tmp_path):
    maker, ev = _maker(str(tmp_path))
    starts = [B + i * MIN for i in range(200)]
    maker.request(starts)
    for start in starts:  # as ScheduleFiles.remove: forget, then unlink
        maker.forget(start)
        try:
            os.unlink(os.path.join(tmp_path, schedlog.file_name(start)))
        except FileNotFoundError:
            pass
    maker.close()
    assert os.listdir(tmp_path) == []


def _defer_files(tmp_path):
    files = ScheduleFiles(str(tmp_path), MIN)
    files.defer = True
    ev = threading.Event()
    files.attach_maker(ev.set)
    return files, ev


def _made(files, ev) -> list[int]:
    assert ev.wait(WAIT_S)
    ev.clear()
    return files.take_made()


def test_a_start_being_made_keeps_its_buffer_until_made_and_journaled(tmp_path):
    files, ev = _defer_files(tmp_path)
    path = files.path(B)
    assert files.write([(B, [_entry(1)])]) == [B]  # journal record not durable, file being made
    assert B in files.making
    files.sync_side()
    ready, exc = files.take_synced()
    assert exc is None and ready == []  # durable now, but still being made: take_made hands it over
    assert files.write([(B, [_entry(1)])]) == [B]
    assert _made(files, ev) == [B]
    assert files.write([(B, [_entry(1)])]) == []
    files.close()
    assert schedlog.read_file(path) == schedlog.encode_header(B, MIN) + _entry(1)


def test_a_start_made_before_its_journal_record_is_durable_comes_back_through_take_synced(tmp_path):
    files, ev = _defer_files(tmp_path)
    assert files.write([(B, [_entry(1)])]) == [B]
    assert _made(files, ev) == []  # made, but the record is not durable yet
    assert B not in files.making and os.path.exists(files.path(B))
    files.sync_side()
    ready, exc = files.take_synced()
    assert exc is None and ready == [B]
    assert files.write([(B, [_entry(1)])]) == []
    files.close()
    assert schedlog.read_file(files.path(B)) == schedlog.encode_header(B, MIN) + _entry(1)


def test_a_write_that_must_happen_now_creates_the_file_inline(tmp_path):
    files, ev = _defer_files(tmp_path)
    assert files.write([(B, [_entry(1)])]) == [B]
    assert files.write([(B, [_entry(2)])], here=True) == []  # the journal's fsync and the create here
    assert B not in files.making
    assert schedlog.read_file(files.path(B)) == schedlog.encode_header(B, MIN) + _entry(2)
    assert files.write([(B + MIN, [_entry(3)])], here=True) == []  # new start: never handed over
    assert schedlog.read_file(files.path(B + MIN)) == schedlog.encode_header(B + MIN, MIN) + _entry(3)
    assert ev.wait(WAIT_S)
    assert files.take_made() == []  # the maker's report of B comes after the loop made it
    files.sync()  # (the checkpoint's: the made files too)
    files.close()
    assert schedlog.read_file(files.path(B)) == schedlog.encode_header(B, MIN) + _entry(2)


def test_a_header_only_file_is_journaled_at_length_0_and_cut_to_0_by_a_roll_back(tmp_path):
    files, ev = _defer_files(tmp_path)
    files.write([(B, [_entry(1)])])
    _made(files, ev)
    files.new_generation(1)  # a checkpoint came between the make and the first write
    files.write([(B, [_entry(1)])], here=True)
    files.abandon()
    again = ScheduleFiles(str(tmp_path), MIN)
    again.generation = 1
    cut, journaled = again.roll_back()
    assert (cut, journaled) == (schedlog.FILE_HEAD_SIZE + len(_entry(1)), 1)
    assert os.path.getsize(again.path(B)) == 0
    assert again.entries(B) == b""
    again.write([(B, [_entry(2)])])  # (embedded: the header comes back first)
    assert schedlog.read_file(again.path(B)) == schedlog.encode_header(B, MIN) + _entry(2)
    again.close()


def _open(path, clock):
    b = open_broker(path, clock, flush_policy="async", timer_prewrite_ms=0)
    if b.topics.get(TOPIC) is None:
        b.create_topic(TOPIC, 1)
    return b


def _attach(b) -> threading.Event:
    ev = threading.Event()
    b.timer.attach_files_syncer(lambda: None, made=ev.set)  # the committer's thread: _side_sync
    return ev


def _side_sync(b) -> None:
    b.timer.files.sync_side()
    b.timer.files_synced()


def _load(b, n: int) -> list[bytes]:
    sent = []
    for i in range(n):  # one message per bucket, none of which has a file
        body = b"m%d" % i
        b.send(TOPIC, body, deliver_at_ms=B + i * MIN + 7)
        sent.append(body)
    b.flush()
    b.timer.absorb_dispatched()
    return sent


def test_the_service_writes_the_buffers_of_made_files_once_told(tmp_path):
    clock = FakeClock(T0)
    b = _open(tmp_path, clock)
    ev = _attach(b)
    sent = _load(b, 40)
    starts = sorted(b.timer._buffered_starts)
    assert len(starts) == 40
    b.timer._flush_buffers()
    assert sorted(b.timer._buffered_starts) == starts  # every buffer kept: records and files on the way
    _side_sync(b)
    deadline = 0
    while b.timer._buffered_starts and deadline < 100:
        assert ev.wait(WAIT_S)
        ev.clear()
        b.timer.files_made()
        deadline += 1
    assert not b.timer._buffered_starts and b.timer._buffered == 0
    for start in starts:
        assert len(schedlog.read_file(b.timer.files.path(start))) > schedlog.FILE_HEAD_SIZE
    crash(b)  # nothing checkpointed: the roll-back cuts every new file to 0 bytes, the replay refills them
    b = _open(tmp_path, clock)
    clock.set(B + 41 * MIN)
    drain(b)
    assert bodies(b) == sorted(sent)
    b.close()


def test_a_kill_9_while_files_are_being_made_loses_nothing_and_delivers_once(tmp_path):
    clock = FakeClock(T0)
    b = _open(tmp_path, clock)
    _attach(b)
    sent = _load(b, 60)
    b.timer._flush_buffers()  # files requested, records written: the kill lands while they are made
    _side_sync(b)
    crash(b)  # (its maker's batch is finished first: the subprocess crash test kills mid-make)
    b = _open(tmp_path, clock)
    assert not [n for n in os.listdir(b.timer.sched_dir) if n.endswith(newfiles.MAKING_SUFFIX)]
    _attach(b)
    b.timer.checkpoint()  # (inline: a checkpoint must not wait for the maker)
    clock.set(B + 61 * MIN)
    drain(b)
    assert bodies(b) == sorted(sent)
    b.close()
    b = _open(tmp_path, clock)
    assert bodies(b) == sorted(sent)
    b.close()


def test_header_only_and_empty_bucket_files_left_by_a_crash_are_empty_buckets_at_start(tmp_path):
    clock = FakeClock(T0)
    b = _open(tmp_path, clock)
    sent = _load(b, 3)
    b.timer.checkpoint()
    sched = b.timer.sched_dir
    crash(b)
    with open(os.path.join(sched, schedlog.file_name(B + 5 * MIN)), "wb") as fh:  # made, never written
        fh.write(schedlog.encode_header(B + 5 * MIN, MIN))
    open(os.path.join(sched, schedlog.file_name(B + 6 * MIN)), "wb").close()  # cut back to 0 bytes
    with open(os.path.join(sched, newfiles.making_name(B + 7 * MIN)), "wb") as fh:  # killed mid-make
        fh.write(schedlog.encode_header(B + 7 * MIN, MIN)[:5])
    b = _open(tmp_path, clock)
    assert sorted(os.listdir(sched)) == sorted(schedlog.file_name(B + i * MIN) for i in (0, 1, 2, 5, 6))
    clock.set(B + 8 * MIN)
    drain(b)
    b.maintenance()
    assert bodies(b) == sorted(sent) and not b.timer.damage
    assert os.listdir(sched) == []  # every bucket finished, the empty ones too
    b.close()
