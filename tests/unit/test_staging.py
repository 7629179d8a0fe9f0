"""Staged publish (chronoq.features.staging): invisible until published, published once per (sink, batch),
abort, restart, interrupted publishes finished at start-up, TTL, and parity with Broker.prepare."""

from __future__ import annotations

import pytest

from chronoq.core import errors
from chronoq.broker.broker import Broker, OutgoingMessage
from chronoq.core.clock import FakeClock
from chronoq.core.config import BrokerConfig
from chronoq.features.staging import STAGE_TOPIC, Rows, Staging, parse_rows


def _open(tmp_path, clock=None, **cfg):
    broker = Broker(BrokerConfig(data_dir=str(tmp_path), **cfg), clock=clock or FakeClock())
    return broker, Staging(broker)


def _visible(broker, topic="out"):
    cfg = broker.topics.get(topic)
    if cfg is None:
        return []
    return [m for q in range(cfg.queues) for m in broker.read(topic, q, 0, 10_000).messages]


def _publish(staging, sink, batch, refs):
    job = staging.publish(sink, batch, refs)
    for _ in job.steps(staging):
        pass
    staging.broker.flush()
    return job


def _rows(n, prefix="m", **columns):
    return Rows([f"{prefix}-{i}".encode() for i in range(n)], **columns)


def test_rows_are_invisible_until_published_then_published_once(tmp_path):
    broker, st = _open(tmp_path)
    assert st.stage("spark", 0, "a1", 0, "out", _rows(3)) == 3
    assert st.stage("spark", 0, "a1", 1, "out", _rows(2, "n")) == 2
    assert st.stage("spark", 0, "a1", 1, "out", _rows(2, "n")) == 2  # a resent chunk: kept once
    broker.flush()
    assert _visible(broker) == []
    job = _publish(st, "spark", 0, [("a1", 2, 5)])
    assert not job.already_published and job.messages == 5
    assert sorted(m.body for m in _visible(broker)) == sorted([b"m-0", b"m-1", b"m-2", b"n-0", b"n-1"])
    again = _publish(st, "spark", 0, [("a1", 2, 5)])  # Spark committed the batch twice
    assert again.already_published and len(_visible(broker)) == 5
    # A straggler staging for the published batch is dropped.
    st.stage("spark", 0, "late", 0, "out", _rows(4, "late"))
    assert _publish(st, "spark", 0, [("late", 1, 4)]).already_published and len(_visible(broker)) == 5
    broker.close()


def test_only_named_stages_are_published_and_incomplete_ones_refused(tmp_path):
    broker, st = _open(tmp_path)
    st.stage("s", 3, "failed-attempt", 0, "out", _rows(2, "x"))   # a task attempt that failed
    st.stage("s", 3, "good-attempt", 0, "out", _rows(2, "x"))
    with pytest.raises(errors.ClientError, match="incomplete"):
        st.publish("s", 3, [("good-attempt", 2, 2)])   # the commit names 2 chunks; 1 arrived
    _publish(st, "s", 3, [("good-attempt", 1, 2)])
    assert sorted(m.body for m in _visible(broker)) == [b"x-0", b"x-1"]
    broker.close()


def test_abort_discards_and_a_restart_replays_the_state(tmp_path):
    clock = FakeClock()
    broker, st = _open(tmp_path, clock)
    st.stage("s", 1, "a", 0, "out", _rows(3))
    st.stage("s", 2, "b", 0, "out", _rows(3))
    st.stage("job", 0, "c", 0, "out", _rows(1))
    st.stage("job", 1, "d", 0, "out", _rows(1))
    assert st.abort("s", 1) == 3
    assert st.abort("job", -1) == 2   # -1: every unpublished batch of the sink
    _publish(st, "s", 5, [])          # an empty batch is published too (its replay is a no-op)
    broker.close()
    broker = Broker(BrokerConfig(data_dir=str(tmp_path)), clock=clock)
    st = Staging(broker)
    assert set(st.batches) == {("s", 2)} and st.is_published("s", 5) and not st.is_published("s", 2)
    with pytest.raises(errors.ClientError):
        st.publish("s", 1, [("a", 1, 3)])  # aborted: its rows are gone
    _publish(st, "s", 2, [("b", 1, 3)])
    assert len(_visible(broker)) == 3
    st.checkpoint(force=True)
    broker.close()
    broker = Broker(BrokerConfig(data_dir=str(tmp_path)), clock=clock)
    st = Staging(broker)
    assert st.batches == {} and st.is_published("s", 2) and st.is_published("s", 5)
    broker.close()


