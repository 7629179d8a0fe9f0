"""Offsets of the Spark source (chronoq.spark.offsets): canonical JSON, options, limits, ranges."""

from __future__ import annotations

import json

import pytest

from chronoq.spark import offsets as offs

BOUNDS = {0: (5, 20), 1: (0, 3), 2: (0, 0), 3: (7, 7)}


def test_canonical_form_is_stable_text():
    a = offs.canonical("t", {3: 1, 0: 9, 10: 2, 1: 4})
    b = offs.canonical("t", {10: 2, 1: 4, 0: 9, 3: 1})
    assert json.dumps(a) == json.dumps(b) == '{"t": {"0": 9, "1": 4, "3": 1, "10": 2}}'
    assert json.dumps(json.loads(json.dumps(a))) == json.dumps(a)  # Spark's round trip keeps it
    assert offs.positions("t", json.loads(json.dumps(a))) == {0: 9, 1: 4, 3: 1, 10: 2}
    with pytest.raises(ValueError, match="checkpoint"):
        offs.positions("other", a)


def test_starting_and_ending_options():
    assert offs.parse_option("t", None, "earliest", BOUNDS, "startingOffsets") == {0: 5, 1: 0, 2: 0, 3: 7}
    assert offs.parse_option("t", "latest", "earliest", BOUNDS, "startingOffsets") == {0: 20, 1: 3, 2: 0, 3: 7}
    got = offs.parse_option("t", '{"t": {"0": 10, "1": -1}}', "earliest", BOUNDS, "startingOffsets")
    assert got == {0: 10, 1: 3, 2: 0, 3: 7}  # missing queues: earliest
    got = offs.parse_option("t", '{"t": {"0": -2}}', "latest", BOUNDS, "endingOffsets")
    assert got == {0: 5, 1: 3, 2: 0, 3: 7}  # missing queues: latest
    for bad in ("soon", '{"x": {"0": 1}}', '{"t": {"9": 1}}', '{"t": {"0": -3}}', '{"t": {"0": "1"}}', "[1]"):
        with pytest.raises(ValueError):
            offs.parse_option("t", bad, "earliest", BOUNDS, "startingOffsets")


def test_limit_is_shared_fairly_and_filled():
    start, end = {0: 0, 1: 0, 2: 0}, {0: 100, 1: 3, 2: 50}
    assert offs.limit_rows(start, end, None) == end
    got = offs.limit_rows(start, end, 30)
    assert sum(got[q] - start[q] for q in got) == 30 and got[1] == 3  # the short queue's share goes on
    assert offs.limit_rows(start, end, 1000) == end
    assert offs.limit_rows({0: 100, 1: 3, 2: 50}, end, 10) == end  # nothing new
    grown = offs.limit_rows({0: 0}, {0: 10, 1: 10}, 4)  # a queue the start does not know counts from 0
    assert grown == {0: 2, 1: 2}


def test_ranges_cover_exactly_and_are_bounded():
    parts = offs.ranges({0: 5, 1: 0}, {0: 25, 1: 3, 2: 4}, 8)
    assert parts == [(0, 5, 13), (0, 13, 21), (0, 21, 25), (1, 0, 3), (2, 0, 4)]
    assert offs.ranges({0: 5}, {0: 5}, 8) == []


def test_several_topics_offsets_options_and_limits():
    bounds = {"b": {0: (0, 4)}, "a": {0: (2, 10), 1: (0, 0)}}
    start = offs.parse_option_many(None, "earliest", bounds, "startingOffsets")
    assert start == {("b", 0): 0, ("a", 0): 2, ("a", 1): 0}
    text = json.dumps(offs.canonical_many(start))
    assert text == '{"a": {"0": 2, "1": 0}, "b": {"0": 0}}'  # topics sorted: one text per position
    assert offs.positions_many(json.loads(text), frozenset({"a", "b"})) == start
    assert offs.positions_many(json.loads(text)) == start  # a pattern: any topic
    with pytest.raises(ValueError, match="new checkpoint location"):
        offs.positions_many(json.loads(text), frozenset({"a"}))
    # JSON naming one topic: the others start at their earliest (ending: their latest).
    got = offs.parse_option_many('{"a": {"0": -1}}', "latest", bounds, "startingOffsets")
    assert got == {("a", 0): 10, ("a", 1): 0, ("b", 0): 0}
    got = offs.parse_option_many('{"a": {"0": 5}}', "latest", bounds, "endingOffsets")
    assert got == {("a", 0): 5, ("a", 1): 0, ("b", 0): 4}
    for bad in ('{"c": {"0": 1}}', "soon", "[1]"):
        with pytest.raises(ValueError):
            offs.parse_option_many(bad, "earliest", bounds, "startingOffsets")
    end = {("a", 0): 10, ("a", 1): 0, ("b", 0): 4}
    cut = offs.limit_rows(start, end, 6)
    assert sum(cut[k] - start[k] for k in cut) == 6 and cut[("b", 0)] - start[("b", 0)] == 3  # shared fairly
    assert offs.ranges(start, end, 5) == [(("a", 0), 2, 7), (("a", 0), 7, 10), (("b", 0), 0, 4)]


