"""chronoq.broker.dedupe: the compact dedupe window against a plain model (Hypothesis state machine), and
the broker's rule that a hash collision is another message, never a duplicate."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from chronoq.core import errors
from chronoq.broker.broker import Broker, OutgoingBatch, OutgoingMessage
from chronoq.core.clock import FakeClock
from chronoq.core.config import BrokerConfig
from chronoq.broker.dedupe import DedupeWindow

NOW_MS = 1_750_000_123_456
TOPICS = ("t1", "t2")
IDS = tuple("abcdefgh")

# Key hashes the machine runs with: Python's own, and forced collisions (few distinct values,
# negative ones, all the same), so chains grow long and different keys share them.
HASHES = {
    "builtin": None,
    "mod3": lambda t, m: (ord(m) + len(t)) % 3,
    "negative": lambda t, m: -(1 << 62) - ord(m) % 2,
    "constant": lambda t, m: 7,
}


class WindowMachine(RuleBasedStateMachine):
    """The model: a dict seq -> (hash, commit offset, stored ms) of the live entries, and the
    seq of the oldest; the window must answer every question as the model does."""

    @initialize(max_entries=st.integers(0, 9), window_ms=st.integers(0, 50), hashing=st.sampled_from(sorted(HASHES)))
    def start(self, max_entries, window_ms, hashing):
        self.window = DedupeWindow(max_entries, window_ms, key_hash=HASHES[hashing])
        self.max_entries, self.window_ms = max_entries, window_ms
        self.live: dict[int, tuple[int, int, int]] = {}
        self.tail = self.head = 0
        self.now = 1_000
        self.commit = 0

    def _hash(self, topic, mid):
        return self.window.hash_key(topic, mid)

    @rule(keys=st.lists(st.tuples(st.sampled_from(TOPICS), st.sampled_from(IDS)), max_size=25))
    def add(self, keys):
        hs = self.window.hash_keys([t for t, _ in keys], [m for _, m in keys])
        assert hs == [self._hash(t, m) for t, m in keys]
        commits = list(range(self.commit, self.commit + len(keys)))
        self.commit += len(keys)
        self.window.add(hs, commits, self.now)
        for h, c in zip(hs, commits):
            self.live[self.head] = (h, c, self.now)
            self.head += 1
        while self.head - self.tail > self.max_entries:  # the count bound: oldest first
            self.live.pop(self.tail, None)
            self.tail += 1

    @rule(ms=st.integers(-5, 40))
    def advance(self, ms):  # (the wall clock may step back a little)
        self.now += ms

    @rule(step=st.integers(0, 12))
    def expire(self, step):
        done = 0
        while done < step and self.tail < self.head and self.live[self.tail][2] < self.now - self.window_ms:
            del self.live[self.tail]
            self.tail += 1
            done += 1
        assert self.window.expire(self.now, step) == done

    @rule(topic=st.sampled_from(TOPICS), mid=st.sampled_from(IDS))
    def lookup(self, topic, mid):
        h = self._hash(topic, mid)
        expected = [c for seq, (eh, c, stored) in sorted(self.live.items(), reverse=True)
                    if eh == h and stored >= self.now - self.window_ms]
        assert self.window.candidates(h, self.now) == expected

    @rule(keys=st.lists(st.tuples(st.sampled_from(TOPICS), st.sampled_from(IDS)), max_size=12),
          others=st.lists(st.integers(-(1 << 63), (1 << 63) - 1), max_size=3))
    def bulk(self, keys, others):
        hs = self.window.hash_keys([t for t, _ in keys], [m for _, m in keys]) + others
        stored = {eh for eh, _c, _s in self.live.values()}
        assert self.window.any_present(hs) == any(h in stored for h in hs)

    @invariant()
    def same_entries(self):
        if not hasattr(self, "window"):
            return
        assert len(self.window) == len(self.live)
        assert list(self.window.items()) == [self.live[s] for s in sorted(self.live)]
        self.window.check()


WindowMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestWindowMachine = WindowMachine.TestCase


def test_ring_wraps_many_times_and_keeps_the_newest():
    w = DedupeWindow(5, 1_000)
    for i in range(23):  # batches of 3 across 4 and a half turns of the ring
        w.add([i * 3, i * 3 + 1, i * 3 + 2], [i * 30, i * 30 + 10, i * 30 + 20], NOW_MS)
        w.check()
    assert [c for _h, c, _s in w.items()] == [640, 650, 660, 670, 680]
    assert w.candidates(67, NOW_MS) == [670] and w.candidates(60, NOW_MS) == []
    w.add(list(range(100, 112)), list(range(12)), NOW_MS)  # a batch longer than the ring
    assert [h for h, _c, _s in w.items()] == list(range(107, 112))
    w.check()


def test_negative_and_64_bit_hashes_take_pythons_cells():
    """The cell is ``hash % (2M)`` as Python computes it (never negative), on both builds: the
    compiled one does this in C, where ``%`` of a negative number is negative."""
    w = DedupeWindow(5, 1_000)  # 10 cells
    low, high = -(1 << 63), (1 << 63) - 1  # Python: cells 2 and 7; -3 is in cell 7 as well
    w.add([low, high, -3, 7, 3], [10, 20, 30, 40, 50], NOW_MS)
    w.check()  # (each entry on the chain of its Python cell)
    # Cell 7's chain holds 7, -3 and high, newest first: each lookup walks past the others.
    assert w.candidates(-3, NOW_MS) == [30] and w.candidates(high, NOW_MS) == [20]
    assert w.candidates(7, NOW_MS) == [40] and w.candidates(3, NOW_MS) == [50] and w.candidates(low, NOW_MS) == [10]
    assert w.candidates(-7, NOW_MS) == [] and w.candidates(-8, NOW_MS) == []  # (cells 3 and 2, other hashes)
    assert w.any_present([-7, -8, 0, -1, 17]) is False and w.any_present([0, high]) is True
    assert w.any_present([low + 10]) is False and w.any_present([low]) is True
    assert list(w.items()) == [(low, 10, NOW_MS), (high, 20, NOW_MS), (-3, 30, NOW_MS), (7, 40, NOW_MS),
                               (3, 50, NOW_MS)]


def test_max_entries_zero_remembers_nothing():
    w = DedupeWindow(0, 1_000)
    w.add([1, 2], [10, 20], NOW_MS)
    assert len(w) == 0 and w.candidates(1, NOW_MS) == [] and not w.any_present([1, 2])
    assert w.expire(NOW_MS + 5_000, 10) == 0


# ----------------------------------------------------------------------------- in the broker
def collide(b: Broker) -> None:
    """Every key of this broker's window hashes alike: each lookup meets the other keys."""
    b._dedupe = DedupeWindow(b.config.dedupe_max_entries, b.config.dedupe_window_ms, key_hash=lambda t, m: 42)


