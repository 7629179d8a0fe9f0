"""``chronoq cluster status`` and ``chronoq promote``: replication (docs/replication.md)."""

from __future__ import annotations

import time

import click

from chronoq.cli.remote import (EXIT_NOT_DONE, EXIT_UNREACHABLE, call, connection, etcd_access, etcd_options, fail,
                                remote_options)
from chronoq.cli.render import print_json, print_table, size_text

PROMOTE_WAIT_S = 120.0  # how long ``promote`` waits for the new primary to serve


def _replication_call(endpoint: str, timeout_s: float, method: str):
    from chronoq.replication.client import ReplicationClient

    async def work():
        async with ReplicationClient(endpoint, request_timeout_s=timeout_s, **connection()) as client:
            return await getattr(client, method)()

    return call(endpoint, timeout_s, work())


def status_json(st) -> dict:
    out = {"role": st.role, "epoch": st.epoch, "node_id": st.node_id, "commit_end": st.commit_end,
           "pop_generation": st.pop_generation, "pop_offset": st.pop_offset}
    if st.role == "replica":
        out.update(following=st.following, state=st.state, primary_synced=st.primary_synced,
                   lag_bytes=st.lag_bytes, lag_ms=None if st.lag_ms < 0 else st.lag_ms)
    else:
        out["replicas"] = [{"node_id": r.node_id, "endpoint": r.endpoint, "position": r.position,
                            "lag_bytes": r.lag_bytes, "last_pull_ms": r.last_pull_ms, "in_sync": r.in_sync}
                           for r in st.replicas]
    return out


@click.group()
def cluster() -> None:
    """Replication: roles, epochs, positions and lag."""


def etcd_json(view) -> dict:
    leader = view.leader
    return {"leader": None if leader is None else {"node": leader.node, "endpoint": leader.endpoint,
                                                   "node_id": leader.node_id, "epoch": leader.epoch},
            "epoch": view.epoch,
            "insync": None if view.insync is None else {"epoch": view.insync.epoch, "leader": view.insync.leader,
                                                        "members": view.insync.members},
            "members": view.members}


def _etcd_status(etcd, cluster_name, group_name, timeout, as_json) -> None:
    from chronoq.core import errors
    from chronoq.replication.etcd import read_view

    try:
        view = read_view(etcd_access(etcd), cluster_name, group_name, timeout)
        if view.leader is None and not view.epoch and view.insync is None and not view.members:
            names = read_view(etcd_access(etcd), cluster_name, group_name, timeout,
                              reading=lambda reader: reader.group_names())
    except errors.ChronoqError as exc:
        fail(exc.message, EXIT_UNREACHABLE)
    if view.leader is None and not view.epoch and view.insync is None and not view.members:
        fail(f"etcd holds nothing of group {group_name!r} in cluster {cluster_name!r}: "
             + (f"its groups there are {', '.join(names)} (--group-name)" if names else
                "no group of that cluster either (--cluster-name; is this the etcd its nodes use?)"),
             EXIT_NOT_DONE)
    if as_json:
        print_json(etcd_json(view))
        return
    leader = view.leader
    insync = view.insync
    rows = [["leader", "none (no lease holds the leader key)" if leader is None
             else f"{leader.endpoint} (node id {leader.node_id})"],
            ["epoch", str(view.epoch)],
            ["in-sync set", "none recorded" if insync is None else
             f"epoch {insync.epoch}: " + ", ".join(f"{n} (from {p:,})" for n, p in sorted(insync.members.items()))]]
    print_table(f"etcd view of {cluster_name}/{group_name}", ["WHAT", "VALUE"], rows, wrap=("VALUE",))
    print_table("members (alive: their lease holds)", ["NODE", "ROLE", "EPOCH", "POSITION AT REGISTRATION"],
                [[n, str(m.get("role", "")), str(m.get("epoch", "")), f"{m.get('position', 0):,}"]
                 for n, m in sorted(view.members.items())] or [["(none)", "", "", ""]],
                right=("POSITION AT REGISTRATION",))


@cluster.command("status")
@remote_options
@etcd_options
@click.option("--cluster-name", default="chronoq", show_default=True, help="With --etcd: the cluster's name.")
@click.option("--group-name", default="default", show_default=True, help="With --etcd: the broker group's name.")
def status(endpoint, timeout, as_json, etcd, cluster_name, group_name) -> None:
    """This node's role and epoch, its durable log position, and lag (a replica's behind its
    primary; a primary's replicas behind it). With --etcd: the group as etcd records it (leader,
    epoch, in-sync set, members)."""
    if etcd:
        _etcd_status(etcd, cluster_name, group_name, timeout, as_json)
        return
    st = _replication_call(endpoint, timeout, "status")
    if as_json:
        print_json(status_json(st))
        return
    rows = [["role", st.role], ["epoch", str(st.epoch)], ["node", st.node_id],
            ["commit log (durable end)", f"{st.commit_end:,}"],
            ["POP log", f"generation {st.pop_generation}, {st.pop_offset:,} bytes"]]
    if st.role == "replica":
        lag = "unknown (no answer yet)" if st.lag_bytes < 0 else size_text(st.lag_bytes)
        since = "never caught up yet" if st.lag_ms < 0 else f"{st.lag_ms / 1000:.1f} s"
        rows += [["following", st.following], ["state", st.state], ["lag", f"{lag} ({since})"]]
    print_table(f"cluster status of {endpoint}", ["WHAT", "VALUE"], rows, wrap=("VALUE",))
    if st.role == "primary":
        print_table("replicas", ["NODE", "ENDPOINT", "POSITION", "LAG", "IN SYNC"],
                    [[r.node_id, r.endpoint, f"{r.position:,}", size_text(r.lag_bytes), "yes" if r.in_sync else "no"]
                     for r in st.replicas]
                    or [["(none)", "", "", "", ""]], right=("POSITION", "LAG"))


@click.command()
@remote_options
@click.option("--no-wait", is_flag=True, help="Return once the replica agreed, without waiting for it to serve.")
def promote(endpoint, timeout, as_json, no_wait) -> None:
    """Make the replica at --endpoint a primary: it stops following, rebuilds, records a new epoch
    and serves. Whatever its primary had not shipped to it is not on it (docs/replication.md)."""
    answer = _replication_call(endpoint, timeout, "promote")
    st = None
    if not no_wait:
        deadline = time.monotonic() + PROMOTE_WAIT_S
        while time.monotonic() < deadline:
            time.sleep(0.2)
            try:
                st = _quiet_status(endpoint, timeout)
            except Exception:  # noqa: BLE001 - restarting its front end: ask again
                continue
            if st.role == "primary" and st.epoch >= answer.epoch:
                break
        else:
            fail(f"{endpoint} agreed to become primary at epoch {answer.epoch} but is not serving as one "
                 f"after {PROMOTE_WAIT_S:g} s; see its log", EXIT_NOT_DONE)
    if as_json:
        print_json({"epoch": answer.epoch, "commit_end": answer.commit_end, "serving": st is not None})
    else:
        click.echo(f"promoted {endpoint}: epoch {answer.epoch}, log end {answer.commit_end:,}"
                   + ("; serving as the primary" if st is not None else ""))


def _quiet_status(endpoint: str, timeout_s: float):
    from chronoq.client.client import run
    from chronoq.replication.client import ReplicationClient

    async def work():
        async with ReplicationClient(endpoint, request_timeout_s=timeout_s, **connection()) as client:
            return await client.status()

    return run(work())
