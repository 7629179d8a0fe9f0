"""Automatic failover through etcd: the pure parts (keys, values, decisions, the lease deadline).

The shell that talks to etcd is ``chronoq.replication.etcd``; the process that acts on these
decisions is ``chronoq.server.failover``. docs/replication.md, "Automatic failover with etcd",
describes the whole; the keys of one broker group, under ``/chronoq/<cluster>/<group>/``:

=================== ========================================================= ===============
key                 value (JSON unless said)                                  lease
=================== ========================================================= ===============
``leader``          ``{"node", "node_id", "endpoint", "replication", "epoch"}`` the leader's
``epoch``           the newest epoch, a decimal number (written only together  none
                    with ``leader``, in one transaction)
``insync``          ``{"epoch", "leader", "members": {node: position}}``: the   none
                    nodes that hold everything the leader acknowledged (the
                    leader itself among them) and the durable log position
                    each had (refreshed every second while they move)
``members/<node>``  ``{"node", "node_id", "role", "endpoint", "position",       that node's
                    "epoch"}``: who is alive (issue 23 builds membership on it)
=================== ========================================================= ===============

A *node* is named by its advertised client endpoint (``host:port``), which is stable across
restarts (the process's node id is not) and unique within a group.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

# The leader's local deadline ends this much before its lease could: etcd measures the TTL from
# when it received the keep-alive (later than we sent it) with its own clock; the margin covers
# a clock running at a slightly different rate and the gap between the check and the answer.
MARGIN_MAX_MS = 1000
MARGIN_FRACTION = 4  # at most a quarter of the TTL


def cluster_prefix(cluster: str) -> str:
    return f"/chronoq/{cluster}/"


def prefix(cluster: str, group: str) -> str:
    return f"{cluster_prefix(cluster)}{group}/"


def leader_key(cluster: str, group: str) -> bytes:
    return (prefix(cluster, group) + "leader").encode()


def epoch_key(cluster: str, group: str) -> bytes:
    return (prefix(cluster, group) + "epoch").encode()


def insync_key(cluster: str, group: str) -> bytes:
    return (prefix(cluster, group) + "insync").encode()


def member_key(cluster: str, group: str, node: str) -> bytes:
    return (prefix(cluster, group) + "members/" + node).encode()


def members_prefix(cluster: str, group: str) -> bytes:
    return (prefix(cluster, group) + "members/").encode()


@dataclass(frozen=True)
class Leader:
    node: str          # its advertised endpoint (the node's name in etcd)
    node_id: str       # the process's id (replication pulls name it)
    endpoint: str      # where clients and replicas reach it (the same gRPC port)
    epoch: int

    def encode(self) -> bytes:
        return json.dumps({"node": self.node, "node_id": self.node_id, "endpoint": self.endpoint,
                           "replication": self.endpoint, "epoch": self.epoch}, sort_keys=True).encode()

    @staticmethod
    def decode(raw: bytes | None) -> "Leader | None":
        if not raw:
            return None
        value = json.loads(raw)
        return Leader(str(value["node"]), str(value.get("node_id", "")), str(value["endpoint"]),
                      int(value["epoch"]))


@dataclass(frozen=True)
class InSync:
    epoch: int
    leader: str
    members: dict = field(default_factory=dict)  # node -> log position when it was last published

    def encode(self) -> bytes:
        return json.dumps({"epoch": self.epoch, "leader": self.leader, "members": self.members},
                          sort_keys=True).encode()

    @staticmethod
    def decode(raw: bytes | None) -> "InSync | None":
        if not raw:
            return None
        value = json.loads(raw)
        return InSync(int(value["epoch"]), str(value["leader"]),
                      {str(k): int(v) for k, v in value.get("members", {}).items()})


def member_value(node: str, node_id: str, role: str, endpoint: str, position: int, epoch: int) -> bytes:
    return json.dumps({"node": node, "node_id": node_id, "role": role, "endpoint": endpoint,
                       "position": position, "epoch": epoch}, sort_keys=True).encode()


@dataclass(frozen=True)
class View:
    """What etcd says about a group at one revision."""
    leader: Leader | None
    epoch: int                 # 0: no leader was ever elected
    epoch_revision: int        # the epoch key's mod revision (0: absent): a campaign compares it
    insync: InSync | None
    members: dict = field(default_factory=dict)  # node -> decoded member value


# ------------------------------------------------------------------------------------- decisions
CAMPAIGN, FOLLOW, WAIT = "campaign", "follow", "wait"


def decide(view: View, node: str, position: int, force: bool = False) -> tuple[str, str]:
    """What a starting node (or a replica whose leader vanished) does, and why.

    A leader exists: follow it (or, if it names this node, that was an earlier life of this
    node whose lease has not expired yet: wait). No leader and no epoch ever: campaign (the first
    node of a new group). No leader but an epoch: campaign only if this node is in the recorded
    in-sync set and its log reaches the position recorded for it there (or ``force``: an unclean
    promotion); otherwise wait for whoever wins.
    """
    if view.leader is not None:
        if view.leader.node == node:
            return WAIT, (f"the leader key still names this node (epoch {view.leader.epoch}, an earlier "
                          "process): waiting for its lease to expire")
        return FOLLOW, f"{view.leader.node} leads epoch {view.leader.epoch}"
    if view.epoch == 0:
        return CAMPAIGN, "no leader was ever elected in this group"
    if force:
        return CAMPAIGN, "forced (an unclean promotion): " + eligibility(view, node, position)[1]
    ok, why = eligibility(view, node, position)
    return (CAMPAIGN if ok else WAIT), why


def eligibility(view: View, node: str, position: int) -> tuple[bool, str]:
    """Whether ``node`` at ``position`` may take over without losing what was acknowledged."""
    insync = view.insync
    if insync is None or node not in insync.members:
        members = ", ".join(sorted(insync.members)) if insync is not None else "none recorded"
        return False, (f"this node is not in the in-sync set of epoch {view.epoch} ({members}): it may lack "
                       "acknowledged messages")
    needed = insync.members[node]
    if position < needed:
        return False, (f"this node's log ends at {position}, before {needed}, where it was when the in-sync set "
                       "was recorded (an older copy of its data directory?)")
    return True, f"this node is in the in-sync set of epoch {view.epoch} and its log reaches {needed}"


def next_epoch(view: View, log_epoch: int) -> int:
    """The epoch a campaign asks for: past etcd's and past this node's log (a data directory that
    served without etcd may have epochs of its own)."""
    return max(view.epoch, log_epoch) + 1


# ------------------------------------------------------------------------------------- the lease
class LeaseDeadline:
    """The leader's local idea of how long its lease surely lasts.

    ``renewed(sent_ns, ttl_s)``: a keep-alive (or the grant) *sent* at monotonic ``sent_ns`` was
    answered with ``ttl_s`` left: etcd cannot expire the lease before ``sent_ns + ttl`` (it
    received the request after we sent it), so the deadline is that minus a margin. ``holds()``
    is checked where writes are acknowledged (``chronoq.broker.committer``); a process stopped
    (SIGSTOP) past the deadline finds it passed on resume, since CLOCK_MONOTONIC keeps running.
    ``lose(why)`` is final: etcd said the lease is gone, or another node leads.
    """

    def __init__(self, clock, ttl_ms: int) -> None:
        self.clock = clock
        self.ttl_ms = ttl_ms
        self.margin_ms = min(MARGIN_MAX_MS, ttl_ms // MARGIN_FRACTION)
        self.deadline_ns = 0  # nothing held before the grant
        self.lost: str | None = None

    def renewed(self, sent_ns: int, ttl_s: int) -> None:
        assert ttl_s > 0, "an expired lease renews nothing"
        if self.lost is None:
            self.deadline_ns = max(self.deadline_ns, sent_ns + (ttl_s * 1000 - self.margin_ms) * 1_000_000)

    def lose(self, why: str) -> None:
        if self.lost is None:
            self.lost = why
        self.deadline_ns = 0

    def holds(self) -> bool:
        return self.lost is None and self.clock.monotonic_ns() < self.deadline_ns

    def remaining_ms(self) -> int:
        """Milliseconds of leadership left (0: none)."""
        if self.lost is not None:
            return 0
        return max(0, (self.deadline_ns - self.clock.monotonic_ns()) // 1_000_000)


def lease_seconds(ttl_ms: int) -> int:
    """etcd's TTLs are whole seconds: ``lease_ttl_ms`` rounded up."""
    return max(1, -(-ttl_ms // 1000))


# --------------------------------------------------------------------------- the in-sync set
class InSyncTracker:
    """The primary's in-sync set: the replicas that hold everything it acknowledged.

    A replica *joins* when a pull reports the whole durable log; it *stays* while it pulls at
    least every ``bound_ms`` and is not behind for longer than that; else it *leaves*. Two sets,
    so that etcd never names a member lacking an acknowledged write: ``required`` (the replicas
    a ``sync`` acknowledgement waits for: all of them) and ``published`` (what the ``insync`` key
    says). A joining replica is required before it is published; a leaving one is removed from
    ``required`` only once the shrunk set is published (``chronoq.server.failover``), so
    ``published <= required`` at every moment an acknowledgement is decided.
    """

    def __init__(self, bound_ms: int) -> None:
        self.bound_ms = bound_ms
        # node -> (reported position, wall ms of the report, wall ms since it has been behind or None)
        self.reports: dict[str, tuple[int, int, int | None]] = {}
        self.required: set[str] = set()
        self.published: set[str] = set()

    def report(self, node: str, position: int, synced: int, now_ms: int) -> None:
        old = self.reports.get(node)
        behind = None
        if position < synced:
            behind = old[2] if old is not None and old[2] is not None else now_ms
        self.reports[node] = (position, now_ms, behind)

    def wanted(self, now_ms: int) -> set[str]:
        """The replicas that belong in the set now."""
        out = set()
        for node, (_pos, seen, behind) in self.reports.items():
            if now_ms - seen > self.bound_ms:
                continue
            member = node in self.published or node in self.required
            if behind is None or (member and now_ms - behind <= self.bound_ms):
                out.add(node)
        return out

    def acked(self, ticket: int) -> bool:
        """Every required replica reported the log durable up to ``ticket`` (and there is one)."""
        reports = self.reports
        return bool(self.required) and all(reports[n][0] >= ticket for n in self.required)

    def positions(self, nodes) -> dict[str, int]:
        return {n: self.reports[n][0] for n in nodes}