def test_a_publish_interrupted_by_a_crash_is_finished_at_start_not_repeated(tmp_path):
    broker, st = _open(tmp_path)
    st.stage("s", 7, "a", 0, "out", _rows(3, "first"))
    st.stage("s", 7, "a", 1, "out", _rows(3, "second"))
    st.stage("s", 7, "b", 0, "out", _rows(2, "third"))
    job = st.publish("s", 7, [("a", 2, 6), ("b", 1, 2)])
    steps = job.steps(st)
    next(steps)  # one chunk (and the "begin" marker) written ...
    broker.flush()
    broker.close()  # ... then the process stops
    broker = Broker(BrokerConfig(data_dir=str(tmp_path)))
    st = Staging(broker)  # finishes the batch from where it stopped
    broker.flush()
    bodies = sorted(m.body for m in _visible(broker))
    assert bodies == sorted([b"first-0", b"first-1", b"first-2", b"second-0", b"second-1", b"second-2",
                             b"third-0", b"third-1"])
    assert st.is_published("s", 7)
    # Spark replays the batch with new stages: nothing more is published.
    st.stage("s", 7, "replay", 0, "out", _rows(8, "replay"))
    assert _publish(st, "s", 7, [("replay", 1, 8)]).already_published
    assert len(_visible(broker)) == 8
    broker.close()


def test_unpublished_stages_expire_after_the_ttl(tmp_path):
    clock = FakeClock()
    broker, st = _open(tmp_path, clock, stage_ttl_ms=60_000)
    st.stage("s", 0, "a", 0, "out", _rows(2))
    assert st._retention_floor() is not None
    clock.advance(61_000)
    assert st.sweep() == 1 and st.batches == {} and st._retention_floor() is None
    broker.close()


def test_bad_rows_fail_the_chunk_and_stage_nothing(tmp_path):
    broker, st = _open(tmp_path)
    before = broker.queue_bounds(STAGE_TOPIC, 0)
    bad = [Rows([b"ok", b""]), Rows([b"ok"], tags=["a|b"]), Rows([b"ok"], deliver_at_ms=[-5]),
           Rows([b"ok"], deliver_at_ms=[1], delay_ms=[1]), Rows([b"ok"], properties=[{"__x": "y"}]),
           Rows([b"x" * (4 * 1024 * 1024 + 1)]), Rows([b"ok"], keys=[["ctl\x01"]])]
    for rows in bad:
        with pytest.raises(errors.ClientError):
            st.stage("s", 0, "a", 0, "out", rows)
    for sink, batch, stage in (("", 0, "a"), ("s", -1, "a"), ("s", 0, "bad id!")):
        with pytest.raises(errors.ClientError):
            st.stage(sink, batch, stage, 0, "out", _rows(1))
    with pytest.raises(errors.ClientError):
        st.stage("s", 0, "a", 0, "CHRONOQ_SYSTEM", _rows(1))  # a reserved topic
    assert broker.queue_bounds(STAGE_TOPIC, 0) == before and "out" not in broker.topics
    broker.close()


def test_staged_rows_match_broker_prepare(tmp_path):
    """The bulk validation in Staging agrees with Broker.prepare, field by field."""
    clock = FakeClock()
    broker, st = _open(tmp_path, clock)
    now = clock.wall_ms()
    rows = Rows([b"a", b"b", b"c", b"d"], tags=["t1", "", "t3", ""], keys=[["k1", "k2"], [], ["k3"], []],
                properties=[{"p": "1"}, {}, {}, {"q": "2"}], groups=["", "", "g1", ""],
                deliver_at_ms=[now + 5000, 0, 0, now - 10], delay_ms=[0, 0, 700, 0])
    st.stage("s", 0, "a", 0, "out", rows)
    chunk = st.batches[("s", 0)].stages["a"][0]
    staged = parse_rows("out", broker.store.read_at(chunk.commit_offset, chunk.size).body)
    msgs = [OutgoingMessage("out", b"a", tag="t1", keys=("k1", "k2"), properties={"p": "1"}, deliver_at_ms=now + 5000),
            OutgoingMessage("out", b"b"),
            OutgoingMessage("out", b"c", tag="t3", keys=("k3",), message_group="g1", deliver_at_ms=now + 700),
            OutgoingMessage("out", b"d", properties={"q": "2"}, deliver_at_ms=now - 10)]
    for mine, msg in zip(staged, msgs):
        ref, _ = broker.prepare(msg, now=now)
        same = ("topic", "flags", "born_ms", "deliver_at_ms", "tag", "keys", "properties", "body")
        assert {f: getattr(mine, f) for f in same} == {f: getattr(ref, f) for f in same}, msg
    assert staged[2].queue_id == broker.prepare(msgs[2], now=now)[0].queue_id  # a group keeps its queue
    broker.close()


