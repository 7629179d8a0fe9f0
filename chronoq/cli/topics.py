"""``chronoq topic`` and ``chronoq group``: create and list topics and consumer groups (with lag)."""

from __future__ import annotations

import click

from chronoq.cli.remote import admin_call, remote_options
from chronoq.cli.render import print_json, print_table

TOPIC_TYPES = ("mixed", "normal", "fifo", "delay", "transaction")


def _topic_json(t) -> dict:
    return {"name": t.name, "queues": t.queues, "message_type": t.message_type}


def _topic_rows(topics) -> list[list]:
    return [[t.name, t.queues, t.message_type] for t in topics]


@click.group()
def topic() -> None:
    """Create and list topics."""


@topic.command("create")
@click.argument("name")
@click.option("--queues", type=click.IntRange(min=1), default=None,
              help="Queue count (can only grow). Default: the broker's default_queues; an existing "
                   "topic keeps its count.")
@click.option("--type", "message_type", type=click.Choice(TOPIC_TYPES, case_sensitive=False), default=None,
              help="Message types the topic accepts. Default mixed (every type); an existing topic "
                   "keeps its type.")
@remote_options
def topic_create(name, queues, message_type, endpoint, timeout, as_json) -> None:
    """Create topic NAME, or grow its queues / change its type. Idempotent."""
    t = admin_call(endpoint, timeout, "create_topic", name, queues or 0, (message_type or "").lower())
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


# ----------------------------------------------------------------------------- group
def _group_json(g) -> dict:
    return {"name": g.name, "fifo": g.fifo, "max_attempts": g.max_attempts}


@click.group()
def group() -> None:
    """Create and list consumer groups (with lag)."""


@group.command("create")
@click.argument("name")
@click.option("--fifo/--no-fifo", default=None,
              help="FIFO group: a message group's next message waits until the previous one is acked. "
                   "Default: off for a new group; unchanged for an existing one.")
@click.option("--max-attempts", type=int, default=None,
              help="Deliveries before a message goes to %DLQ%<group> (1-1000). Default 17 for a new "
                   "group; unchanged for an existing one.")
@remote_options
def group_create(name, fifo, max_attempts, endpoint, timeout, as_json) -> None:
    """Create consumer group NAME, or change its settings."""
    g = admin_call(endpoint, timeout, "create_group", name, fifo=fifo, max_attempts=max_attempts)
    if as_json:
        print_json(_group_json(g))
    else:
        print_table(f"group {g.name} ready", ["GROUP", "FIFO", "MAX ATTEMPTS"],
                     [[g.name, "yes" if g.fifo else "no", g.max_attempts]], right=("MAX ATTEMPTS",))


@group.command("list")
@click.option("--group", "only_group", default="", help="Only this group.")
@click.option("--topic", "only_topic", default="",
              help="Lag on this topic for every listed group, even one that has not received from it yet.")
@remote_options
def group_list(only_group, only_topic, endpoint, timeout, as_json) -> None:
    """List consumer groups: per topic consumed, the lag (not yet received) and in-flight count."""
    rows = admin_call(endpoint, timeout, "list_groups", only_group, only_topic)
    if as_json:
        print_json([dict(_group_json(r.group), topic=r.topic or None, lag=r.lag, inflight=r.inflight)
                     for r in rows])
    elif not rows:
        click.echo("no consumer groups")
    else:
        print_table(None, ["GROUP", "FIFO", "MAX ATTEMPTS", "TOPIC", "LAG", "IN FLIGHT"],
                     [[r.group.name, "yes" if r.group.fifo else "no", r.group.max_attempts, r.topic or "-",
                       r.lag, r.inflight] for r in rows], right=("MAX ATTEMPTS", "LAG", "IN FLIGHT"))
