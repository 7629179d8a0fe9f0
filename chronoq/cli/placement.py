"""A cluster of broker groups from the command line (docs/cluster.md): ``chronoq cluster groups``,
``chronoq cluster drain``, ``chronoq topic add-queues``, and the placement that ``topic create
--groups`` and ``topic describe`` show. Every call goes to one node (``--endpoint``, any group's
primary), which reads and writes etcd for it."""

from __future__ import annotations

import click

from chronoq.cli.remote import EXIT_NOT_DONE, admin_call, fail, remote_options
from chronoq.cli.render import print_json, print_table


def placement_json(p) -> dict:
    return {"topic": p.topic, "message_type": p.message_type, "groups": dict(sorted(p.groups.items())),
            "draining": sorted(p.draining), "queues": sum(p.groups.values()), "revision": p.revision}


def print_placement(p) -> None:
    click.echo(f"topic {p.topic}: type {p.message_type}, {sum(p.groups.values())} queues over "
               f"{len(p.groups)} broker group{'' if len(p.groups) == 1 else 's'}")
    print_table(None, ["GROUP", "QUEUES", "SENDS"],
                [[g, n, "no (draining)" if g in p.draining else "yes"] for g, n in sorted(p.groups.items())],
                right=("QUEUES",))


def place(endpoint, timeout, action: str, topic: str, queues: int = 0, message_type: str = "",
          groups: tuple = ()):
    return admin_call(endpoint, timeout, "call", "PlaceTopic", topic=topic, queues=queues, message_type=message_type,
                      groups=list(groups), action=action).placement


def placement_or_none(endpoint, timeout, topic: str):
    """The topic's placement when the node is part of a cluster and the topic has one, else None
    (one extra call; its refusal is not an error here)."""
    from chronoq.client.client import AdminClient, run
    from chronoq.cli.remote import connection

    async def work():
        async with AdminClient(endpoint, request_timeout_s=timeout, **connection()) as admin:
            resp = await admin._stub.ClusterGroups(admin._apb.ClusterGroupsRequest(topic=topic), timeout=timeout)
            return resp.placements[0] if resp.status.code == 20000 and resp.placements else None
    try:
        return run(work())
    except Exception:  # noqa: BLE001 - an older broker, or no cluster: nothing to show
        return None


@click.command("add-queues")
@click.argument("name")
@click.option("--group", "group", required=True, help="The broker group (live) to hold queues of the topic.")
@click.option("--queues", type=click.IntRange(min=1), default=None,
              help="Its queue count. Default: as many as the group holding most.")
@remote_options
def add_queues(name, group, queues, endpoint, timeout, as_json) -> None:
    """Place queues of topic NAME on broker GROUP (e.g. a group just added to the cluster)."""
    p = place(endpoint, timeout, "add-queues", name, queues or 0, groups=(group,))
    if as_json:
        print_json(placement_json(p))
    else:
        print_placement(p)


def _from_etcd(etcd: str, cluster_name: str, timeout: float):
    """``ClusterGroups``' answer built from etcd itself (no node asked: all may be down)."""
    from chronoq.core import errors
    from chronoq.proto import chronoq_admin_pb2 as apb
    from chronoq.replication.cluster import read_once
    from chronoq.server.cluster import groups_pb, placement_pb

    try:
        snap = read_once([e.strip() for e in etcd.split(",") if e.strip()], cluster_name, timeout)
    except errors.ChronoqError as exc:
        fail(exc.message, EXIT_NOT_DONE)
    return apb.ClusterGroupsResponse(cluster=cluster_name, groups=groups_pb(snap),
                                     placements=[placement_pb(snap.placements[t]) for t in sorted(snap.placements)])


@click.command("groups")
@remote_options
@click.option("--etcd", default=None, metavar="HOST:PORT[,...]",
              help="Read etcd itself instead of asking the node at --endpoint (works with every node down).")
@click.option("--cluster-name", default="chronoq", show_default=True, help="With --etcd: the cluster's name.")
def groups(endpoint, timeout, as_json, etcd, cluster_name) -> None:
    """The broker groups of the cluster the node at --endpoint belongs to (from etcd): each
    group's primary, epoch and members, and every topic's placement."""
    if etcd:
        r = _from_etcd(etcd, cluster_name, timeout)
    else:
        r = admin_call(endpoint, timeout, "call", "ClusterGroups")
    if as_json:
        print_json({"cluster": r.cluster, "group": r.group,
                    "groups": [{"name": g.name, "live": g.live, "leader": g.leader or None, "epoch": g.epoch,
                                "members": list(g.members)} for g in r.groups],
                    "placements": [placement_json(p) for p in r.placements]})
        return
    print_table(f"cluster {r.cluster}" + (f" (asked {endpoint}, of group {r.group})" if r.group else " (etcd)"),
                ["GROUP", "STATE", "PRIMARY", "EPOCH", "MEMBERS"],
                [[g.name, "live" if g.live else "no primary", g.leader or "-", g.epoch, ", ".join(g.members) or "-"]
                 for g in r.groups] or [["(none)", "", "", "", ""]], right=("EPOCH",), wrap=("MEMBERS",))
    if r.placements:
        print_table(None, ["TOPIC", "TYPE", "QUEUES BY GROUP"],
                    [[p.topic, p.message_type, ", ".join(f"{g}: {n}" + (" (draining)" if g in p.draining else "")
                                                          for g, n in sorted(p.groups.items()))]
                     for p in r.placements], wrap=("QUEUES BY GROUP",))


@click.command("drain")
@click.argument("topic")
@click.option("--group", "group", required=True, help="The broker group that stops taking sends of TOPIC.")
@remote_options
def drain(topic, group, endpoint, timeout, as_json) -> None:
    """Stop routing sends of TOPIC to GROUP: its queues stay routed for receives until consumed
    (watch `chronoq group list` on that group's primary). Refused for the last group taking sends."""
    p = place(endpoint, timeout, "drain", topic, groups=(group,))
    if as_json:
        print_json(placement_json(p))
    else:
        print_placement(p)
