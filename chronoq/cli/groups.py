"""``chronoq group``: create, list, reset the offsets of, and delete consumer groups."""

from __future__ import annotations

import click

from chronoq.cli.remote import admin_call, call, connection, remote_options
from chronoq.cli.render import iso_ms, plural, print_json, print_table


def _group_json(g) -> dict:
    return {"name": g.name, "fifo": g.fifo, "max_attempts": g.max_attempts}


@click.group()
def group() -> None:
    """Create, list (with lag), reset and delete consumer groups."""


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
    """List consumer groups: per topic consumed, the lag (not yet received) and in-flight count.

    On a node of a cluster: summed over every live broker group (each holds its own part of a
    spread topic, and its own offsets)."""
    rows = call(endpoint, timeout, _summed_lag(endpoint, timeout, only_group, only_topic))
    if as_json:
        print_json([dict(_group_json(r.group), topic=r.topic or None, lag=r.lag, inflight=r.inflight)
                    for r in rows])
    elif not rows:
        click.echo("no consumer groups")
    else:
        print_table(None, ["GROUP", "FIFO", "MAX ATTEMPTS", "TOPIC", "LAG", "IN FLIGHT"],
                    [[r.group.name, "yes" if r.group.fifo else "no", r.group.max_attempts, r.topic or "-",
                      f"{r.lag:,}", f"{r.inflight:,}"] for r in rows], right=("MAX ATTEMPTS", "LAG", "IN FLIGHT"),
                    optional=("MAX ATTEMPTS", "FIFO"))


async def _summed_lag(endpoint: str, timeout: float, only_group: str, only_topic: str) -> list:
    """``ListGroups`` of every live broker group's primary (``endpoint`` alone outside a cluster),
    lag and in-flight summed per (consumer group, topic); a group's settings as the first primary
    answering them says (each broker group keeps its own: docs/cluster.md)."""
    from rocketmq.grpc_protocol.definition_pb2 import Code

    from chronoq.client.admin import AdminClient
    from chronoq.client.client import ClientError
    from chronoq.client.routed import cluster_primaries

    summed: dict = {}
    primaries = await cluster_primaries(endpoint, request_timeout_s=timeout, **connection())
    unknown = None
    for primary in primaries:
        async with AdminClient(primary, request_timeout_s=timeout, **connection()) as admin:
            try:
                rows = await admin.list_groups(only_group, only_topic)
            except ClientError as exc:  # a consumer group that has not received from every group yet
                if exc.code != Code.CONSUMER_GROUP_NOT_FOUND or len(primaries) == 1:
                    raise
                unknown = exc
                continue
            for r in rows:
                seen = summed.get((r.group.name, r.topic))
                if seen is None:
                    summed[(r.group.name, r.topic)] = r
                else:
                    seen.lag += r.lag
                    seen.inflight += r.inflight
    if unknown is not None and not summed:
        raise unknown  # (no broker group knows it)
    return [summed[k] for k in sorted(summed)] if len(primaries) > 1 else list(summed.values())


def _parse_to(text: str) -> tuple[str, int]:
    """``--to``: earliest, latest, or a time (ISO 8601 with its zone, or epoch ms)."""
    value = text.strip()
    if value.lower() in ("earliest", "latest"):
        return value.lower(), 0
    if value.isascii() and value.isdigit():
        return "timestamp", int(value)
    import datetime

    try:
        when = datetime.datetime.fromisoformat(value)
    except ValueError:
        raise click.BadParameter(f"{text!r} is not earliest, latest, an ISO 8601 time or epoch ms",
                                 param_hint="--to") from None
    if when.tzinfo is None:
        raise click.BadParameter(f"{text!r} has no time zone; add one, e.g. {when.isoformat()}Z (UTC)",
                                 param_hint="--to")
    return "timestamp", int(when.timestamp() * 1000)


@group.command("reset-offset")
@click.argument("name")
@click.argument("topic")
@click.option("--to", "to", required=True, metavar="earliest|latest|TIME",
              help="earliest (the oldest retained message: consume everything again), latest (skip the "
                   "backlog), or a time (ISO 8601 with its zone, or epoch ms): the first message stored then "
                   "or later.")
@click.option("--queue", "queue_id", type=click.IntRange(min=0), default=None,
              help="Only this queue. Default: every queue of the topic.")
@remote_options
def group_reset_offset(name, topic, to, queue_id, endpoint, timeout, as_json) -> None:
    """Move consumer group NAME's position in TOPIC: its next receive reads from there.

    Messages in flight stay in flight (acked or retried as usual); retry copies are not touched.
    Durable before the answer, also across a restart.
    """
    kind, at_ms = _parse_to(to)
    fields = {"group": name, "topic": topic, "to": kind, "timestamp_ms": at_ms}
    if queue_id is not None:
        fields["queue_id"] = queue_id
    r = admin_call(endpoint, timeout, "call", "ResetOffset", **fields)
    if as_json:
        print_json({"group": name, "topic": topic, "to": kind, "timestamp_ms": at_ms or None, "queues": [
            {"queue_id": q.queue_id, "old_offset": q.old_offset, "new_offset": q.new_offset} for q in r.queues]})
        return
    when = f" ({iso_ms(at_ms)})" if at_ms else ""
    click.echo(f"group {name} on {topic} reset to {kind}{when}, {plural(len(r.queues), 'queue')}:")
    print_table(None, ["QUEUE", "OLD OFFSET", "NEW OFFSET", "MOVED"],
                [[q.queue_id, q.old_offset, q.new_offset, f"{q.new_offset - q.old_offset:+,}"] for q in r.queues],
                right=("QUEUE", "OLD OFFSET", "NEW OFFSET", "MOVED"))


@group.command("delete")
@click.argument("name")
@remote_options
def group_delete(name, endpoint, timeout, as_json) -> None:
    """Delete consumer group NAME: its settings, offsets and POP state.

    Refused while it has messages in flight. Its %RETRY% and %DLQ% topics stay (chronoq dlq
    list|resend still work); a receive under the same name later starts a new group, at the
    oldest retained message.
    """
    r = admin_call(endpoint, timeout, "call", "DeleteGroup", group=name)
    if as_json:
        print_json({"deleted": name, "topics": list(r.topics)})
    else:
        click.echo(f"deleted group {name}; it had offsets for {plural(len(r.topics), 'topic')}"
                   + (f" ({', '.join(r.topics)})" if r.topics else ""))