def _staged(st, broker, rows, topic="out", batch=0):
    st.stage("s", batch, "a", 0, topic, rows)
    chunk = st.batches[("s", batch)].stages["a"][0]
    return parse_rows(topic, broker.store.read_at(chunk.commit_offset, chunk.size).body)


def test_bulk_rows_encode_exactly_as_the_row_by_row_path(tmp_path):
    """Chunks of bodies and delivery times only take a whole-column path; it must stage the same
    messages (message ids aside) as the row loop, which an all-empty tag column forces."""
    clock = FakeClock()
    broker, st = _open(tmp_path, clock)
    now = clock.wall_ms()
    bodies = [b"a", b"bb", b"ccc", b"d"]
    cases = [dict(deliver_at_ms=[now + 5000, 0, now - 10, now + 1]), dict(delay_ms=[0, 700, 0, 1]), {}]
    batch = 0
    for columns in cases:
        fast = _staged(st, broker, Rows(list(bodies), **columns), batch=batch)
        slow = _staged(st, broker, Rows(list(bodies), tags=[""] * 4, **columns), batch=batch + 1)
        batch += 2
        assert [m._replace(message_id=b"", queue_id=0) for m in fast] == \
            [m._replace(message_id=b"", queue_id=0) for m in slow], columns
        assert len({m.message_id for m in fast + slow}) == 8 and len({m.queue_id for m in fast}) == 1
    # Rows the column checks reject go through the row loop, which names the row and the error.
    broker.create_topic("plain", 4, "NORMAL")
    for rows, topic, error in [
            (Rows([b"ok"], deliver_at_ms=[now + 10 ** 13]), "out", errors.InvalidDeliveryTime),
            (Rows([b"ok", b"x"], delay_ms=[1, -1]), "out", errors.InvalidDeliveryTime),
            (Rows([b"ok"], deliver_at_ms=[True]), "out", errors.InvalidDeliveryTime),
            (Rows([b"ok", b"ok"], deliver_at_ms=[0, now + 5]), "plain", errors.MessageTypeMismatch)]:
        with pytest.raises(error):
            st.stage("s", 99, "b", 0, topic, rows)
    assert [m.body for m in _staged(st, broker, Rows([b"p"], deliver_at_ms=[0]), "plain", 100)] == [b"p"]
    broker.close()


def test_staged_chunks_stop_at_max_staged_chunks_and_publish_abort_and_ttl_make_room(tmp_path):
    clock = FakeClock()
    broker, st = _open(tmp_path, clock, max_staged_chunks=3)
    st.stage("s", 0, "a", 0, "out", _rows(1))
    st.stage("s", 0, "a", 1, "out", _rows(1))
    st.stage("s", 1, "b", 0, "out", _rows(1))
    end = broker.queue_bounds(STAGE_TOPIC, 0)[1]
    with pytest.raises(errors.TooManyRequests, match=r"max_staged_chunks \(3\)"):
        st.stage("s", 2, "c", 0, "out", _rows(1))
    assert broker.queue_bounds(STAGE_TOPIC, 0)[1] == end  # refused before anything is written
    assert st.stage("s", 0, "a", 1, "out", _rows(1)) == 1  # a resent chunk is not a new one
    _publish(st, "s", 0, [("a", 2, 2)])  # publishing frees its two
    assert st.chunks_held == 1
    st.stage("s", 2, "c", 0, "out", _rows(1))
    st.stage("s", 2, "c", 1, "out", _rows(1))
    assert st.abort("s", 2) == 2 and st.chunks_held == 1
    st.stage("s", 3, "d", 0, "out", _rows(1))
    clock.advance(broker.config.stage_ttl_ms + 1)
    assert st.sweep() == 2 and st.chunks_held == 0  # batches 1 and 3 expired
    broker.close()


def test_chunks_restored_past_a_lowered_limit_are_all_kept(tmp_path):
    broker, st = _open(tmp_path)
    for seq in range(4):
        st.stage("s", 0, "a", seq, "out", _rows(2, f"r{seq}"))
    st.stage("s", 1, "b", 0, "out", _rows(1))
    st.abort("s", 1)
    broker.close()
    broker, st = _open(tmp_path, max_staged_chunks=2)
    assert st.chunks_held == 4  # the aborted batch's chunk is gone, the rest restored whole
    with pytest.raises(errors.TooManyRequests):
        st.stage("s", 2, "c", 0, "out", _rows(1))
    assert _publish(st, "s", 0, [("a", 4, 8)]).messages == 8 and st.chunks_held == 0
    broker.close()


def _stage_end(broker):
    return broker.queue_bounds(STAGE_TOPIC, 0)[1]


