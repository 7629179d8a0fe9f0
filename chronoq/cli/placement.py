"""A cluster of broker groups from the command line (docs/cluster.md): ``chronoq cluster groups``,
``chronoq cluster drain``, ``chronoq cluster remove-group``, ``chronoq topic add-queues``, and the
placement that ``topic create --groups`` and ``topic describe`` show. Every call goes to one node
(``--endpoint``, any group's primary), which reads and writes etcd for it; ``remove-group`` also
reads the removed group's lag at its own primary."""

from __future__ import annotations

import click

from chronoq.cli.params import Seconds
from chronoq.cli.remote import (EXIT_NOT_DONE, EXIT_REFUSED, admin_call, call, etcd_access, etcd_options, fail,
                                remote_options)
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
    from chronoq.client.admin import AdminClient
    from chronoq.client.client import run
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
        snap = read_once(etcd_access(etcd), cluster_name, timeout)
    except errors.ChronoqError as exc:
        fail(exc.message, EXIT_NOT_DONE)
    return apb.ClusterGroupsResponse(cluster=cluster_name, groups=groups_pb(snap),
                                     placements=[placement_pb(snap.placements[t]) for t in sorted(snap.placements)])


@click.command("groups")
@remote_options
@etcd_options
@click.option("--cluster-name", default="chronoq", show_default=True, help="With --etcd: the cluster's name.")
def groups(endpoint, timeout, as_json, etcd, cluster_name) -> None:
    """The broker groups of the cluster the node at --endpoint belongs to (from etcd): each
    group's primary, epoch and members, and every topic's placement. With --etcd: read from etcd
    itself (works with every node down)."""
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


class _Refused(Exception):
    """``remove-group`` refused before changing anything (said as one line, exit 1)."""


PENDING_PAGE = 1000  # delayed messages counted per topic on the removed group (more: "1000+")
POLL_S = 1.0         # remove-group --wait: the group's lag is read again this often
ROUTE_SETTLE_S = 30.0  # a group drained just now is removed no sooner: the official clients' route refresh


@click.command("remove-group")
@click.argument("group")
@click.option("--wait", "wait_s", type=Seconds(min=0), default=0.0, show_default=True,
              help="Seconds to wait for GROUP's lag to reach zero. 0: check once.")
@click.option("--force", is_flag=True,
              help="Remove a group that has no primary now (its lag cannot be read): what it still holds is "
                   "routed no more.")
@remote_options
def remove_group(group, wait_s, force, endpoint, timeout, as_json) -> None:
    """Take broker GROUP out of every topic's placement: drain it (no more sends), wait until no
    consumer group lags on its queues and no delayed message is pending there (asked of GROUP's
    primary), then remove it from the placements. Not drained in time: GROUP stays draining,
    what is left is printed and the exit status is 1 (run it again to finish)."""
    try:
        done = call(endpoint, timeout, _remove_group(endpoint, timeout, group, wait_s, force))
    except _Refused as exc:
        fail(str(exc), EXIT_REFUSED)
    if as_json:
        print_json(done)
    else:
        _print_removal(done)
    if done["topics"] and not done["removed"] and not done["left"] and not done["pending"]:
        fail(f"broker group {group} was drained just now and is not removed yet: run `chronoq cluster remove-group "
             f"{group}` again in {ROUTE_SETTLE_S:g} s (or with --wait {ROUTE_SETTLE_S + 10:g})", EXIT_REFUSED)
    if done["topics"] and not done["removed"]:
        fail(f"broker group {group} is draining but not drained{f' after {wait_s:g} s' if wait_s else ''}: run "
             f"`chronoq cluster remove-group {group}` again once its consumers caught up (--wait SECONDS waits "
             "for it)", EXIT_REFUSED)


async def _remove_group(endpoint: str, timeout: float, group: str, wait_s: float, force: bool) -> dict:
    import asyncio

    from chronoq.cli.remote import connection
    from chronoq.client.admin import AdminClient

    done = {"group": group, "removed": False, "forced": False, "topics": [], "left": [], "pending": {},
            "unread": {}, "settling": False, "placements": []}
    async with AdminClient(endpoint, request_timeout_s=timeout, **connection()) as admin:
        state = await _group_state(admin, group)
        fresh = state is not None and bool(state[2])  # (drained by this call: routes held may still name it)
        if state is not None and not state[0] and state[1] and not force:
            raise _Refused(f"broker group {group} has no primary now (no leader key in etcd): its lag cannot be read "
                           f"(it holds queues of {', '.join(state[1])}); start its primary and run this again, or "
                           "--force to remove it anyway (its unconsumed and pending delayed messages are then "
                           "routed no more)")
        drained = (await admin.call("PlaceTopic", action="drain-group", groups=[group])).placements
        done["topics"] = topics = [p.topic for p in drained]
        if not topics:
            done["removed"] = True
            return done
        if state is not None and not state[0]:
            done["forced"] = True  # (dead and --force: nothing can be read)
        else:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + wait_s
            settled = loop.time() + (ROUTE_SETTLE_S if fresh else 0.0)
            for _round in range(int(wait_s / POLL_S) + 2):  # (bounded by the deadline too)
                state = await _group_state(admin, group)
                if state is None or not state[0]:
                    raise _Refused(f"broker group {group} lost its primary while draining: it stays draining; run "
                                   "this again once it has one (or with --force)")
                done.update(await _left_on(state[0], timeout, topics))
                done["settling"] = loop.time() < settled
                if not done["left"] and not done["pending"] and not done["settling"]:
                    break
                if loop.time() >= deadline:
                    return done
                await asyncio.sleep(min(POLL_S, max(0.0, deadline - loop.time())))
            else:
                return done
        for topic in topics:
            placed = await admin.call("PlaceTopic", action="remove-group", topic=topic, groups=[group])
            done["placements"].append(placement_json(placed.placement))
        done["removed"] = True
    return done


