"""The embedded broker API: bad input gets a named error and stores nothing; ids; offsets; config."""

from __future__ import annotations

import os
import re
import time

import pytest

from chronoq.core import errors, fsutil
from chronoq.broker.broker import TOPICS_FILE, Broker, OutgoingMessage
from chronoq.core.clock import FakeClock
from chronoq.core.config import BrokerConfig, load_config
from chronoq.core.model import MessageType
from chronoq.core.msgid import EPOCH_2021_S, parse_message_id

NOW_MS = 1_750_000_123_456


def make(tmp_path, **cfg) -> Broker:
    return Broker(BrokerConfig(data_dir=str(tmp_path), segment_bytes=64 * 1024, **cfg), clock=FakeClock(NOW_MS))


def state(b: Broker) -> tuple:
    """Everything a bad request must leave alone."""
    bounds = {key: b.store.bounds(*key) for key in b.store.queues}
    topics = [(t.name, t.queues, t.message_type) for t in b.list_topics(include_system=True)]
    on_disk = fsutil.read_json(os.path.join(b.data_dir, TOPICS_FILE))
    return b.store.log.written, bounds, topics, on_disk


@pytest.fixture
def broker(tmp_path):
    b = make(tmp_path)
    b.create_topic("orders", 2)
    b.send("orders", b"first")
    yield b
    b.close()


BAD_TOPICS = ["", " ", "has space", "a" * 128, "tab\t", "new\nline", "orders\n", "dot.dot", "../x", "slash/x",
              "ünï", None, 5, ["orders"]]
RESERVED = ["%RETRY%g_orders", "%DLQ%g", "%SYS%x", "CHRONOQ_internal", "SCHEDULE_TOPIC_XXXX", "rmq_sys_x"]


@pytest.mark.parametrize("topic", BAD_TOPICS)
def test_invalid_topic_names(broker, topic):
    before = state(broker)
    with pytest.raises(errors.InvalidTopic) as info:
        broker.send(topic, b"x")
    assert info.value.kind == "illegal_topic" and info.value.message
    with pytest.raises(errors.InvalidTopic):
        broker.create_topic(topic)
    assert state(broker) == before


def test_longest_topic_name_is_fine(broker):
    name = "a" * 127
    assert broker.send(name, b"x").topic == name


@pytest.mark.parametrize("topic", RESERVED)
def test_reserved_system_prefixes(broker, topic):
    before = state(broker)
    with pytest.raises(errors.ReservedName):
        broker.send(topic, b"x")
    with pytest.raises(errors.ReservedName):
        broker.create_topic(topic)
    assert state(broker) == before


@pytest.mark.parametrize("body", [b"", "", bytearray(), memoryview(b"")])
def test_empty_body(broker, body):
    before = state(broker)
    with pytest.raises(errors.BodyEmpty):
        broker.send("orders", body)
    # An empty body to a topic auto-create would make must not create the topic either.
    with pytest.raises(errors.BodyEmpty):
        broker.send("brand_new", body)
    assert state(broker) == before


@pytest.mark.parametrize("body", [None, 5, ["x"], {"a": 1}])
def test_body_of_the_wrong_type(broker, body):
    before = state(broker)
    with pytest.raises(errors.ClientError):
        broker.send("orders", body)
    assert state(broker) == before


def test_body_size_limit_from_config(tmp_path):
    with make(tmp_path, max_body_bytes=1000) as b:
        b.create_topic("t")
        before = state(b)
        with pytest.raises(errors.BodyTooLarge) as info:
            b.send("t", b"x" * 1001)
        assert "1000" in info.value.message
        assert state(b) == before
        assert b.send("t", b"x" * 1000).queue_offset == 0


def test_unknown_topic_without_auto_create(tmp_path):
    with make(tmp_path, auto_create_topics=False) as b:
        before = state(b)
        with pytest.raises(errors.TopicNotFound):
            b.send("nope", b"x")
        with pytest.raises(errors.TopicNotFound):
            b.read("nope", 0, 0)
        assert state(b) == before and b.list_topics() == []