@pytest.fixture
def broker(tmp_path):
    b = Broker(BrokerConfig(data_dir=str(tmp_path), segment_bytes=64 * 1024), clock=FakeClock(NOW_MS))
    b.create_topic("orders", 2)
    b.create_topic("events", 1)
    collide(b)
    yield b
    b.close()


def test_a_hash_collision_is_another_message_not_a_duplicate(broker):
    first = broker.send("orders", b"same body", message_id="id-1")
    other = broker.send("orders", b"same body", message_id="id-2")  # same hash, same body: not a resend
    assert not other.duplicate and other.commit_offset != first.commit_offset
    elsewhere = broker.send("events", b"same body", message_id="id-1")  # same id, another topic
    assert not elsewhere.duplicate
    # A real resend is still found, past the colliding entries on its chain.
    again = broker.send("orders", b"same body", message_id="id-1")
    assert again.duplicate and (again.queue_id, again.queue_offset, again.commit_offset) == \
        (first.queue_id, first.queue_offset, first.commit_offset)
    with pytest.raises(errors.DuplicateMessageId):
        broker.send("orders", b"another body", message_id="id-2")
    stored = [m.message_id for q in (0, 1) for m in broker.read("orders", q, 0, 100).messages]
    assert sorted(stored) == ["id-1", "id-2"]