def test_read_options_kafka_aliases_and_unknown_options():
    pytest.importorskip("pyspark")
    from chronoq.spark.source import READ_OPTIONS, Settings

    base = {"endpoints": "127.0.0.1:1"}
    s = Settings.parse({**base, "subscribe": "orders, bills,orders", "maxOffsetsPerTrigger": "500"}, reading=True)
    assert s.topics == ("orders", "bills") and s.pattern is None and s.max_per_trigger == 500
    s = Settings.parse({**base, "subscribePattern": "ord.*", "maxRecordsPerTrigger": "7"}, reading=True)
    assert s.topics == () and s.pattern == "ord.*" and s.max_per_trigger == 7
    assert Settings.parse({**base, "topic": "orders"}, reading=True).topics == ("orders",)
    with pytest.raises(ValueError, match="the same limit"):
        Settings.parse({**base, "topic": "t", "maxRecordsPerTrigger": "5", "maxOffsetsPerTrigger": "6"}, reading=True)
    with pytest.raises(ValueError, match="topic and subscribe given"):
        Settings.parse({**base, "topic": "t", "subscribe": "u"}, reading=True)
    with pytest.raises(ValueError, match="none given"):
        Settings.parse(base, reading=True)
    with pytest.raises(ValueError, match="not a regular expression"):
        Settings.parse({**base, "subscribePattern": "("}, reading=True)
    with pytest.raises(ValueError) as info:
        Settings.parse({**base, "topic": "t", "startingoffset": "earliest"}, reading=True)  # a typo
    assert "startingoffset" in str(info.value)
    assert all(name in str(info.value) for name in READ_OPTIONS)
    # The sink's options are not the source's: a write keeps its own checks.
    assert Settings.parse({**base, "topic": "t", "checkpointlocation": "/x"}).topic == "t"
    with pytest.raises(ValueError, match="does not know the read option.s. jobid"):
        Settings.parse({**base, "topic": "t", "jobid": "j"}, reading=True)


def test_write_options_unknown_ones_are_refused():
    """A misspelt write option (Spark hands them lowercased) is refused, naming what the sink
    takes: a misspelt jobId used to become a random id, and a re-run published everything again."""
    pytest.importorskip("pyspark")
    from pyspark.sql.datasource import CaseInsensitiveDict  # what Spark hands a data source

    from chronoq.spark.source import WRITE_OPTIONS, Settings

    base = {"endpoints": "127.0.0.1:1", "topic": "t"}
    s = Settings.parse(CaseInsensitiveDict({**base, "jobId": "nightly", "atomic": "true", "sinkId": "s",
                                            "timeoutSeconds": "3", "checkpointLocation": "/ck", "tls": "false",
                                            "tlsCaFile": "", "accessKey": "a", "secretKey": "b"}))
    assert (s.job_id, s.atomic, s.sink_id, s.timeout_s, s.checkpoint) == ("nightly", True, "s", 3.0, "/ck")
    with pytest.raises(ValueError) as info:
        Settings.parse({**base, "jobld": "nightly"})  # a typo
    assert "does not know the write option(s) jobld" in str(info.value)
    assert all(name in str(info.value) for name in WRITE_OPTIONS)
    with pytest.raises(ValueError, match="startingoffsets"):  # a read option on a write
        Settings.parse({**base, "startingoffsets": "earliest"})
    with pytest.raises(ValueError, match="takes no path"):  # save("/some/path")
        Settings.parse({**base, "path": "/some/path"})


def test_first_offset_at_or_after_a_time():
    times = [10, 10, 20, 20, 20, 30, 45]  # offsets 3.. of a queue whose first three were deleted
    reads = []

    def time_at(offset: int) -> int:
        reads.append(offset)
        return times[offset - 3]

    for at_ms, want in ((0, 3), (10, 3), (11, 5), (20, 5), (21, 8), (45, 9), (46, 10)):
        reads.clear()
        assert offs.first_at_or_after(3, 10, time_at, at_ms) == want, at_ms
        assert len(reads) <= 3  # log2(7) reads, not a scan
    assert offs.first_at_or_after(4, 4, time_at, 0) == 4  # an empty queue: its end