def test_auto_create_makes_the_topic_on_a_valid_send(broker):
    r = broker.send("fresh", b"x")
    assert "fresh" in [t.name for t in broker.list_topics()]
    assert broker.read("fresh", r.queue_id, 0).messages[0].body == b"x"


def test_a_batch_to_many_new_topics_creates_them_all_durably(tmp_path):
    names = [f"new-{i}" for i in range(50)]
    with make(tmp_path) as b:
        b.send_batch([OutgoingMessage(n, b"x") for n in names] + [OutgoingMessage(names[0], b"y")])
    on_disk = fsutil.read_json(os.path.join(str(tmp_path), TOPICS_FILE))
    assert sorted(t["name"] for t in on_disk["topics"] if t["name"].startswith("new-")) == sorted(names)
    with make(tmp_path) as b:
        assert all(b.topic(n).queues == 4 for n in names)
        assert sum(len(b.read(names[0], q, 0).messages) for q in range(4)) == 2


def test_user_topics_stop_at_max_topics_and_a_refusal_changes_nothing(tmp_path):
    with make(tmp_path, max_topics=3) as b:
        b.create_topic("a")
        b.send("b", b"x")  # auto-created
        before = state(b)
        with pytest.raises(errors.TopicNotFound, match=r"max_topics \(3\)"):
            b.send_batch([OutgoingMessage("c", b"x"), OutgoingMessage("d", b"x")])  # room for one only
        assert state(b) == before
        b.send_batch([OutgoingMessage("c", b"x"), OutgoingMessage("a", b"y")])
        with pytest.raises(errors.TopicNotFound, match="max_topics"):
            b.send("d", b"x")
        with pytest.raises(errors.ClientError, match="max_topics"):
            b.create_topic("d")
        b.create_topic("a", 8)  # an existing topic may still grow
        b.send("b", b"again")
        assert sorted(t.name for t in b.list_topics()) == ["a", "b", "c"]
        b.delete_topic("c")  # makes room
        b.send("d", b"x")
    with make(tmp_path, max_topics=1) as b:  # a lowered limit keeps what exists
        assert b.send("a", b"kept").queue_offset >= 0 and "b" in [t.name for t in b.list_topics()]


def test_a_batch_of_new_topics_saves_the_topic_file_once(tmp_path):
    """(One save per topic rewrote the whole, growing file with its fsyncs: 500 new topics in a
    batch held the server's loop 0.8 s, bench/stalls.py --topics 2000.)"""
    names = [f"new{i}" for i in range(50)]
    with make(tmp_path) as b:
        before = fsutil.rewrites()
        b.send_batch([OutgoingMessage(n, b"x") for n in names] + [OutgoingMessage("new0", b"y")])
        assert fsutil.rewrites() - before == 1
        on_disk = fsutil.read_json(os.path.join(b.data_dir, TOPICS_FILE))
        assert {t["name"] for t in on_disk["topics"]} >= set(names)
    with make(tmp_path) as b:
        assert [t.name for t in b.list_topics()] == sorted(names)


def test_a_batch_whose_topic_file_save_fails_creates_no_topic(tmp_path):
    with make(tmp_path) as b:
        blocker = os.path.join(b.data_dir, TOPICS_FILE + ".tmp")
        os.mkdir(blocker)  # the save's temporary file cannot be made
        before = b.store.log.written
        with pytest.raises(OSError):
            b.send_batch([OutgoingMessage(f"new{i}", b"x") for i in range(3)])
        assert b.list_topics() == [] and b.store.log.written == before
        os.rmdir(blocker)
        b.send_batch([OutgoingMessage(f"new{i}", b"x") for i in range(3)])
        assert [t.name for t in b.list_topics()] == ["new0", "new1", "new2"]


@pytest.mark.parametrize("queue_id", [-1, 2, 99, "0", 1.0])
def test_invalid_queue_id(broker, queue_id):
    before = state(broker)
    with pytest.raises(errors.InvalidQueue):
        broker.send("orders", b"x", queue_id=queue_id)
    with pytest.raises(errors.InvalidQueue):
        broker.read("orders", queue_id, 0)
    assert state(broker) == before


