"""Recall handles naming their broker group (chronoq.timer.handle version 2, issue 23 step 3)."""

from __future__ import annotations

import pytest

from chronoq.core import errors
from chronoq.timer import handle as handles


def test_a_handle_minted_outside_a_cluster_is_version_1_and_names_no_group():
    text = handles.encode(handles.TIMER, 0, 4096, 1_700_000_000_000, "orders", "MID-1")
    assert text.startswith("1")
    assert handles.decode(text) == handles.RecallHandle(handles.TIMER, 0, 4096, 1_700_000_000_000, "orders", "MID-1")
    assert handles.decode(text).group == ""


def test_a_handle_minted_in_a_cluster_names_its_group_and_round_trips():
    text = handles.encode(handles.LEVEL, 3, 77, 1_700_000_000_000, "orders", "MID-2", "g2")
    assert text.startswith("2")
    h = handles.decode(text)
    assert (h.kind, h.level, h.position, h.topic, h.message_id, h.group) == (handles.LEVEL, 3, 77, "orders", "MID-2",
                                                                           "g2")
    assert h.encode() == text


def test_the_batch_encoder_names_the_group_as_the_single_one_does():
    positions, dues, topics, ids = [1, 2, 3], [10, 20, 30], ["a", "b", "a"], [b"m1", "m2", b"m3"]
    for group in ("", "g1", "group-with.a_long-name" * 5):
        many = handles.encode_many(handles.TIMER, positions, dues, topics, ids, group)
        one = [handles.encode(handles.TIMER, 0, p, d, t, m if isinstance(m, str) else m.decode(), group)
               for p, d, t, m in zip(positions, dues, topics, ids)]
        assert many == one
        assert {handles.decode(x).group for x in many} == {group}


def test_a_mangled_group_fails_the_checksum():
    text = handles.encode(handles.TIMER, 0, 1, 2, "t", "m", "g1")
    h = handles.decode(text)
    other = handles.encode(handles.TIMER, 0, 1, 2, "t", "m", "g2")
    assert handles.decode(other).group == "g2" and h.group == "g1"
    tampered = text[:-3] + ("A" if text[-3] != "A" else "B") + text[-2:]
    with pytest.raises(errors.ClientError):
        handles.decode(tampered)
    with pytest.raises(errors.ClientError, match="version '3' is not supported"):
        handles.decode("3" + text[1:])