def test_new_sinks_stop_at_max_stage_sinks_before_any_write_and_idle_ones_make_room(tmp_path):
    clock = FakeClock()
    broker, st = _open(tmp_path, clock, max_stage_sinks=2)
    _publish(st, "job:a", 0, [])
    st.stage("job:b", 0, "s", 0, "out", _rows(2))
    _publish(st, "job:b", 0, [("s", 1, 2)])
    st.stage("job:c", 0, "s", 0, "out", _rows(1))  # staging is bounded by max_staged_chunks, not here
    end = _stage_end(broker)
    with pytest.raises(errors.TooManyRequests, match=r"max_stage_sinks \(2\)") as refused:
        st.publish("job:c", 0, [("s", 1, 1)])
    assert "job:c" in str(refused.value)
    assert _stage_end(broker) == end  # refused before anything is written
    assert len(_visible(broker)) == 2 and not st.is_published("job:c", 0) and st.sinks.get("job:c") is None
    # Sinks already held publish on, and a replay of a published batch is still answered.
    assert _publish(st, "job:a", 1, []).messages == 0 and _publish(st, "job:b", 0, []).already_published
    clock.advance(30 * 86_400_000 + 1)
    _publish(st, "job:a", 2, [])  # job:a stays in use; job:b goes idle past SINK_FORGET_MS
    assert _publish(st, "job:c", 0, [("s", 1, 1)]).messages == 1  # job:b was forgotten to make room
    assert len(st.sinks) == 2 and st.sinks.get("job:b") is None
    broker.close()


def test_published_ids_above_a_gap_stop_at_max_stage_published_ids_and_in_order_ones_never_do(tmp_path):
    broker, st = _open(tmp_path, max_stage_published_ids=2)
    for batch in (5, 7):  # partitions finished before partition 0: held one by one
        _publish(st, "job:x", batch, [])
    assert st.sinks.ids_held == 2
    end = _stage_end(broker)
    with pytest.raises(errors.TooManyRequests, match=r"max_stage_published_ids \(2\)"):
        st.publish("job:x", 9, [])
    with pytest.raises(errors.TooManyRequests, match="max_stage_published_ids"):
        st.publish("job:new", 3, [])  # a new sink starting above 0 would hold an id too...
    assert _stage_end(broker) == end and st.sinks.get("job:new") is None  # ...refused whole
    for batch in range(0, 5):  # in order from ``below``: never refused, and they fold 5 in
        _publish(st, "job:x", batch, [])
        _publish(st, "stream", batch, [])
    assert st.sinks.ids_held == 1 and st.sinks.get("job:x").below == 6
    _publish(st, "job:x", 9, [])
    assert st.sinks.ids_held == 2
    broker.close()


def test_a_publish_under_way_counts_toward_max_stage_published_ids(tmp_path):
    broker, st = _open(tmp_path, max_stage_published_ids=1)
    for seq in range(2):
        st.stage("s", 4, "a", seq, "out", _rows(1, f"c{seq}"))
    steps = st.publish("s", 4, [("a", 2, 2)]).steps(st)
    next(steps)  # the first chunk (and "begin") written: this publish will hold id 4
    with pytest.raises(errors.TooManyRequests, match=r"1 publishes under way"):
        st.publish("s", 8, [])
    assert list(steps) == [1] and st.sinks.ids_held == 1
    broker.close()


def test_sinks_and_ids_restored_past_lowered_limits_are_all_kept(tmp_path, caplog):
    broker, st = _open(tmp_path)
    for name in ("a", "b", "c"):
        _publish(st, name, 3, [])
    st.checkpoint(force=True)
    _publish(st, "d", 0, [])  # after the state file: replayed from the log
    broker.close()
    broker, st = _open(tmp_path, max_stage_sinks=2, max_stage_published_ids=2)
    assert len(st.sinks) == 4 and st.sinks.ids_held == 3
    assert all(st.is_published(n, 3) for n in "abc") and st.is_published("d", 0)
    assert "all kept" in caplog.text
    with pytest.raises(errors.TooManyRequests, match="max_stage_sinks"):
        st.publish("e", 0, [])
    _publish(st, "d", 1, [])  # a held sink publishing in order is never refused
    broker.close()


def test_a_sink_never_counts_an_unpublished_batch_id_as_published_however_many_it_holds():
    """Ids above a gap stay until the gap fills (the id limit is what bounds them): a sink once
    folded its oldest past 100,000 into "published", and a late publish of a folded-over id
    would have been answered already_published with its rows dropped."""
    from chronoq.features.stagesinks import Sink

    s = Sink()
    for batch in range(1, 120_001):  # batch 0 is late
        s.add(batch, 1)
    assert not s.has(0) and s.has(1) and s.has(120_000) and len(s.published) == 120_000
    s.add(0, 2)  # the gap fills: everything folds into one number
    assert s.below == 120_001 and not s.published and s.has(0) and not s.has(120_001)