@pytest.mark.parametrize("queues", [0, -1, 1025, "4", 2.5])
def test_invalid_queue_count(broker, queues):
    with pytest.raises(errors.InvalidQueue):
        broker.create_topic("other", queues)
    assert "other" not in [t.name for t in broker.list_topics()]


def test_queue_count_only_grows(broker):
    with pytest.raises(errors.InvalidQueue):
        broker.create_topic("orders", 1)
    assert broker.create_topic("orders", 3).queues == 3


@pytest.mark.parametrize("props, kind", [
    ({"__GROUP": "g"}, errors.InvalidProperty),
    ({"__anything": "v"}, errors.InvalidProperty),
    ({"a\x01b": "v"}, errors.InvalidProperty),
    ({"a": "v\x02"}, errors.InvalidProperty),
    ({"a": "v\x01"}, errors.InvalidProperty),
    ({"new\nline": "v"}, errors.InvalidProperty),
    ({"nul\x00": "v"}, errors.InvalidProperty),
    ({"": "v"}, errors.InvalidProperty),
    ({"k": 5}, errors.InvalidProperty),
    ({5: "v"}, errors.InvalidProperty),
    ([("k", "v")], errors.InvalidProperty),
    ({f"k{i}": "v" for i in range(129)}, errors.PropertiesTooLarge),
    ({"k": "v" * 17000}, errors.PropertiesTooLarge),
])
def test_bad_properties(broker, props, kind):
    before = state(broker)
    with pytest.raises(kind):
        broker.send("orders", b"x", properties=props)
    assert state(broker) == before


@pytest.mark.parametrize("kwargs, kind", [
    ({"tag": "a|b"}, errors.InvalidTag),
    ({"tag": "tab\t"}, errors.InvalidTag),
    ({"tag": "   "}, errors.InvalidTag),
    ({"tag": "t" * 1025}, errors.InvalidTag),
    ({"tag": ["x"]}, errors.InvalidTag),
    ({"tag": 7}, errors.InvalidTag),
    ({"keys": ["   "]}, errors.InvalidKey),  # blank (a space inside a key is allowed)
    ({"keys": [""]}, errors.InvalidKey),
    ({"keys": ["ctl\x01"]}, errors.InvalidKey),
    ({"keys": [5]}, errors.InvalidKey),
    ({"keys": 5}, errors.InvalidKey),
    ({"message_id": " "}, errors.InvalidMessageId),
    ({"message_id": "x" * 129}, errors.InvalidMessageId),
    ({"message_id": "ünicode"}, errors.InvalidMessageId),
    ({"message_id": "ctl\n"}, errors.InvalidMessageId),
    ({"message_group": " "}, errors.ClientError),
    ({"message_group": "g" * 64}, errors.ClientError),
])
def test_bad_tags_keys_ids_and_groups(broker, kwargs, kind):
    before = state(broker)
    with pytest.raises(kind):
        broker.send("orders", b"x", **kwargs)
    assert state(broker) == before


def test_message_type_mismatch(broker):
    broker.create_topic("fifo_only", 2, "fifo")
    broker.create_topic("normal_only", 2, MessageType.NORMAL)
    before = state(broker)
    with pytest.raises(errors.MessageTypeMismatch):
        broker.send("fifo_only", b"x")
    with pytest.raises(errors.MessageTypeMismatch):
        broker.send("normal_only", b"x", message_group="g1")
    with pytest.raises(errors.MessageTypeMismatch):
        broker.send("normal_only", b"x", message_type=MessageType.TRANSACTION)
    assert state(broker) == before
    assert broker.send("fifo_only", b"x", message_group="g1").topic == "fifo_only"
    assert broker.send("normal_only", b"x").topic == "normal_only"
    with pytest.raises(errors.ClientError):
        broker.create_topic("t3", 1, "bogus")


