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
