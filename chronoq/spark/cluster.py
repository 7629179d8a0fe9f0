"""Where a topic's queues live, for the data source: one node, or every broker group of a cluster
(docs/cluster.md; docs/spark.md, "Across a cluster").

The driver asks the endpoint the user gave (``ClusterGroups``, an Admin call answered from etcd by
any group's primary) for the cluster's groups and placements, once per planning. A topic with a
placement record is read from, and written to, every group holding it, each at its primary's
endpoint; a topic without one (a node without etcd, or a topic created on one node) stays on the
node asked, exactly as before clusters. Tasks are handed the group's endpoint with their
partition, and talk to that endpoint only: a queue id means something on its own group alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from chronoq.spark import rpc

PRECONDITION_FAILED = 42800  # Code.PRECONDITION_FAILED: "this broker is not part of a cluster"


@dataclass(frozen=True)
class Topology:
    """The cluster as the node asked sees it (empty ``group``: a node without etcd)."""

    group: str = ""                                   # the answering node's group
    leaders: dict[str, str] = field(default_factory=dict)          # live group -> its primary's endpoint
    placements: dict[str, dict[str, int]] = field(default_factory=dict)  # topic -> {group: queues}
    draining: dict[str, frozenset] = field(default_factory=dict)   # topic -> groups routed READ only
    known: tuple[str, ...] = ()                        # every group etcd knows, live or not

    def members(self) -> list[tuple[str, str]]:
        """(group, endpoint) of every group of the cluster, by name; a group without a primary
        now is refused (what reads the whole cluster, the audit, would miss it)."""
        dead = [g for g in self.known if g not in self.leaders]
        if dead:
            raise RuntimeError(f"chronoq: broker group(s) {', '.join(dead)} have no primary now (live: "
                               f"{', '.join(sorted(self.leaders)) or 'none'}): the whole cluster cannot be read")
        return sorted(self.leaders.items())

    def spread(self, topic: str) -> bool:
        return topic in self.placements

    def groups_of(self, topic: str) -> list[str]:
        return sorted(self.placements.get(topic, {}))

    def readable(self, topic: str, strict: bool) -> list[tuple[str, str]]:
        """(group, endpoint) of every group holding ``topic``, by name. A group without a primary
        now is refused when ``strict`` (a batch read would miss its queues), else left out (a
        stream keeps its position and reads it once it is back)."""
        out = []
        for group in self.groups_of(topic):
            endpoint = self.leaders.get(group)
            if endpoint is None:
                if strict:
                    raise RuntimeError(
                        f"chronoq: broker group {group!r}, which holds queues of topic {topic!r}, has no primary "
                        f"now (live groups: {', '.join(sorted(self.leaders)) or 'none'}): the read would miss "
                        "them; try again once a replica took over or the primary is back")
                continue
            out.append((group, endpoint))
        return out

    def writable(self, topic: str) -> list[tuple[str, str]]:
        """(group, endpoint) of the live groups taking sends of ``topic`` (not draining), by name:
        the groups the route sends to (``chronoq.client.routed``)."""
        out = [(g, e) for g, e in self.readable(topic, strict=False) if g not in self.draining.get(topic, ())]
        if self.spread(topic) and not out:
            raise RuntimeError(f"chronoq: no live broker group takes sends of topic {topic!r} "
                               f"(groups holding it: {', '.join(self.groups_of(topic))})")
        return out


def read_topology(client: rpc.AdminRpc) -> Topology:
    """The cluster's groups and placements as the node behind ``client`` reads them from etcd; a
    node without etcd answers PRECONDITION_FAILED: one node, no placement."""
    try:
        resp = client.cluster_groups()
    except rpc.BrokerError as exc:
        if exc.code == PRECONDITION_FAILED:
            return Topology()
        raise
    return Topology(
        group=resp.group,
        leaders={g.name: g.leader for g in resp.groups if g.live and g.leader},
        placements={p.topic: dict(p.groups) for p in resp.placements},
        draining={p.topic: frozenset(p.draining) for p in resp.placements if p.draining},
        known=tuple(sorted(g.name for g in resp.groups)))
