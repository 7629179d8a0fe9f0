"""topics.json as ``TopicRegistry.save`` writes it: each entry encoded once and kept, the file the
same bytes as ``fsutil.write_json`` of the whole document, through every change a topic can see."""

from __future__ import annotations

from chronoq.broker.topics import TopicRegistry
from chronoq.core import fsutil
from chronoq.core.config import BrokerConfig
from chronoq.core.model import MessageType


def _registry(path) -> TopicRegistry:
    reg = TopicRegistry(str(path), BrokerConfig(data_dir=str(path), default_queues=4))
    return reg


def _expected(reg: TopicRegistry, tmp_path) -> bytes:
    """What the one-document writer gives for the registry's topics now."""
    other = tmp_path / "expected.json"
    fsutil.write_json(str(other), {"topics": [t.to_json() for t in sorted(reg.topics.values(), key=lambda t: t.name)]})
    return other.read_bytes()


def _written(reg: TopicRegistry) -> bytes:
    with open(reg.path, "rb") as fh:
        return fh.read()


def test_the_file_is_the_whole_document_through_creates_changes_and_removes(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    reg = _registry(data)
    reg.load([])
    reg.create("orders")
    reg.create_planned(["b-topic", "a-topic", "z%topic|1"])
    assert _written(reg) == _expected(reg, tmp_path)
    reg.create("orders", 8)  # more queues: its entry is encoded again
    assert b'"name":"orders","queues":8' in _written(reg)
    reg.create("a-topic", 4, MessageType.FIFO)  # another type
    assert _written(reg) == _expected(reg, tmp_path)
    reg.remove("b-topic")
    assert _written(reg) == _expected(reg, tmp_path)
    assert b"b-topic" not in _written(reg) and "b-topic" not in reg._encoded

    again = _registry(data)  # read back: the same topics, and a save of them the same bytes
    again.load([])
    assert {n: (t.queues, t.message_type) for n, t in again.topics.items()} == \
        {n: (t.queues, t.message_type) for n, t in reg.topics.items()}
    again.save()
    assert _written(again) == _expected(reg, tmp_path)


def test_a_topic_changed_in_place_is_encoded_again(tmp_path):
    """Start-up's adoption grows a known topic's queue count in place (the store has more queues
    than the file says): the kept entry must not be written for it."""
    data = tmp_path / "data"
    data.mkdir()
    reg = _registry(data)
    reg.load([])
    reg.create("orders", 2)
    again = _registry(data)
    again.load([("orders", 0), ("orders", 5)])  # queue 5 in the store: 6 queues, saved at once
    assert again.topics["orders"].queues == 6
    assert _written(again) == _expected(again, tmp_path)
    again.save()  # (its kept entry is the grown one now)
    assert _written(again) == _expected(again, tmp_path)
    again.topics["orders"].queues = 7  # in place, as adoption does, after the entry was kept
    again.save()
    assert b'"name":"orders","queues":7' in _written(again)