def test_starting_timestamp_option():
    pytest.importorskip("pyspark")
    from chronoq.spark.source import Settings

    base = {"endpoints": "127.0.0.1:1", "topic": "t"}
    assert Settings.parse({**base, "startingTimestamp": "1700000000000"}, reading=True).starting_ms == 1700000000000
    assert Settings.parse(base, reading=True).starting_ms is None
    with pytest.raises(ValueError, match="not both"):
        Settings.parse({**base, "startingTimestamp": "1", "startingOffsets": "earliest"}, reading=True)
    for bad in ("soon", "-5", "1.5"):
        with pytest.raises(ValueError, match="epoch milliseconds"):
            Settings.parse({**base, "startingTimestamp": bad}, reading=True)


def test_queues_of_a_topic_spread_over_broker_groups_name_their_group():
    g = offs.GroupQueue
    bounds = {g("g2", 0): (0, 4), g("g1", 1): (0, 3), g("g1", 0): (2, 9), g("g1", 10): (0, 1)}
    start = offs.parse_option_many(None, "earliest", {"t": bounds}, "startingOffsets")
    text = json.dumps(offs.canonical_many(start))
    assert text == '{"t": {"g1/0": 2, "g1/1": 0, "g1/10": 0, "g2/0": 0}}'  # group, then queue in numeric order
    assert offs.positions_many(json.loads(text), frozenset({"t"})) == start
    got = offs.parse_option_many('{"t": {"g2/0": 3, "g1/0": -1}}', "earliest", {"t": bounds}, "startingOffsets")
    assert got[("t", g("g2", 0))] == 3 and got[("t", g("g1", 0))] == 9 and got[("t", g("g1", 1))] == 0
    for bad in ('{"t": {"0": 1}}', '{"t": {"g3/0": 1}}', '{"t": {"g1/x": 1}}', '{"t": {"/0": 1}}'):
        with pytest.raises(ValueError, match="has no queue"):
            offs.parse_option_many(bad, "earliest", {"t": bounds}, "startingOffsets")
    end = {("t", q): hi for q, (_lo, hi) in bounds.items()}
    assert offs.ranges(start, end, 4) == [(("t", g("g1", 0)), 2, 6), (("t", g("g1", 0)), 6, 9),
                                          (("t", g("g1", 1)), 0, 3), (("t", g("g1", 10)), 0, 1),
                                          (("t", g("g2", 0)), 0, 4)]
    cut = offs.limit_rows(start, end, 8)
    assert sum(cut[k] - start[k] for k in cut) == 8 and cut[("t", g("g2", 0))] == 2
    # A checkpoint written before the topic was spread: its bare ids are the queues of the group
    # the query reads through; other topics keep theirs.
    old = offs.positions_many(json.loads('{"t": {"0": 5, "1": 7}, "u": {"0": 1}}'))
    assert offs.adopt(old, {"t": "g1"}) == {("t", g("g1", 0)): 5, ("t", g("g1", 1)): 7, ("u", 0): 1}
    assert offs.parse_queue("12") == 12 and offs.parse_queue("g.x-1/3") == g("g.x-1", 3)


def test_a_checkpoint_named_another_way_is_the_same_sink(tmp_path, monkeypatch):
    # The stream sink's id comes from its checkpoint location: spelt relative, absolute, as a
    # file: URI or with a trailing slash, a restart must find the same sink (else the batch Spark
    # replays after a crash is published again).
    pytest.importorskip("pyspark")
    from chronoq.spark.source import checkpoint_key

    monkeypatch.chdir(tmp_path)
    here = str(tmp_path / "s5" / "ckpt")
    spellings = ["s5/ckpt", "./s5/ckpt/", here, here + "/", "file:" + here, "file://" + here, "file:///" + here.lstrip("/"),
                 str(tmp_path / "s5" / "x" / ".." / "ckpt")]
    assert {checkpoint_key(s) for s in spellings} == {here}
    assert checkpoint_key("hdfs://nn:8020/ckpt/q1/") == "hdfs://nn:8020/ckpt/q1"
    assert checkpoint_key("s3a://bucket/ckpt") != checkpoint_key("s3a://bucket/other")


def test_batch_ranges_that_cannot_be_read_are_refused():
    bounds = {"a": {0: (5, 10), 1: (0, 0)}}
    offs.check_batch_range({("a", 0): 5, ("a", 1): 0}, {("a", 0): 10, ("a", 1): 0}, bounds)  # all, and empty
    offs.check_batch_range({("a", 0): 7}, {("a", 0): 7, ("a", 1): 0}, bounds)  # start == end: nothing
    with pytest.raises(ValueError, match="startingOffsets 8 is after endingOffsets 7 for queue 0 of topic a"):
        offs.check_batch_range({("a", 0): 8}, {("a", 0): 7}, bounds)
    with pytest.raises(ValueError, match="queue 0 of topic a ends at offset 10; 11 is past it"):
        offs.check_batch_range({("a", 0): 5}, {("a", 0): 11}, bounds)
