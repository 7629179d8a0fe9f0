"""The pure parts of a cluster's placement (chronoq.replication.placement): the snapshot read
from etcd's keys, the default policy, refusals, the route, a group's identity."""

from __future__ import annotations

import json

import pytest

from chronoq.core import errors
from chronoq.replication import coordinator as co
from chronoq.replication import placement as pl


def keys(cluster: str, live: dict, dead: tuple = (), placements: dict | None = None) -> list:
    out = []
    for group, endpoint in live.items():
        leader = co.Leader(endpoint, "n", endpoint, 1)
        out += [(co.leader_key(cluster, group), leader.encode(), 5), (co.epoch_key(cluster, group), b"1", 4),
                (co.member_key(cluster, group, endpoint),
                 co.member_value(endpoint, "n", "primary", endpoint, 0, 1), 6)]
    for group in dead:
        out.append((co.epoch_key(cluster, group), b"3", 2))
    for topic, p in (placements or {}).items():
        out.append((pl.topic_key(cluster, topic), p.encode(), 9))
    out.append((pl.identity_key(cluster, "g1"), json.dumps({"id": "abc"}).encode(), 3))
    return out


def snapshot(**kw) -> pl.Snapshot:
    return pl.parse("c", 10, keys("c", **kw))


def test_the_snapshot_names_groups_live_and_dead_placements_and_identities():
    snap = snapshot(live={"g1": "h:1", "g2": "h:2"}, dead=("g3",),
                    placements={"t": pl.Placement("t", "fifo", {"g1": 2, "g3": 1})})
    assert sorted(snap.groups) == ["g1", "g2", "g3"] and snap.live() == ["g1", "g2"]
    assert snap.groups["g1"].leader.endpoint == "h:1" and "h:1" in snap.groups["g1"].members
    assert snap.placements["t"] == pl.Placement("t", "fifo", {"g1": 2, "g3": 1}, (), 9)
    assert snap.identities == {"g1": {"id": "abc"}}


def test_the_default_policy_puts_the_queue_count_on_every_live_group():
    snap = snapshot(live={"g1": "h:1", "g2": "h:2"}, dead=("g3",))
    p = pl.place(snap, "c", "t", 4, "", None)
    assert (p.groups, p.message_type, p.queues()) == ({"g1": 4, "g2": 4}, "mixed", 8)
    assert pl.place(snap, "c", "t", 2, "delay", ["g2"]).groups == {"g2": 2}


def test_an_existing_placement_grows_and_keeps_its_groups_and_type():
    old = pl.Placement("t", "mixed", {"g1": 4})
    snap = snapshot(live={"g1": "h:1", "g2": "h:2"}, placements={"t": old})
    assert pl.place(snap, "c", "t", 2, "", None).groups == {"g1": 4}       # (never shrinks; g2 not added)
    assert pl.place(snap, "c", "t", 6, "", ["g2"]).groups == {"g1": 4, "g2": 6}
    with pytest.raises(errors.ClientError, match="has type mixed in cluster c"):
        pl.place(snap, "c", "t", 4, "fifo", None)
    assert pl.add_queues(snap, "c", "t", "g2", None).groups == {"g1": 4, "g2": 4}


def test_refusals_name_the_group():
    snap = snapshot(live={"g1": "h:1"}, dead=("g3",), placements={"t": pl.Placement("t", "mixed", {"g1": 2})})
    with pytest.raises(errors.ClientError, match="unknown broker group 'g9' in cluster c \\(groups: g1, g3\\)"):
        pl.place(snap, "c", "u", 2, "", ["g9"])
    with pytest.raises(errors.ClientError, match="broker group 'g3' has no primary now"):
        pl.add_queues(snap, "c", "t", "g3", 2)
    with pytest.raises(errors.ClientError, match="last group taking sends of t"):
        pl.drain(snap, "c", "t", "g1")
    with pytest.raises(errors.TopicNotFound):
        pl.add_queues(snap, "c", "nope", "g1", 1)
    with pytest.raises(errors.ClientError, match="no live broker group"):
        pl.place(snapshot(live={}, dead=("g3",)), "c", "u", 2, "", None)