def test_a_failing_batch_stores_nothing(broker):
    before = state(broker)
    batch = [OutgoingMessage("orders", b"ok-1"), OutgoingMessage("new_topic_in_batch", b"ok-2"),
             OutgoingMessage("orders", b"ok-3", queue_id=1), OutgoingMessage("orders", b"")]
    with pytest.raises(errors.BodyEmpty):
        broker.send_batch(batch)
    assert state(broker) == before
    assert "new_topic_in_batch" not in [t.name for t in broker.list_topics()]
    # Nothing half-written is left to surface at the next flush either.
    broker.flush()
    assert state(broker) == before
    results = broker.send_batch(batch[:3])
    assert "new_topic_in_batch" in [t.name for t in broker.list_topics()]
    for r, msg in zip(results, batch):
        assert broker.read(r.topic, r.queue_id, r.queue_offset, 1).messages[0].body == msg.body


def test_exact_resend_returns_the_original_and_stores_nothing(broker):
    first = broker.send("orders", b"payload", message_id="client-id-1", tag="t")
    assert not first.duplicate
    before = state(broker)
    again = broker.send("orders", b"payload", message_id="client-id-1", tag="t")
    assert again.duplicate
    assert (again.message_id, again.topic, again.queue_id, again.queue_offset, again.commit_offset) == (
        first.message_id, first.topic, first.queue_id, first.queue_offset, first.commit_offset)
    assert state(broker) == before


def test_same_id_with_a_different_body_is_refused(broker):
    broker.send("orders", b"payload", message_id="client-id-2")
    before = state(broker)
    with pytest.raises(errors.DuplicateMessageId):
        broker.send("orders", b"other payload", message_id="client-id-2")
    assert state(broker) == before


def test_duplicates_inside_one_batch(broker):
    before = state(broker)
    with pytest.raises(errors.DuplicateMessageId):
        broker.send_batch([OutgoingMessage("orders", b"a", message_id="dup"),
                           OutgoingMessage("orders", b"b", message_id="dup")])
    assert state(broker) == before
    first, second = broker.send_batch([OutgoingMessage("orders", b"a", message_id="dup"),
                                       OutgoingMessage("orders", b"a", message_id="dup")])
    assert not first.duplicate and second.duplicate
    assert (second.queue_id, second.queue_offset) == (first.queue_id, first.queue_offset)
    lo, hi = broker.queue_bounds("orders", first.queue_id)
    assert [m.message_id for m in broker.read("orders", first.queue_id, lo, 100).messages].count("dup") == 1


def test_resend_after_the_dedupe_window_is_a_new_message(tmp_path):
    clock = FakeClock(NOW_MS)
    with Broker(BrokerConfig(data_dir=str(tmp_path), dedupe_window_ms=1000), clock=clock) as b:
        first = b.send("orders", b"p", message_id="late")
        clock.advance(1001)
        second = b.send("orders", b"p", message_id="late")
        assert not second.duplicate and second.commit_offset != first.commit_offset


def test_generated_message_ids_have_the_rocketmq5_format(broker):
    ids = [broker.send("orders", b"x").message_id for _ in range(200)]
    assert len(set(ids)) == len(ids)
    for mid in ids:
        assert re.fullmatch(r"01[0-9A-F]{32}", mid), mid
        fields = parse_message_id(mid)
        assert fields is not None
        assert fields["process"] == (os.getpid() & 0xFFFF) ^ 0x8000
        assert fields["seconds_since_2021"] == NOW_MS // 1000 - EPOCH_2021_S
    seqs = [parse_message_id(m)["sequence"] for m in ids]
    assert seqs == sorted(seqs)
    # The stored message carries the id the send returned.
    r = broker.send("orders", b"y")
    got = broker.read("orders", r.queue_id, r.queue_offset, 1).messages[0]
    assert got.message_id == r.message_id


def test_ids_differ_from_the_official_clients_in_the_same_process():
    # The official client's codec and ours, one process, one second: the same MAC, pid and a
    # counter from 0 would mint the same ids, and the dedupe window would drop one message.
    from rocketmq.v5.util.message_id_codec import MessageIdCodec

    from chronoq.core.msgid import new_message_id

    theirs = {MessageIdCodec().next_message_id() for _ in range(50)}
    ours = {new_message_id(int(time.time() * 1000)) for _ in range(50)}
    assert {m[:18] for m in theirs} != {m[:18] for m in ours}
    assert not theirs & ours


