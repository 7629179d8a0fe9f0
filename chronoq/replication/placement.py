"""Broker groups and topic placement across a cluster: the pure parts (keys, values, the policy).

The shell that reads, watches and writes these keys is ``chronoq.replication.cluster``; the
broker's side (local parts, the route) is ``chronoq.server.cluster``. docs/cluster.md describes
the whole. Beside each group's own keys (``chronoq.replication.coordinator``: ``leader``,
``epoch``, ``insync``, ``members/<node>`` under ``/chronoq/<cluster>/<group>/``) one cluster-wide
record per topic and one per group:

================================= =================================================== =====
key                               value (JSON)                                        lease
================================= =================================================== =====
``/chronoq/<c>/@topics/<name>``   ``{"type": "mixed", "groups": {"<group>": queues},   none
                                  "draining": ["<group>", ...]}``: which groups hold
                                  the topic's queues, and how many each (the group's
                                  local queue ids ``0..queues-1``); a draining group
                                  is routed for receives only; a group removed
                                  (``remove_group``) is no longer named
``/chronoq/<c>/@groups/<group>``  ``{"id", "created_ms"}``: the group's identity,      none
                                  created once (a transaction) by its first node and
                                  kept in each member's data directory
                                  (``cluster.json``: ``{"cluster", "group", "id"}``);
                                  a directory bound to another identity is refused
                                  the name: two groups cannot claim one name
================================= =================================================== =====

``@`` cannot start a group name (``cluster_name``/``group_name`` are letters, digits, ``-``,
``_``, ``.``), so the record never collides with a group's keys. Every write of a record is an
etcd transaction comparing the record's mod revision with the one the change was computed from:
two creators cannot both win; the loser computes again from what the winner wrote.

A group is *known* when etcd holds any key of it (an epoch: a leader was elected once) and *live*
while its ``leader`` key exists (it hangs on the leader's lease: a dead primary's group drops out
within the TTL, at once on a clean stop).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from chronoq.core import errors
from chronoq.replication import coordinator as co

TOPICS = "@topics/"
GROUPS = "@groups/"
IDENTITY_FILE = "cluster.json"
TOPIC_TYPES = ("mixed", "normal", "fifo", "delay", "transaction")


def cluster_prefix(cluster: str) -> bytes:
    return f"/chronoq/{cluster}/".encode()


def identity_key(cluster: str, group: str) -> bytes:
    return f"/chronoq/{cluster}/{GROUPS}{group}".encode()


def topic_key(cluster: str, topic: str) -> bytes:
    return f"/chronoq/{cluster}/{TOPICS}{topic}".encode()


@dataclass(frozen=True)
class Placement:
    topic: str
    message_type: str = "mixed"
    groups: dict = field(default_factory=dict)   # group -> queue count (its local ids 0..n-1)
    draining: tuple = ()                          # groups routed for receives only
    revision: int = 0                             # the record's mod revision in etcd (0: not written)

    def encode(self) -> bytes:
        return json.dumps({"type": self.message_type, "groups": dict(sorted(self.groups.items())),
                           "draining": sorted(self.draining)}, sort_keys=True).encode()

    @staticmethod
    def decode(topic: str, raw: bytes, revision: int = 0) -> "Placement":
        value = json.loads(raw)
        return Placement(topic, str(value.get("type", "mixed")), {str(g): int(n) for g, n in value["groups"].items()},
                         tuple(sorted(value.get("draining", ()))), revision)

    def queues(self) -> int:
        return sum(self.groups.values())


@dataclass
class GroupState:
    name: str
    leader: co.Leader | None = None
    epoch: int = 0
    members: dict = field(default_factory=dict)  # node -> decoded member value


@dataclass
class Snapshot:
    """The cluster as etcd says at one revision: its groups and its placement records."""
    revision: int = 0
    groups: dict = field(default_factory=dict)      # name -> GroupState
    placements: dict = field(default_factory=dict)  # topic -> Placement
    identities: dict = field(default_factory=dict)  # group -> its identity record

    def live(self) -> list[str]:
        return sorted(g for g, s in self.groups.items() if s.leader is not None)


def parse(cluster: str, revision: int, kvs) -> Snapshot:
    """A ``Snapshot`` from the keys under ``/chronoq/<cluster>/`` (``(key, value, mod_revision)``)."""
    base = cluster_prefix(cluster).decode()
    snap = Snapshot(revision)
    for key, value, mod in kvs:
        rel = key.decode()[len(base):]
        if rel.startswith(TOPICS):
            topic = rel[len(TOPICS):]
            try:
                snap.placements[topic] = Placement.decode(topic, value, mod)
            except (ValueError, KeyError, TypeError):
                continue  # (a record this version cannot read is ignored, not fatal)
            continue
        group, _, what = rel.partition("/")
        if group == GROUPS[:-1]:
            try:
                snap.identities[what] = json.loads(value)
            except ValueError:
                pass
            continue
        if not group or not what or group.startswith("@"):
            continue
        state = snap.groups.setdefault(group, GroupState(group))
        try:
            if what == "leader":
                state.leader = co.Leader.decode(value)
            elif what == "epoch":
                state.epoch = int(value)
            elif what.startswith("members/"):
                state.members[what[len("members/"):]] = json.loads(value)
        except (ValueError, KeyError, TypeError):
            continue
    return snap


# ------------------------------------------------------------------------------------- the policy
def _check_groups(snap: Snapshot, wanted: list[str], cluster: str) -> None:
    live = snap.live()
    for g in wanted:
        if g not in snap.groups:
            known = ", ".join(sorted(snap.groups)) or "none"
            raise errors.ClientError(f"unknown broker group {g!r} in cluster {cluster} (groups: {known}): start its "
                                     "primary with --group-name first")
        if g not in live:
            raise errors.ClientError(
                f"broker group {g!r} has no primary now (no leader key in etcd; live groups: "
                f"{', '.join(live) or 'none'}): queues are placed on live groups only")


def place(snap: Snapshot, cluster: str, topic: str, queues: int, message_type: str,
          groups: list[str] | None) -> Placement:
    """The record ``chronoq topic create`` writes. Default policy: ``queues`` queues on **each**
    live group (as RocketMQ creates a topic on every broker of a cluster); ``groups``: those only.
    An existing record keeps its groups and counts, growing them to ``queues`` and adding the
    groups named; its type stays (a different one is refused)."""
    if not 1 <= queues <= 65535:
        raise errors.InvalidQueue(f"queue count must be between 1 and 65535, not {queues}")
    message_type = message_type or "mixed"
    if message_type not in TOPIC_TYPES:
        raise errors.ClientError(f"topic type must be one of {', '.join(TOPIC_TYPES)}, not {message_type!r}")
    existing = snap.placements.get(topic)
    if groups:
        wanted = sorted(set(groups))
        _check_groups(snap, wanted, cluster)
    elif existing is not None:
        wanted = sorted(existing.groups)
    else:
        wanted = snap.live()
        if not wanted:
            raise errors.ClientError(f"cluster {cluster} has no live broker group (no leader key in etcd)")
    if existing is None:
        return Placement(topic, message_type, {g: queues for g in wanted})
    if message_type != existing.message_type:
        raise errors.ClientError(f"topic {topic} has type {existing.message_type} in cluster {cluster}; "
                                 f"not changed to {message_type}")
    placed = dict(existing.groups)
    for g in wanted:
        placed[g] = max(placed.get(g, 0), queues)
    return Placement(topic, existing.message_type, placed, tuple(d for d in existing.draining if d not in wanted),
                     existing.revision)


def add_queues(snap: Snapshot, cluster: str, topic: str, group: str, queues: int | None) -> Placement:
    """``chronoq topic add-queues``: ``group`` (live) holds ``queues`` of the topic (default: as
    many as the group holding most); counts only grow."""
    existing = snap.placements.get(topic)
    if existing is None:
        raise errors.TopicNotFound(f"topic {topic!r} has no placement in cluster {cluster}: create it first")
    _check_groups(snap, [group], cluster)
    count = queues or max(existing.groups.values())
    if count < existing.groups.get(group, 0):
        raise errors.InvalidQueue(f"group {group} holds {existing.groups[group]} queues of {topic}; the count can "
                                  "only grow")
    placed = dict(existing.groups, **{group: count})
    return Placement(topic, existing.message_type, placed, tuple(d for d in existing.draining if d != group),
                     existing.revision)


def drain(snap: Snapshot, cluster: str, topic: str, group: str) -> Placement:
    """Stop routing sends of ``topic`` to ``group`` (its queues stay readable until consumed):
    refused when no other group would take sends."""
    existing = snap.placements.get(topic)
    if existing is None:
        raise errors.TopicNotFound(f"topic {topic!r} has no placement in cluster {cluster}")
    if group not in existing.groups:
        raise errors.ClientError(f"group {group!r} holds no queue of {topic} (it is on "
                                 f"{', '.join(sorted(existing.groups))})")
    writers = [g for g in existing.groups if g != group and g not in existing.draining]
    if not writers:
        raise errors.ClientError(f"group {group} is the last group taking sends of {topic}: place it on another "
                                 f"group first (chronoq topic add-queues {topic} --group OTHER)")
    return Placement(topic, existing.message_type, dict(existing.groups),
                     tuple(sorted(set(existing.draining) | {group})), existing.revision)


def group_topics(snap: Snapshot, cluster: str, group: str) -> list[str]:
    """The topics whose placement holds ``group``, checked for ``chronoq cluster remove-group``
    (each is drained, then the group removed from it): refused for a group etcd does not know, and
    for one that is the last group taking sends of some topic (naming every such topic)."""
    if group not in snap.groups and not any(group in p.groups for p in snap.placements.values()):
        known = ", ".join(sorted(snap.groups)) or "none"
        raise errors.ClientError(f"unknown broker group {group!r} in cluster {cluster} (groups: {known})")
    held = sorted(t for t, p in snap.placements.items() if group in p.groups)
    last = [t for t in held if not [g for g in snap.placements[t].groups
                                    if g != group and g not in snap.placements[t].draining]]
    if last:
        raise errors.ClientError(
            f"group {group} is the last group taking sends of {', '.join(last)}: place "
            f"{'it' if len(last) == 1 else 'each'} on another group first (chronoq topic add-queues TOPIC --group "
            "OTHER)")
    return held


def remove_group(snap: Snapshot, cluster: str, topic: str, group: str) -> Placement:
    """``group`` out of ``topic``'s placement for good (its queues leave the route). Only a
    draining group is removed (the caller waited for its lag: ``chronoq cluster remove-group``),
    and never the last one taking sends; a group the placement no longer holds: unchanged."""
    existing = snap.placements.get(topic)
    if existing is None:
        raise errors.TopicNotFound(f"topic {topic!r} has no placement in cluster {cluster}")
    if group not in existing.groups:
        return existing  # (removed already: nothing to write)
    if group not in existing.draining:
        raise errors.ClientError(f"group {group} still takes sends of {topic}: drain it first (chronoq cluster "
                                 f"remove-group {group} drains it and waits for its lag)")
    left = {g: n for g, n in existing.groups.items() if g != group}
    if not [g for g in left if g not in existing.draining]:
        raise errors.ClientError(f"group {group} cannot leave {topic}: no other group would take its sends")
    return Placement(topic, existing.message_type, left, tuple(d for d in existing.draining if d != group),
                     existing.revision)


def route(snap: Snapshot, topic: str) -> list[tuple[str, str, int, bool]] | None:
    """The queues of ``topic`` across the cluster: ``(group, leader endpoint, queue id, writable)``
    for every queue of every live group holding it, groups by name; None: no placement record."""
    placement = snap.placements.get(topic)
    if placement is None:
        return None
    out = []
    for group in sorted(placement.groups):
        state = snap.groups.get(group)
        if state is None or state.leader is None:
            continue  # a dead group (no leader key) is dropped at once
        writable = group not in placement.draining
        out.extend((group, state.leader.endpoint, q, writable) for q in range(placement.groups[group]))
    return out


# ------------------------------------------------------------------------------ a group's identity
def claim(cluster: str, group: str, local: dict | None, recorded: dict | None) -> tuple[str, str | None]:
    """A starting node's check of its group name: ``(identity, None)`` to go on with (the
    identity to record, in etcd when ``recorded`` is None and in the data directory), or
    ``("", why)`` to refuse. ``local``: the data directory's ``cluster.json`` (None: a fresh or
    a pre-cluster directory, which joins whatever identity the name has)."""
    if local is not None and (local.get("cluster"), local.get("group")) != (cluster, group):
        return "", (f"this data directory belongs to broker group {local.get('group')!r} of cluster "
                    f"{local.get('cluster')!r}, not {group!r} of {cluster!r}: start it with its own --cluster-name and "
                    "--group-name (or give the new group a fresh data directory)")
    if recorded is None:
        return (local or {}).get("id") or "", None
    if local is not None and local.get("id") and local["id"] != recorded.get("id"):
        return "", (f"broker group name {group!r} of cluster {cluster!r} is taken in etcd by another group (identity "
                    f"{recorded.get('id')}); this data directory belongs to a group of the same name with identity "
                    f"{local['id']}: two groups cannot share a name, choose another --group-name")
    return str(recorded.get("id", "")), None