def test_the_route_drops_dead_groups_and_marks_draining_ones_read_only():
    placed = pl.Placement("t", "mixed", {"g1": 2, "g2": 1, "g3": 3}, ("g2",))
    snap = snapshot(live={"g1": "h:1", "g2": "h:2"}, dead=("g3",), placements={"t": placed})
    assert pl.route(snap, "t") == [("g1", "h:1", 0, True), ("g1", "h:1", 1, True), ("g2", "h:2", 0, False)]
    assert pl.route(snap, "other") is None


def test_a_group_name_is_claimed_by_one_identity():
    assert pl.claim("c", "g1", None, None) == ("", None)  # a new group: an identity is made
    assert pl.claim("c", "g1", None, {"id": "abc"}) == ("abc", None)  # a fresh node joins
    assert pl.claim("c", "g1", {"cluster": "c", "group": "g1", "id": "abc"}, {"id": "abc"}) == ("abc", None)
    _, why = pl.claim("c", "g1", {"cluster": "c", "group": "g1", "id": "zzz"}, {"id": "abc"})
    assert "is taken in etcd by another group" in why
    _, why = pl.claim("c", "g1", {"cluster": "d", "group": "g1", "id": "abc"}, None)
    assert "belongs to broker group 'g1' of cluster 'd'" in why


def test_removing_a_group_checks_every_topic_holding_it_before_anything():
    snap = snapshot(live={"g1": "h:1", "g2": "h:2"}, dead=("g3",), placements={
        "a": pl.Placement("a", "mixed", {"g1": 2, "g2": 2}), "b": pl.Placement("b", "fifo", {"g2": 1, "g3": 1}),
        "c": pl.Placement("c", "mixed", {"g2": 4}), "d": pl.Placement("d", "mixed", {"g2": 1, "g1": 1}, ("g1",))})
    assert pl.group_topics(snap, "c", "g1") == ["a", "d"]
    assert pl.group_topics(snap, "c", "g3") == ["b"]  # (a dead group: the caller decides, --force)
    with pytest.raises(errors.ClientError, match="unknown broker group 'g9' in cluster c \\(groups: g1, g2, g3\\)"):
        pl.group_topics(snap, "c", "g9")
    with pytest.raises(errors.ClientError, match="g2 is the last group taking sends of c, d: place each"):
        pl.group_topics(snap, "c", "g2")


def test_a_group_is_removed_from_a_placement_only_once_drained_and_never_the_last_sender():
    snap = snapshot(live={"g1": "h:1", "g2": "h:2"}, placements={
        "t": pl.Placement("t", "delay", {"g1": 2, "g2": 3}), "u": pl.Placement("u", "mixed", {"g2": 1})})
    with pytest.raises(errors.ClientError, match="g2 still takes sends of t: drain it first"):
        pl.remove_group(snap, "c", "t", "g2")
    drained = pl.drain(snap, "c", "t", "g2")
    assert drained.draining == ("g2",)
    snap.placements["t"] = drained
    removed = pl.remove_group(snap, "c", "t", "g2")
    assert (removed.groups, removed.draining, removed.message_type, removed.revision) == ({"g1": 2}, (), "delay", 9)
    assert pl.route(pl.Snapshot(snap.revision, snap.groups, {"t": removed}), "t") == [
        ("g1", "h:1", 0, True), ("g1", "h:1", 1, True)]
    snap.placements["t"] = removed
    assert pl.remove_group(snap, "c", "t", "g2") is removed  # (again: nothing to write)
    snap.placements["u"] = pl.Placement("u", "mixed", {"g1": 1, "g2": 1}, ("g1", "g2"))
    with pytest.raises(errors.ClientError, match="no other group would take its sends"):
        pl.remove_group(snap, "c", "u", "g2")
    with pytest.raises(errors.TopicNotFound):
        pl.remove_group(snap, "c", "nope", "g2")
