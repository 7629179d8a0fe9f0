"""A data directory whose source files ``topics.json`` or ``groups.json`` are lost or damaged
(docs/storage.md, "A lost or damaged topics.json or groups.json"): a lost topics.json is rebuilt
from the store's queues (system topics exactly, user topics as said in the recovery report); a
damaged file refuses the open with ``CorruptionError`` naming it and what to do, never a
traceback of another kind. Real data directories, embedded brokers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from chronoq.broker.broker import TOPICS_FILE, Broker, OutgoingMessage
from chronoq.broker.trace import TRACE_TOPIC
from chronoq.core import errors, fsutil
from chronoq.core.clock import FakeClock
from chronoq.core.config import BrokerConfig
from chronoq.core.delay_levels import DELAY_TOPIC
from chronoq.core.model import MessageType
from chronoq.pop.groups import GROUPS_FILE
from chronoq.pop.service import PopService

NOW_MS = 1_750_000_000_000
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def open_broker(data_dir, **settings) -> Broker:
    settings = {"trace_enabled": True, "default_queues": 4, "segment_bytes": 64 * 1024, **settings}
    return Broker(BrokerConfig(data_dir=str(data_dir), **settings), clock=FakeClock(NOW_MS))


def table(b: Broker) -> dict:
    return {t.name: (t.queues, t.message_type) for t in b.list_topics(include_system=True)}


def filled(data_dir) -> dict:
    """A data directory holding trace records, level-delayed records and a user topic's messages
    in its second queue; returns its topic table."""
    b = open_broker(data_dir)
    b.create_topic("orders", 2, MessageType.NORMAL)
    b.create_topic("reminders", 1, MessageType.DELAY)
    b.send_batch([OutgoingMessage("orders", b"first", queue_id=1),
                  OutgoingMessage("reminders", b"later", delay_level=3)])
    assert b.write_trace() > 0
    before = table(b)
    b.close()
    assert before[TRACE_TOPIC][0] == 1 and before[DELAY_TOPIC][0] == 18
    return before


def test_a_lost_topics_file_is_rebuilt_system_topics_as_their_owners_make_them(tmp_path):
    before = filled(tmp_path)
    os.remove(tmp_path / TOPICS_FILE)
    b = open_broker(tmp_path)  # was: InvalidQueue "topic CHRONOQ_TRACE has 4 queues; the count can only grow"
    try:
        after = table(b)
        # System topics: the queues the store has; each owner grows its topic to what it needs
        # before it writes there (the trace: 1 queue, at open; the delay levels: 18, at the next
        # level send), as it made it the first time.
        assert after[TRACE_TOPIC] == before[TRACE_TOPIC] == (1, MessageType.MIXED)
        assert after[DELAY_TOPIC] == (3, MessageType.MIXED)  # level 3's queue is the highest in the store
        # A user topic: at least default_queues, type mixed (it accepts every type): the report says
        # so. (One whose messages all wait in the timer has no queue yet: it comes back when they are due.)
        assert after["orders"] == (4, MessageType.MIXED) and "reminders" not in after
        assert [m.body for m in b.read("orders", 1, 0).messages] == [b"first"]
        [note] = [n for n in b.recovery.notes if TOPICS_FILE in n]
        assert "was missing" in note and "orders (4)" in note and "type mixed" in note
        assert os.path.exists(tmp_path / TOPICS_FILE)
        b.create_topic("reminders", 1, MessageType.DELAY)
        b.send("reminders", b"again", delay_level=1)
        after = table(b)
        assert after[DELAY_TOPIC] == before[DELAY_TOPIC]
    finally:
        b.close()
    b = open_broker(tmp_path)  # the rebuilt table was saved: the next open has nothing to say
    try:
        assert table(b) == after and not [n for n in b.recovery.notes if TOPICS_FILE in n]
    finally:
        b.close()


def test_a_system_topic_saved_with_more_queues_than_its_owner_asks_for_opens(tmp_path):
    """A file saved by an older adoption (CHRONOQ_TRACE at default_queues) no longer stops the open."""
    filled(tmp_path)
    fsutil.write_json(str(tmp_path / TOPICS_FILE), {"topics": [
        {"name": TRACE_TOPIC, "queues": 4, "message_type": "mixed"},
        {"name": "orders", "queues": 2, "message_type": "normal"}]})
    b = open_broker(tmp_path)
    try:
        assert table(b)[TRACE_TOPIC] == (4, MessageType.MIXED)
        assert table(b)["orders"] == (2, MessageType.NORMAL)
        with pytest.raises(errors.InvalidQueue):  # a user topic's count still only grows
            b.create_topic("orders", 1, MessageType.NORMAL)
    finally:
        b.close()


def damage(path, how: str) -> None:
    if how == "truncated":
        with open(path, "rb") as fh:
            raw = fh.read()
        with open(path, "wb") as fh:
            fh.write(raw[: len(raw) // 2])
    elif how == "garbage":
        with open(path, "wb") as fh:
            fh.write(b"\x00\xff not json at all")
    elif how == "a list":  # a valid checksum over something that is not the document
        fsutil.write_json(str(path), [1, 2])
    else:  # entries not as written
        fsutil.write_json(str(path), {"topics": [{"name": "x"}], "groups": {"g": 5}})


HOWS = ("truncated", "garbage", "a list", "entries")


@pytest.mark.parametrize("how", HOWS)
def test_a_damaged_topics_file_refuses_naming_it_and_the_way_out(tmp_path, how):
    filled(tmp_path)
    path = tmp_path / TOPICS_FILE
    damage(path, how)
    with pytest.raises(errors.CorruptionError) as info:
        open_broker(tmp_path)
    message = info.value.message
    assert message.startswith(f"corrupt data in {path} at byte 0: ") and "topic configurations" in message
    assert "Restore it from a backup" in message and "move it aside" in message
    assert "--quarantine" not in message  # (the log's advice: nothing to quarantine here)
    os.rename(path, str(path) + ".damaged")  # what the message says: the open then rebuilds
    b = open_broker(tmp_path)
    try:
        assert table(b)[TRACE_TOPIC][0] == 1 and [m.body for m in b.read("orders", 1, 0).messages] == [b"first"]
    finally:
        b.close()


@pytest.mark.parametrize("how", HOWS)
def test_a_damaged_groups_file_refuses_naming_it_and_the_way_out(tmp_path, how):
    b = open_broker(tmp_path)
    pop = PopService(b, FakeClock(NOW_MS))
    pop.set_group("billing", fifo=True, max_attempts=3)
    pop.close()
    b.close()
    path = tmp_path / GROUPS_FILE
    damage(path, how)
    b = open_broker(tmp_path)
    try:
        with pytest.raises(errors.CorruptionError) as info:
            PopService(b, FakeClock(NOW_MS))
        message = info.value.message
        assert message.startswith(f"corrupt data in {path} at byte 0: ") and "consumer groups' settings" in message
        assert "Restore it from a backup" in message and "default settings" in message
        assert "--quarantine" not in message
    finally:
        b.close()


CHILD = """
import os, signal, sys
from chronoq.broker.broker import Broker
from chronoq.core.config import BrokerConfig
b = Broker(BrokerConfig(data_dir=sys.argv[1], trace_enabled=True, default_queues=4, segment_bytes=64 * 1024))
os.kill(os.getpid(), signal.SIGKILL)  # right after the open adopted and saved the table: no close
"""


def test_the_rebuilt_table_survives_a_kill_right_after_the_open(tmp_path):
    before = filled(tmp_path)
    os.remove(tmp_path / TOPICS_FILE)
    proc = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path)], cwd=ROOT, capture_output=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")))
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()
    assert os.path.exists(tmp_path / TOPICS_FILE)
    b = open_broker(tmp_path)
    try:
        after = table(b)
        assert after[TRACE_TOPIC] == before[TRACE_TOPIC] and after[DELAY_TOPIC] == (3, MessageType.MIXED)
        assert after["orders"] == (4, MessageType.MIXED)
        assert not [n for n in b.recovery.notes if TOPICS_FILE in n]  # adopted and saved by the killed one
    finally:
        b.close()