def test_consumer_offsets_survive_a_clean_restart(tmp_path):
    with make(tmp_path) as b:
        b.create_topic("orders", 2)
        for i in range(5):
            b.send("orders", b"m%d" % i, queue_id=i % 2)
        assert b.get_offset("g1", "orders", 0) is None
        b.commit_offset("g1", "orders", 0, 2)
        b.commit_offset("g1", "orders", 1, 1)
        b.commit_offset("g2", "orders", 0, 3)
        b.commit_offset("g1", "orders", 0, 3)  # later commits win
        before = state(b)
        bad_commits = [
            (("g1", "orders", 0, 4), errors.InvalidOffset), (("g1", "orders", 0, -1), errors.InvalidOffset),
            (("g1", "orders", 0, "1"), errors.InvalidOffset), (("g1", "orders", 2, 0), errors.InvalidQueue),
            (("g1", "nope", 0, 0), errors.TopicNotFound), (("bad group", "orders", 0, 0), errors.InvalidGroup),
            (("CHRONOQ_x", "orders", 0, 0), errors.InvalidGroup), (("", "orders", 0, 0), errors.InvalidGroup),
        ]
        for bad, kind in bad_commits:
            with pytest.raises(kind):
                b.commit_offset(*bad)
        assert state(b) == before
        assert b.get_offset("g1", "orders", 0) == 3
    with make(tmp_path) as b:
        assert b.get_offset("g1", "orders", 0) == 3
        assert b.get_offset("g1", "orders", 1) == 1
        assert b.get_offset("g2", "orders", 0) == 3
        assert b.get_offset("g2", "orders", 1) is None
        assert b.list_groups() == ["g1", "g2"]


def test_topics_survive_a_restart(tmp_path):
    with make(tmp_path) as b:
        b.create_topic("orders", 3)
        b.create_topic("fifo_t", 2, "fifo")
        b.create_topic("%RETRY%g_orders", 1, system=True)
        b.send("auto_made", b"x")
        expect = [(t.name, t.queues, t.message_type) for t in b.list_topics(include_system=True)]
        user = [t.name for t in b.list_topics()]
    with make(tmp_path) as b:
        assert [(t.name, t.queues, t.message_type) for t in b.list_topics(include_system=True)] == expect
        assert [t.name for t in b.list_topics()] == user == ["auto_made", "fifo_t", "orders"]


def test_messages_survive_a_restart(tmp_path):
    with make(tmp_path) as b:
        sent = [b.send("orders", b"body-%d" % i, tag="t", keys=["k%d" % i], properties={"i": str(i)})
                for i in range(20)]
    with make(tmp_path) as b:
        for i, r in enumerate(sent):
            (m,) = b.read("orders", r.queue_id, r.queue_offset, 1).messages
            assert (m.message_id, m.body, m.tag, m.keys, m.properties) == (
                r.message_id, b"body-%d" % i, "t", ("k%d" % i,), {"i": str(i)})


# ---------------------------------------------------------------- configuration
def test_an_unknown_table_in_the_config_file_is_refused_naming_the_known_ones(tmp_path):
    # A misspelt table ([brokr]) was kept aside unread: its settings, and its mistakes, ignored.
    path = tmp_path / "chronoq.toml"
    path.write_text('[brokr]\nport = 18392\nflush_policy = "bogus"\n[metrics]\nx = 1\n')
    with pytest.raises(errors.ClientError) as info:
        load_config(str(path), env={})
    text = str(info.value)
    assert "unknown table(s) [brokr], [metrics]" in text and "[broker]" in text and "[groups.<name>]" in text
    path.write_text('[broker]\nport = 18392\n[groups.g1]\nfifo = true\n[auth]\nenabled = false\n')
    assert load_config(str(path), env={}).port == 18392