def test_a_hash_collision_on_the_columns_path_stores_both(broker):
    broker.send("orders", b"first")  # (no id)
    first = broker.write_batch(OutgoingBatch(["orders"], [b"x"], message_ids=["p-1"]))
    assert first.duplicates is None
    # The bulk test meets p-1's hash: the batch is answered message by message, reading p-1's record.
    second = broker.write_batch(OutgoingBatch(["orders"], [b"x"], message_ids=["p-2"]))
    assert second.duplicates is None and second.commit_offsets != first.commit_offsets
    (result,) = broker.send_batch([OutgoingMessage("orders", b"x", message_id="p-2")])
    assert result.duplicate  # (and an exact resend is still found past the colliding entry)
    broker.flush()
    stored = [m.message_id for q in (0, 1) for m in broker.read("orders", q, 0, 100).messages]
    assert sorted(stored)[1:] == ["p-1", "p-2"]  # (after the first message's generated id)


def test_resends_answer_what_the_first_send_answered(broker):
    """The answer is rebuilt from the stored record: plain, timer (recall handle), delay level,
    due already, transactional half."""
    sends = [dict(topic="orders", body=b"plain", message_id="m-plain"),
             dict(topic="orders", body=b"later", message_id="m-timer", deliver_at_ms=NOW_MS + 60_000),
             dict(topic="orders", body=b"level", message_id="m-level", delay_level=2),
             dict(topic="orders", body=b"due", message_id="m-due", deliver_at_ms=NOW_MS - 5),
             dict(topic="orders", body=b"fifo", message_id="m-fifo", message_group="g1")]
    firsts = [broker.send(**s) for s in sends]
    half = broker.send_batch([OutgoingMessage("orders", b"half", message_id="m-half")])[0]
    for s, first in zip(sends, firsts):
        again = broker.send(**s)
        assert again.duplicate
        again.duplicate = False
        assert again == first, s["message_id"]
    again = broker.send_batch([OutgoingMessage("orders", b"half", message_id="m-half")])[0]
    assert again.duplicate and again.commit_offset == half.commit_offset


def test_a_record_gone_inside_the_window_makes_the_entry_gone(tmp_path):
    """Retention deleted the segment of the original inside the window: there is no original to
    answer with, so the resend is stored anew (the window used to answer with the lost copy)."""
    cfg = BrokerConfig(data_dir=str(tmp_path), segment_bytes=64 * 1024, retention_max_bytes=64 * 1024)
    with Broker(cfg, clock=FakeClock(NOW_MS)) as b:
        first = b.send("orders", b"x" * 1024, message_id="old-one")
        for i in range(3):  # fill the first segments and roll past them
            b.send_batch([OutgoingMessage("orders", b"y" * 1024) for _ in range(70)])
        b.timer_tick()  # (the timer's cursor passes the log: it holds no segment back)
        b.maintenance()
        assert b.retention(), "retention deleted the first segment"
        again = b.send("orders", b"x" * 1024, message_id="old-one")
        assert not again.duplicate and again.commit_offset > first.commit_offset


def test_dedupe_max_entries_is_bounded_in_the_config(tmp_path):
    with pytest.raises(errors.ClientError):
        BrokerConfig(data_dir=str(tmp_path), dedupe_max_entries=-1).validate()
    with pytest.raises(errors.ClientError):
        BrokerConfig(data_dir=str(tmp_path), dedupe_max_entries=50_000_001).validate()
    BrokerConfig(data_dir=str(tmp_path), dedupe_max_entries=0).validate()