async def _group_state(admin, group: str):
    """``(primary endpoint or "", topics whose placement holds it, those of them where it takes
    sends)``; None: etcd knows no such group."""
    shown = await admin.call("ClusterGroups")
    topics = [p.topic for p in shown.placements if group in p.groups]
    sending = [p.topic for p in shown.placements if group in p.groups and group not in p.draining]
    for g in shown.groups:
        if g.name == group:
            return (g.leader if g.live else "", topics, sending)
    return ("", topics, sending) if topics else None


async def _left_on(primary: str, timeout: float, topics: list) -> dict:
    """What still waits on the removed group's primary, per topic: consumer groups' lag and
    in-flight counts, delayed messages pending (counted up to ``PENDING_PAGE``), and messages no
    consumer group has received there (said, not waited for: nothing would ever read them)."""
    from rocketmq.grpc_protocol.definition_pb2 import Code

    from chronoq.cli.remote import connection
    from chronoq.client.admin import AdminClient
    from chronoq.client.client import ClientError

    left, pending, unread = [], {}, {}
    async with AdminClient(primary, request_timeout_s=timeout, **connection()) as admin:
        for topic in topics:
            try:
                shown = await admin.call("DescribeTopic", topic=topic)
            except ClientError as exc:
                if exc.code != Code.TOPIC_NOT_FOUND:
                    raise
                continue  # (its part was never made there: it holds nothing of the topic)
            left += [{"topic": topic, "consumer_group": r.group.name, "lag": r.lag, "inflight": r.inflight}
                     for r in shown.groups if r.lag or r.inflight]
            if not shown.groups and shown.messages:
                unread[topic] = shown.messages
            page = await admin.list_pending(topic=topic, limit=PENDING_PAGE)
            if page.messages:
                pending[topic] = f"{len(page.messages)}{'+' if page.next_cursor else ''}"
    return {"left": left, "pending": pending, "unread": unread}


def _print_removal(done: dict) -> None:
    group, topics = done["group"], done["topics"]
    if not topics:
        click.echo(f"broker group {group} holds no queue of any topic: nothing to remove")
        return
    if done["removed"]:
        click.echo(f"broker group {group} removed from {len(topics)} topic{'' if len(topics) == 1 else 's'}: "
                   "its queues are routed no more")
        print_table(None, ["TOPIC", "QUEUES BY GROUP"],
                    [[p["topic"], ", ".join(f"{g}: {n}" for g, n in p["groups"].items())]
                     for p in done["placements"]], wrap=("QUEUES BY GROUP",))
        click.echo(f"its identity (@groups/{group}) stays: a node of {group} may take queues again "
                   f"(chronoq topic add-queues TOPIC --group {group})")
        if done["forced"]:
            click.echo(f"forced: {group} had no primary, so its lag was not read: messages it stored and no consumer "
                       "received, and delayed messages pending on it, stay in its data directory, routed no more")
    else:
        click.echo(f"broker group {group} is draining {', '.join(topics)} (it takes no sends); left on it:")
        if done["left"]:
            print_table(None, ["TOPIC", "CONSUMER GROUP", "LAG", "IN FLIGHT"],
                        [[r["topic"], r["consumer_group"], f"{r['lag']:,}", f"{r['inflight']:,}"]
                         for r in done["left"]], right=("LAG", "IN FLIGHT"))
        for topic, count in sorted(done["pending"].items()):
            click.echo(f"{topic}: {count} delayed message(s) pending on {group} (they fire there)")
        if done["settling"]:
            click.echo(f"{group} was drained just now: producers may hold a route naming it for up to "
                       f"{ROUTE_SETTLE_S:g} s more (the official clients refresh theirs every 30 s)")
    for topic, count in sorted(done["unread"].items()):
        click.echo(f"note: no consumer group has received {topic} from {group}: its {count:,} stored message(s) "
                   "there are not waited for")