def test_config_precedence_file_env_overrides(tmp_path):
    path = tmp_path / "chronoq.toml"
    path.write_text('port = 9000\nhost = "0.0.0.0"\n[broker]\nmax_body_bytes = 2048\nflush_policy = "async"\n'
                    '[console]\nlookup_scan_mib = 8\n')
    cfg = load_config(str(path), env={})
    assert (cfg.port, cfg.host, cfg.max_body_bytes, cfg.flush_policy) == (9000, "0.0.0.0", 2048, "async")
    assert cfg.extra == {"console": {"lookup_scan_mib": 8}}
    env = {"CHRONOQ_PORT": "9100", "CHRONOQ_MAX_BODY_BYTES": "4_096", "CHRONOQ_QUARANTINE": "yes",
           "UNRELATED": "1"}
    cfg = load_config(str(path), env=env)
    assert (cfg.port, cfg.host, cfg.max_body_bytes, cfg.quarantine) == (9100, "0.0.0.0", 4096, True)
    cfg = load_config(str(path), env=env, overrides={"port": 9200, "host": None, "data_dir": str(tmp_path)})
    assert (cfg.port, cfg.host, cfg.max_body_bytes, cfg.data_dir) == (9200, "0.0.0.0", 4096, str(tmp_path))
    assert load_config(None, env={}).port == BrokerConfig().port


@pytest.mark.parametrize("toml", [
    "prot = 9000\n",
    "[broker]\nsegmnt_bytes = 65536\n",
    "port = \"not a number\"\n",
    "port = 70000\n",
    "auto_create_topics = 1\n",
    "flush_policy = \"sometimes\"\n",
    "segment_bytes = 1024\n",
    "port = \n",
])
def test_config_file_errors_are_client_errors(tmp_path, toml):
    path = tmp_path / "bad.toml"
    path.write_text(toml)
    with pytest.raises(errors.ClientError):
        load_config(str(path), env={})


def test_config_unknown_override_and_bad_env_values(tmp_path):
    with pytest.raises(errors.ClientError):
        load_config(None, env={}, overrides={"no_such_setting": 1})
    with pytest.raises(errors.ClientError):
        load_config(None, env={"CHRONOQ_PORT": "eighty"})
    with pytest.raises(errors.ClientError):
        load_config(None, env={"CHRONOQ_AUTO_CREATE_TOPICS": "maybe"})
    with pytest.raises(errors.ClientError):
        load_config(str(tmp_path / "missing.toml"), env={})


def test_booleans_are_not_queue_ids_or_offsets(tmp_path):
    import pytest

    from chronoq.core import errors
    from chronoq.broker.broker import Broker
    from chronoq.core.config import BrokerConfig

    with Broker(BrokerConfig(data_dir=str(tmp_path))) as b:
        b.send("orders", b"x", queue_id=0)
        with pytest.raises(errors.InvalidQueue):
            b.send("orders", b"x", queue_id=True)
        with pytest.raises(errors.InvalidQueue):
            b.read("orders", True, 0, 1)
        with pytest.raises(errors.InvalidOffset):
            b.read("orders", 0, False, 1)


def test_dedupe_entries_expire_a_bounded_step_per_maintenance_call(tmp_path):
    # A burst of sends expires all at once; maintenance takes it in steps so the event loop is not
    # held for tens of ms (timer releases wait behind it).
    from chronoq.broker import broker as broker_module
    from chronoq.broker.broker import OutgoingMessage

    clock = FakeClock(NOW_MS)
    step = broker_module.DEDUPE_EXPIRE_STEP
    with Broker(BrokerConfig(data_dir=str(tmp_path), dedupe_window_ms=1000), clock=clock) as b:
        total = step * 2 + 500
        for first in range(0, total, 1000):
            b.send_batch([OutgoingMessage("orders", b"p", message_id=f"m{first + i}")
                          for i in range(min(1000, total - first))])
        assert len(b._dedupe) == total
        clock.advance(1001)
        b.maintenance()
        assert len(b._dedupe) == total - step
        b.maintenance()
        b.maintenance()
        assert len(b._dedupe) == 0
