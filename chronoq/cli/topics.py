"""``chronoq topic``: create, list, describe and delete topics."""

from __future__ import annotations

import click

from chronoq.cli.remote import admin_call, remote_options
from chronoq.cli.render import iso_ms, plural, print_json, print_table

TOPIC_TYPES = ("mixed", "normal", "fifo", "delay", "transaction")


def _topic_json(t) -> dict:
    return {"name": t.name, "queues": t.queues, "message_type": t.message_type}


def _topic_rows(topics) -> list[list]:
    return [[t.name, t.queues, t.message_type] for t in topics]


@click.group()
def topic() -> None:
    """Create, list, describe and delete topics."""


@topic.command("create")
@click.argument("name")
@click.option("--queues", type=click.IntRange(min=1), default=None,
              help="Queue count (can only grow). Default: the broker's default_queues; an existing "
                   "topic keeps its count.")
@click.option("--type", "message_type", type=click.Choice(TOPIC_TYPES, case_sensitive=False), default=None,
              help="Message types the topic accepts. Default mixed (every type); an existing topic "
                   "keeps its type.")
@click.option("--force", is_flag=True,
              help="Change the type of a topic that holds messages (refused without it: its producers and "
                   "consumers were written for the old type).")
@click.option("--groups", default=None, metavar="G1,G2",
              help="A cluster (docs/cluster.md): the broker groups to hold the topic's queues (--queues on each). "
                   "Default on a clustered node: every live group.")
@remote_options
def topic_create(name, queues, message_type, force, groups, endpoint, timeout, as_json) -> None:
    """Create topic NAME, or grow its queues / change its type. Idempotent. On a node of a
    cluster: its placement over the broker groups (--queues on each group)."""
    if groups:
        from chronoq.cli.placement import place, placement_json, print_placement

        p = place(endpoint, timeout, "create", name, queues or 0, (message_type or "").lower(),
                  tuple(g.strip() for g in groups.split(",") if g.strip()))
        if as_json:
            print_json(placement_json(p))
        else:
            print_placement(p)
        return
    t = admin_call(endpoint, timeout, "create_topic", name, queues or 0, (message_type or "").lower(), force)
    if as_json:
        print_json(_topic_json(t))
    else:
        print_table(f"topic {t.name} ready", ["TOPIC", "QUEUES", "TYPE"], _topic_rows([t]), right=("QUEUES",))


@topic.command("list")
@click.option("--system", is_flag=True, help="Include the broker's own topics (%RETRY%, %DLQ%, ...).")
@remote_options
def topic_list(system, endpoint, timeout, as_json) -> None:
    """List topics with their queue count and message type."""
    topics = admin_call(endpoint, timeout, "list_topics", system)
    if as_json:
        print_json([_topic_json(t) for t in topics])
    elif not topics:
        click.echo("no topics")
    else:
        print_table(None, ["TOPIC", "QUEUES", "TYPE"], _topic_rows(topics), right=("QUEUES",))


@topic.command("describe")
@click.argument("name")
@remote_options
def topic_describe(name, endpoint, timeout, as_json) -> None:
    """Queues of topic NAME (offsets, messages, oldest and newest) and the groups consuming it."""
    from chronoq.cli.placement import placement_json, placement_or_none, print_placement

    r = admin_call(endpoint, timeout, "call", "DescribeTopic", topic=name)
    placed = placement_or_none(endpoint, timeout, name)  # a cluster: which groups hold its queues
    if as_json:
        print_json(dict(_topic_json(r.topic), messages=r.messages,
                        placement=placement_json(placed) if placed is not None else None, per_queue=[
            {"queue_id": q.queue_id, "min_offset": q.min_offset, "max_offset": q.max_offset, "messages": q.messages,
             "oldest_ms": q.oldest_ms or None, "newest_ms": q.newest_ms or None} for q in r.queues],
            groups=[{"group": g.group.name, "lag": g.lag, "inflight": g.inflight} for g in r.groups]))
        return
    part = ""
    if placed is not None:  # a cluster: the whole topic, then the answering node's part of it
        print_placement(placed)
        part = "this group's part of "
    click.echo(f"{part}topic {r.topic.name}: type {r.topic.message_type}, {plural(r.topic.queues, 'queue')}, "
               f"{plural(r.messages, 'message')}")
    print_table(None, ["QUEUE", "MIN OFFSET", "MAX OFFSET", "MESSAGES", "OLDEST (UTC)", "NEWEST (UTC)"],
                [[q.queue_id, q.min_offset, q.max_offset, f"{q.messages:,}", iso_ms(q.oldest_ms) or "-",
                  iso_ms(q.newest_ms) or "-"] for q in r.queues],
                right=("QUEUE", "MIN OFFSET", "MAX OFFSET", "MESSAGES"), optional=("OLDEST (UTC)", "MIN OFFSET"))
    if r.groups:
        print_table(None, ["GROUP", "LAG", "IN FLIGHT"],
                    [[g.group.name, f"{g.lag:,}", f"{g.inflight:,}"] for g in r.groups], right=("LAG", "IN FLIGHT"))
    else:
        click.echo("no consumer group consumes it")


@topic.command("delete")
@click.argument("name")
@click.option("--force", is_flag=True,
              help="Delete although consumer groups have not received all of it (never while deliveries are "
                   "in flight).")
@remote_options
def topic_delete(name, force, endpoint, timeout, as_json) -> None:
    """Delete topic NAME, with its consumers' offsets and retry topics.

    Refused while a consumer group lags on it, unless --force. The messages' records stay in the
    commit log until retention deletes their segment (disk space comes back then); delayed
    messages of the topic still pending are delivered when due and make the topic again, so
    recall them first (chronoq message recall) if they must not be. See docs/cli.md.
    """
    r = admin_call(endpoint, timeout, "call", "DeleteTopic", topic=name, force=force)
    if as_json:
        print_json({"deleted": list(r.deleted), "messages": r.messages, "groups": list(r.groups)})
        return
    also = f" (and {', '.join(r.deleted[1:])})" if len(r.deleted) > 1 else ""
    click.echo(f"deleted topic {name}{also}: {plural(r.messages, 'message')}; offsets dropped for "
               f"{plural(len(r.groups), 'group')}" + (f" ({', '.join(r.groups)})" if r.groups else ""))
